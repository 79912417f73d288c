"""The end of a run's ownership, for `Run.finish` and the owner loop.

    settle_tree(run, terminal)   what the tree left: the postconditions the run
                                 asked for, the accounting (before the cgroups
                                 go), the container removed, the end hooks
    publish(run)                 the current record to the run directory and --record;
                                 a write that fails never aborts a stop
    abandon(run, err)            the owner loop failed: the run is stopped all
                                 the same, or at least handed on (lock released)
"""
from __future__ import annotations

import sys
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

    from ._run import Run

from . import _state as S
from ._record import StopRecord
from ._identity import forget_orphan_source


def settle_tree(run: Run, terminal: bool) -> None:
    """Before the record: everything that must be read while the container
    and the run's cgroups still exist, then their removal."""
    if terminal and run.snap.state == "REAPED":
        forget_orphan_source(run.uid)      # a tree proven gone leaves no orphan to tell from another run's
        subreaper = sys.modules.get("launcher._platform.subreaper")
        if subreaper is not None:
            subreaper.forget(run.uid)
    if terminal and (run.opts.workspace or run.opts.check_sockets):
        from ._postconditions import measure   # lazy: only runs that asked for it

        c = run.container
        cg = getattr(c, "dir", None) if c is not None and c.backend == "cgroup2" else None
        run.facts.layers.update(measure(run.opts.workspace, run.opts.check_sockets, run.stop.sockets, cg))
    if run.container is not None:
        run.facts.cpu = run.container.cpu_stat() or run.facts.cpu
        run.see_nested()
        if terminal:
            # Counters live only as long as their cgroups: read them first.
            run.usage.finish(run.facts, run.container, run.pid)
            problem = run.container.remove()
            run.facts.cleanup.update(container_removed=problem is None, detail=problem)
    if run.snap.phase == S.Phase.REAPED:
        for hook in run.end_hooks:
            hook(run)
    if run.watch is not None:
        run.watch.close()
    if terminal and run.root is not None:
        run.root.close()


def record_dict(run: Run) -> dict[str, Any]:
    return run.facts.record(run_id=run.id, run_uid=run.uid, argv=run.argv, snap=run.snap,
                            container=run.container, watch=run.watch, ops=list(run.inbox.ops),
                            pid=run.pid, run_dir=run.layout.path if run.layout else None)


def publish(run: Run) -> StopRecord:
    run.live_due = 0.0              # any record is the first one that was due
    rec = record_dict(run)
    durable = run.snap.terminal     # only the result outlives the processes (see _layout.py)
    if run.layout is not None:
        try:
            run.layout.write_record(rec, durable=durable)
        except OSError as e:
            # Stop first: the record stays in memory (the library returns
            # it, the CLI says what could not be written and exits 125).
            run.facts.not_saved("record.json", e)
            rec = record_dict(run)
    target = run.record_target
    if target is not None:
        # record_file= (the library's --record, checked at the start by
        # _recordfile.prepare): a regular file follows along, a device or
        # FIFO gets the final record once. A failed write is said once, in
        # the record it failed to take.
        from ._runfiles import encode

        try:
            if durable:
                run.record_target = None
                try:
                    target.final(encode(rec, pretty=True))
                finally:
                    target.close()
            else:
                target.update(encode(rec, pretty=True))
        except OSError as e:
            if not run.record_target_failed:
                run.record_target_failed = True
                run.facts.notes.append(f"record_file {e}")
                rec = record_dict(run)
                if durable and run.layout is not None:
                    try:                      # record.json says it too
                        run.layout.write_record(rec, durable=True)
                    except OSError:
                        pass                  # already said (not_saved) if it is the state directory too
    return StopRecord(rec)


def abandon(run: Run, err: BaseException) -> None:
    """The owner loop raised (a bug, an interrupt of a library caller's
    thread). A worker must not run on unowned with the lock held: the run is
    stopped as a cancel of contain's own (grace 0: whoever waited on it is
    gone) and recorded; if even that fails, the lock is released so that
    `contain cancel` can adopt the run."""
    why = "interrupted" if isinstance(err, KeyboardInterrupt) else f"{type(err).__name__}: {err}"
    try:
        run.facts.notes.append(f"the owner loop failed ({why}): contain stopped the run itself")
        if not run.snap.terminal and run.snap.phase != S.Phase.UNCONFIRMED:
            if not run.snap.stopping:
                run.facts.set("cancel_requested", True, "the owner loop failed", {"by": "contain", "error": why})
                run.feed(S.Event.CANCEL)
                run.publish()
            now = time.monotonic()
            ev = run.stop.begin(now, 0.0) if run.stop.stage is None else run.stop.observe()
            if ev is None and run.stop.stage in ("linger", "term"):
                # Interrupted in the linger or the grace of a stop under
                # way: nobody is left to wait it out. Waiting for a tree
                # that ignores SIGTERM to empty by itself only left it
                # UNCONFIRMED after the kill timeout.
                run.stop.retry(now)
            if ev is None or ev == S.Event.OBSERVE_FAILED:
                ev = run.stop.wait_empty(now + run.opts.kill_timeout)
            run.feed(ev)
        run.finish()
    except BaseException:
        run.facts.notes.append("the stop after the owner loop failed did not finish: the owner lock was "
                               "released for `contain cancel` to adopt the run")
        run.close()
        raise
