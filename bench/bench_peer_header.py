"""The CPU a relayed request's peer header costs: made at the front door, checked at the
serving gateway (``peer_identity.py``), against an Ed25519 signature of the same bytes
(what the header used before the pair keys), in one run.

Each sample times ``--batch`` headers made (``Identity.sign``) and then checked
(``Verifier.verify``, every one taken: a new nonce each), per header; for the
signature, ``--batch`` signatures of the same bytes made, then verified. The two are
measured in turns (``--rounds`` each), on one process and one core, and the medians and
p99 of the samples compared. Run: ``python bench/bench_peer_header.py [--rounds 30]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bench_http import pct
from gpu_arbiter.peer_identity import Identity, Relayed, Verifier, decode_key, signed_bytes

RELAYED = Relayed("POST", b"/v1/chat/completions", "500", "lease-0123456789")


def _per_header(run: Callable[[int], None], batch: int) -> float:
    started = time.perf_counter()
    run(batch)
    return (time.perf_counter() - started) / batch * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args()

    front, serving = Identity("gw-2"), Identity("gw-3")
    verifier = Verifier(serving)
    keys = {"gw-2": decode_key(front.public_key)}
    to = decode_key(serving.public_key)
    signer = Ed25519PrivateKey.generate()
    public = signer.public_key()
    message = signed_bytes("gw-2", "gw-3", serving.key_id, "1765000000000", "n" * 22, RELAYED)

    def mac_make(n: int) -> None:
        for _ in range(n):
            front.sign("gw-3", to, RELAYED)

    def mac_check(n: int, made: list[str]) -> None:
        for header in made:
            assert verifier.verify(header, RELAYED, keys) == "gw-2"

    def sig_make(n: int) -> None:
        for _ in range(n):
            signer.sign(message)

    def sig_check(n: int, signature: bytes) -> None:
        for _ in range(n):
            public.verify(signature, message)

    samples: dict[str, list[float]] = {
        k: [] for k in ("mac make", "mac check", "sig make", "sig check")
    }
    signature = signer.sign(message)
    for _ in range(args.rounds):
        made = [front.sign("gw-3", to, RELAYED) for _ in range(args.batch)]
        samples["mac make"].append(_per_header(mac_make, args.batch))
        samples["mac check"].append(
            _per_header(lambda n, made=made: mac_check(n, made), args.batch)
        )
        samples["sig make"].append(_per_header(sig_make, args.batch))
        samples["sig check"].append(_per_header(lambda n: sig_check(n, signature), args.batch))

    print(
        f"{'per header':>12} {'p50 us':>8} {'p99 us':>8}   ({args.rounds} rounds of {args.batch})"
    )
    for name, found in samples.items():
        print(f"{name:>12} {statistics.median(found):8.1f} {pct(found, 0.99):8.1f}")
    mac = statistics.median(samples["mac make"]) + statistics.median(samples["mac check"])
    sig = statistics.median(samples["sig make"]) + statistics.median(samples["sig check"])
    print(
        f"a relay's header, made and checked: {mac:.1f} us (pair key and HMAC, the whole "
        f"header) against {sig:.1f} us (an Ed25519 signature alone): {mac / sig:.2f}x"
    )


if __name__ == "__main__":
    main()
