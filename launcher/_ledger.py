"""A fork/exit ledger of one run's tree, from the netlink process connector.

A cgroup holds its members only while they stay: a root worker on a mount
without `nsdelegate` can write its pid into another `cgroup.procs` and walk
out (KERNEL-NOTES.md). The kernel announces every fork and exit on the
process connector (`NETLINK_CONNECTOR`, `CN_IDX_PROC`), so a ledger that
listens from before the spawn knows every process the tree ever made, with
its identity, wherever it went. At stop, whatever it tracked that is alive
outside the run's cgroup is an escape.

The wire format is the one pyroute2 reads in
`pyroute2/netlink/connector/cn_proc.py` (`ProcEventSocket`); the socket is
opened here with the standard library because `import pyroute2` costs
130-155 ms on this host (it imports ndb, ipdb and conntrack), which every
unsealed run would pay (benchmarks/bench_ledger.py measures both).

Ordering: an event is queued to the socket in the context of the task that
forks or exits, so a fork that has returned is already in the queue.
Draining the socket to EAGAIN (`sync`) therefore covers every fork that
happened before the call. Events that arrive before the worker's pid is
known are kept and replayed, so a worker that forks at once is not missed.
A socket overflow (ENOBUFS) loses events: the ledger then says so, and the
escape layer becomes "not observed" rather than "none seen".

Order between processes is not promised: a member orphaned by its parent's
exit can fork before that exit's event is queued (the kernel reparents in
exit_notify and sends the event after it, kernel/exit.c do_exit), and a
child it makes with clone(CLONE_PARENT) is reported as its new reaper's.
So which forks get a look never depends on an exit having been read first:
the reapers a member can ever have are known from the start (the
supervisor, its ancestors and pid 1: find_new_reaper walks up the
ancestry, kernel/exit.c), and every fork they report is looked at as it
comes. Whether such a fork outside the run could have been the tree's is
decided only at the end, from facts that do not depend on order: the
parent each member had at its exit (the exit event carries it) or has now,
and the fork's time against the birth of the member that had that reaper
(a member forks only after its own fork event was queued by its parent).

The table holds what may still be alive: an entry whose exit was seen and
that is reaped leaves it (a sweep every _SWEEP_EVERY exits), so a run of
30,000 short forks keeps a few entries, not 30,000.
"""
from __future__ import annotations

import errno
import os
import select
# _socket, not socket: the wrapper module costs ~2 ms of imports (selectors,
# array, enum constants) on every unsealed run's start.
import _socket
import threading
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable

from ._identity import boot_id, spawned_here
from ._proccn import PROC_EVENT_EXIT, PROC_EVENT_FORK, THREAD_EXIT, events, listen
from ._procfs import cgroup_of, read_stat


VIA = "fork ledger (netlink process connector)"
_COALESCE_S = 0.002
_SWEEP_EVERY = 256      # exited entries between two sweeps of the reaped ones
_SAMPLES = 20           # unattributed forks listed per reporting parent

class Tracked:
    """One process the tree made: its identity and what the ledger saw."""

    __slots__ = ("pid", "ppid", "start_time", "forked_ns", "exit_seen", "gone", "note")

    def __init__(self, pid: int, ppid: int, start_time: int | None, forked_ns: int) -> None:
        self.pid = pid
        self.ppid = ppid
        self.start_time = start_time   # None: it was gone before /proc could be read
        self.forked_ns = forked_ns
        self.exit_seen = False
        self.gone = start_time is None
        self.note: str | None = None

    def alive(self) -> bool:
        """This very process exists and has not exited (a zombie has)."""
        if self.gone or self.start_time is None:
            return False
        st = read_stat(self.pid)
        if st is None or st[4] != self.start_time or st[0] in ("Z", "X"):
            self.gone = True
            return False
        return True

    def identity(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "boot_id": boot_id(), "pidns": None,
                "pidfd_inode": None}


