"""The requesting side of a cancel (CONTRACT.md, "Cancel operations").

1. The intent is appended to the run's inbox and fsynced: nothing is
   signalled before it is durable.
2. The owner acknowledges in `cancellations/<op>.json`. We wait for that by
   inotify on the directory and the owner's pidfd (its death), never by
   sleeping in a loop.
3. If the owner is gone (its flock is free), this process adopts the run:
   it becomes the owner, applies the inbox, stops the container and writes
   the record and the acknowledgement itself.
"""
from __future__ import annotations

import os
import select
import time
from typing import Any

from ._errors import LauncherError
from ._identity import ProcessIdentity
from ._layout import RunDir, new_uid
from ._record import CancelRecord, now_iso

SETTLED = ("cancelled", "not_live", "unknown")
TERMINAL_STATES = ("REAPED", "EXITED", "BREACHED")
ACK_TIMEOUT = 10.0


def settled(ack: dict[str, Any]) -> bool:
    return ack.get("effect") in SETTLED or ack.get("state") in TERMINAL_STATES


class _Watch:
    """inotify on a directory plus, optionally, an owner's pidfd."""

    def __init__(self, path: str, owner: dict[str, Any] | None) -> None:
        from ._native import lib

        self.fd = lib.ct_inotify_open()
        if self.fd >= 0 and lib.ct_inotify_watch(self.fd, path.encode(), 0x2 | 0x8 | 0x80) < 0:
            os.close(self.fd)
            self.fd = -1
        self.owner_fd = -1
        if owner:
            ident = ProcessIdentity.from_dict(owner)
            try:
                fd = os.pidfd_open(ident.pid)
                if ident.is_alive():
                    self.owner_fd = fd
                else:
                    os.close(fd)
            except OSError:
                pass

    def wait(self, timeout: float) -> None:
        p = select.poll()
        for fd in (self.fd, self.owner_fd):
            if fd >= 0:
                p.register(fd, select.POLLIN)
        # Without inotify the bounded timeout below is the only wake-up.
        cap = timeout if self.fd >= 0 else min(timeout, 0.05)
        for fd, _ in p.poll(max(0, int(cap * 1000))):
            if fd == self.fd:
                try:
                    while os.read(fd, 65536):
                        pass
                except BlockingIOError:
                    pass

    def close(self) -> None:
        for fd in (self.fd, self.owner_fd):
            if fd >= 0:
                os.close(fd)


def cancel(run_id: str, *, op_id: str | None = None, grace: float | None = None,
           run_uid: str | None = None, wait: bool = False, timeout: float | None = None,
           state_dir: str | None = None) -> CancelRecord:
    """Cancel a run by id from any process. Raises RunNotFound, RunConflict."""
    layout = RunDir.find(run_id, state_dir)
    op = op_id or f"op-{new_uid()}"
    ack = layout.read_ack(op)
    info = layout.read_run() or {}
    if ack is None and run_uid is not None and info.get("run_uid") != run_uid:
        return CancelRecord({"op_id": op, "run_id": run_id, "run_uid": run_uid, "effect": "unknown",
                             "state": None, "detail": f"refused: run {run_id} is now run uid "
                             f"{info.get('run_uid')}, not {run_uid}", "requested_at": now_iso()})
    if ack is not None and (not wait or settled(ack)):
        return CancelRecord(ack)
    if ack is None:
        req: dict[str, Any] = {"op_id": op, "run_uid": run_uid or info.get("run_uid"),
                               "requested_at": now_iso(), "by": {"pid": os.getpid()}}
        if grace is not None:
            req["grace"] = grace
        layout.append_request(req)
    return _await(layout, op, info, wait, timeout)


def _await(layout: RunDir, op: str, info: dict[str, Any], wait: bool, timeout: float | None) -> CancelRecord:
    limit = timeout if timeout is not None else (None if wait else ACK_TIMEOUT)
    deadline = None if limit is None else time.monotonic() + limit
    watch = _Watch(layout.cancellations, info.get("supervisor"))
    try:
        while True:
            ack = layout.read_ack(op)
            if ack is not None and (not wait or settled(ack)):
                return CancelRecord(ack)
            if not layout.owner_alive():
                adopted = _adopt(layout, op, wait)
                if adopted is not None:
                    return adopted
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                ack = layout.read_ack(op)
                if ack is not None:
                    return CancelRecord(ack)
                return CancelRecord({"op_id": op, "run_id": layout.id, "effect": "unknown", "state": None,
                                     "detail": "no acknowledgement from the owner before the deadline; "
                                     "the request stays in the inbox"})
            watch.wait(0.5 if remaining is None else min(remaining, 0.5))
    finally:
        watch.close()


def _adopt(layout: RunDir, op: str, wait: bool) -> CancelRecord | None:
    """Take ownership of a run whose owner is gone and finish the stop.
    None if another process became the owner first."""
    if not layout.take_ownership():
        return None
    from ._run import Run

    try:
        run = Run.adopt(layout)
    except BaseException:
        layout.release()
        raise
    was_terminal = run.snap.terminal
    try:
        run._turn()               # apply the inbox (this op included) and act
        if was_terminal:
            run.close()           # one result: an ended run's record is left as it is
        else:
            run.supervise()
    except BaseException:
        run.close()
        raise
    ack = layout.read_ack(op)
    if ack is None:
        raise LauncherError(f"run {layout.id}: adopted, but operation {op} was not acknowledged")
    return CancelRecord(ack)
