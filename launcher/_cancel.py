"""The requesting side of a cancel (CONTRACT.md, "Cancel operations").

1. The intent is appended to the run's inbox and fsynced: nothing is
   signalled before it is durable.
2. The owner acknowledges in `cancellations/<op>.json`. We wait for that on
   a waiter FIFO the owner pokes after each write, and on the owner's pidfd
   (its death), never by sleeping in a loop.
3. If the owner is gone (its flock is free), this process adopts the run
   (_adopt.py): it becomes the owner, applies the inbox, stops the container
   and writes the record and the acknowledgement itself.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import time
from typing import Any

from ._args import check_optional_seconds
from ._identity import ProcessIdentity
from ._layout import RunDir, op_id_or_new
from ._record import CancelRecord, now_iso
from ._state import TERMINAL_STATES, Effect

SETTLED = frozenset({Effect.CANCELLED, Effect.NOT_LIVE, Effect.UNKNOWN})
ACK_TIMEOUT = 10.0


def settled(ack: dict[str, Any]) -> bool:
    return ack.get("effect") in SETTLED or ack.get("state") in TERMINAL_STATES


class Watcher:
    """A waiter FIFO of our own in the run directory, which the owner pokes
    after every record or acknowledgement it writes, plus, optionally, the
    owner's pidfd (readable when the owner dies).

    Not inotify: closing an inotify fd that holds a watch waits for an SRCU
    grace period (up to 24 ms here), which every `contain cancel --wait` and
    `contain wait` paid on its way out (docs/performance.md)."""

    def __init__(self, layout: RunDir, owner: dict[str, Any] | None) -> None:
        try:
            self.fd, self.path = layout.add_waiter()
        except OSError:
            self.fd, self.path = -1, ""
        self.owner_fd = -1
        self.owner_pid = 0
        if owner:
            ident = ProcessIdentity.from_dict(owner)
            try:
                fd = os.pidfd_open(ident.pid)
                if ident.is_alive():
                    self.owner_fd, self.owner_pid = fd, ident.pid
                else:
                    os.close(fd)
            except OSError:
                pass

    def resume_owner(self) -> int | None:
        """SIGCONT to the owner, by the pidfd taken with its identity checked,
        when it is stopped (SIGSTOP, or a Ctrl-Z that stopped `contain run`
        and not its worker): a stopped owner never reads the request, and a
        cancel would wait on it for ever. The owner's pid when it was
        resumed; None when it is not stopped or cannot be signalled by us."""
        if self.owner_fd < 0:
            return None
        from ._procfs import read_stat

        st = read_stat(self.owner_pid)
        if st is None or st[0] != "T":     # not "t": a tracer's stop is the tracer's to end
            return None
        try:
            signal.pidfd_send_signal(self.owner_fd, signal.SIGCONT)
        except OSError:
            return None                    # gone, or not ours to signal (EPERM)
        return self.owner_pid

    def wait(self, timeout: float) -> None:
        p = select.poll()
        for fd in (self.fd, self.owner_fd):
            if fd >= 0:
                p.register(fd, select.POLLIN)
        # Without a waiter FIFO the bounded timeout below is the only wake-up.
        cap = timeout if self.fd >= 0 else min(timeout, 0.05)
        for fd, _ in p.poll(max(0, int(cap * 1000))):
            if fd == self.fd:
                try:
                    while os.read(fd, 4096):
                        pass
                except BlockingIOError:
                    pass

    def close(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        for fd in (self.fd, self.owner_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.owner_fd = -1
        self.path = ""


if sys.platform == "win32":   # named events and the owner's process handle, not FIFOs and a pidfd
    from ._platform.winlayout import Watcher  # noqa: F811


def cancel(run_id: str, *, op_id: str | None = None, grace: float | None = None,
           run_uid: str | None = None, wait: bool = False, timeout: float | None = None,
           state_dir: str | None = None) -> CancelRecord:
    """Cancel a run by id from any process. Raises RunNotFound, RunConflict,
    ValueError/TypeError (a grace or timeout that is not a finite number of
    seconds >= 0)."""
    grace = check_optional_seconds(grace, "grace")
    timeout = check_optional_seconds(timeout, "timeout")
    op = op_id_or_new(op_id)
    layout = RunDir.find(run_id, state_dir)
    ack = layout.read_ack(op)
    info = layout.read_run() or {}
    applied_to = ack.get("run_uid") if ack is not None else None   # a known op answers for that run alone
    known_uid: str | None
    if isinstance(applied_to, str):
        known_uid, what = applied_to, f"operation {op} was applied to run uid"
    else:
        known_uid, what = info.get("run_uid") or _run_uid_elsewhere(layout), f"run {run_id} is now run uid"
    if run_uid is not None and known_uid != run_uid:
        return CancelRecord({"op_id": op, "run_id": run_id, "run_uid": run_uid, "effect": "unknown",
                             "state": None, "detail": f"refused: {what} {known_uid}, not {run_uid}",
                             "requested_at": now_iso()})
    if ack is not None and (not wait or (settled(ack) and layout.owner() is not True)):
        return CancelRecord(ack)
    if ack is None:
        req: dict[str, Any] = {"op_id": op, "run_uid": run_uid or known_uid,
                               "requested_at": now_iso(), "by": {"pid": os.getpid()}}
        if grace is not None:
            req["grace"] = grace
        layout.append_request(req)
    return _await(layout, op, info, wait, timeout)


def _said(ack: dict[str, Any], notes: list[str]) -> CancelRecord:
    """The owner's acknowledgement, with what this process did on the way."""
    if notes:
        earlier = ack.get("notes")
        ack = dict(ack, notes=[*(earlier if isinstance(earlier, list) else []), *notes])
    return CancelRecord(ack)


