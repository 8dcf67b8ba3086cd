"""TLS for the project's listeners and clients, from PEM files (the standard library's
``ssl``; ``gpu-arbiter tls`` makes the files, :mod:`.certs`).

A listener (the controller's, a gateway's) serves with its certificate and key
(:class:`ServerTls`, :func:`server_context`). With a client CA it asks every client for
a certificate signed by it: the controller requires one (its clients are the cluster's
own agents, gateways and operators, each of which holds a host certificate: a token
stolen off the cluster is then not enough to reach it); a gateway only checks one a
client presents (a peer relaying to it), since the SDKs that call it have none.

A client that opens a connection and never completes its handshake (sends nothing, or
half a ClientHello) is closed after a bound (:func:`handshake_bound`: the listener's
``header_timeout_s``, 10 s by default), not after asyncio's default of 60 s: until its
handshake is done the connection is not HTTP yet, so the header timeout cannot close it,
yet it holds one of the listener's connections.

Certificates are reloaded without a restart (:class:`Reloader`): every ``RELOAD_S`` the
files are looked at, and once they changed they are loaded into the listener's very
context. The handshakes after it present the new certificate; connections already open
keep theirs. A cert and a key that do not match (one written, the other not yet) are
kept out until they do; the old pair serves meanwhile. A client CA file that changed
adds its certificates to those trusted (a CA being rotated is trusted beside the old
one); to stop trusting one, restart.

A client (:class:`~.client.ArbiterClient`: the CLI, ``run``, the agent, the gateway's
link to the controller) verifies an https controller against ``GPU_ARBITER_CA`` (else
the system's CAs) and, for mutual TLS, presents ``GPU_ARBITER_CLIENT_CERT`` and
``GPU_ARBITER_CLIENT_KEY`` (:func:`client_context`). A long-lived client (an agent, a
gateway) reloads its certificate and key the same way, without a restart: before a new
connection's handshake, at most every ``RELOAD_S``, the files are looked at and, once
they changed (and match), loaded into its context; connections already open keep the
old pair. A certificate it refuses is said in words (:func:`refusal`): not signed by the
CA, expired, for another name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .core import InvalidInput
from .paths import is_loopback

__all__ = [
    "CA_ENV",
    "CLIENT_CERT_ENV",
    "CLIENT_KEY_ENV",
    "ClientContext",
    "Reloader",
    "ServerTls",
    "client_context",
    "handshake_bound",
    "refusal",
    "server_context",
    "warn_if_plain",
]

log = logging.getLogger(__name__)

CA_ENV = "GPU_ARBITER_CA"
CLIENT_CERT_ENV = "GPU_ARBITER_CLIENT_CERT"
CLIENT_KEY_ENV = "GPU_ARBITER_CLIENT_KEY"
RELOAD_S = 2.0
"""How often a listener, or a client about to connect, looks whether its certificate
files changed."""


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A listener's certificate and key; with ``client_ca``, clients present a certificate
    it signed: always (``client_cert_required``), or where they present one at all."""

    cert: Path
    key: Path
    client_ca: Path | None = None
    client_cert_required: bool = True
    fields: tuple[str, str, str] = ("tls_cert", "tls_key", "tls_client_ca")
    """How its settings are named where they were given, for errors."""

    @property
    def files(self) -> tuple[Path, ...]:
        return (
            (self.cert, self.key)
            if self.client_ca is None
            else (self.cert, self.key, self.client_ca)
        )


