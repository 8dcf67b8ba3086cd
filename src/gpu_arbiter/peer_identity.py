"""Who relayed a request: each gateway's own key pair, and the header a gateway puts on
every request it relays to another (``x-arbiter-peer``), made with a key only the two
of them hold.

Each gateway makes an X25519 key pair when it starts (:class:`Identity`), held in
memory only: a restarted gateway has a new one. It reports the public half with its
report (``PUT /v1/gateways/{name}``, ``public_key``: 32 raw bytes, base64url without
padding, :func:`decode_key`), under its own gateway token, so the controller binds the
key to the name and the name to its worker; the controller's cluster view shows every
gateway's public key to the others.

Two gateways share a key no third party can make: each takes the Diffie-Hellman
exchange of its own private key with the other's public key from the view, which gives
both the same secret, hashed (HKDF-SHA256, both public keys in its info) into the
pair's key (:meth:`Identity.pair_key`, made once per peer key and kept). A relaying
gateway authenticates each request it relays with an HMAC-SHA256 under the key it
shares with the receiver (:meth:`Identity.sign`)::

    x-arbiter-peer: v=2;sender=gw-2;to=gw-3;for=...;ts=1765059709123;nonce=...;mac=...

``for`` names the receiver's key the sender used (its first 8 bytes), ``ts`` is the
sender's wall clock in milliseconds, ``nonce`` 16 random bytes, ``mac`` the HMAC of
:func:`signed_bytes`: the sender, the gateway it is for, the time, the nonce, the
method, the request target (path and query as sent) and the two headers a peer's word
decides (``x-arbiter-priority``, ``x-arbiter-lease``; '' when absent). The receiving
gateway (:class:`Verifier`) takes the request as the sender's only when the header is
for it and for its present key, the time is within :data:`WINDOW_S` of its own clock
either way, the MAC verifies under the key it shares with the sender's key as ITS
view of the cluster shows it, and the sender's nonce was not seen within the window (a
bounded replay cache, :class:`_Nonces`); else it refuses, saying which of these
failed (:class:`Refusal`; the header holds no secret: the MAC proves, it does not
open). The hosts' clocks must agree within the window (NTP).

So: no client can be a peer (it holds no gateway's private key); no gateway can speak
as another to a third (the key gw-2 shares with gw-3 is made from one of their two
private keys; gw-4 has neither); a header that leaked (a log, a model server that saw
it) opens nothing: it names one gateway, one method and target, and is taken once,
within :data:`WINDOW_S`. The one holder besides the sender who could make gw-2's MAC
for gw-3 is gw-3 itself, for itself alone: whoever holds gw-3's key is gw-3 already.
A rotated key (the gateway restarted, or reported another) is refused as soon as the
receiver's view shows the new one: the controller answers every gateway's view
long-poll within a second of the report that brought it (``server/cluster.py``), and a
gateway asks for its view again at once when a sender's MAC does not verify
(``gateway/cluster/cluster.py``). A header made for the receiver's previous key (the
receiver restarted; the sender's view has not shown its new key yet) is a 503 to
retry in a second, not a 403: it is the sender's view that is behind.

Why not signatures (Ed25519, as the first version of this header had): verifying one
took 176 us of CPU and making one 62 us on this project's 2-core test machine, on the
path of every relayed request (more than a third of what the hop added); an HMAC
takes about 2 us, and the exchange is made once per pair of keys. What a signature has
that this lacks is proof to a third party, which nothing here asks for.

The body is not authenticated: that would mean holding every body whole (a stream, an
upload) before relaying it. Between hosts a real cluster relays over TLS (``tls.py``),
where nobody but the two gateways reads or changes a byte; without TLS a man in the
middle reads and alters everything anyway (the answer too), so a MAC on the body
would protect nothing he could not take otherwise; and the nonce and the window stop
a captured request from being played again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import heapq
import hmac
import json
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .core import InvalidInput

__all__ = [
    "HEADER",
    "MAX_NONCES",
    "WINDOW_S",
    "Identity",
    "Keys",
    "PublicKey",
    "Refusal",
    "Relayed",
    "Verifier",
    "decode_key",
    "encode_key",
    "signed_bytes",
]

HEADER = "x-arbiter-peer"
VERSION = "2"
WINDOW_S = 30.0
"""A signed header is taken this long either way of the receiver's clock; its nonce is
remembered as long."""
MAX_NONCES = 65536
"""Nonces remembered at most (the replay cache's bound): past it, the oldest is forgotten
and no header as old as it is taken any more (:class:`_Nonces`)."""
KEY_BYTES = 32
NONCE_BYTES = 16
MAC_BYTES = 32
FOR_BYTES = 8
"""How much of the receiver's public key the header names (``for``): enough to tell its
present key from its previous one."""
MAX_PAIRS = 4096
"""Pair keys kept at most (one per peer key seen); past it they are made again."""
_FIELDS = ("v", "sender", "to", "for", "ts", "nonce", "mac")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
"""A gateway's name (a worker name: ``core.validate_worker_name``'s rule)."""
_DOMAIN = "gpu-arbiter peer relay v2"
"""The first item of the MAC'ed bytes, and the HKDF's info: a MAC or a key of this kind
is nothing else's."""

