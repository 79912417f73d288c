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

Nothing an adopter acts on is taken from run.json or record.json alone (a
worker may have rewritten them): the worker's identity, the cgroup's
identity and a degraded run's members come from the tags the owner wrote
(_tags.py), and each is re-verified against the kernel before use: a process
by pid + start time + boot id (pidfd_open, then the start time re-read), a
cgroup by path, inode, mount and tag (_platform/cgattach.py). What cannot be
verified is UNCONFIRMED, never terminal. See docs/protocol.md.
"""
from __future__ import annotations

import os
import sys
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from . import _nested
from . import _state as S
from ._containers import AttachResult, attach_container, trusted_facts
from ._errors import LauncherError
from ._evidence import RunEvidence
from ._identity import ProcessIdentity
from ._inbox import grace_of
from ._layout import RunDir
from ._options import DEFAULT_GRACE, DEFAULT_KILL_TIMEOUT, Options
from ._platform import host
from ._record import CancelRecord, evidence, now_iso
from ._run import Run

_MAX_S = 3600.0      # the longest grace or kill wait an adopter honours from run.json


def _bounded(value: Any, default: float, limit: float, name: str, notes: list[str]) -> float:
    """A number from run.json (input): finite, within [0, limit], else the default."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= limit:
        return float(value)
    if value is not None:
        notes.append(f"run.json's {name} {value!r} ignored: {default} s used")
    return default


