"""Starting a run: claim its id, make its container, spawn its worker inside.

    start(run)              the whole start, in the order that keeps a run
                            findable: claimed, contained, described (run.json),
                            then spawned, then described again with the worker
    spawn_failed(run, err)  a start that failed after the claim still ends
                            like a run: stopped, observed, recorded
    caller_ignored()        the signals the worker starts with ignored

Nothing runs in the container before it is described: an owner killed right
after the spawn still leaves a run that `ls` shows and `cancel` can adopt.

Signals and cancels during the start-up are never lost: the supervisor's
handlers only queue the signal (the wake-up pipe may not exist yet), and the
last step before the spawn is one turn of the owner loop. A cancel that
arrived by then ends the run there, recorded, with nothing started in its
container (`cancelled_before_spawn`); one that arrives after it is acted on
by the first turn after the spawn.
"""
from __future__ import annotations

import os
import sys
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from ._run import Run

from . import _nested
from . import _state as S
from ._containers import make_container, refused_here, spawn_request
from ._errors import ContainmentUnavailable, LauncherError, SpawnFailed
from ._layout import RunDir
from ._escapes import EscapeWatch
from ._identity import forget_orphan_source, note_orphan_source, note_spawn
from ._options import user_account
from ._record import not_measured

LIVE_RECORD_DELAY_S = 0.005


def start(run: Run) -> None:
    """Raises RunConflict, ContainmentUnavailable or SpawnFailed; in the last
    two cases a final record with outcome `spawn_failed` exists, except for
    options this platform refuses outright (`refused_here`: a Linux-only
    backend or --user on Windows), refused before the claim. Whatever
    fails after the claim (an unknown user, EMFILE, a full disk, an
    interrupt) is rolled back the same way: the container stopped and
    removed, a `spawn_failed` record, the lock released, the id reusable;
    then the error goes on to the caller."""
    refused = refused_here(run.opts)
    if refused is not None:
        raise ContainmentUnavailable(refused)   # before the claim: no run directory, nothing made
    if run.opts.user is not None:
        user_account(run.opts.user)        # an unknown user is refused before anything is made
    if run.opts.record_file:
        from ._recordfile import prepare   # lazy: only runs that asked for it

        run.record_target = prepare(run.opts.record_file)   # refused (OSError) as --record is: before the claim
        if run.record_target.kind in ("file", "winfile"):
            run.record_path = os.path.abspath(run.opts.record_file)
    if run.opts.stats_json:
        from ._stats import check_stats

        try:
            check_stats(run.opts.stats_json)                 # the same: before anything is made
        except OSError as e:
            raise OSError(e.errno, f"stats_json {run.opts.stats_json}: {e.strerror or e}") from None
    try:
        run.attach(RunDir.claim(run.id, run.opts.state_dir))
    except BaseException:
        run.close()
        raise
    try:
        _start(run)
    except BaseException as e:
        if not run.finished():
            roll_back(run, e)
        raise


def roll_back(run: Run, e: BaseException) -> None:
    err = e if isinstance(e, LauncherError) else ContainmentUnavailable(
        f"start-up failed: {e}" if not isinstance(e, KeyboardInterrupt) else "interrupted during the start-up")
    try:
        spawn_failed(run, err, ran=run.pid > 0)
    except BaseException:
        # Even the roll-back failed: at least nobody is locked out, and a
        # container with nothing in it is not left behind.
        if run.pid <= 0:
            if run.container is not None:
                run.container.remove()
            if run.usage.cgroups is not None:
                run.usage.cgroups.remove()
            _untag_unrecorded(run)
        run.close()
        raise


def _untag_unrecorded(run: Run) -> None:
    """Nothing ran, and no record in the state directory says so (it is
    full: ENOSPC): without its tag the run directory reads "never started"
    (gc removes it), not a described run that an adopter would stop and
    call cancelled. Only once the run's container was observed empty
    (REAPED): a degraded run may have cloned a worker it never named."""
    if run.layout is not None and run.pid <= 0 and run.snap.state == "REAPED":
        from . import _tags

        _tags.remove(run.layout.path, _tags.RUN_TAG)


