"""The cluster's CA and its host certificates (``certs.py``): what is written, with which
modes, what a certificate says, and each refusal naming its field."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from gpu_arbiter.certs import CA_CERT, CA_KEY, create_ca, create_cert
from gpu_arbiter.core import InvalidInput


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_a_ca_is_a_ca_and_its_key_is_the_owners_alone(tmp_path: Path) -> None:
    issued = create_ca(tmp_path / "tls", days=30)
    assert issued.cert == tmp_path / "tls" / CA_CERT
    assert issued.key == tmp_path / "tls" / CA_KEY
    assert _mode(issued.key) == 0o600
    assert _mode(issued.cert) == 0o644
    assert _mode(tmp_path / "tls") == 0o700
    cert = _cert(issued.cert)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert datetime.timedelta(days=30) <= lifetime <= datetime.timedelta(days=30, minutes=6)
    assert list(tmp_path.joinpath("tls").iterdir()) != []  # no temporary file left
    assert not [p for p in tmp_path.joinpath("tls").iterdir() if p.name.startswith(".")]


def test_an_existing_ca_is_kept_unless_forced(tmp_path: Path) -> None:
    first = create_ca(tmp_path).cert.read_bytes()
    with pytest.raises(InvalidInput) as refused:
        create_ca(tmp_path)
    assert refused.value.field == "dir"
    assert "--force" in refused.value.reason
    assert (tmp_path / CA_CERT).read_bytes() == first
    create_ca(tmp_path, force=True)
    assert (tmp_path / CA_CERT).read_bytes() != first


def test_a_host_certificate_is_signed_by_the_ca_for_its_names_and_both_ends(
    tmp_path: Path,
) -> None:
    ca = create_ca(tmp_path)
    issued = create_cert(
        tmp_path, "box-1", ips=("127.0.0.2", "::1"), dns=("box-1", "Box-1.Example.com"), days=7
    )
    assert issued.cert == tmp_path / "box-1.pem"
    assert issued.key == tmp_path / "box-1-key.pem"
    assert _mode(issued.key) == 0o600
    cert = _cert(issued.cert)
    cert.verify_directly_issued_by(_cert(ca.cert))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["box-1", "box-1.example.com"]
    assert names.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.2"),
        ipaddress.ip_address("::1"),
    ]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # the standard library loads and verifies the pair, as the listeners will
    context = ssl.create_default_context(cafile=ca.cert)
    context.load_cert_chain(issued.cert, issued.key)


@pytest.mark.parametrize(
    ("name", "ips", "dns", "field", "words"),
    [
        ("box-1", ("300.1.2.3",), (), "ip", "'300.1.2.3' is not an IP address"),
        ("box-1", (), ("bad_name!",), "dns", "'bad_name!' is not a host name"),
        ("box-1", (), ("10.0.0.5",), "dns", "give it with --ip"),
        ("box-1", (), (), "ip", "name the addresses"),
        ("../etc", ("10.0.0.5",), (), "name", "letters, digits"),
        ("ca", ("10.0.0.5",), (), "name", "not ca"),
    ],
)
def test_a_bad_argument_is_refused_naming_its_field(
    tmp_path: Path, name: str, ips: tuple[str, ...], dns: tuple[str, ...], field: str, words: str
) -> None:
    create_ca(tmp_path)
    with pytest.raises(InvalidInput) as refused:
        create_cert(tmp_path, name, ips=ips, dns=dns)
    assert refused.value.field == field
    assert words in refused.value.reason
    assert sorted(p.name for p in tmp_path.iterdir()) == [CA_KEY, CA_CERT]


def test_a_certificate_without_a_ca_is_refused_saying_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as refused:
        create_cert(tmp_path, "box-1", ips=("10.0.0.5",))
    assert refused.value.field == "dir"
    assert "no CA in" in refused.value.reason
    assert "gpu-arbiter tls ca --dir" in refused.value.reason


def test_days_are_bounded(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as refused:
        create_ca(tmp_path, days=0)
    assert refused.value.field == "days"