class Ledger:
    """Every process forked by the worker or its descendants, from before
    the spawn to the stop. Use `open()`, then `track_root(pid)` right after
    the spawn, `sync()` before reading, `close()` at the end."""

    def __init__(self, sock: _socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._buf = bytearray(256 * 1024)
        self._me = os.getpid()
        self._root: int | None = None
        self._root_born = False      # the root's own fork event was seen
        self._pending: list[tuple[int, int, int, int]] = []   # (what, a, b, ts) before the root is known
        self._live: dict[int, Tracked] = {}                   # tgid -> entry, while its pid is ours
        self._exited: list[Tracked] = []                      # exit seen, not yet found reaped
        self.forks = 0                                        # processes ever tracked (the root included)
        self.newest: Tracked | None = None
        self.lost = 0                                         # ENOBUFS seen: events were dropped
        self.failed: str | None = None                        # the socket broke
        # The process connector reports task->real_parent: a child made with
        # clone(CLONE_PARENT) shows up as a child of its creator's parent
        # (KERNEL-NOTES.md). Membership must not hang on that link, so forks
        # reported as children of a process *outside* the tree that is, or
        # can become, a parent of a tracked process (the supervisor, its
        # ancestors, pid 1: every reaper an orphan of the tree can get) are
        # attributed by where the kernel put them: a child is born in its
        # creator's cgroup.
        self.inside: Callable[[str], bool] | None = None       # the run's cgroup subtree, set by the run
        # The run's own v1 cgroups (hybrid hosts): a fork found in them was
        # born inside the run even if it left the v2 container at once.
        self.holds: Callable[[int], bool] | None = None
        self._reapers = _ancestry(self._me)                   # outside parents whose forks get a look
        self._watched = frozenset(self._reapers)              # ... from the start
        # Outside parents members were seen to have (at their exit, or
        # now): parent -> the earliest fork time of such a member. A fork
        # of that parent reported outside the run after it may be the tree's.
        self._had: dict[int, int] = {}
        self._beyond: dict[int, int] = {}                     # such parents not watched from the start
        self._self_forks: list[tuple[int, int | None, str | None]] = []    # (pid, start, cgroup)
        self._outside: dict[int, _Outside] = {}               # other watched parent -> its forks outside
        self._dead: list[_Outside] = []                       # ... of such parents that exited since
        self.unattributed: list[dict[str, Any]] = []          # the supervisor's forks that may have been ours
        self.attributed = 0                                   # members found by their cgroup, not their parent
        self._closed = False
        self._hz = os.sysconf("SC_CLK_TCK")
        # /proc start times count from boot including suspend; event stamps
        # are CLOCK_MONOTONIC. The offset turns one into the other.
        self._boot_offset_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - time.monotonic_ns()
        self._opened_ns = time.monotonic_ns()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._loop, name="contain-ledger", daemon=True)
        self._thread.start()

    # -- opening -----------------------------------------------------------

    @classmethod
    def open(cls, ack_timeout: float = 0.2) -> "Ledger":
        """Subscribe to the process connector. Raises LedgerUnavailable."""
        return cls(listen(ack_timeout))

    # -- the tree ----------------------------------------------------------

    @property
    def tracked(self) -> list[Tracked]:
        """The entries still held: every tracked process not yet known to be
        reaped (those are dropped from the table)."""
        with self._lock:
            return list(self._live.values())

    def track_root(self, pid: int) -> None:
        """The worker's pid, as soon as the spawn returns. Replays what was
        received before, so its first forks are not missed."""
        st = read_stat(pid)
        with self._lock:
            self._drain()
            self._root = pid
            root = Tracked(pid, self._me, st[4] if st else None, self._opened_ns)
            self._add(root)
            pending, self._pending = self._pending, []
            for what, a, b, ts in pending:
                self._on_event(what, a, b, ts)

    def sync(self) -> None:
        """Take in every event queued so far (every fork that has returned)."""
        with self._lock:
            self._drain()

    def track_member(self, pid: int, note: str) -> bool:
        """A member found some other way (in the run's own v1 cgroups after
        the container emptied): tracked from now on, so the stop treats it
        like any member that left. False if it is tracked already or gone."""
        st = read_stat(pid)
        if st is None or st[0] in ("Z", "X"):
            return False
        with self._lock:
            cur = self._live.get(pid)
            if cur is not None and cur.start_time == st[4]:
                return False
            t = Tracked(pid, st[1], st[4], self._opened_ns)   # born when, unknown: at the earliest
            t.note = note
            self._add(t)
            # If it was an unattributed fork, it is accounted for now.
            self.unattributed = [u for u in self.unattributed if (u["pid"], u["start_time"]) != (pid, st[4])]
            self._self_forks = [u for u in self._self_forks if (u[0], u[1]) != (pid, st[4])]
            for out in self._outside.values():
                out.forget(pid, st[4])
        return True

    def live(self) -> list[Tracked]:
        """Tracked processes that are alive now (identity checked)."""
        self.sync()
        return [t for t in self.tracked if t.alive()]

    def all_reaped(self) -> bool:
        """Every process it tracked is reaped (no /proc entry with its
        identity; a zombie is not). Each queued its forks (in its own
        context, as it forked) before its exit, and that before the reaping:
        so once this holds, one more drain has read every fork the tree made."""
        for t in self.tracked:
            if t.start_time is None:
                continue                # gone (or its pid reused) before it could be read
            st = read_stat(t.pid)
            if st is not None and st[4] == t.start_time:
                return False
        return True

    def complete(self) -> bool:
        """Nothing lost, nothing broken, and every fork that could have been
        the tree's accounted for."""
        self._resolve()
        return not self.lost and self.failed is None and not self.unattributed and not self._beyond

    def _resolve(self) -> None:
        """Decide, from what is known now, which forks reported by a parent
        outside the tree and found outside the run could have been the
        tree's: the supervisor's that are not another spawn of this process
        (a child that left at once, or was gone before it could be read);
        another watched parent's made after a member that had it as its
        parent was born. Nothing here depends on the order events came in."""
        with self._lock:
            self._drain()
            todo, self._self_forks = self._self_forks, []
            unknown_since = None
            for t in list(self._live.values()):
                if t.pid == self._root or t.exit_seen:
                    continue
                st = read_stat(t.pid)
                if st is not None and t.start_time is not None and st[4] == t.start_time:
                    self._note_parent(st[1], t)      # its parent now (a zombie's too)
                elif unknown_since is None or t.forked_ns < unknown_since:
                    # Gone, and its exit not read yet: which reaper it had is
                    # not known, so any watched parent may have been it.
                    unknown_since = t.forked_ns
            for pid, start, where in todo:
                if start is not None and spawned_here(pid, start):
                    continue
                self.unattributed.append({"pid": pid, "reported_parent": self._me, "seen_in": where,
                                          "start_time": start})
            anyone = min([*self._had.values(), *([unknown_since] if unknown_since is not None else [])],
                         default=None)
            for parent, out in self._outside.items():
                since = self._had.get(parent)
                if unknown_since is not None:
                    since = unknown_since if since is None else min(since, unknown_since)
                if since is not None:
                    self.unattributed.extend(out.taken(since))
            # Parents that died during the run: a member orphaned to one was
            # orphaned again, to a reaper further up, which is what its exit
            # names. Any member orphaned at all makes their forks count.
            if anyone is not None:
                for out in self._dead:
                    self.unattributed.extend(out.taken(anyone))

    def close(self) -> None:
        self._closed = True
        if self._stop_w >= 0:
            try:
                os.write(self._stop_w, b"x")
            except OSError:
                pass
            self._thread.join(timeout=2)
            os.close(self._stop_w)
            os.close(self._stop_r)
            self._stop_w = self._stop_r = -1
        try:
            self._sock.close()
        except OSError:
            pass

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tracked": self.forks, "lost_events": self.lost, "failed": self.failed}
        if self.attributed:
            out["attributed_by_cgroup"] = self.attributed
        if self.unattributed:
            out["unattributed_forks"] = self.unattributed[:_SAMPLES]
            out["unattributed_count"] = len(self.unattributed)
        if self._beyond:
            out["reparented_beyond_watch"] = sorted(self._beyond)[:_SAMPLES]
        return out

    # -- the thread --------------------------------------------------------

    def _loop(self) -> None:
        p = select.poll()
        p.register(self._sock.fileno(), select.POLLIN)
        p.register(self._stop_r, select.POLLIN)
        while True:
            try:
                ready = p.poll()
            except InterruptedError:
                continue
            if any(fd == self._stop_r for fd, _ in ready):
                return
            # Every fork and exit on the host wakes this thread; a short
            # pause lets a burst collect so one drain (and one GIL hand-off)
            # takes it all. Identities are still read within milliseconds.
            time.sleep(_COALESCE_S)
            with self._lock:
                try:
                    self._drain()
                except Exception as e:   # a dead ledger must not read as "nothing left"
                    self.failed = f"ledger thread: {type(e).__name__}: {e}"
                if self.failed:
                    return

    def _drain(self) -> None:
        """Read until EAGAIN. Caller holds the lock."""
        if self.failed or self._closed:
            return
        buf = self._buf
        while True:
            try:
                n = self._sock.recv_into(buf)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self.lost += 1
                    continue
                self.failed = f"recv: {os.strerror(e.errno or 0)}"
                return
            for what, a, b, ts in events(buf, n):
                if self._root is None:
                    self._pending.append((what, a, b, ts))
                else:
                    self._on_event(what, a, b, ts)
        if len(self._exited) >= _SWEEP_EVERY:
            self._sweep()

    def _on_event(self, what: int, a: int, b: int, ts: int) -> None:
        if what == PROC_EVENT_FORK:
            self._on_fork(a, b, ts)
        elif what == PROC_EVENT_EXIT:
            self._on_exit(a, b, leader=True)
        elif what == THREAD_EXIT:
            self._on_exit(a, b, leader=False)

    def _add(self, t: Tracked) -> None:
        old = self._live.get(t.pid)
        if old is not None:
            old.gone = True
        self._live[t.pid] = t
        self.forks += 1
        self.newest = t

    def _sweep(self) -> None:
        """Drop the entries whose exit was seen and that are reaped: nothing
        of them can fork, and a fork that reuses the pid is not theirs."""
        keep = []
        for t in self._exited:
            if self._live.get(t.pid) is not t:
                continue                 # replaced already (its pid reused)
            st = read_stat(t.pid) if t.start_time is not None else None
            if st is not None and st[4] == t.start_time:
                keep.append(t)           # a zombie, not reaped yet
            else:
                t.gone = True
                del self._live[t.pid]
        self._exited = keep

    def _note_parent(self, parent: int, t: Tracked) -> None:
        """Member `t` had `parent` as its parent (read at its exit or now)."""
        if parent <= 0 or parent in self._live:
            return
        if parent != self._me:
            cur = self._had.get(parent)
            if cur is None or t.forked_ns < cur:
                self._had[parent] = t.forked_ns
        if parent not in self._watched:
            # A reaper no one saw coming (an init of another PID namespace
            # the tree joined): its earlier forks had no look.
            self._beyond.setdefault(parent, t.forked_ns)
            self._reapers.add(parent)

    def _on_fork(self, ptgid: int, child: int, ts: int) -> None:
        if child == self._root and not self._root_born:
            # The spawn itself (the ledger opened before it): the first fork
            # that makes the root's pid is the root's birth, not a reuse.
            self._root_born = True
            return
        # A fork of a pid we hold means that pid was freed and reused: the
        # old holder is gone, whoever forks now.
        old = self._live.pop(child, None)
        if old is not None:
            old.gone = True
        note = None
        if ptgid not in self._live:
            if ptgid not in self._reapers:
                return
            # Perhaps a CLONE_PARENT child of a tracked process: ours if the
            # kernel put it inside the run (it is born in its creator's cgroup).
            where = cgroup_of(child, missing_ok=True)
            if where is not None and self.inside is not None and self.inside(where):
                note = f"born in the run's cgroup; reported parent {ptgid} is outside the tree (CLONE_PARENT)"
            elif self.holds is not None and self.holds(child):
                note = (f"in the run's own v1 cgroups (v2: {where}); reported parent {ptgid} is outside "
                        "the tree (CLONE_PARENT)")
            else:
                st0 = read_stat(child)
                start0 = st0[4] if st0 else None
                if ptgid == self._me:
                    self._self_forks.append((child, start0, where))
                else:
                    self._outside.setdefault(ptgid, _Outside()).add(child, start0, ptgid, where, ts)
                return
            self.attributed += 1
        st = read_stat(child)
        t = Tracked(child, ptgid, None, ts)
        t.note = note
        if st is None:
            t.note = "gone before its identity could be read"
        else:
            # A start time later than the event is another process that got
            # the pid after ours exited (pid_max is small): ours is gone.
            limit = (ts + self._boot_offset_ns) * self._hz // 1_000_000_000 + 1
            if st[4] > limit:
                t.note = "pid reused before its identity could be read"
            else:
                t.start_time = st[4]
                t.gone = False
        self._add(t)

    def _on_exit(self, tgid: int, parent: int, leader: bool) -> None:
        t = self._live.get(tgid)
        if t is None:
            if leader and tgid in self._reapers and tgid != self._me and _exited(tgid):
                # A watched reaper is gone: a later holder of its pid is
                # someone else. What it forked is judged without its pid.
                self._reapers.discard(tgid)
                out = self._outside.pop(tgid, None)
                if out is not None:
                    self._dead.append(out)
            return
        # The parent at exit: a member orphaned before (by any thread's
        # exit) names its reaper here, whenever its old parent's exit is read.
        self._note_parent(parent, t)
        if leader and not t.exit_seen:
            # Kept in the table until reaped: other threads of the process
            # may still fork (the leader can exit first).
            t.exit_seen = True
            self._exited.append(t)