def _run_uid_elsewhere(layout: RunDir) -> str | None:
    """The run uid when run.json does not give it (gone, unreadable, or a
    FIFO a worker put there): the record's, else the run's own tag (root's
    is a trusted. xattr no worker of another uid can touch). Without one the
    owner refuses the request, and a cancel would wait on a run that never
    hears it."""
    rec = layout.read_record()
    if rec is not None and isinstance(rec.get("run_uid"), str):
        return str(rec["run_uid"])
    from . import _tags
    from ._names import valid_uid

    tag = _tags.read(layout.path, _tags.RUN_TAG).value
    uid = tag.get("run_uid") if tag is not None else None
    return uid if valid_uid(uid) else None


def _await(layout: RunDir, op: str, info: dict[str, Any], wait: bool, timeout: float | None) -> CancelRecord:
    limit = timeout if timeout is not None else (None if wait else ACK_TIMEOUT)
    deadline = None if limit is None else time.monotonic() + limit
    watch = Watcher(layout, info.get("supervisor"))
    resumed: list[str] = []
    try:
        while True:
            ack = layout.read_ack(op)
            # A settled answer is the owner's last word only once it has let
            # go of its lock (it settles, then releases): a worker that can
            # write its run directory could have written it (cmd_wait alike).
            if ack is not None and (not wait or (settled(ack) and layout.owner() is not True)):
                return _said(ack, resumed)
            if not layout.owner_alive():
                # Lazy: adoption loads the whole run driver, which a cancel
                # of a live run never needs (`contain cancel`'s start-up).
                from ._adopt import take_over

                adopted = take_over(layout, op)
                if adopted is not None:
                    # Also when the owner this process resumed settled and let
                    # go between the two looks (then this is its answer): what
                    # this process did on the way is said all the same.
                    return _said(adopted.to_dict(), resumed)
            woke = watch.resume_owner()
            if woke is not None and not resumed:
                resumed.append(f"the owner (pid {woke}) was stopped: contain cancel resumed it with SIGCONT")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                ack = layout.read_ack(op)
                held = ack is not None and wait and settled(ack) and layout.owner() is True
                if ack is not None and not held:
                    return _said(ack, resumed)
                return _said({"op_id": op, "run_id": layout.id, "effect": "unknown", "state": None,
                              "detail": "a settled acknowledgement is there but the owner still holds the "
                              "run: not final" if held else "no acknowledgement from the owner before the "
                              "deadline; the request stays in the inbox"}, resumed)
            # Stopped once, it may be stopped again (a worker that can signal
            # it): look again soon.
            pause = 0.05 if resumed else 0.5
            watch.wait(pause if remaining is None else min(remaining, pause))
    finally:
        watch.close()
