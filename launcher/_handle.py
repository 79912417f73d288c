"""What a sync Worker and an AsyncWorker share: a view of one owned run and
the requesting half of a cancel."""
from __future__ import annotations

import os
from typing import Any

from . import _signals as signal
from ._cancel import cancel
from ._errors import RunNotFound
from ._record import CancelRecord, StopRecord, now_iso
from ._run import Run
from ._state import TERMINAL_STATES
from ._fdbudget import reserve


class RunHandle:
    """`subprocess.Popen`'s manners too: `args`, `returncode`, `poll()`,
    `send_signal()`, `terminate()`, `kill()` (the async worker's the same,
    as anyio's Process has them)."""

    _run: Run
    _to_worker: list[int]

    def done(self) -> bool:
        raise NotImplementedError

    @property
    def args(self) -> list[str]:
        """The command, as `Popen.args`."""
        return list(self._run.argv)

    @property
    def returncode(self) -> int | None:
        """As `Popen.returncode`: None until the run has ended (its stop
        included), then the worker's exit code, or -N for signal N."""
        return self.record().returncode if self.done() else None

    def poll(self) -> int | None:
        """As `Popen.poll()`: `returncode`, without waiting."""
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """As `Popen.send_signal`: `sig` to the worker itself (not its
        tree: the tree is stopped once the worker ends), by its pidfd, from
        the owner loop's thread (which alone may close that pidfd). Nothing
        once the worker has ended."""
        if self.done():
            return
        self._to_worker.append(int(sig))
        self._run.wake()

    def terminate(self) -> None:
        """As `Popen.terminate()`: SIGTERM to the worker."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """As `Popen.kill()`: SIGKILL to the worker (the rest of its tree is
        then stopped as after any worker exit)."""
        self.send_signal(signal.SIGKILL)

    def _send_queued(self) -> None:
        """In the owner loop's thread (after each turn): send_signal's queue."""
        q = self._to_worker
        while q:
            sig = q.pop(0)
            send = getattr(self._run.root, "send_signal", None)
            if send is not None:
                try:
                    send(sig)
                except OSError:
                    pass           # gone meanwhile: as Popen.send_signal on an ended child

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
        """The current stop record (final once the run has ended). An owner
        loop that ended without a terminal state (UNCONFIRMED after its
        retries) has let go of the run: a later stop (a cancel, from here or
        any process, adopts it) may have ended it since, and then its record
        is what the run directory holds, once nobody owns the run and
        nothing its tag names lives."""
        rec = self._run.record()
        d = self._run.layout
        if rec.terminal or not self._run.finished() or d is None:
            return rec
        latest = d.load_record()
        if not (isinstance(latest, dict) and latest["state"] in TERMINAL_STATES and d.owner() is False):
            return rec
        if latest["state"] in ("REAPED", "EXITED"):
            from ._tags import still_alive

            if still_alive(d.path) is not None:
                # As `contain wait` judges it: what the tag names lives, so
                # the record is not a stop's (a member can write its run
                # directory); the last word stays ours.
                return rec
        return StopRecord(latest)

    def cancel_record(self, op_id: str) -> CancelRecord | None:
        """The acknowledgement of operation `op_id`, as stored."""
        assert self._run.layout is not None
        ack = self._run.layout.read_ack(op_id)
        return None if ack is None else CancelRecord(ack)

    def _known_ack(self, op: str) -> CancelRecord | None:
        assert self._run.layout is not None
        ack = self._run.layout.read_ack(op)
        return None if ack is None else CancelRecord(ack)

    def _request(self, op: str, grace: float | None, by: dict[str, Any]) -> None:
        """Append the cancel intent to the inbox, durably, before anything is
        signalled (docs/protocol.md). The owner is this process's: every
        caller wakes it directly (Run.wake, wake_all), so the inbox's
        wake-up FIFO, which is for other processes' requests, is left alone."""
        assert self._run.layout is not None
        req: dict[str, Any] = {"op_id": op, "run_uid": self._run.uid, "requested_at": now_iso(),
                               "by": {"pid": os.getpid(), **by}}
        if grace is not None:
            req["grace"] = grace
        with reserve.released():       # a cancel must be writable at the descriptor limit (_fdbudget.py)
            self._run.layout.append_request(req, poke=False)

    def _answer_as_ended(self, op: str) -> CancelRecord:
        """A cancel for a run whose owner loop has finished: answered from the
        layout, as any other process would be."""
        assert self._run.layout is not None
        try:
            ack: CancelRecord | None = cancel(self.id, op_id=op, run_uid=self._run.uid,
                                              state_dir=os.path.dirname(os.path.dirname(self._run.layout.path)))
        except RunNotFound:
            ack = None
        if ack is not None and ack.effect != "unknown":
            return ack
        rec = self.record()
        if not rec.terminal:
            if ack is None:
                raise RunNotFound(f"run {self.id}: its directory is gone and its end was not seen")
            return ack
        # This object saw its run end, and the run's directory is gone
        # (`contain gc`) or holds another run of the id now: the answer is
        # the record's, as it would have been from the directory.
        now = now_iso()
        return CancelRecord({"op_id": op, "run_id": self.id, "run_uid": self._run.uid, "requested_at": now,
                             "acknowledged_at": now, "effect": "not_live", "state": rec.state,
                             "outcome": rec.outcome, "detail": "the run had ended; its directory is gone "
                             "or holds another run of its id now"})

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self.id} pid={self.pid} state={self._run.snap.state}>"
