"""Update operations: an update of a worker's agent, step by step (drain -> the agent
runs its update command -> it restarts and registers its new version -> the drain is
cancelled), each step recorded with its time and outcome.

Owns the running operations. Its part of every change (a :class:`~.change.Participant`):
:meth:`Updates.sweep` fails the updates past their deadline, :meth:`Updates.encode`
writes the operations a change touched. It is the :class:`~.workers.WorkerListener` of
the workers: a registration may end an update, a cancelled drain or a removal fails one.

Drives drains only through the calls an operator's drain and cancel-drain run
(:meth:`~.workers.Workers.drain_in`, :meth:`~.workers.Workers.cancel_drain_in`), so the
drain and the operation's record are one transaction; runs the core's cycle once
more in that change (is the worker drained already?) through ``changes.scheduler`` and
:meth:`~.leases.Leases.absorb`; reads workers through :class:`~.workers.Workers`'
public calls and older operations from the store.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from ..core import Conflict, NotFound, WorkerStatus
from ..store import Batch, OperationRecord, OperationStep, Store
from .change import Change, Changes, Participant
from .leases import Leases
from .values import UPDATE_TIMEOUT_S
from .workers import Workers

__all__ = ["Updates"]


class Updates(Participant):
    def __init__(self, changes: Changes, store: Store, leases: Leases, workers: Workers) -> None:
        self._changes = changes
        self._store = store
        self._leases = leases
        self._workers = workers
        self._operations: dict[str, OperationRecord] = {}

    def start(
        self,
        name: str,
        *,
        timeout_s: float = UPDATE_TIMEOUT_S,
        drain_deadline_s: float | None = None,
    ) -> OperationRecord:
        """An update of a worker's agent: drain -> the agent runs its own update command ->
        it restarts and registers its new version -> the drain is cancelled. Each step is
        recorded in the operation, with its time and outcome. The drain and the record are
        one transaction. Not done within ``timeout_s``, it fails and the worker stays
        drained; ``drain_deadline_s`` revokes what still runs there by then."""
        self._changes.gate.check_available()
        record = self._workers.get(name)
        if record.simulated:
            raise Conflict(f"worker {name} is simulated by this controller; it has no agent")
        running = self.running(name)
        if running is not None:
            raise Conflict(f"worker {name} is already being updated", operation=running.id)
        with self._changes.change() as change:
            status = self._workers.worker_now(name).status
            if status is not WorkerStatus.DRAINED and (
                status is not WorkerStatus.DRAINING or drain_deadline_s is not None
            ):
                self._workers.drain_in(change, name, force=False, deadline_s=drain_deadline_s)
                self._leases.absorb(change, self._changes.scheduler.decide(change.now))
            how = "" if drain_deadline_s is None else f", deadline {drain_deadline_s:g} s"
            operation = OperationRecord(
                id=f"op-{secrets.token_hex(8)}",
                kind="update",
                worker=name,
                state="running",
                created_at=change.now,
                steps=(
                    OperationStep(
                        "drain", "started", change.now, f"graceful drain{how} (was {status})"
                    ),
                ),
                from_version=record.agent_version,
                deadline=change.now + timeout_s,
            )
            if self._workers.worker_now(name).status is WorkerStatus.DRAINED:
                operation = _with_step(operation, "drain", "ok", change.now, "no lease left")
            self._put(change, operation)
        return operation

    def get(self, operation_id: str) -> OperationRecord:
        """An operation, running or ended. Raises NotFound."""
        found = self._operations.get(operation_id) or self._store.operation(operation_id)
        if found is None:
            raise NotFound(f"no operation {operation_id!r}", operation=operation_id)
        return found

    def running(self, name: str) -> OperationRecord | None:
        """The update of worker ``name`` under way, if any."""
        return next(
            (op for op in self._operations.values() if op.worker == name and op.running), None
        )

    def for_agent(self, name: str) -> dict[str, Any] | None:
        """What a heartbeat answer tells the agent of an update: its operation, and whether
        to run the update command now (the worker is drained and it has not run yet)."""
        operation = self.running(name)
        if operation is None:
            return None
        drained = self._workers.worker_now(name).status is WorkerStatus.DRAINED
        drain = operation.step("drain")
        if drained and (drain is None or drain.outcome != "ok"):
            operation = self._step(operation, "drain", "ok", "no lease left on the worker")
        return {"operation": operation.id, "run": drained and not operation.step("update_command")}

    def report(self, operation_id: str, step: str, outcome: str, detail: str) -> OperationRecord:
        """The agent reports a step it carried out (``update_command``)."""
        self._changes.gate.check_available()
        operation = self.get(operation_id)
        if not operation.running:
            raise Conflict(f"operation {operation_id} is {operation.state}", state=operation.state)
        done = operation.step(step)
        if done is not None and done.outcome != "started":
            raise Conflict(f"step {step} of {operation_id} was already reported {done.outcome}")
        if outcome == "failed":
            failed = replace(operation, state="failed", reason=f"{step} failed: {detail}")
            return self._step(failed, step, outcome, detail)
        if outcome == "ok":
            now = self._changes.clock()
            operation = _with_step(operation, step, outcome, now, detail)
            return self._step(operation, "restart", "started", "the agent restarts")
        return self._step(operation, step, outcome, detail)

    # ------------------------------------------------------------------ WorkerListener

    def check_cancel_drain(self, name: str) -> None:
        """A drain may not be cancelled while the worker runs its update command."""
        update = self.running(name)
        command = None if update is None else update.step("update_command")
        if update is not None and command is not None and update.step("restart") is None:
            raise Conflict(
                f"worker {name} is running its update command (operation {update.id}); "
                "wait for its outcome",
                operation=update.id,
            )

    def registered(self, change: Change, name: str, version: str) -> None:
        """An agent back from its update ends the operation and its drain, in the same
        transaction as its registration."""
        operation = self.running(name)
        if operation is None or operation.step("restart") is None:
            return
        detail = f"registered with version {version} (was {operation.from_version})"
        operation = _with_step(operation, "restart", "ok", change.now, detail)
        status = self._workers.worker_now(name).status
        if status in (WorkerStatus.DRAINING, WorkerStatus.DRAINED):
            self._workers.cancel_drain_in(change, name)
        operation = replace(operation, state="succeeded", to_version=version)
        self._put(change, _with_step(operation, "cancel_drain", "ok", change.now, "back online"))

    def drain_cancelled(self, change: Change, name: str) -> None:
        update = self.running(name)
        if update is not None:
            self._fail(change, update, "cancelled by cancel-drain")

    def removed(self, change: Change, name: str) -> None:
        update = self.running(name)
        if update is not None:
            self._fail(change, update, "the worker was removed")

    # ------------------------------------------------------------------ in a change

    def sweep(self, change: Change) -> None:
        """Updates past their deadline fail; the worker stays as it is (drained)."""
        for operation in list(self._operations.values()):
            if operation.deadline is not None and operation.deadline <= change.now:
                limit = operation.deadline - operation.created_at
                why = f"{_WAITING_FOR[operation.waiting_on]} within {limit:g} s"
                self._fail(change, operation, why)

    def encode(self, change: Change, batch: Batch) -> None:
        batch.operations = dict(change.operations)

    def next_deadline(self) -> float | None:
        deadlines = [op.deadline for op in self._operations.values() if op.deadline is not None]
        return min(deadlines, default=None)

    def restore(self, operations: tuple[OperationRecord, ...]) -> None:
        self._operations = {op.id: op for op in operations}

    def _fail(self, change: Change, operation: OperationRecord, why: str) -> None:
        """Ends a running update as failed at the step it was waiting on."""
        step = operation.waiting_on
        failed = replace(operation, state="failed", reason=f"{step} failed: {why}")
        self._put(change, _with_step(failed, step, "failed", change.now, why))

    def _step(self, op: OperationRecord, name: str, outcome: str, detail: str) -> OperationRecord:
        operation = _with_step(op, name, outcome, self._changes.clock(), detail)
        with self._changes.change() as change:
            self._put(change, operation)
        return operation

    def _put(self, change: Change, operation: OperationRecord) -> None:
        """Stores ``operation`` in ``change``, with an event for each step it gained (the
        last one ``operation.<state>`` when it ended)."""
        before = change.operations.get(operation.id) or self._operations.get(operation.id)
        change.operations[operation.id] = operation
        new = operation.steps[len(before.steps) if before is not None else 0 :]
        for i, step in enumerate(new, 1):
            ended = i == len(new) and not operation.running
            change.event(
                f"operation.{operation.state}" if ended else "operation.step",
                worker=operation.worker,
                operation=operation.id,
                step=step.name,
                outcome=step.outcome,
            )
        if operation.running:
            self._operations[operation.id] = operation
        else:
            self._operations.pop(operation.id, None)


_WAITING_FOR = {
    "drain": "the worker was not drained",
    "update_command": "the update command was not run to its end",
    "restart": "the agent did not register again",
}


def _with_step(
    operation: OperationRecord, name: str, outcome: str, at: float, detail: str
) -> OperationRecord:
    return replace(operation, steps=(*operation.steps, OperationStep(name, outcome, at, detail)))