def _run_info(layout: RunDir, rec: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """run.json, or, when a worker that can write the run directory made it
    unreadable, what the owner's tag says (the only thing an adopter acts
    on anyway): a run whose owner is gone must still be stoppable. Without
    a tag there is nothing trustworthy to act on (LauncherError)."""
    info = layout.read_run()
    if isinstance(info, dict) and isinstance(info.get("argv"), list):
        return info
    facts, source = trusted_facts(layout.path, {}, acting=True)
    if facts is None or source != "tag":
        if info is None and layout.load_run() is None and not rec:
            # The owner describes the run (run.json and its tag) before the
            # spawn: killed before that, it started nothing. Its cgroups go
            # now (the caller holds the owner lock), its directory with gc.
            held = _drop_strays(layout)
            if held is not None:
                raise LauncherError(f"run {layout.id}: no run.json and no record, but {held}: nothing to act on")
            raise LauncherError(f"run {layout.id} never started: its supervisor died before the spawn "
                                "(no run.json, no record); `contain gc` removes it")
        raise LauncherError(f"run {layout.id}: run.json unreadable")
    notes.append("run.json unreadable: adopted from the run's tag (the run's own v1 cgroups, if any, "
                 "are not known and are left)")
    argv = rec.get("argv")
    return {"run_id": layout.id, "run_uid": facts.get("run_uid"), "backend": facts.get("backend"),
            "argv": argv if isinstance(argv, list) and argv else ["?"], "cgroup_identity": facts.get("cgroup"),
            "worker": facts.get("worker"), "boot_id": facts.get("boot_id"), "wall": facts.get("wall"),
            "pgid": facts.get("pgid")}


def _drop_strays(layout: RunDir) -> str | None:
    """Remove the cgroups of a run that never started (_strays); None, or
    why one was left (it holds a process: then it is not that run)."""
    if sys.platform == "win32":
        return None                     # a Job Object dies with its last handle
    from ._strays import claimed_uid, remove_strays

    try:
        fd = layout.dir_fd()
    except OSError:
        return None
    try:
        uid = claimed_uid(fd)
    finally:
        os.close(fd)
    return remove_strays(layout.id, uid) if uid is not None else None


def _take_record_file(r: Run, path: Any, notes: list[str]) -> None:
    """The owner's --record FILE (run.json's `record_file`): the adopter
    writes the final record there too, under --record's rules (never a link
    of another user's, never anything but a regular file replaced). Whoever
    could have rewritten run.json (its uid, root) could write that file
    anyway; a FIFO or device is not taken (nobody may be reading it now)."""
    if path is None:
        return
    if not isinstance(path, str) or not os.path.isabs(path) or len(path) > 4096 or "\0" in path:
        notes.append("run.json's record_file ignored: not an absolute path")
        return
    from ._recordfile import prepare

    try:
        target = prepare(path)
    except OSError as e:
        notes.append(f"--record {path} not written by the adopter: {e}")
        return
    if target.kind not in ("file", "winfile"):
        target.close()
        notes.append(f"--record {path} not written by the adopter: not a regular file")
        return
    r.record_target = target
    r.record_path = path


def _adopt(layout: RunDir, vouched: str | None = None, note: str | None = None) -> tuple[Run, AttachResult]:
    rec = layout.read_record() or {}
    early: list[str] = []
    info = _run_info(layout, rec, early)
    att = attach_container(layout.path, layout.id, info)
    forged = _terminal_but_held(rec, att)
    if forged is not None:
        rec = {}
    facts = RunEvidence.from_record(rec)
    facts.notes.append(f"adopted by pid {os.getpid()} after the owner was gone")
    if note:
        facts.notes.append(note)         # why the adopter acted (contain janitor: the owner's death, as observed)
    facts.notes.extend(early)
    if forged is not None:
        facts.notes.append(forged)
    facts.notes.extend(n for n in att.notes if n)
    if vouched is not None and att.unattached is None and att.container.backend == "cgroup2":
        att.container.vouched = vouched
    opts = Options(grace=_bounded(info.get("grace"), DEFAULT_GRACE, _MAX_S, "grace", facts.notes),
                   kill_timeout=_bounded(info.get("kill_timeout"), DEFAULT_KILL_TIMEOUT, _MAX_S, "kill_timeout",
                                         facts.notes) or DEFAULT_KILL_TIMEOUT)
    uid = att.run_uid or info.get("run_uid")
    r = Run([str(a) for a in info["argv"]] or ["?"], id=layout.id, options=opts,
            uid=str(uid) if uid else None, facts=facts)
    r.attach(layout)
    r.end_hooks.append(finish_nested)
    _take_record_file(r, info.get("record_file"), facts.notes)
    r.snap = S.from_record(rec.get("state", "RUNNING"), rec.get("outcome") or rec.get("stopping"))
    r.inbox.load()
    _grace_applied_before(layout, r)
    _trust_the_tag(facts, att)
    if facts.identity is not None:
        r.pid = facts.identity.pid
    r.set_container(att.container)
    problem = r.usage.adopt(info, att.container)
    if problem:
        facts.notes.append(problem)
    if not r.snap.terminal and facts.exit_code is None and facts.signal is None and facts.identity is not None:
        r.root = host.Root.reattach(facts.identity)
        if r.root is None and not facts.observed("root_exit"):
            facts.root_exited(None, None, evidence(True, "identity re-read after adoption (pid + start time gone)",
                                                   "exit status unknown: the owner was gone when it exited"))
            r.snap = S.step(r.snap, S.Event.ROOT_EXITED)
    r.open_channels()
    return r, att


def _grace_applied_before(layout: RunDir, r: Run) -> None:
    """The grace the previous owner's stop had from the cancels it applied:
    the first one's replaces the run's own, later ones only shorten it (as
    in Run._read_inbox). They are acknowledged, so the adopter's inbox
    skips them; without this it began the stop again with the run's grace,
    whatever `cancel --grace` had asked."""
    if r.snap.terminal or not r.snap.stopping:
        return
    grace: float | None = None
    offset, first = 0, True
    for _ in range(16):               # bounded, as one turn of the inbox is
        got = layout.read_inbox(offset, None, require_uid=True)
        for req in got.accepted:
            d = req.to_dict()
            ack = r.inbox.ops.get(str(d.get("op_id")))
            if ack is None or ack.get("effect") != S.Effect.CANCEL_REQUESTED:
                continue
            g = grace_of(d)
            if first:
                grace, first = (r.opts.grace if g is None else g), False
            elif g is not None and grace is not None:
                grace = min(grace, g)
        offset = got.offset
        if not got.more:
            break
    if grace is not None:
        r.opts.grace = grace


def _terminal_but_held(rec: dict[str, Any], att: AttachResult) -> str | None:
    """Why record.json's terminal state is not the previous owner's, or None.
    An owner writes a terminal state only once it observed its kernel
    container empty; a worker that can write its run directory (the same
    uid, or root unsealed) can write one while its tree goes on, and then
    an adopter that believed it stopped nothing. So a terminal record of a
    cgroup or PID-namespace run whose container, as tagged and re-verified,
    is observed holding members is not the owner's, and is ignored. Only a
    positive observation overrides the file: one that cannot be made leaves
    it as it is (docs/protocol.md, "What an adopter acts on")."""
    state = rec.get("state")
    c = att.container
    if state not in S.TERMINAL_STATES or att.unattached is not None or c.backend not in ("cgroup2", "pidns"):
        return None
    try:
        held = c.populated()
    except OSError:
        return None
    if not held:
        return None
    return (f"record.json said {str(state)[:20]} but the run's container still held members: "
            "not the owner's record (a process that can write the run directory wrote it), ignored")


def _trust_the_tag(facts: RunEvidence, att: AttachResult) -> None:
    """The worker's identity and the seal are what the run's tag says, not
    what record.json says (which the worker may have rewritten)."""
    w = att.worker
    if w is not None and isinstance(w.get("pid"), int) and isinstance(w.get("start_time"), int):
        tagged = ProcessIdentity(w["pid"], w["start_time"], str(w.get("boot_id")), None)
        if facts.identity is not None and facts.identity != tagged:
            facts.notes.append("record.json's worker identity differs from the run's tag: the tag's is used")
        if facts.identity is None or facts.identity != tagged:
            facts.identity = tagged
    if att.sealed and not _walled(att.container):
        # A seal is never made without the wall (sealing.check), and an
        # unsealed root worker can set trusted.* tags itself: a tag that
        # names a seal but no wall was not written by an owner.
        facts.notes.append("the run's tag names a seal but no PID-namespace wall, which a seal never comes "
                           "without: the seal is not believed")
        att.sealed = False
    if att.sealed is not None and facts.sealed[0] and not att.sealed:
        facts.notes.append("record.json says sealed, the run's tag does not: not sealed")
        facts.sealed = (False, "the seal is not vouched for by the run's tag")
    if not facts.sealed[0] and not facts.sealed[1]:
        # No record said why (the owner died before its first one, or a
        # worker rewrote it): `sealed` false always comes with its reason.
        facts.sealed = (False, "not known to be sealed: no record of the owner says why, and the seal "
                        "is not vouched for by the run's tag" if not att.sealed else
                        "not known to be sealed: the run's tag names a seal, but no record of the owner "
                        "describes it")


def _walled(c: Any) -> bool:
    """Whether the adopted container has the PID-namespace wall its tag
    named (alive, reaped, or not observable from here)."""
    return (getattr(c, "wall", None) is not None or bool(getattr(c, "wall_gone", False))
            or bool(getattr(c, "wall_unknown", None)))


def adopt(layout: RunDir) -> Run:
    """Become the owner of a run whose owner is gone (the caller holds the
    owner lock). State, evidence and acknowledgements come from the run
    directory; what is acted on, from its tags, re-verified (attach_container)."""
    return _adopt(layout)[0]


def take_over(layout: RunDir, op: str, vouched: str | None = None, note: str | None = None) -> CancelRecord | None:
    """Take ownership of a run whose owner is gone and finish the stop.
    None if another process became the owner first. `vouched`: how a lead
    proved this (nested) run's tree could not leave unseen. `note`: a line
    for the record's notes (contain janitor says how the owner died)."""
    if not layout.take_ownership():
        return None
    try:
        run, att = _adopt(layout, vouched, note)
    except BaseException:
        layout.release()
        raise
    was_terminal = run.snap.terminal
    try:
        run.turn()                      # apply the inbox (this op included) and act
        if was_terminal:
            run.inbox.settle(run.snap, emptied=run.facts.observed("container_empty"))  # the previous owner may have died between record and acks
            run.close()                 # one result: an ended run's record is left as it is
        elif att.unattached is not None:
            # Nothing here may be signalled: the stop is UNCONFIRMED with the
            # reason, at once, and a later owner (in a view that can verify
            # the cgroup) finishes it. Waiting out the kill deadlines would
            # change nothing.
            run.finish()
        else:
            run.supervise()
    except BaseException:
        run.close()
        raise
    ack = layout.read_ack(op)
    if ack is None:
        raise LauncherError(f"run {layout.id}: adopted, but operation {op} was not acknowledged")
    return CancelRecord(ack)


def adopt_quietly(layout: RunDir, op: str, run_uid: str | None, by: dict[str, Any],
                  vouched: str | None = None) -> None:
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
    take_over(layout, op, vouched)


def finish_nested(run: Run) -> None:
    """Runs nested in `run` died with it (their owners lived in its tree).
    The lead observed its whole subtree empty, theirs included, so each one
    left RUNNING is finished the way any orphan is: a durable cancel from
    the lead, then adoption (docs/protocol.md)."""
    if not run.facts.nested_seen or run.layout is None:
        return
    regs, notes = _nested.registered(run.layout.path, run.container.path if run.container is not None else None)
    run.facts.notes.extend(notes)
    seen = {s.get("cgroup"): s.get("cgroup_dir") for s in run.facts.nested_seen}
    lead = run.facts.layers.get("descendants_exit") or {}
    # The lead ended REAPED: its container, which held each nested run's,
    # was observed empty and no member could leave it unseen. That proof is
    # the nested run's too (its tree was part of the lead's).
    vouched = (f"nested in run {run.id}, whose cgroup held this one: {lead.get('via')}"
               if lead.get("observed") is True else None)
    for reg in regs:
        run_dir = reg.get("run_dir")
        if not isinstance(run_dir, str) or not os.path.isdir(run_dir):
            continue
        why = _not_nested_here(run_dir, reg, seen)
        if why is not None:
            run.facts.notes.append(f"nested run {str(reg.get('id'))[:100]!r} not finished: {why}")
            continue
        try:
            adopt_quietly(RunDir(run_dir), f"lead-{run.uid}", reg.get("run_uid"),
                          {"pid": os.getpid(), "lead": run.id}, vouched)
        except (LauncherError, OSError, ValueError) as e:
            run.facts.notes.append(f"nested run {reg.get('id')}: not finished: {e}")


def _not_nested_here(run_dir: str, reg: dict[str, Any], seen: dict[Any, Any]) -> str | None:
    """A registration is a line a process of the lead's tree wrote: the run
    it names is finished by the lead only if the lead's own scan saw its
    cgroup inside the lead, and that run's tag names that same cgroup."""
    where = seen.get(reg.get("cgroup"))
    if where is None:
        return f"its cgroup {reg.get('cgroup')} was never seen inside this run's cgroup"
    facts, source = trusted_facts(run_dir, RunDir(run_dir).read_run() or {}, acting=True)
    cg = (facts or {}).get("cgroup")
    if not isinstance(cg, dict) or cg.get("dir") != where:
        return f"its run directory does not describe the cgroup {where} ({source})"
    return None
