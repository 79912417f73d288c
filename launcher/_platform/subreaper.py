"""The subreaper wall: the supervisor's own subtree, where nothing else is
left to contain a run (a default container: no cgroup to write, no
namespace to make, clone3 refused).

Why it is a container (CONTRACT.md, "container"): a process that is a child
subreaper (prctl(2), PR_SET_CHILD_SUBREAPER) receives every orphan of its
subtree, because the kernel reparents an orphan to its nearest living
subreaper ancestor (kernel/exit.c, find_new_reaper) and never moves a
process out of an ancestor's subtree otherwise: no clone flag, setsid,
double fork or reparenting takes a descendant elsewhere while the
supervisor lives (CLONE_PARENT gives the creator's own parent, still inside).
So every process of the tree is, at every moment, a descendant of the
supervisor, and every ancestor of a tree process below the supervisor is a
tree process too. Hence:

    the tree is gone  <=>  no child of the supervisor is the tree's

and when the supervisor was a child subreaper from before the spawn to the
end of the stop, and then has no child left that could be the tree's (the
CLI, which owns its process: waitid says ECHILD), the tree is proven gone:
REAPED, with a wall of kind `subreaper`. It does not hold once the
supervisor dies (an adopter cannot be its ancestor: _containers.py adopts
such a run as degraded mode), and it says nothing of where the tree's
processes are beyond that: no limits, no cgroup accounting.

Which children are the tree's. The worker is (by identity). A process seen
below a member is (membership is decided at birth: the ancestors of a tree
process are tree processes). An orphan that reparented to the supervisor
before anything saw it is attributed only where that is sound:
- a process that started before the worker is not the tree's (a descendant
  never predates its ancestor); nor is a run's root (worker or init) that
  this process cloned (_identity.spawned_here), nor one attributed to
  another run;
- where this process declared itself the sole source of its children (the
  CLI; the library's `subreaper=True`, documented so) an orphan that
  started while this run was the only run of the process that could have
  left it is this run's;
- when the supervisor is PID 1 of its namespace, the orphans of processes
  that entered from outside (`docker exec`, `kubectl exec`) are reparented
  to it too: nothing is attributed by that rule, only by what was seen.
A child that fits none of these is unattributed: never signalled, never
counted as a member, and while one lives that could be the tree's, the run
cannot prove its tree gone (EXITED, naming it). The CLI as PID 1 avoids
that: it forks its supervisor off first (_pid1.py), so visitors' orphans go
to PID 1 and the tree's to the supervisor.

The tree must not reach into the supervisor: a worker that can ptrace it
(or write its memory) can turn the flag off, orphan a process past it and
turn it on again, and the flag reads as if it had stayed. So the supervisor
makes itself non-dumpable before the spawn, which leaves that only to a
process with CAP_SYS_PTRACE over it, and a run whose worker may have that (a
root worker whose bounding set keeps it) is never proven by this wall
(_tamper).
"""
from __future__ import annotations

import os
from typing import Any

from .._identity import orphan_sources, spawned_here
from .._procfs import read_stat
from .._record import now_iso
from .._scan import scan_processes
from . import none, posix

KIND = "subreaper"
_LIST_CAP = 50

# (pid, start) of a process attributed to a run -> that run's uid. Which
# runs of this process may have left an orphan: _identity.orphan_sources().
_attributed: dict[tuple[int, int], str] = {}


def forget(uid: str) -> None:
    """A run whose tree was proven gone: its members' identities recur never."""
    for key in [k for k, v in _attributed.items() if v == uid]:
        del _attributed[key]


def subreaper_status() -> tuple[bool, str]:
    """Whether this process receives its subtree's orphans, and how."""
    if os.getpid() == 1:
        return True, "PID 1 of its namespace (the namespace's child reaper)"
    from .._native import lib

    rc = lib.ct_get_child_subreaper()
    if rc < 0:
        return False, f"PR_GET_CHILD_SUBREAPER: {os.strerror(-rc)}"
    return bool(rc), "PR_SET_CHILD_SUBREAPER" if rc else "not a child subreaper"


def available(opts: Any) -> str | None:
    """None if a run with these options can have the subreaper wall, else why not."""
    if os.getpid() == 1 or getattr(opts, "subreaper", False):
        return None
    return ("the supervisor is not a child subreaper: the library takes subreaper=True for it "
            "(process-wide; `contain run` always is one)")


