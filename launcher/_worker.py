"""The library face of a run: `spawn`, `run` and `Worker`.

A Worker's owner loop runs in a thread of the caller's process. It does not
make the process a child subreaper (that is process-wide and would take
children from `subprocess` users): orphans of the tree are reaped by init,
and emptiness is still the kernel's `populated 0`.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Sequence

from ._errors import RunConflict
from ._layout import new_uid
from ._record import CancelRecord, StopRecord, now_iso
from ._run import DEFAULT_GRACE, Options, Run


class Worker:
    """A live run owned by this process. Thread-safe."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self._cond = threading.Condition()
        run.on_change = self._changed
        self._thread = threading.Thread(target=self._own, name=f"contain-{run.id}", daemon=True)
        self._error: BaseException | None = None
        self._thread.start()

    def _own(self) -> None:
        try:
            self._run.supervise()
        except BaseException as e:      # surfaced by wait(), never lost
            self._error = e
        finally:
            self._changed()

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @property
    def id(self) -> str:
        return self._run.id

    @property
    def run_uid(self) -> str:
        return self._run.uid

    @property
    def pid(self) -> int:
        return self._run.pid

    @property
    def run_dir(self) -> str:
        assert self._run.layout is not None
        return self._run.layout.path

    def record(self) -> StopRecord:
        """The current stop record (final once the run has ended)."""
        return self._run.record()

    def done(self) -> bool:
        return self._run._done.is_set()

    def wait(self, timeout: float | None = None) -> StopRecord:
        """Block until the owner loop has finished; return the stop record.
        Raises TimeoutError if `timeout` passes first."""
        if not self._run._done.wait(timeout):
            raise TimeoutError(f"run {self.id} still running after {timeout} s")
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._run.record()

    def cancel(self, *, op_id: str | None = None, grace: float | None = None) -> CancelRecord:
        """Request a stop; returns this operation's acknowledgement at once
        (effect `cancel_requested` or `not_live`). `wait()` for the end; the
        settled acknowledgement is `cancel_record(op_id)`."""
        layout = self._run.layout
        assert layout is not None
        op = op_id or f"op-{new_uid()}"
        ack = layout.read_ack(op)
        if ack is not None:
            return CancelRecord(ack)
        if self.done():
            from ._cancel import cancel

            return cancel(self.id, op_id=op, state_dir=os.path.dirname(os.path.dirname(layout.path)))
        req: dict[str, Any] = {"op_id": op, "run_uid": self._run.uid, "requested_at": now_iso(),
                               "by": {"pid": os.getpid(), "thread": threading.get_ident()}}
        if grace is not None:
            req["grace"] = grace
        layout.append_request(req)        # durable before anything is signalled
        self._run.wake()
        with self._cond:
            while op not in self._run.ops and not self.done():
                self._cond.wait(1.0)
        ack = self._run.ops.get(op) or layout.read_ack(op)
        if ack is None:
            raise RunConflict(f"run {self.id}: operation {op} was not acknowledged")
        return CancelRecord(ack)

    def cancel_record(self, op_id: str) -> CancelRecord | None:
        assert self._run.layout is not None
        ack = self._run.layout.read_ack(op_id)
        return None if ack is None else CancelRecord(ack)

    def __repr__(self) -> str:
        return f"<Worker id={self.id} pid={self.pid} state={self._run.snap.state.value}>"


def _options(grace: float, timeout: float | None, backend: str, kw: dict[str, Any]) -> Options:
    return Options(grace=grace, timeout=timeout, backend=backend, **kw)


def spawn(argv: Sequence[str], *, id: str | None = None, grace: float = DEFAULT_GRACE,
          timeout: float | None = None, backend: str = "auto", **options: Any) -> Worker:
    """Start `argv` in a fresh container and return its Worker at once.
    Raises SpawnFailed, ContainmentUnavailable or RunConflict; on the first
    two a stop record with outcome `spawn_failed` is in the run directory."""
    run = Run(argv, id=id, options=_options(grace, timeout, backend, options))
    run.start()
    return Worker(run)


def run(argv: Sequence[str], *, id: str | None = None, grace: float = DEFAULT_GRACE,
        timeout: float | None = None, backend: str = "auto", **options: Any) -> StopRecord:
    """Run `argv` to the end in a fresh container; return the stop record."""
    r = Run(argv, id=id, options=_options(grace, timeout, backend, options))
    r.start()
    return r.supervise()
