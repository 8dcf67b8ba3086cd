"""A log of what a scheduler was told, and its replay.

The core is deterministic: time is an argument, nothing is random, every sort has a
tie-break. So the calls a driver made — its events and its cycles, each with its
arguments (frozen values) — make the same decisions again on a fresh scheduler with the
same policy: :class:`Recorder` logs them, :func:`replay` runs them again and returns
what each call returned (or the refusal it raised). A decision nobody can explain can be
replayed, stepped through and explained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ArbiterError
from .model import Policy
from .scheduler import Scheduler

__all__ = ["CALLS", "Call", "Recorder", "replay"]

CALLS = frozenset(
    {
        "put_worker",
        "remove_worker",
        "set_worker_status",
        "drain",
        "cancel_drain",
        "set_offline",
        "set_probe",
        "submit",
        "cancel",
        "release",
        "ready",
        "renew",
        "set_supervised",
        "set_idle",
        "shrink",
        "revoke",
        "pause",
        "resume",
        "restore_lease",
        "decide",
        "plan",
        "apply",
    }
)
"""The calls that change a scheduler's state or decide (what a log must hold)."""


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def _refusal(error: ArbiterError) -> tuple[str, str]:
    return (type(error).__name__, str(error))


def _outcome(run: Callable[[], Any]) -> Any:
    """What a call returned, or the refusal it raised, as a comparable value."""
    try:
        return run()
    except ArbiterError as error:
        return _refusal(error)


class Recorder:
    """A scheduler whose state-changing calls (:data:`CALLS`) are logged, with what each
    returned (or the refusal it raised, raised again); every other attribute is the
    scheduler's own."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.calls: list[Call] = []
        self.outcomes: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.scheduler, name)
        if name not in CALLS:
            return attribute

        def logged(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(Call(name, args, dict(kwargs)))
            try:
                result = attribute(*args, **kwargs)
            except ArbiterError as error:
                self.outcomes.append(_refusal(error))
                raise
            self.outcomes.append(result)
            return result

        return logged


def replay(
    calls: Iterable[Call], policy: Policy | None = None, *, next_token: int = 1, next_seq: int = 1
) -> list[Any]:
    """Runs ``calls`` on a fresh scheduler; returns each one's outcome, as
    :class:`Recorder` logged them."""
    scheduler = Scheduler(policy, next_token=next_token, next_seq=next_seq)
    outcomes = []
    for call in calls:
        method = getattr(scheduler, call.name)
        outcomes.append(_outcome(lambda: method(*call.args, **call.kwargs)))  # noqa: B023
    return outcomes
