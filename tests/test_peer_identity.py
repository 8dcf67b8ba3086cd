"""A relay's header (``peer_identity.py``), on a fake wall clock: taken from the sender
whose key the receiver's view shows, for the receiver (and its present key) only,
within the window, once; refused, saying why, for a wrong key, another target, an old
or future time, a replayed nonce, a method, target, priority or lease changed on the
way, an unknown sender, a malformed header; a header made for the receiver's previous
key is a 503 to retry. The two ends make the same pair key, no third gateway does. The
replay cache stays bounded and still refuses every replay."""

from __future__ import annotations

import pytest

from gpu_arbiter.core import InvalidInput
from gpu_arbiter.peer_identity import (
    WINDOW_S,
    Identity,
    Keys,
    PublicKey,
    Refusal,
    Relayed,
    Verifier,
    decode_key,
    encode_key,
)

RELAYED = Relayed("POST", b"/v1/chat/completions?x=1", "800", "lease-1")


class Wall:
    def __init__(self) -> None:
        self.t = 1_765_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def wall() -> Wall:
    return Wall()


def _keys(*identities: Identity) -> Keys:
    return {i.name: decode_key(i.public_key) for i in identities}


def _receiver(name: str, wall: Wall, **more: int) -> Verifier:
    return Verifier(Identity(name, wall=wall), **more)


def _key(of: Verifier | Identity) -> PublicKey:
    identity = of.identity if isinstance(of, Verifier) else of
    return decode_key(identity.public_key)


def _refused(verdict: str | Refusal, *words: str, ask_again: bool = False) -> None:
    assert isinstance(verdict, Refusal), verdict
    for word in words:
        assert word in verdict.why, verdict.why
    assert verdict.ask_again is ask_again


def test_a_signed_relay_is_taken_once_from_its_sender(wall: Wall) -> None:
    gw2 = Identity("gw-2", wall=wall)
    receiver = _receiver("gw-3", wall)
    header = gw2.sign("gw-3", _key(receiver), RELAYED)
    for_key = receiver.identity.key_id  # the receiver's key's first 8 bytes
    assert header.startswith(f"v=2;sender=gw-2;to=gw-3;for={for_key};")
    assert ";ts=1765000000000;nonce=" in header
    wall.t += 1.0
    assert receiver.verify(header, RELAYED, _keys(gw2)) == "gw-2"
    _refused(receiver.verify(header, RELAYED, _keys(gw2)), "nonce", "replay")
    again = gw2.sign("gw-3", _key(receiver), RELAYED)  # a new nonce: another relay
    assert receiver.verify(again, RELAYED, _keys(gw2)) == "gw-2"


def test_another_gateways_key_or_a_forged_name_is_refused(wall: Wall) -> None:
    gw2, gw4 = Identity("gw-2", wall=wall), Identity("gw-4", wall=wall)
    receiver = _receiver("gw-3", wall)
    liar = Identity("gw-2", wall=wall)  # gw-4's holder signing as gw-2, with its own key
    header = liar.sign("gw-3", _key(receiver), RELAYED)
    _refused(
        receiver.verify(header, RELAYED, _keys(gw2, gw4)),
        "does not verify with the key this gateway shares with gateway gw-2's public key",
        ask_again=True,  # the view may be behind: asked again, then refused
    )
    # the refused header was not remembered: the real gw-2's key, once known, would take
    # it (a restarted gw-2 whose new key the view brings now)
    assert receiver.verify(header, RELAYED, {"gw-2": decode_key(liar.public_key)}) == "gw-2"


def test_a_relay_for_another_gateway_or_its_previous_key_is_refused(wall: Wall) -> None:
    gw2, gw4 = Identity("gw-2", wall=wall), _receiver("gw-4", wall)
    header = gw2.sign("gw-4", _key(gw4), RELAYED)
    _refused(_receiver("gw-3", wall).verify(header, RELAYED, _keys(gw2)), "for gateway gw-4")
    assert gw4.verify(header, RELAYED, _keys(gw2)) == "gw-2"
    restarted = _receiver("gw-4", wall)  # a new key: gw-2's view still shows the old one
    stale = gw2.sign("gw-4", _key(gw4), RELAYED)
    verdict = restarted.verify(stale, RELAYED, _keys(gw2))
    _refused(verdict, "made for another key of this gateway", "retry in a second")
    assert isinstance(verdict, Refusal) and verdict.status == 503


def test_both_ends_make_the_same_pair_key_and_no_third_gateway_does() -> None:
    gw2, gw3, gw4 = Identity("gw-2"), Identity("gw-3"), Identity("gw-4")
    assert gw2.pair_key(_key(gw3)) == gw3.pair_key(_key(gw2))
    assert gw4.pair_key(_key(gw3)) != gw2.pair_key(_key(gw3))
    assert gw4.pair_key(_key(gw2)) != gw2.pair_key(_key(gw3))
    assert len(gw2.pair_key(_key(gw3))) == 32


@pytest.mark.parametrize(
    ("moved_s", "side"), [(WINDOW_S + 0.5, "behind"), (-WINDOW_S - 1, "ahead")]
)
def test_a_relay_out_of_the_window_is_refused(wall: Wall, moved_s: float, side: str) -> None:
    gw2 = Identity("gw-2", wall=wall)
    receiver = _receiver("gw-3", wall)
    header = gw2.sign("gw-3", _key(receiver), RELAYED)
    wall.t += moved_s
    _refused(receiver.verify(header, RELAYED, _keys(gw2)), side, f"{WINDOW_S:g}s either way")
    wall.t -= moved_s - (WINDOW_S - 0.5 if moved_s > 0 else -WINDOW_S + 0.5)
    assert receiver.verify(header, RELAYED, _keys(gw2)) == "gw-2"  # just inside