def become() -> str | None:
    """Make this process a child subreaper (process-wide, for good). None, or why not."""
    if os.getpid() == 1:
        return None
    from .._native import lib

    rc = lib.ct_set_child_subreaper(1)
    return None if rc == 0 else f"PR_SET_CHILD_SUBREAPER: {os.strerror(-rc)}"


def _tamper(req: posix.SpawnRequest) -> str | None:
    """How the tree could reach into the supervisor and turn its subreaper
    flag off and on again unseen (ptrace, process_vm_writev, /proc/<pid>/mem:
    orphans made meanwhile reparent past it), or None. The supervisor makes
    itself non-dumpable first (process-wide, for good: no core dumps): then
    only a process with CAP_SYS_PTRACE over it can, which a worker of root's
    has where the bounding set keeps it (a host, not a default container)."""
    from .._native import lib

    if lib.ct_set_dumpable(0) < 0:
        return "the supervisor could not make itself non-dumpable: a worker of its uid could ptrace it"
    root_worker = req.uid == 0 or (req.uid < 0 and os.geteuid() == 0)
    if root_worker and not getattr(req, "clear_caps", False) and _bounding_has(19):     # CAP_SYS_PTRACE
        return ("the worker runs as root with CAP_SYS_PTRACE in its bounding set: it could ptrace the "
                "supervisor and turn its subreaper flag off and on again unseen")
    return None


