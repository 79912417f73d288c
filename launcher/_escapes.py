"""Escapes: processes that left the run's cgroup, found and stopped.

A cgroup holds its members only while they stay (_ledger.py says how a
process can leave, and how the fork ledger sees every fork). `EscapeWatch`
is what a run uses: it opens the ledger before the spawn when the run needs
one (a cgroup2 run that is not sealed, or degraded mode), and when the
container is observed empty, `stop_escapers` kills whatever the ledger
tracked that is alive outside it, and waits for each to be gone.
"""
from __future__ import annotations

import os
import select
from . import _signals as signal
import sys
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable

from ._policy import policy_env
from ._procfs import cgroup_of, read_stat
from ._record import now_iso

if TYPE_CHECKING:
    # The fork ledger (netlink) is imported where one is opened: never on
    # Windows, and not on the run path of a walled or sealed run.
    from ._ledger import Ledger


_SETTLE_S = 0.02      # the escaper pass's last look waits this long for late fork events


def stop_escapers(ledger: Ledger, inside: Callable[[str], bool], deadline: float,
                  known: set[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """Find every tracked process alive outside the container (`inside` says
    whether a v2 path is the run's), SIGKILL it by pidfd after re-checking
    its identity, and wait (until `deadline`, monotonic) for its pidfd to
    become readable. Repeats while the ledger finds more (an escaper's own
    children). Returns one entry per escaper, `gone` True only when its exit
    was observed."""
    from ._ledger import VIA

    known = known if known is not None else set()
    found: dict[tuple[int, int], dict[str, Any]] = {}
    fds: dict[int, tuple[int, int]] = {}
    try:
        quiet = True
        while True:
            fresh = 0
            live = ledger.live()            # (synced first)
            made = ledger.forks              # every fork into the tree so far
            for t in live:
                key = (t.pid, t.start_time or -1)
                if key in found or key in known:
                    continue
                where = cgroup_of(t.pid, missing_ok=True)
                # The container was observed empty before this is called, so
                # a live member found inside it now was outside then and came
                # back (or its cgroup could not be read): it left too, and
                # is stopped like any escaper. Only one found gone is none.
                back = where is None or inside(where)
                fd, gone, why = -1, False, None
                try:
                    fd = os.pidfd_open(t.pid)
                except ProcessLookupError:
                    gone = True
                except OSError as e:
                    why = f"pidfd_open: {os.strerror(e.errno or 0)}"
                if fd >= 0:
                    # The pidfd pins a process; it must still be the one tracked.
                    st = read_stat(t.pid)
                    if st is None or st[4] != t.start_time or st[0] in ("Z", "X"):
                        os.close(fd)
                        fd, gone = -1, True
                if back and gone:
                    continue
                entry = {"pid": t.pid, "ppid": t.ppid, "identity": t.identity(), "seen_in": where,
                         "at": now_iso(), "via": VIA, "killed": False, "gone": True if gone else None}
                if back:
                    entry["note"] = ("inside the container again after it was observed empty" if where else
                                     "its cgroup could not be read after the container was observed empty")
                if why:
                    entry["detail"] = why
                found[key] = entry
                fresh += 1
                if fd >= 0:
                    _kill(fd, key, entry, fds)
            _wait_pidfds(fds, found, deadline)
            # Done only after a pass that found no one new while nothing of
            # the tree forked: a chain whose members fork and exit faster
            # than their identities can be read is never seen alive, but
            # its forks keep coming.
            ledger.sync()
            quiet = ledger.forks == made
            if not fresh and quiet:
                # Once more after a moment: a fork's event is sent after the
                # child may already run (kernel_clone: wake_up_new_task, then
                # proc_fork_connector), so on a loaded host the fork that
                # keeps a chain going can be reported late. Not once every
                # process it tracked is reaped: nothing of it can fork any
                # more, and what it forked is all queued (Ledger.all_reaped).
                if not ledger.all_reaped():
                    time.sleep(_SETTLE_S)
                ledger.sync()
                quiet = ledger.forks == made
                if quiet:
                    break
            if time.monotonic() >= deadline:
                break
        newest = ledger.newest
        if not quiet and newest is not None:
            found[(-1, -1)] = {"pid": newest.pid, "ppid": newest.ppid, "identity": None, "seen_in": None,
                               "at": now_iso(), "via": VIA, "killed": False, "gone": None,
                               "detail": ("the tree was still forking when the escaper pass ran out of time: "
                                          "its newest processes were never caught")}
    finally:
        for fd in fds:
            os.close(fd)
    for entry in found.values():
        entry["alive_at_end"] = not entry["gone"] if entry["gone"] is not None else None
    return list(found.values())


def _kill(fd: int, key: Any, entry: dict[str, Any], fds: dict[int, Any]) -> None:
    """SIGKILL by the pidfd `fd` (pinned and verified by the caller), said in
    `entry`; the pidfd is kept in `fds` to wait on, or closed."""
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        entry["killed"] = True
        fds[fd] = key
    except ProcessLookupError:
        entry["gone"] = True
        os.close(fd)
    except OSError as e:
        entry["detail"] = f"pidfd_send_signal: {os.strerror(e.errno or 0)}"
        os.close(fd)


def _wait_pidfds(fds: dict[int, tuple[int, int]], found: dict[tuple[int, int], dict[str, Any]],
                 deadline: float) -> None:
    waiting = {fd for fd, key in fds.items() if found[key]["gone"] is None}
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        p = select.poll()
        for fd in waiting:
            p.register(fd, select.POLLIN)
        for fd, _ in p.poll(int(left * 1000) + 1):
            found[fds[fd]]["gone"] = True   # a pidfd polls readable once its process exited
            waiting.discard(fd)


def stop_v1_members(v1: Any, inside: Callable[[str], bool], deadline: float) -> list[dict[str, Any]]:
    """Without a fork ledger: every process still in the run's own v1
    cgroups once its v2 container was observed empty. A process is born in
    its creator's cgroups, and a member that moved itself out of the v2
    container (a root worker, unsealed) is most often still in them: it
    left, and is stopped like an escaper (pinned by pidfd, found in the
    run's v1 cgroups again after the pin, SIGKILLed, waited for). Left
    there, it kept the run's v1 cgroups from being removed for ever
    (issue 30). Repeats while more are found (an escaper's children)."""
    via = "the run's own v1 cgroups (no fork ledger)"
    found: dict[tuple[int, int], dict[str, Any]] = {}
    fds: dict[int, tuple[int, int]] = {}
    try:
        while time.monotonic() < deadline:
            members = v1.v1_members()
            fresh = 0
            for pid in sorted({p for pids in (members or {}).values() for p in pids}):
                try:
                    fd = os.pidfd_open(pid)
                except OSError:
                    continue                        # gone already
                st = read_stat(pid)
                # The pidfd pins a process; the pid must still name one of the run's.
                if st is None or st[0] in ("Z", "X") or not v1.holds(pid):
                    os.close(fd)
                    continue
                key = (pid, st[4])
                if key in found:
                    os.close(fd)
                    continue
                where = cgroup_of(pid, missing_ok=True)
                entry: dict[str, Any] = {"pid": pid, "ppid": st[1], "identity": {"pid": pid, "start_time": st[4]},
                                         "seen_in": where, "at": now_iso(), "via": via, "killed": False,
                                         "gone": None}
                if where is not None and inside(where):
                    entry["note"] = "inside the container again after it was observed empty"
                found[key] = entry
                fresh += 1
                _kill(fd, key, entry, fds)
            _wait_pidfds(fds, found, deadline)
            if not fresh:
                break
    finally:
        for fd in fds:
            os.close(fd)
    for entry in found.values():
        entry["alive_at_end"] = not entry["gone"] if entry["gone"] is not None else None
    return list(found.values())


# -- the ledger's part in one run ------------------------------------------

class EscapeWatch:
    """What `Run` calls: `before_spawn`, `after_spawn`, `at_empty`,
    `evidence`, `close`. Holds the ledger when the run needs one: a cgroup2
    run that is not sealed, or degraded mode."""

    def __init__(self) -> None:
        self.ledger: Ledger | None = None
        self.reason: str | None = None      # why there is no ledger
        self.start_ms: float | None = None  # what opening it cost
        self.checked = False
        self.v1: Any = None                 # the run's own v1 cgroups (_runcgroups.RunCgroups), if any

    @classmethod
    def before_spawn(cls, container: Any, req: Any, env: Any = None, v1: Any = None) -> "EscapeWatch":
        w = cls()
        env = os.environ if env is None else env
        if getattr(req, "pidns", False):
            w.reason = ("not watched: a PID-namespace wall, which no process can leave, so leaving is "
                        "prevented rather than detected")
            return w
        sealed, _ = container.seal_status(req)
        if sealed:
            how = (container.seal_detail or {}).get("method", "sealed")
            w.reason = f"not watched: the run is sealed ({how}), so leaving is prevented rather than detected"
            return w
        if v1 is not None and v1.v1:
            w.v1 = v1        # with or without a ledger, members left there are found at the end
        if (policy_env("CONTAIN_LEDGER", env) or "on").lower() in ("0", "off", "no", "false"):
            w.reason = "fork ledger turned off (CONTAIN_LEDGER=off)"
            return w
        if container.backend == "job-object":
            w.reason = "not watched: no fork ledger on Windows; the job says whether it can be left"
            return w
        if container.backend == "subreaper":
            w.reason = ("not watched: the supervisor's subtree, which no process leaves while it lives (child "
                        "subreaper), so leaving is prevented rather than detected")
            return w
        from ._ledger import Ledger
        from ._proccn import LedgerUnavailable

        t0 = time.perf_counter()
        try:
            w.ledger = Ledger.open()
        except LedgerUnavailable as e:
            w.reason = f"process connector unavailable: {e.reason}"
        w.start_ms = round((time.perf_counter() - t0) * 1000, 3)
        if w.ledger is not None and w.v1 is not None:
            w.ledger.holds = v1.holds
        if container.backend == "none":
            container.ledger = w.ledger
        return w

    def wall_fell_back(self, problem: str) -> None:
        """`auto` asked for the wall and the host refused it: the ledger was
        left off for a wall that is not there, so nothing watched."""
        if self.ledger is None and self.reason and self.reason.startswith("not watched: a PID-namespace wall"):
            self.reason = (f"no fork ledger: it was left off for the PID-namespace wall, which this host "
                           f"refused ({problem})")

    def after_spawn(self, pid: int, container: Any = None) -> None:
        if self.ledger is not None:
            path = getattr(container, "path", None)
            if path:
                self.ledger.inside = lambda where: where == path or where.startswith(path.rstrip("/") + "/")
            self.ledger.track_root(pid)

    def saw_whole_run(self) -> str | None:
        """None if the ledger watched every fork of the run from before the
        spawn, lost nothing and attributed every fork; else why not."""
        if self.ledger is None:
            return self.reason or "no fork ledger"
        if not self.ledger.complete():
            return f"the fork ledger is incomplete ({self.ledger.summary()})"
        return None

    def at_empty(self, container: Any, timeout: float) -> list[dict[str, Any]]:
        """The container was observed empty: stop whatever left it."""
        self.checked = True
        if container.backend == "none":
            return []
        path = container.path

        def inside(where: str) -> bool:
            return where == path or where.startswith(path.rstrip("/") + "/")

        if self.ledger is None:
            if self.v1 is None or container.backend != "cgroup2":
                return []
            return stop_v1_members(self.v1, inside, time.monotonic() + min(timeout, 10.0))
        if self.v1 is not None:
            # Still in the run's own v1 cgroups while the v2 container is
            # empty: members that left it, whatever the ledger attributed.
            found = self.v1.v1_members()
            if found is None:
                self.ledger.failed = self.ledger.failed or "the run's own v1 cgroups could not be listed at the end"
            for pid in sorted({p for pids in (found or {}).values() for p in pids}):
                self.ledger.track_member(pid, "in the run's own v1 cgroups after the container emptied")
        return stop_escapers(self.ledger, inside, time.monotonic() + min(timeout, 10.0))

    def evidence(self, container: Any, terminal: bool) -> dict[str, Any]:
        """The `escapes` layer when no escape was recorded."""
        if container.backend == "job-object":
            return dict(container.escape_evidence())
        if self.ledger is None:
            detail = self.reason or "no fork ledger"
            if not detail.startswith("not watched"):
                detail += ": a process that left the container would not be seen"
            return {"observed": None, "at": None, "via": "none", "detail": detail}
        from ._ledger import VIA

        complete = self.ledger.complete()
        info = dict(self.ledger.summary(), ledger_start_ms=self.start_ms)
        if container.backend == "none":
            info["reason"] = ("no kernel container: nothing to leave; every process the ledger saw was "
                              "stopped as a member")
            return {"observed": None, "at": None, "via": VIA, "detail": info}
        if not complete:
            info["reason"] = ("the ledger lost events" if self.ledger.lost or self.ledger.failed else
                              "forks reported as children of a process outside the tree could not be "
                              "attributed") + ": an escape could have been missed"
            return {"observed": None, "at": None, "via": VIA, "detail": info}
        if not (terminal and self.checked):
            info["reason"] = "checked when the container is observed empty"
            return {"observed": None, "at": None, "via": VIA, "detail": info}
        return {"observed": False, "at": now_iso(), "via": VIA, "detail": info}

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