def _start(run: Run) -> None:
    layout = run.layout
    assert layout is not None
    run.journal("claimed", run_uid=run.uid)
    try:
        run.set_container(make_container(run.id, run.opts, run.uid))
        run.usage.create(run.container, run.id, run.uid)
    except ContainmentUnavailable as e:
        spawn_failed(run, e)
        raise
    weaker = getattr(run.container, "weaker", None)
    if weaker:
        run.facts.notes.append(f"backend auto: {weaker}")
        if callable(run.opts.notify):
            run.opts.notify(weaker, run.container.backend)
    run.facts.lead, problem = _nested.join_lead(run.container, os.environ, {
        "id": run.id, "run_uid": run.uid, "run_dir": layout.path})
    if problem is not None:
        run.facts.notes.append(problem)
    run.open_channels()
    req = spawn_request(run.argv, run.opts, run.container, run.id, layout.path)
    if run.opts.keep_ignored is not None:     # the CLI's caller's ignores (else: this process's, at the spawn)
        req.keep_ignored = frozenset(run.opts.keep_ignored)
    layout.write_run(run.facts.run_info(run, None))
    if cancelled_before_spawn(run):
        return
    # The fork ledger listens before the spawn, so a worker that forks at
    # once is not missed (_ledger.py).
    run.watch = run.stop.watch = EscapeWatch.before_spawn(run.container, req, v1=run.usage.cgroups)
    if req.pidns:
        req.on_init = lambda init_pid, start, ns: describe_wall(run, init_pid, start, ns, req.userns)
    if run.container.backend in ("none", "subreaper"):
        # Degraded mode: nothing names the worker until the tag (or run.json)
        # does, a moment after the clone. An adopter that knows no member
        # tells "never started" from "started, not described" by this line.
        run.journal("spawning")
    t0 = time.time()
    note_orphan_source(run.uid)
    try:
        run.usage.join(req)
        sp = run.container.spawn(req)
    except (SpawnFailed, ContainmentUnavailable, OSError) as e:
        err = e if isinstance(e, LauncherError) else ContainmentUnavailable(f"spawn: {e}")
        err = run.usage.explain_spawn_failure(err, run.container)     # while its cgroups still exist
        spawn_failed(run, err)
        raise err from (None if err is e else e)
    finally:
        run.usage.close_join()
    run.pid, run.root = sp.pid, run.container.root(sp)
    misplaced = run.usage.spawned(sp.pid, getattr(sp, "pidfd", -1))
    unverified = run.usage.placement_note()
    if unverified is not None:
        run.facts.notes.append(unverified)      # a worker that ran and exited: a note, not a failed start
    if misplaced is not None:
        # Limited, or not at all: a worker outside its limits is stopped, never
        # left to run as if they held.
        err = ContainmentUnavailable(misplaced)
        spawn_failed(run, err, ran=True)
        raise err
    run.facts.spawned(sp, run.container, req, t0)
    if run.facts.identity is not None and sys.platform != "win32":
        note_spawn(sp.pid, run.facts.identity.start_time)
        init = (run.facts.pending_wall or {}).get("init") if getattr(sp, "wall", None) else None
        if isinstance(init, dict) and isinstance(init.get("start_time"), int):
            note_spawn(init["pid"], init["start_time"])      # a wall's init is our child, never a tree's orphan
    if getattr(sp, "wall", None):
        forget_orphan_source(run.uid)          # its orphans stay in its PID namespace
    fell_back = getattr(run.container, "wall_problem", None)
    if fell_back:
        run.facts.notes.append(f"backend auto: {fell_back}; the cgroup alone holds the tree")
        run.watch.wall_fell_back(fell_back)
    run.watch.after_spawn(sp.pid, run.container)
    if not run.facts.tag_holds(run):
        try:
            layout.write_run(run.facts.run_info(run, sp.via))
        except OSError as e:
            run.facts.not_saved("run.json", e)     # the worker runs: it is stopped, not abandoned
    run.journal("spawned", pid=sp.pid, via=sp.via)
    # The first record is due a moment from now, not at once: a short job
    # ends in that moment, and its first record is then its final one (the
    # owner's turns publish it, or any record before it; readers meanwhile
    # see a run with no record yet, which is RUNNING).
    run.live_due = time.monotonic() + LIVE_RECORD_DELAY_S


