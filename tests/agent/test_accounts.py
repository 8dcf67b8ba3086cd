"""One process group's GPU memory split among the leases that share it (``agent/accounts.py``):
the split, the table of accounts and its expiry on a clock the test moves."""

from __future__ import annotations

import pytest

from gpu_arbiter.agent.accounts import (
    ACCOUNT_TTL_S,
    MAX_SHARES,
    Accounts,
    parse_shares,
    split_groups,
    split_mb,
)

SERVE, RUNNER, OTHER, SUPERVISED = 500, 501, 600, 502  # pids; 500 leads group 500


def test_a_group_is_split_in_proportion_to_the_shares() -> None:
    assert split_mb(5000, {"a": 2000, "b": 3000}) == {"a": 2000, "b": 3000}
    assert split_mb(2500, {"a": 2000, "b": 3000}) == {"a": 1000, "b": 1500}
    assert split_mb(0, {"a": 2000, "b": 3000}) == {"a": 0, "b": 0}
    assert split_mb(700, {}) == {}


def test_the_remainder_goes_to_the_largest_share_so_the_sum_is_exact() -> None:
    parts = split_mb(1000, {"a": 1, "b": 1, "c": 2})
    assert parts == {"a": 250, "b": 250, "c": 500}
    parts = split_mb(1001, {"a": 1, "b": 1, "c": 1})
    assert parts == {"a": 335, "b": 333, "c": 333}  # among equals, the first lease id
    parts = split_mb(997, {"x": 3, "y": 5, "z": 7})
    assert sum(parts.values()) == 997 and parts == {"x": 199, "y": 332, "z": 466}


def test_shares_all_zero_split_the_group_equally() -> None:
    assert split_mb(901, {"a": 0, "b": 0}) == {"a": 451, "b": 450}
    assert split_mb(900, {"a": 0, "b": 900}) == {"a": 0, "b": 900}


def test_each_accounted_group_is_summed_and_split_and_others_stay_external() -> None:
    processes = {SERVE: 1000, RUNNER: 4000, OTHER: 700}
    group_of = {SERVE: SERVE, RUNNER: SERVE, OTHER: OTHER}
    used = split_groups(processes, group_of, {SERVE: {"a": 2000, "b": 3000}})
    assert used == {"a": 2000, "b": 3000}  # OTHER's group has no account: nobody's
    assert split_groups(processes, group_of, {}) == {}
    two = {SERVE: {"a": 1}, OTHER: {"a": 1, "c": 1}}  # a lease in two groups: both added
    assert split_groups(processes, group_of, two) == {"a": 5350, "c": 350}


def test_a_process_supervised_for_a_lease_is_that_leases_alone() -> None:
    processes = {SERVE: 1000, RUNNER: 4000, SUPERVISED: 600}
    group_of = {SERVE: SERVE, RUNNER: SERVE, SUPERVISED: SERVE}
    used = split_groups(processes, group_of, {SERVE: {"a": 1, "b": 1}}, {SUPERVISED})
    assert used == {"a": 2500, "b": 2500}


def test_without_per_process_figures_nothing_is_attributed() -> None:
    accounts = {SERVE: {"a": 1}}
    assert split_groups(None, {SERVE: SERVE}, accounts) is None
    assert split_groups({SERVE: 1000, OTHER: None}, {SERVE: SERVE}, accounts) is None


@pytest.mark.parametrize(
    ("shares", "reason"),
    [
        ([["a", 1]], "shares must be an object"),
        ({"": 1}, "each key must be a lease id"),
        ({"x" * 65: 1}, "each key must be a lease id"),
        ({"a": -1}, "shares['a'] must be MiB"),
        ({"a": 1.5}, "shares['a'] must be MiB"),
        ({"a": True}, "shares['a'] must be MiB"),
        ({"a": "3G"}, "shares['a'] must be MiB"),
        ({"a": (1 << 40) + 1}, "shares['a'] must be MiB"),
        ({f"l{n}": 1 for n in range(MAX_SHARES + 1)}, "at most 256 leases"),
    ],
)
def test_bad_shares_are_refused_naming_the_field(shares: object, reason: str) -> None:
    refused = parse_shares(shares)
    assert isinstance(refused, str) and reason in refused


def test_good_shares_are_taken() -> None:
    assert parse_shares({"a": 0, "b": 1 << 40}) == {"a": 0, "b": 1 << 40}
    assert parse_shares({}) == {}


class Clock:
    def __init__(self) -> None:
        self.time = 100.0

    def __call__(self) -> float:
        return self.time


def test_an_account_not_said_again_within_30s_is_dropped() -> None:
    clock = Clock()
    accounts = Accounts({SERVE: 7, OTHER: 9}.get, clock)
    assert accounts.put(SERVE, {"a": 1}) is None
    clock.time += ACCOUNT_TTL_S - 1
    assert accounts.current() == {SERVE: {"a": 1}}
    assert accounts.put(SERVE, {"a": 1, "b": 2}) is None  # said again: 30 s more
    clock.time += ACCOUNT_TTL_S - 1
    assert accounts.current() == {SERVE: {"a": 1, "b": 2}}
    clock.time += 2
    assert accounts.current() == {}


def test_an_account_whose_group_is_gone_or_reused_is_dropped_and_empty_drops_it() -> None:
    started = {SERVE: 7, OTHER: 9}
    accounts = Accounts(started.get, Clock())
    assert accounts.put(SERVE, {"a": 1}) is None
    assert accounts.put(OTHER, {"b": 1}) is None
    del started[SERVE]  # its leader exited
    assert accounts.current() == {OTHER: {"b": 1}}
    started[OTHER] = 10  # another process now has that pid
    assert accounts.current() == {}
    assert accounts.put(OTHER, {"b": 1}) is None
    assert accounts.put(OTHER, {}) is None  # dropped at once
    assert accounts.current() == {}


def test_at_most_256_leases_in_all_accounts() -> None:
    accounts = Accounts({SERVE: 7, OTHER: 9}.get, Clock())
    assert accounts.put(SERVE, {f"l{n}": 1 for n in range(200)}) is None
    refused = accounts.put(OTHER, {f"m{n}": 1 for n in range(57)})
    assert refused is not None and refused.startswith("shares: at most 256")
    assert accounts.current().keys() == {SERVE}
    assert accounts.put(OTHER, {f"m{n}": 1 for n in range(56)}) is None
    assert accounts.put(SERVE, {f"l{n}": 1 for n in range(200)}) is None  # its own again
