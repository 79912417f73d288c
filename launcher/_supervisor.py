"""`Supervisor`: one scope that owns many workers.

    with launcher.Supervisor() as sup:
        a = sup.spawn(["worker", "1"])
        b = sup.spawn(["worker", "2"])
        a.wait()
    # here every run is over and reaped

Leaving the block, normally, on an exception or on KeyboardInterrupt,
cancels every run still going (all stops are requested first, so their
graces run together), waits until each container is observed empty and
closes every pipe. A KeyboardInterrupt that arrives during that wait is
held until the end (which takes at most the grace plus the kill deadline)
and then raised: Ctrl-C never leaves a worker behind.

The async counterpart is `AsyncSupervisor` (launcher/_aio.py).
"""
from __future__ import annotations

import threading
from types import TracebackType
from typing import Any, Sequence

from ._args import check_optional_seconds
from ._layout import new_uid
from ._record import StopRecord
from ._options import DEFAULT_GRACE
from ._run import Run
from ._worker import SHARED_OWNER, Worker, abandon, start_run, wait_all, wake_all


class Supervisor:
    """Owns the workers it spawns. `defaults` are spawn options applied to
    every worker (per-spawn options win); `grace` overrides the workers'
    grace when the supervisor stops them on exit."""

    def __init__(self, *, grace: float | None = None, **defaults: Any) -> None:
        self.grace = check_optional_seconds(grace, "grace")
        self._defaults = defaults
        self._lock = threading.Lock()
        self._spawning: dict[int, int] = {}        # thread ident -> spawns under way in it (close() waits)
        self._idle = threading.Condition(self._lock)
        self._runs: list[Run] = []                 # every run, from before it starts
        self._workers: dict[int, Worker] = {}      # id(run) -> its Worker
        self._closed = False
        self._uid = new_uid()

    @property
    def workers(self) -> list[Worker]:
        with self._lock:
            return [self._workers[id(r)] for r in self._runs if id(r) in self._workers]

    def spawn(self, argv: Sequence[str], **kw: Any) -> Worker:
        """As `launcher.spawn`, owned by this supervisor."""
        me = threading.get_ident()
        counted = False
        try:
            with self._lock:
                # Counted under the lock that close() takes: a spawn either
                # starts before close() takes its list (which waits for it)
                # or is refused; never a run that close() did not see.
                if self._closed:
                    raise RuntimeError("Supervisor is closed")
                self._spawning[me] = self._spawning.get(me, 0) + 1
                counted = True
            o = {"id": None, "grace": DEFAULT_GRACE, "timeout": None, "backend": "auto",
                 "stdin": None, "stdout": None, "stderr": None, **self._defaults, **kw}
            run, st = start_run(argv, id=o.pop("id"), grace=o.pop("grace"), timeout=o.pop("timeout"),
                                backend=o.pop("backend"), stdin=o.pop("stdin"), stdout=o.pop("stdout"),
                                stderr=o.pop("stderr"), options=o, track=self._track, shared=SHARED_OWNER,
                                api="launcher.Supervisor.spawn")
            w = Worker(run, st)
            with self._lock:
                self._workers[id(run)] = w
            return w
        finally:
            with self._lock:
                if counted:
                    left = self._spawning.get(me, 1) - 1
                    if left > 0:
                        self._spawning[me] = left
                    else:
                        self._spawning.pop(me, None)
                    self._idle.notify_all()

    def _track(self, run: Run) -> None:
        with self._lock:
            self._runs.append(run)

    def wait(self, timeout: float | None = None) -> list[StopRecord]:
        """Until every worker spawned so far has ended; their records."""
        return [w.wait(timeout) for w in self.workers]

    def cancel_all(self, *, grace: float | None = None) -> list[StopRecord]:
        """Cancel every worker still going in one pass: every stop's intent
        is written first (their graces run together, the one owner loop
        sends every kill), then all are waited for together. The supervisor
        stays open. Returns every worker's final record."""
        grace = check_optional_seconds(grace, "grace")
        if grace is None:
            grace = self.grace
        op = f"cancel-all-{new_uid()}"
        with self._lock:
            pairs = [(r, self._workers[id(r)]) for r in self._runs if id(r) in self._workers]
        workers = [w for _r, w in pairs]
        asked: list[Run] = []
        try:
            for r, w in pairs:
                if w.request_stop(op, grace, wake=False):
                    asked.append(r)
        finally:
            wake_all(asked)                 # one wake-up of the owner loop for every run asked
        wait_all(workers)
        return [w.wait() for w in workers]

    def close(self) -> list[StopRecord]:
        """Cancel every run still going, wait until all are reaped, close
        their pipes. Idempotent. Returns every run's final record."""
        with self._lock:
            self._closed = True
        interrupted: KeyboardInterrupt | None = None
        errors: list[Exception] = []
        op = f"supervisor-exit-{self._uid}"
        while True:
            try:
                with self._lock:
                    # Another thread's spawn under way: it ends shortly. Not
                    # this thread's own (close() from a signal handler that
                    # interrupted a spawn here would wait for itself).
                    me = threading.get_ident()
                    while any(t != me for t in self._spawning):
                        self._idle.wait(1.0)
                    runs = list(self._runs)
                    workers = dict(self._workers)
                asked: set[int] = set()
                try:
                    for r in runs:                   # every stop requested first (no wait for each answer)
                        w = workers.get(id(r))
                        if w is not None and not w.done():
                            try:
                                if w.request_stop(op, self.grace, wake=False):
                                    asked.add(id(r))
                            except Exception as e:   # stop() below tries again
                                errors.append(e)
                finally:
                    wake_all([r for r in runs if id(r) in asked])   # the owner loop, once for all
                wait_all([w for r in runs if id(r) in asked and (w := workers.get(id(r))) is not None])
                for r in runs:
                    w = workers.get(id(r))
                    try:
                        if w is None:
                            abandon(r)               # started, but interrupted before its Worker existed
                        elif id(r) in asked:
                            try:
                                w.wait()             # its stop is asked: only its end is awaited
                            finally:
                                w.close()
                        else:
                            w.stop(op_id=op, grace=self.grace)
                    except Exception as e:           # one failure never leaves the others running
                        errors.append(e)
                break
            except KeyboardInterrupt as e:           # held: the stop is bounded; retried from the top
                interrupted = e
                errors.clear()
        records = [r.record() for r in runs]
        if interrupted is not None:
            raise interrupted
        if errors:
            raise errors[0]
        return records

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Supervisor workers={len(self._runs)} closed={self._closed}>"