def server_context(tls: ServerTls) -> ssl.SSLContext:
    """A listener's context (TLS 1.2 and later); :class:`InvalidInput` naming the setting
    of a file that cannot be read or a pair that does not match."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_pair(context, tls)
    if tls.client_ca is not None:
        _load_client_ca(context, tls)
        context.verify_mode = ssl.CERT_REQUIRED if tls.client_cert_required else ssl.CERT_OPTIONAL
    return context


def _load_pair(context: ssl.SSLContext, tls: ServerTls, shown: ServerTls | None = None) -> None:
    """Loads ``tls``'s pair into ``context``; an error names ``shown``'s files (those
    ``tls`` copies) and settings."""
    shown = shown or tls
    for path, name in ((tls.cert, shown.fields[0]), (tls.key, shown.fields[1])):
        if not path.is_file():
            raise InvalidInput(name, f"{path}: no such file")
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except ssl.SSLError as error:
        why = "the key is not the certificate's" if "mismatch" in str(error) else str(error)
        raise InvalidInput(shown.fields[0], f"{shown.cert} with {shown.key}: {why}") from None
    except OSError as error:
        raise InvalidInput(shown.fields[0], f"{shown.cert}: {error.strerror or error}") from None


def _load_client_ca(context: ssl.SSLContext, tls: ServerTls) -> None:
    assert tls.client_ca is not None
    try:
        context.load_verify_locations(cafile=tls.client_ca)
    except (ssl.SSLError, OSError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise InvalidInput(tls.fields[2], f"{tls.client_ca}: {why}") from None


class Reloader:
    """Loads a listener's changed certificate files into its ``context`` (see the module);
    :meth:`check` once, :meth:`watching` every ``every_s`` while a server runs."""

    def __init__(self, context: ssl.SSLContext, tls: ServerTls, every_s: float = RELOAD_S):
        self.context = context
        self.tls = tls
        self.every_s = every_s
        self._seen = self._signature()
        self._refused: tuple[tuple[int, int, int], ...] | None = None
        self.reloads = 0

    def _signature(self) -> tuple[tuple[int, int, int], ...]:
        found = []
        for path in self.tls.files:
            try:
                stat = path.stat()
            except OSError:
                found.append((0, 0, 0))
                continue
            found.append((stat.st_mtime_ns, stat.st_size, stat.st_ino))
        return tuple(found)

    def check(self) -> bool:
        """Loads the files if they changed since last loaded; whether it did."""
        now = self._signature()
        if now == self._seen:
            return False
        try:
            self._load_checked()
            if self.tls.client_ca is not None and now[2:] != self._seen[2:]:
                _load_client_ca(self.context, self.tls)
        except InvalidInput as error:
            if now != self._refused:  # said once for each state of the files
                log.warning("TLS certificate not reloaded, the old one serves on: %s", error)
                self._refused = now
            return False
        self._seen = now
        self.reloads += 1
        log.info("TLS certificate %s reloaded", self.tls.cert)
        return True

    def _load_checked(self) -> None:
        """Loads the pair as it is now into the live context, once a scratch context
        took the very same bytes: a load that fails half-way (a new certificate beside
        the old key) leaves a context without a key, and every handshake would fail."""
        with tempfile.TemporaryDirectory(prefix="gpu-arbiter-tls-") as held:
            copy = replace(self.tls, cert=Path(held, "cert.pem"), key=Path(held, "key.pem"))
            for source, target in ((self.tls.cert, copy.cert), (self.tls.key, copy.key)):
                with contextlib.suppress(FileNotFoundError):  # named by the load below
                    target.write_bytes(source.read_bytes())
            _load_pair(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), copy, self.tls)
            _load_pair(self.context, copy, self.tls)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self.check()

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Reloads while the body runs (a server serving); the watch ends with it."""
        task = asyncio.create_task(self.run())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@contextlib.contextmanager
def handshake_bound(timeout_s: float) -> Iterator[None]:
    """While the body runs, the TLS listeners the running loop creates give a client
    ``timeout_s`` to complete its handshake, else the connection is closed (asyncio's
    default is 60 s). Wrap uvicorn's ``Server.startup`` in it: uvicorn (0.55) creates its
    listeners there with ``loop.create_server(..., ssl=context)`` and has no setting for
    the bound, so the loop's ``create_server`` is given it for that while."""
    loop = asyncio.get_running_loop()
    create = loop.create_server

    async def bounded(*args: Any, **kwargs: Any) -> asyncio.Server:
        if kwargs.get("ssl") is not None:
            kwargs.setdefault("ssl_handshake_timeout", timeout_s)
        return await create(*args, **kwargs)

    loop.create_server = bounded  # type: ignore[method-assign]
    try:
        yield
    finally:
        del loop.create_server  # the loop's own method again


def warn_if_plain(what: str, host: str, tls: ServerTls | None, flags: str) -> None:
    """A loud warning for a listener beyond loopback without TLS: its tokens, keys and
    bodies cross the network for anyone on it to read."""
    if tls is None and not is_loopback(host):
        log.warning(
            "%s listens on %s in PLAIN HTTP: every token and body crosses the network "
            "readable (and changeable) by anyone on it; serve TLS with %s "
            "(certificates: gpu-arbiter tls ca, gpu-arbiter tls cert)",
            what, host, flags,
        )  # fmt: skip