class _Outside:
    """The forks one watched parent outside the tree reported outside the
    run: the latest _SAMPLES (for the record), and the latest time among
    those let go (they count as much, unlisted)."""

    __slots__ = ("samples", "dropped", "dropped_ns")

    def __init__(self) -> None:
        self.samples: list[tuple[int, dict[str, Any]]] = []
        self.dropped = 0
        self.dropped_ns = -1

    def add(self, pid: int, start: int | None, parent: int, where: str | None, ts: int) -> None:
        self.samples.append((ts, {"pid": pid, "reported_parent": parent, "seen_in": where, "start_time": start}))
        if len(self.samples) > _SAMPLES:
            ts0, _ = self.samples.pop(0)
            self.dropped += 1
            self.dropped_ns = max(self.dropped_ns, ts0)

    def forget(self, pid: int, start: int) -> None:
        self.samples = [(ts, u) for ts, u in self.samples if (u["pid"], u["start_time"]) != (pid, start)]

    def taken(self, since: int) -> list[dict[str, Any]]:
        """The forks at or after `since`, taken out (each is reported once)."""
        out = [u for ts, u in self.samples if ts >= since]
        self.samples = [(ts, u) for ts, u in self.samples if ts < since]
        if self.dropped_ns >= since:
            out.append({"pid": None, "reported_parent": None, "seen_in": None, "start_time": None,
                        "note": f"up to {self.dropped} more such forks, not listed"})
            self.dropped, self.dropped_ns = 0, -1
        return out


def _exited(pid: int) -> bool:
    """The process `pid` is a zombie or gone (a leader's exit event also
    comes when a thread's exec replaces it: de_thread, and the process lives on)."""
    st = read_stat(pid)
    return st is None or st[0] in ("Z", "X")


def _ancestry(pid: int) -> set[int]:
    """`pid`, its ancestors and pid 1: every process the kernel can make the
    parent of an orphan of a tree below `pid` (find_new_reaper: a live
    thread of the group, else the nearest child-subreaper ancestor, else the
    PID namespace's init), as long as the tree stays in this namespace."""
    out = {pid, 1}
    seen = 0
    while pid > 1 and seen < 4096:
        st = read_stat(pid)
        if st is None:
            break
        pid = st[1]
        out.add(pid)
        seen += 1
    out.discard(0)
    return out