PublicKey = X25519PublicKey


def encode_key(key: PublicKey) -> str:
    """A public key as reported: its 32 raw bytes, base64url without padding."""
    return _b64(_raw(key))


def decode_key(text: str, field: str = "public_key") -> PublicKey:
    """The public key ``text`` encodes (:func:`encode_key`); :class:`InvalidInput` naming
    ``field`` when it is not one, or one no key can be shared with (a point of small
    order, whose exchange gives a known secret)."""
    raw = _unb64(text)
    if raw is None or len(raw) != KEY_BYTES:
        raise InvalidInput(
            field, f"must be an X25519 public key: {KEY_BYTES} raw bytes, base64url (43 chars)"
        )
    key = X25519PublicKey.from_public_bytes(raw)
    try:
        _PROBE.exchange(key)
    except ValueError:
        raise InvalidInput(
            field, "is a point of small order: no key can be shared with it"
        ) from None
    return key


@dataclass(frozen=True, slots=True)
class Relayed:
    """What is signed of a relayed request besides who sends it, to whom and when: its
    method, its target (path and query, as sent), and the peer headers
    ``x-arbiter-priority`` and ``x-arbiter-lease`` ('' when absent)."""

    method: str
    target: bytes
    priority: str = ""
    lease: str = ""


def signed_bytes(
    sender: str, to: str, for_key: str, ts: str, nonce: str, relayed: Relayed
) -> bytes:
    """The bytes a relay's MAC covers: a JSON list, so no field can run into the next."""
    items = [
        _DOMAIN, sender, to, for_key, ts, nonce, relayed.method,
        relayed.target.decode("latin-1"), relayed.priority, relayed.lease,
    ]  # fmt: skip
    return json.dumps(items, separators=(",", ":")).encode()


class Identity:
    """A gateway's own key pair (made here, in memory only), the keys it shares with its
    peers, and its MAC of the requests it relays. ``wall``: the wall clock, seconds (a
    fake one in tests)."""

    def __init__(self, name: str, *, wall: Callable[[], float] = time.time) -> None:
        self.name = name
        self.wall = wall
        self._private = X25519PrivateKey.generate()
        self._raw_public = _raw(self._private.public_key())
        self.public_key = _b64(self._raw_public)
        """The public half, as reported to the controller."""
        self.key_id = _b64(self._raw_public[:FOR_BYTES])
        """What a header made for this key names (``for``)."""
        self._pairs: dict[bytes, bytes] = {}  # a peer's public key -> the pair's key

    def __repr__(self) -> str:
        return f"Identity({self.name!r}, public_key={self.public_key!r})"

    def pair_key(self, key: PublicKey) -> bytes:
        """The key this gateway shares with the holder of ``key``: made once, then kept.
        Raises ValueError for a key of small order (:func:`decode_key` refuses those)."""
        raw = _raw(key)
        found = self._pairs.get(raw)
        if found is None:
            secret = self._private.exchange(key)
            ends = b"".join(sorted((self._raw_public, raw)))
            info = _DOMAIN.encode() + ends
            found = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)
            if len(self._pairs) >= MAX_PAIRS:
                self._pairs.clear()
            self._pairs[raw] = found
        return found

    def sign(self, to: str, key: PublicKey, relayed: Relayed) -> str:
        """The ``x-arbiter-peer`` header for ``relayed``, sent to gateway ``to`` whose
        public key (as this gateway's view shows it) is ``key``."""
        for_key = _b64(_raw(key)[:FOR_BYTES])
        ts = str(int(self.wall() * 1000))
        nonce = _b64(secrets.token_bytes(NONCE_BYTES))
        signed = signed_bytes(self.name, to, for_key, ts, nonce, relayed)
        mac = hmac.digest(self.pair_key(key), signed, hashlib.sha256)
        found = {"v": VERSION, "sender": self.name, "to": to, "for": for_key, "ts": ts}
        return ";".join(f"{k}={v}" for k, v in found.items()) + f";nonce={nonce};mac={_b64(mac)}"


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a peer's header was not taken. ``ask_again``: the receiver's view may be
    behind (the sender, or its key, is new): a view asked for again may know it."""

    why: str
    ask_again: bool = False
    status: int = 403  # 503: the sender's view is behind (try again in a second)


Keys = Mapping[str, PublicKey | None]
"""The gateways a receiver's view shows, by name, with the key each reported (None:
none)."""


class Verifier:
    """Gateway ``identity``'s check of the headers its peers make (:meth:`verify`)."""

    def __init__(
        self,
        identity: Identity,
        *,
        window_s: float = WINDOW_S,
        max_nonces: int = MAX_NONCES,
    ) -> None:
        self.identity = identity
        self.name = identity.name
        self.window_s = window_s
        self._nonces = _Nonces(max_nonces)

    def verify(self, header: str, relayed: Relayed, keys: Keys) -> str | Refusal:
        """The sender's name when ``header`` proves it sent ``relayed`` to this gateway
        just now and never before, else why not. Only a header that verified is
        remembered (its nonce): one refused can be sent again, once its sender's key is
        known here."""
        fields = _fields(header)
        if isinstance(fields, Refusal):
            return fields
        sender, to, ts = fields["sender"], fields["to"], fields["ts"]
        if to != self.name:
            return Refusal(f"it is made for gateway {to}, not for this one ({self.name})")
        if fields["for"] != self.identity.key_id:
            return Refusal(
                f"it was made for another key of this gateway ({self.name} restarted since "
                f"gateway {sender}'s view showed it): retry in a second, once that view "
                "shows this gateway's present key",
                status=503,
            )
        now = self.identity.wall()
        late_s = now - int(ts) / 1000
        if abs(late_s) > self.window_s:
            side = "behind" if late_s > 0 else "ahead of"
            return Refusal(
                f"its time is {abs(late_s):.1f}s {side} this gateway's clock (at most "
                f"{self.window_s:g}s either way: a replay, or the hosts' clocks disagree)"
            )
        if sender == self.name:
            return Refusal(f"it names this gateway ({sender}) as its sender")
        if sender not in keys:
            return Refusal(f"gateway {sender} is not in this gateway's view", ask_again=True)
        key = keys[sender]
        if key is None:
            return Refusal(f"gateway {sender} reported no public key", ask_again=True)
        signed = signed_bytes(sender, to, fields["for"], ts, fields["nonce"], relayed)
        try:
            expected = hmac.digest(self.identity.pair_key(key), signed, hashlib.sha256)
        except ValueError:
            return Refusal(f"gateway {sender}'s public key is one no key can be shared with")
        if not hmac.compare_digest(expected, _unb64(fields["mac"]) or b""):
            return Refusal(
                f"its MAC does not verify with the key this gateway shares with gateway "
                f"{sender}'s public key in its view (the request was altered, or made with "
                "another key)",
                ask_again=True,
            )
        refused = self._nonces.take(sender, fields["nonce"], int(ts) / 1000, now - self.window_s)
        return refused or sender