def _bounding_has(cap: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapBnd:"):
                    return bool(int(line.split()[1], 16) >> cap & 1)
    except (OSError, ValueError):
        pass
    return True           # when in doubt: it could


def _has_children_file() -> bool:
    return os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _children_of_every_thread() -> set[int]:
    """Every child of this process: the union of its threads' lists. A
    thread that exits hands its children to another thread of the process
    (find_alive_thread), possibly one already read: so the pass is repeated
    until the threads are the same before and after it. Threads come and go
    here (the /proc scan's own helpers end as it returns, and a loaded host
    can take a while to remove them from /proc/self/task), so the passes go
    on for up to 5 s, yielding between them, before the observation fails."""
    import time

    deadline = time.monotonic() + 5.0
    while True:
        tids = sorted(os.listdir("/proc/self/task"))
        pids: set[int] = set()
        gone = False
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/children", "rb") as f:
                    pids.update(int(x) for x in f.read().split())
            except FileNotFoundError:
                gone = True
        if not gone and sorted(os.listdir("/proc/self/task")) == tids:
            return pids
        if time.monotonic() > deadline:
            raise OSError("the supervisor's threads kept changing for 5 s: its children could not be listed")
        time.sleep(0.001)


class Container(none.Container):
    """One run held by the supervisor's subtree."""

    backend = KIND
    empty_via = "the supervisor's subtree (child subreaper): its children"
    empty_proof = "no child of the supervisor left that could be the tree's"
    UNLEAVABLE = ("the supervisor was a child subreaper from before the spawn to the end of the stop, and the "
                  "kernel never moves a process out of a living subreaper's subtree")

    def __init__(self, run_id: str, uid: str | None = None, *, sole: bool = False) -> None:
        super().__init__(run_id)
        self.uid = uid or run_id
        self.me = os.getpid()
        self.pid1 = self.me == 1
        # Declared the sole source of this process's children (the CLI, or
        # subreaper=True), and not PID 1 (visitors' orphans come to PID 1).
        self.sole = sole and not self.pid1
        self.path = f"subtree of pid {self.me}"
        self.since: str | None = None          # how this process was a subreaper at the spawn
        self.unattributed: dict[int, int] = {}  # pid -> start: children it cannot place (at the last look)
        self.outside: dict[int, int] = {}       # children proven not the tree's (seen at the last look)
        self.problem: str | None = None         # why emptiness, once observed, proves nothing
        self.seen_empty: bool | None = None
        self.no_child: bool | None = None       # waitid said ECHILD (the supervisor has no child at all)
        self.tamper: str | None = None          # how the tree could reach into the supervisor (_tamper)

    def prepare(self, req: posix.SpawnRequest, opts: Any) -> None:
        super().prepare(req, opts)
        self._subreaper = True
        if opts.seal:
            self._seal_error = "--seal needs a namespace or a cgroup: the subreaper wall has nothing to seal"

    def spawn(self, req: posix.SpawnRequest) -> posix.Spawned:
        on, how = subreaper_status()
        if not on:
            from .._errors import ContainmentUnavailable

            raise ContainmentUnavailable(f"subreaper wall: {how}")
        self.since = how
        self.tamper = _tamper(req)
        sp = super().spawn(req)
        if self.root_start < 0:
            st = read_stat(sp.pid)        # exited already: our unreaped child's stat still says when it began
            if st is not None:
                self.root_start = st[4]
                self._remember(sp.pid, st[4], "worker")
        sp.via = f"{posix.clone_call('CLONE_VM', 'CLONE_VFORK', 'CLONE_PIDFD')}, into the subtree of pid {self.me} " \
                 f"({how})"
        return sp

    # -- membership ------------------------------------------------------------

    def _place(self, pid: int, start: int, candidates: list[str]) -> str | None:
        """How a child of the supervisor is this tree's, "" if it is proven
        not to be, None if that cannot be told."""
        if (pid, start) == (self.root_pid, self.root_start):
            return "worker"
        if self.seen.get(pid) == start:
            return "seen as a member"
        owner = _attributed.get((pid, start))
        if owner is not None:
            return "" if owner != self.uid else "seen as a member"
        if start < self.root_start or spawned_here(pid, start):
            return ""                 # older than the worker, or a run's root this process cloned
        if self.sole and candidates == [self.uid]:
            return "reparented to the supervisor (child subreaper) while this was its only run that could leave it"
        return None

    def _candidates(self, start: int) -> list[str]:
        """The runs of this process a process that started at `start` may
        belong to (those whose worker is not younger)."""
        return sorted(uid for uid, began in orphan_sources().items() if began <= start)

    def _closure(self) -> dict[int, int]:
        """Members alive now (pid -> start time): the subtrees of the
        supervisor's children that are the tree's, from one /proc pass
        (for signalling and for a later owner; emptiness is decided by
        populated(), from the kernel's list of children)."""
        if self.ledger is not None:
            self.ledger.sync()
        procs = {p.pid: p for p in scan_processes(cgroups=False)}
        me = self.me
        members: dict[int, int] = {}
        for p in procs.values():
            if p.ppid == me and p.pid != me:
                how = self._place(p.pid, p.start_time, self._candidates(p.start_time))
                if how:
                    self._take(members, p.pid, p.start_time, how)
        changed = True
        while changed:                     # their descendants, at any depth
            changed = False
            for p in procs.values():
                if p.pid not in members and p.ppid in members and p.pid != me:
                    self._take(members, p.pid, p.start_time, "ancestry")
                    changed = True
        alive = {pid: start for pid, start in members.items()
                 if procs[pid].state not in ("Z", "X") or none.live_start(pid) is not None}
        self.last_alive = sorted(alive)
        self._persist(alive)
        return alive

    def _take(self, members: dict[int, int], pid: int, start: int, how: str) -> None:
        members[pid] = start
        self._remember(pid, start, how)
        _attributed[(pid, start)] = self.uid

    def members(self) -> list[int]:
        return sorted(self._closure())

    def _children(self) -> list[tuple[int, str, int]]:
        """The supervisor's children, as the kernel lists them under
        /proc/self/task/*/children (each read under the tasklist lock: an
        orphan is put on one live thread's list), with their state and start
        time: [(pid, state, start)]. A child gone meanwhile is left out.
        Raises OSError where the kernel has no such file
        (CONFIG_PROC_CHILDREN): a /proc scan is not atomic enough to prove
        "no child" (a process reparented while it is read is missed)."""
        if not _has_children_file():
            if not self.sole:
                raise OSError("/proc/self/task/*/children is missing (a kernel without CONFIG_PROC_CHILDREN): "
                              "the supervisor's children cannot be listed atomically")
            # `contain run` reaps every child, so "none left" is the kernel's
            # ECHILD (populated() asks it); the list only tells what is left.
            pids = {p.pid for p in scan_processes(cgroups=False) if p.ppid == self.me}
        else:
            pids = _children_of_every_thread()
        out = []
        for pid in sorted(pids):
            st = read_stat(pid)
            if st is not None:
                out.append((pid, st[0], st[4]))
        return out

    # -- reaping ---------------------------------------------------------------

    def reap(self, root_pid: int) -> None:
        """Reap the zombies among the supervisor's children that are the
        tree's (never the worker, whose status its pidfd takes; never a
        child that is not this run's: a library caller's own children are
        its own). A zombie's pid cannot be reused until it is reaped, so
        the identity checked is the one reaped."""
        try:
            kids = self._children()
        except OSError:
            return
        for pid, state, start in kids:
            if state == "Z" and pid != root_pid and self._place(pid, start, self._candidates(start)):
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    # -- emptiness -------------------------------------------------------------

    def populated(self) -> bool:
        """Whether a child of the supervisor that is the tree's is alive
        (then the tree is not gone; if none is, no process of the tree is:
        every ancestor of a tree process below the supervisor is one).
        Raises OSError when the children cannot be listed."""
        if self.unknown is not None:
            raise OSError(self.unknown)
        self._closure()
        self.unattributed, self.outside = {}, {}
        alive = False
        for pid, state, start in self._children():
            live = state not in ("Z", "X") or none.live_start(pid) is not None
            how = self._place(pid, start, self._candidates(start))
            if how:
                self._remember(pid, start, how)
                _attributed[(pid, start)] = self.uid
                alive = alive or live
            elif how is None and live:
                self.unattributed[pid] = start
            elif how == "":
                self.outside[pid] = start
        if alive:
            return True
        if self.sole and not _has_children_file():
            try:
                os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                return True           # a child is left (the turn reaps it; then ECHILD decides)
            except ChildProcessError:
                pass
        self.seen_empty = True
        self.problem = self._proof_problem()
        return False

    def _proof_problem(self) -> str | None:
        """None when "no child of the tree's is alive" proves the tree gone, else why not."""
        on, how = subreaper_status()
        if not on:
            return f"the supervisor stopped being a child subreaper during the run ({how})"
        if self.tamper:
            return self.tamper
        if self.unattributed:
            pids = ", ".join(map(str, sorted(self.unattributed)[:10]))
            return (f"the supervisor has {len(self.unattributed)} child(ren) it cannot attribute (pid {pids}): "
                    "started after the worker and never seen below a member"
                    + (": as PID 1 it also receives the orphans of processes from outside the tree"
                       if self.pid1 else ": with other runs or children of this process live, an orphan's run "
                       "cannot be told"))
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            self.no_child = False
        except ChildProcessError:
            self.no_child = True
        return None

    def proof_problem(self) -> str | None:
        """Why the emptiness observed proves nothing (None: it proves the tree gone)."""
        return self.problem

    def unleavable(self) -> str | None:
        return self.UNLEAVABLE if self.seen_empty and self.problem is None else None

    def seal_status(self, req: posix.SpawnRequest) -> tuple[bool, str]:
        return False, ("the subreaper wall keeps the tree in the supervisor's subtree, but nothing stops a member "
                       "from acting outside it (no namespace, no cgroup)")

    def escape_evidence(self) -> dict[str, Any]:
        return {"observed": False, "at": now_iso(), "via": "child subreaper",
                "detail": "no process leaves a living child subreaper's subtree (the kernel reparents orphans "
                          "to their nearest living subreaper ancestor)"}

    def walls(self) -> list[dict[str, Any]]:
        if self.seen_empty and self.problem is None:
            observed: bool | None = True
            via = "no child of the supervisor left that could be the tree's" + (
                " (waitid: ECHILD, no child at all)" if self.no_child else "")
        elif self.seen_empty:
            observed, via = None, self.problem or ""
        else:
            observed, via = (False, "members alive at the last look") if self.last_alive else (None, "not observed")
        out: dict[str, Any] = {"kind": "subreaper", "path": self.path, "observed_empty": observed, "via": via,
                               "subreaper": self.since}
        if self.unattributed:
            out["unattributed"] = [{"pid": p, "start_time": s} for p, s in sorted(self.unattributed.items())][
                :_LIST_CAP]
        return [out]

    def seen_summary(self) -> dict[str, Any]:
        out = super().seen_summary()
        out["unprovable"] = self.problem or "the subreaper wall does not hold: see the wall's via"
        if self.unattributed:
            out["unattributed"] = sorted(self.unattributed)[:_LIST_CAP]
        return out