@pytest.mark.parametrize(
    "changed",
    [
        Relayed("GET", RELAYED.target, RELAYED.priority, RELAYED.lease),
        Relayed("POST", b"/v1/embeddings?x=1", RELAYED.priority, RELAYED.lease),
        Relayed("POST", b"/v1/chat/completions?x=2", RELAYED.priority, RELAYED.lease),
        Relayed("POST", RELAYED.target, "1000", RELAYED.lease),
        Relayed("POST", RELAYED.target, RELAYED.priority, "lease-2"),
        Relayed("POST", RELAYED.target, "", ""),
    ],
)
def test_a_relay_changed_on_the_way_is_refused(wall: Wall, changed: Relayed) -> None:
    gw2 = Identity("gw-2", wall=wall)
    receiver = _receiver("gw-3", wall)
    header = gw2.sign("gw-3", _key(receiver), RELAYED)
    _refused(receiver.verify(header, changed, _keys(gw2)), "altered", ask_again=True)
    assert receiver.verify(header, RELAYED, _keys(gw2)) == "gw-2"


def test_an_unknown_sender_or_one_without_a_key_is_asked_again(wall: Wall) -> None:
    gw2 = Identity("gw-2", wall=wall)
    receiver = _receiver("gw-3", wall)
    header = gw2.sign("gw-3", _key(receiver), RELAYED)
    _refused(
        receiver.verify(header, RELAYED, {}), "gw-2 is not in this gateway's view", ask_again=True
    )
    _refused(
        receiver.verify(header, RELAYED, {"gw-2": None}), "reported no public key", ask_again=True
    )
    own = receiver.identity.sign("gw-3", _key(receiver), RELAYED)
    _refused(receiver.verify(own, RELAYED, _keys(gw2)), "names this gateway")


@pytest.mark.parametrize(
    ("header", "says"),
    [
        ("", "not a peer header"),
        ("k", "not a peer header"),
        (
            "v=2;sender=gw-2;to=gw-3;for=AAAAAAAAAAA;ts=1;nonce=AAAAAAAAAAAAAAAAAAAAAA",
            "not a peer header",
        ),
        ("v=1;sender=gw-2;to=gw-3;for=a;ts=1;nonce=a;mac=b", "version 2"),
        ("v=2;sender=gw-2;sender=gw-2;to=gw-3;for=a;ts=1;nonce=a;mac=b", "not a peer header"),
        ("v=2;sender=GW 2;to=gw-3;for=a;ts=1;nonce=a;mac=b", "its sender"),
        ("v=2;sender=gw-2;to=gw-3;for=a;ts=-1;nonce=a;mac=b", "its ts"),
        ("v=2;sender=gw-2;to=gw-3;for=a;ts=1e3;nonce=a;mac=b", "its ts"),
        ("v=2;sender=gw-2;to=gw-3;for=a;ts=1;nonce=a=;mac=b", "its nonce"),
        ("v=2;sender=gw-2;to=gw-3;for=a;ts=1;nonce=AAAAAAAAAAAAAAAAAAAAAA;mac=b", "its for"),
        (
            "v=2;sender=gw-2;to=gw-3;for=AAAAAAAAAAA;ts=1;nonce=AAAAAAAAAAAAAAAAAAAAAA;mac=b",
            "its mac",
        ),
    ],
)
def test_a_malformed_header_is_refused_saying_so(wall: Wall, header: str, says: str) -> None:
    _refused(_receiver("gw-3", wall).verify(header, RELAYED, {}), says)


def test_the_replay_cache_is_bounded_and_still_refuses_every_replay(wall: Wall) -> None:
    gw2 = Identity("gw-2", wall=wall)
    receiver = _receiver("gw-3", wall, max_nonces=4)
    keys = _keys(gw2)
    headers = []
    for _ in range(6):
        headers.append(gw2.sign("gw-3", _key(receiver), RELAYED))
        wall.t += 0.01
    for header in headers:
        assert receiver.verify(header, RELAYED, keys) == "gw-2"
    assert len(receiver._nonces) == 4
    for header in headers:  # those forgotten are older than what it still holds
        _refused(
            receiver.verify(header, RELAYED, keys), "replay" if header in headers[2:] else "older"
        )
    wall.t += WINDOW_S + 1  # out of the window: forgotten, and refused for their time
    fresh = gw2.sign("gw-3", _key(receiver), RELAYED)
    assert receiver.verify(fresh, RELAYED, keys) == "gw-2"
    assert len(receiver._nonces) == 1
    _refused(receiver.verify(headers[-1], RELAYED, keys), "behind")


def test_a_reported_key_is_32_bytes_of_base64url(wall: Wall) -> None:
    key = Identity("gw-2", wall=wall).public_key
    assert len(key) == 43 and encode_key(decode_key(key)) == key
    for bad in ("", "x" * 42, key + "A", key[:-1] + "=", "+" + key[1:], "not a key"):
        with pytest.raises(InvalidInput) as raised:
            decode_key(bad, "public_key")
        assert raised.value.field == "public_key" and "32 raw bytes" in raised.value.reason
    with pytest.raises(InvalidInput) as raised:
        decode_key("A" * 43, "public_key")  # 0: a point of small order, a known secret
    assert "small order" in raised.value.reason
    assert repr(Identity("gw-2")).startswith("Identity('gw-2', public_key=")  # nothing private