def client_context(
    ca: str | Path | None = None,
    cert: str | Path | None = None,
    key: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> ssl.SSLContext | None:
    """The context a client verifies servers with: trusting ``ca`` (else the
    system's CAs), presenting ``cert`` and ``key`` (mutual TLS), reloaded when they change
    (:class:`ClientContext`); each not given is read from ``env`` (the environment:
    ``GPU_ARBITER_CA``, ``GPU_ARBITER_CLIENT_CERT``, ``GPU_ARBITER_CLIENT_KEY``). None when
    nothing is set: httpx's own defaults. :class:`InvalidInput` naming the variable of a
    file that cannot be read."""
    env = os.environ if env is None else env
    ca = ca or env.get(CA_ENV) or None
    cert = cert or env.get(CLIENT_CERT_ENV) or None
    key = key or env.get(CLIENT_KEY_ENV) or None
    if ca is None and cert is None and key is None:
        return None
    context = ClientContext(ssl.PROTOCOL_TLS_CLIENT)  # as ssl.create_default_context
    try:
        if ca is None:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
        else:
            context.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise InvalidInput(CA_ENV, f"{ca}: {why}") from None
    if cert is None and key is not None:
        raise InvalidInput(CLIENT_CERT_ENV, f"not set, but {CLIENT_KEY_ENV} is")
    if cert is not None:
        tls = ServerTls(Path(cert), Path(key or cert), fields=(CLIENT_CERT_ENV, CLIENT_KEY_ENV, ""))
        _load_pair(context, tls)
        context.reloader = Reloader(context, tls)
    return context


class ClientContext(ssl.SSLContext):
    """A client's context whose certificate and key (``reloader``'s files) are loaded
    again once they changed: looked at before a new connection's handshake (every wrap
    of a socket or a memory BIO, as httpx's transports do), at most every
    ``reloader.every_s``."""

    reloader: Reloader | None = None
    _looked_at = -float("inf")
    _looking = threading.Lock()  # httpx's sync client may connect on several threads

    def reload_if_changed(self) -> None:
        reloader = self.reloader
        now = time.monotonic()
        if reloader is None or now - self._looked_at < reloader.every_s:
            return
        with self._looking:
            if now - self._looked_at >= reloader.every_s:
                self._looked_at = now
                reloader.check()

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:
        self.reload_if_changed()
        return super().wrap_socket(*args, **kwargs)

    def wrap_bio(self, *args: Any, **kwargs: Any) -> ssl.SSLObject:
        self.reload_if_changed()
        return super().wrap_bio(*args, **kwargs)


def refusal(error: BaseException, closed_unanswered: bool = False) -> str | None:
    """What a failed TLS connection says in words, or None if it is not one: the
    server's certificate refused (and why), or the server refusing this client's. With
    TLS 1.3 a server that requires a client certificate closes the connection once the
    handshake is over, unanswered: ``closed_unanswered`` (an https request that ended
    so) is said as that possibility."""
    seen: BaseException | None = error
    if closed_unanswered and not any(isinstance(e, ssl.SSLError) for e in _chain(error)):
        return (
            "it closed the connection unanswered, as a server that requires a client "
            f"certificate does without one: set {CLIENT_CERT_ENV} and {CLIENT_KEY_ENV} "
            "(or --client-cert and --client-key)"
        )
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            why = (seen.verify_message or str(seen)).rstrip(".")
            if "issuer" in why or "self-signed" in why:
                why += f": not signed by a CA trusted here (the cluster's: {CA_ENV} or --ca)"
            return f"its certificate was refused: {why}"
        if isinstance(seen, ssl.SSLError):
            text = str(seen)
            if "CERTIFICATE_REQUIRED" in text.upper():
                return (
                    "it asks for a client certificate: set "
                    f"{CLIENT_CERT_ENV} and {CLIENT_KEY_ENV} (gpu-arbiter tls cert)"
                )
            if "UNKNOWN_CA" in text.upper() or "BAD_CERTIFICATE" in text.upper():
                return "it refused this client's certificate (not signed by its CA)"
            if "WRONG_VERSION_NUMBER" in text.upper():
                return "it does not speak TLS (an http:// URL?)"
            return f"TLS failed: {text}"
        seen = seen.__cause__ or seen.__context__
    return None


def _chain(error: BaseException) -> list[BaseException]:
    found: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and seen not in found:
        found.append(seen)
        seen = seen.__cause__ or seen.__context__
    return found
