"""Adoption: taking over a run whose owner died, and finishing it.

A run is never lost with its supervisor: the kernel drops the owner's flock
when it dies, and whoever next needs the run to end (a `contain cancel`, a
lead whose nested runs died with it) takes the lock and becomes the owner.

    adopt(layout)            a Run resumed from the run directory alone (the
                             caller holds the owner lock)
    take_over(layout, op)    adopt, apply the inbox (op included) and own the
                             run to its end; the operation's acknowledgement
    adopt_quietly(...)       record an intent durably, then take over
    finish_nested(run)       a lead's end hook: its nested runs whose owners
                             lived in its tree are finished the same way

The worker is re-attached by identity (pidfd_open, then the start time is
re-read); the container by what run.json names. See docs/protocol.md.
"""
from __future__ import annotations

import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from . import _nested
from . import _state as S
from ._containers import attach_container
from ._errors import LauncherError
from ._evidence import RunEvidence
from ._layout import RunDir
from ._options import DEFAULT_GRACE, DEFAULT_KILL_TIMEOUT, Options
from ._platform import host
from ._record import CancelRecord, evidence, now_iso
from ._run import Run


def adopt(layout: RunDir) -> Run:
    """Become the owner of a run whose owner is gone (the caller holds the
    owner lock). State, evidence and acknowledgements come from the run
    directory alone."""
    info = layout.read_run()
    if info is None:
        raise LauncherError(f"run {layout.id}: run.json unreadable")
    rec = layout.read_record() or {}
    opts = Options(grace=float(info.get("grace", DEFAULT_GRACE)),
                   kill_timeout=float(info.get("kill_timeout", DEFAULT_KILL_TIMEOUT)))
    facts = RunEvidence.from_record(rec)
    facts.notes.append(f"adopted by pid {os.getpid()} after the owner was gone")
    r = Run(info["argv"], id=info["run_id"], options=opts, uid=info["run_uid"], facts=facts)
    r.attach(layout)
    r.end_hooks.append(finish_nested)
    r.snap = S.from_record(rec.get("state", "RUNNING"), rec.get("outcome"))
    r.inbox.load()
    if facts.identity is not None:
        r.pid = facts.identity.pid
    r.set_container(attach_container(info, r.pid))
    if not r.snap.terminal and facts.exit_code is None and facts.signal is None and facts.identity is not None:
        r.root = host.Root.reattach(facts.identity)
        if r.root is None and not facts.observed("root_exit"):
            facts.root_exited(None, None, evidence(True, "identity re-read after adoption (pid + start time gone)",
                                                   "exit status unknown: the owner was gone when it exited"))
            r.snap = S.step(r.snap, S.Event.ROOT_EXITED)
    r.open_channels()
    return r


def take_over(layout: RunDir, op: str) -> CancelRecord | None:
    """Take ownership of a run whose owner is gone and finish the stop.
    None if another process became the owner first."""
    if not layout.take_ownership():
        return None
    try:
        run = adopt(layout)
    except BaseException:
        layout.release()
        raise
    was_terminal = run.snap.terminal
    try:
        run.turn()                      # apply the inbox (this op included) and act
        if was_terminal:
            run.inbox.settle(run.snap)  # the previous owner may have died between record and acks
            run.close()                 # one result: an ended run's record is left as it is
        else:
            run.supervise()
    except BaseException:
        run.close()
        raise
    ack = layout.read_ack(op)
    if ack is None:
        raise LauncherError(f"run {layout.id}: adopted, but operation {op} was not acknowledged")
    return CancelRecord(ack)


def adopt_quietly(layout: RunDir, op: str, run_uid: str | None, by: dict[str, Any]) -> None:
    """Finish a run whose owner is gone and whose record is not terminal:
    record the intent durably, then take over. Does nothing if the run has
    an owner, has ended, or is another run now (run uid)."""
    rec = layout.read_record() or {}
    info = layout.read_run() or {}
    if rec.get("state") in S.TERMINAL_STATES or layout.owner_alive():
        return
    if run_uid is not None and info.get("run_uid") != run_uid:
        return
    if layout.read_ack(op) is None:
        layout.append_request({"op_id": op, "run_uid": info.get("run_uid"), "requested_at": now_iso(),
                               "by": by})
    take_over(layout, op)


def finish_nested(run: Run) -> None:
    """Runs nested in `run` died with it (their owners lived in its tree).
    The lead observed its whole subtree empty, theirs included, so each one
    left RUNNING is finished the way any orphan is: a durable cancel from
    the lead, then adoption (docs/protocol.md)."""
    if not run.facts.nested_seen or run.layout is None:
        return
    for reg in _nested.registered(run.layout.path):
        run_dir = reg.get("run_dir")
        if not run_dir or not os.path.isdir(str(run_dir)):
            continue
        try:
            adopt_quietly(RunDir(str(run_dir)), f"lead-{run.uid}", reg.get("run_uid"),
                          {"pid": os.getpid(), "lead": run.id})
        except (LauncherError, OSError) as e:
            run.facts.notes.append(f"nested run {reg.get('id')}: not finished: {e}")
