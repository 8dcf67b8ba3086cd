"""The cluster's own certificate authority: ``gpu-arbiter tls ca`` and ``tls cert``.

One directory holds the CA (``ca.pem``, and ``ca-key.pem`` of mode 0600) and the host
certificates it signed (``NAME.pem``, ``NAME-key.pem``). A host certificate names the
addresses clients reach its host by (subject alternative names: IP addresses and DNS
names) and serves both ends of mutual TLS: a server's certificate (the controller's, a
gateway's listener) and a client's (an agent, a gateway relaying to a peer, the CLI).

Keys are ECDSA P-256: small, and cheap in a handshake. Files are written whole or not at
all (a temporary file renamed over the old), so a listener that reloads its certificate
never reads half of one; a key is never readable by others, even for a moment.

``cryptography`` is imported by this module only, which only ``gpu-arbiter tls`` imports:
the listeners and clients read PEM files through the standard library's ``ssl``
(:mod:`.tls`).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .core import InvalidInput

__all__ = ["CA_CERT", "CA_KEY", "Issued", "create_ca", "create_cert"]

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
CA_DAYS = 3650
CERT_DAYS = 365
SKEW = datetime.timedelta(minutes=5)
"""A certificate is valid from this long before it was made: a host whose clock is a
little behind the one that made it still accepts it."""

_CLIENT_AUTH = ExtendedKeyUsageOID.CLIENT_AUTH
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS = re.compile(rf"(?:\*\.)?{_LABEL}(?:\.{_LABEL})*\.?")


@dataclass(frozen=True, slots=True)
class Issued:
    """What was written: the certificate and its key."""

    cert: Path
    key: Path


def create_ca(
    directory: Path,
    *,
    days: int = CA_DAYS,
    force: bool = False,
    now: datetime.datetime | None = None,
) -> Issued:
    """A new cluster CA in ``directory``. An existing one is kept (:class:`InvalidInput`
    naming ``dir``) unless ``force``: replacing it makes every certificate it signed
    untrusted."""
    _check_days(days)
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if not force and (cert_path.exists() or key_path.exists()):
        raise InvalidInput(
            "dir",
            f"{directory} holds a CA already ({CA_CERT}); --force replaces it, and every "
            "certificate it signed is then refused",
        )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpu-arbiter cluster CA")])
    start = (now or _now()) - SKEW
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + SKEW + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    _make_dir(directory)
    _write(key_path, _key_pem(key), secret=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), secret=False)
    return Issued(cert_path, key_path)


def create_cert(
    directory: Path,
    name: str,
    *,
    ips: tuple[str, ...] = (),
    dns: tuple[str, ...] = (),
    days: int = CERT_DAYS,
    now: datetime.datetime | None = None,
) -> Issued:
    """A host certificate ``NAME.pem`` (and ``NAME-key.pem``) signed by the CA of
    ``directory``, for the addresses ``ips`` and names ``dns`` (at least one), usable by
    a server and a client. Written over an earlier one of the same name (a rotation:
    listeners reload it)."""
    if not _NAME.fullmatch(name) or name.endswith("-key") or name in ("ca",):
        raise InvalidInput(
            "name", f"{name!r}: letters, digits, '.', '_' or '-', at most 63 (not ca)"
        )
    _check_days(days)
    addresses = [_ip(one) for one in ips]
    names = [_dns(one) for one in dns]
    if not addresses and not names:
        raise InvalidInput(
            "ip", "name the addresses clients reach this host by: --ip 10.0.0.5, --dns box-1"
        )
    ca_cert, ca_key = _load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    start = (now or _now()) - SKEW
    public = key.public_key()
    alternatives: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    alternatives += [x509.IPAddress(a) for a in addresses]
    authority = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + SKEW + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, _CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(authority),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    _write(key_path, _key_pem(key), secret=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), secret=False)
    return Issued(cert_path, key_path)


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if not cert_path.is_file() or not key_path.is_file():
        raise InvalidInput(
            "dir", f"no CA in {directory} ({CA_CERT}, {CA_KEY}): make one with "
            f"`gpu-arbiter tls ca --dir {directory}`",
        )  # fmt: skip
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError, OSError) as error:
        why = error.strerror if isinstance(error, OSError) else error
        raise InvalidInput("dir", f"the CA in {directory} cannot be read: {why}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidInput("dir", f"{key_path} is not a key this command made (ECDSA)")
    return cert, key


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
        crl_sign=cert_sign, encipher_only=False, decipher_only=False,
    )  # fmt: skip


def _ip(value: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(value.strip().strip("[]"))
    except ValueError:
        raise InvalidInput("ip", f"{value!r} is not an IP address (such as 10.0.0.5)") from None


def _dns(value: str) -> str:
    name = value.strip()
    if not _DNS.fullmatch(name) or len(name) > 253:
        raise InvalidInput("dns", f"{value!r} is not a host name (such as box-1.example.com)")
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name.rstrip(".").lower()
    raise InvalidInput("dns", f"{value!r} is an IP address: give it with --ip")


def _check_days(days: int) -> None:
    if not 1 <= days <= 36500:
        raise InvalidInput("days", f"must be between 1 and 36500, not {days}")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _make_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as error:
        raise InvalidInput("dir", f"cannot make {directory}: {error.strerror}") from None


def _write(path: Path, data: bytes, *, secret: bool) -> None:
    """``data`` in ``path``, whole or not at all; a secret of mode 0600 from its first
    byte (a certificate 0644)."""
    try:
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as error:
        raise InvalidInput("dir", f"cannot write in {path.parent}: {error.strerror}") from None
    try:
        os.fchmod(fd, 0o600 if secret else 0o644)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