def describe_wall(run: Run, init_pid: int, start: int | None, ns: int | None, userns: str | None) -> None:
    """The wall's init exists and waits: the tag (or, where none can be
    kept, run.json) names it before the worker can run, so an owner killed
    from here on leaves a wall its adopter re-attaches (and so proves
    emptiness through). Raises PersistError (OSError): then nothing runs."""
    from ._platform.pidwall import describe_init

    assert run.layout is not None
    run.facts.pending_wall = describe_init(init_pid, start, ns, userns)
    if not run.facts.tag_holds(run):
        run.layout.write_run(run.facts.run_info(run, None))


def cancelled_before_spawn(run: Run) -> bool:
    """The last look before the spawn: one turn of the owner loop (queued
    signals become durable requests; the inbox is read, including what was
    written before its wake-up FIFO existed). A cancel found here ends the
    run with nothing started: the container is observed empty, and no
    member can have left it, since none was ever made. True if the run is
    stopping or ended (the spawn is skipped)."""
    run.stop.never_ran = True
    run.turn()
    if run.snap.phase == S.Phase.RUNNING:
        run.stop.never_ran = False
        return False
    run.facts.layers["root_exit"] = not_measured("cancelled before the spawn: no worker was started")
    if run.snap.terminal:
        run.finish()
    return True


def caller_ignored() -> frozenset[int]:
    """The signals this process ignores (SIG_IGN) now, as the kernel has
    them: what the caller of `contain` ignored (nohup's SIGHUP, a background
    job's SIGINT, a shell's `trap '' TERM`) stays ignored in the worker, as
    it would across exec; the CLI installs no handler over them. SIGPIPE
    and SIGXFSZ (Python ignores those itself) and SIGCHLD are never handed
    on (posix.NEVER_KEPT)."""
    if sys.platform == "win32":
        return frozenset()             # no dispositions to carry over
    from ._platform import posix       # the Linux spawn module (never loaded on Windows)

    return posix.keep_ignored_now()


def spawn_failed(run: Run, err: LauncherError, *, ran: bool = False) -> None:
    """A failed spawn is stopped like any run: the leaf may hold the dying
    child, and REAPED still needs an observed populated 0. `ran`: the worker
    did run (it was found outside its limits) and is killed."""
    run.feed(S.Event.SPAWN_FAILED)
    run.stop.never_ran = not ran
    run.facts.notes.append(str(err))
    run.facts.set("root_exit", False, "spawn", {"error": str(err), "stage": getattr(err, "stage", None)})
    run.facts.exit_code = getattr(err, "exit_code", 125)
    if run.facts.limits is None:
        # What was asked stays in the record though nothing could hold it
        # (finish() reads the limits back only from cgroups that exist).
        run.facts.limits = run.usage.unapplied(str(err))
    if run.container is None:
        run.feed(S.Event.TREE_GONE)
    else:
        ev = run.stop.begin(time.monotonic(), 0.0)
        if ev is None or ev == S.Event.OBSERVE_FAILED:
            ev = run.stop.wait_empty(run.stop.deadline)
        run.feed(ev)
    run.finish()
    if not ran and any(u.startswith("record.json:") for u in run.facts.unsaved):
        _untag_unrecorded(run)