class _Nonces:
    """The nonces taken, each until its header's time has left the window: a header seen
    again is refused. Bounded: past ``limit`` the one of the oldest time is forgotten and
    ``floor`` rises to that time, and no header of a time at or below the floor is taken
    (it could be one forgotten), so a replay never gets through, however many."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_time: list[tuple[float, str, str]] = []  # (its time, sender, nonce): a heap
        self._taken: set[tuple[str, str]] = set()
        self.floor = float("-inf")

    def take(self, sender: str, nonce: str, at: float, oldest: float) -> Refusal | None:
        """Takes ``sender``'s ``nonce`` of time ``at``; those older than ``oldest`` (out of
        the window) are forgotten first. A refusal when it was taken already, or when the
        cache no longer reaches back to ``at``."""
        while self._by_time and self._by_time[0][0] < oldest:
            _, *gone = heapq.heappop(self._by_time)
            self._taken.discard((gone[0], gone[1]))
        if (sender, nonce) in self._taken:
            return Refusal(f"its nonce from {sender} was taken already: a replay")
        if at <= self.floor:
            return Refusal(
                f"it is older than the oldest of the last {self.limit} relays remembered here"
            )
        if len(self._by_time) >= self.limit:
            forgotten, *gone = heapq.heappop(self._by_time)
            self._taken.discard((gone[0], gone[1]))
            self.floor = max(self.floor, forgotten)
        heapq.heappush(self._by_time, (at, sender, nonce))
        self._taken.add((sender, nonce))
        return None

    def __len__(self) -> int:
        return len(self._taken)


def _fields(header: str) -> dict[str, str] | Refusal:
    """The header's fields, each there once and well formed, or why not."""
    found: dict[str, str] = {}
    for part in header.split(";"):
        name, equals, value = part.strip().partition("=")
        if not equals or name not in _FIELDS or name in found:
            found = {}
            break
        found[name] = value
    if set(found) != set(_FIELDS) or found["v"] != VERSION:
        expected = ";".join(f"{name}=..." for name in _FIELDS)
        return Refusal(f"it is not a peer header of version {VERSION} ({expected})")
    bad = next((n for n in ("sender", "to") if not _NAME.fullmatch(found[n])), None)
    if bad is None and not (found["ts"].isdigit() and len(found["ts"]) <= 15):
        bad = "ts"
    if bad is None and len(_unb64(found["nonce"]) or b"") != NONCE_BYTES:
        bad = "nonce"
    if bad is None and len(_unb64(found["for"]) or b"") != FOR_BYTES:
        bad = "for"
    if bad is None and len(_unb64(found["mac"]) or b"") != MAC_BYTES:
        bad = "mac"
    if bad is not None:
        return Refusal(f"its {bad} is not well formed")
    return found


def _raw(key: PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes | None:
    """The bytes of unpadded base64url ``text``; None when it is not that."""
    if not text or len(text) > 200 or not _B64.fullmatch(text) or len(text) % 4 == 1:
        return None
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        return None


_B64 = re.compile(r"[A-Za-z0-9_-]+")
_PROBE = X25519PrivateKey.generate()
"""A throwaway key :func:`decode_key` tries an exchange with (refusing small-order points)."""
