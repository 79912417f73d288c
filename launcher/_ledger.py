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
from ._proccn import PROC_EVENT_FORK, events, listen
from ._procfs import cgroup_of, read_stat


VIA = "fork ledger (netlink process connector)"
_COALESCE_S = 0.002

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
        self._root: int | None = None
        self._root_born = False      # the root's own fork event was seen
        self._pending: list[tuple[int, int, int, int]] = []   # (what, a, b, ts) before the root is known
        self._live: dict[int, Tracked] = {}                   # tgid -> entry, while its pid is ours
        self.tracked: list[Tracked] = []                      # everything ever tracked, in fork order
        self.lost = 0                                         # ENOBUFS seen: events were dropped
        self.failed: str | None = None                        # the socket broke
        # The process connector reports task->real_parent: a child made with
        # clone(CLONE_PARENT) shows up as a child of its creator's parent
        # (KERNEL-NOTES.md). Membership must not hang on that link, so forks
        # reported as children of a process *outside* the tree that is a
        # parent of a tracked process (the supervisor, or whoever adopted a
        # tracked orphan) are attributed by where the kernel put them: a
        # child is born in its creator's cgroup.
        self.inside: Callable[[str], bool] | None = None       # the run's cgroup subtree, set by the run
        # The run's own v1 cgroups (hybrid hosts): a fork found in them was
        # born inside the run even if it left the v2 container at once.
        self.holds: Callable[[int], bool] | None = None
        self._suspects: set[int] = {os.getpid()}
        self._kids: dict[int, list[Tracked]] = {}             # ppid -> tracked children, for reparenting
        self._unresolved: list[tuple[int, int | None, int, str | None]] = []   # (pid, start, parent, cgroup)
        self.unattributed: list[dict[str, Any]] = []          # forks of suspects that may have been ours
        self.attributed = 0                                   # members found by their cgroup, not their parent
        self._closed = False
        self._hz = os.sysconf("SC_CLK_TCK")
        # /proc start times count from boot including suspend; event stamps
        # are CLOCK_MONOTONIC. The offset turns one into the other.
        self._boot_offset_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - time.monotonic_ns()
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._loop, name="contain-ledger", daemon=True)
        self._thread.start()

    # -- opening -----------------------------------------------------------

    @classmethod
    def open(cls, ack_timeout: float = 0.2) -> "Ledger":
        """Subscribe to the process connector. Raises LedgerUnavailable."""
        return cls(listen(ack_timeout))

    # -- the tree ----------------------------------------------------------

    def track_root(self, pid: int) -> None:
        """The worker's pid, as soon as the spawn returns. Replays what was
        received before, so its first forks are not missed."""
        st = read_stat(pid)
        with self._lock:
            self._drain()
            self._root = pid
            root = Tracked(pid, os.getpid(), st[4] if st else None, time.monotonic_ns())
            self._live[pid] = root
            self.tracked.append(root)
            pending, self._pending = self._pending, []
            for what, a, b, ts in pending:
                if what == PROC_EVENT_FORK:
                    self._on_fork(a, b, ts)
                else:
                    self._on_exit(a, ts)

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
            t = Tracked(pid, st[1], st[4], time.monotonic_ns())
            t.note = note
            self._live[pid] = t
            self.tracked.append(t)
            # If it was an unattributed fork, it is accounted for now.
            self.unattributed = [u for u in self.unattributed if (u["pid"], u["start_time"]) != (pid, st[4])]
            self._unresolved = [u for u in self._unresolved if (u[0], u[1]) != (pid, st[4])]
        return True

    def live(self) -> list[Tracked]:
        """Tracked processes that are alive now (identity checked)."""
        self.sync()
        return [t for t in list(self.tracked) if t.alive()]

    def all_reaped(self) -> bool:
        """Every process it tracked is reaped (no /proc entry with its
        identity; a zombie is not). Each queued its forks (in its own
        context, as it forked) before its exit, and that before the reaping:
        so once this holds, one more drain has read every fork the tree made."""
        for t in list(self.tracked):
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
        return not self.lost and self.failed is None and not self.unattributed

    def _resolve(self) -> None:
        """Forks of a suspect parent that were not born inside the run:
        another spawn of this process, or a fork the ledger cannot rule out
        as the tree's (its child left at once, or was gone before it could
        be read)."""
        with self._lock:
            self._drain()
            todo, self._unresolved = self._unresolved, []
        for pid, start, parent, where in todo:
            if start is not None and spawned_here(pid, start):
                continue
            self.unattributed.append({"pid": pid, "reported_parent": parent, "seen_in": where,
                                      "start_time": start})

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
        out: dict[str, Any] = {"tracked": len(self.tracked), "lost_events": self.lost, "failed": self.failed}
        if self.attributed:
            out["attributed_by_cgroup"] = self.attributed
        if self.unattributed:
            out["unattributed_forks"] = self.unattributed[:20]
            out["unattributed_count"] = len(self.unattributed)
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
                return
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
                elif what == PROC_EVENT_FORK:
                    self._on_fork(a, b, ts)
                else:
                    self._on_exit(a, ts)

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
            if ptgid not in self._suspects:
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
                self._unresolved.append((child, st0[4] if st0 else None, ptgid, where))
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
        self._live[child] = t
        self.tracked.append(t)
        self._kids.setdefault(ptgid, []).append(t)

    def _on_exit(self, tgid: int, ts: int) -> None:
        t = self._live.get(tgid)
        if t is not None:
            # Kept in _live: other threads of the process may still fork
            # (the leader can exit first). A reuse of the pid drops it.
            t.exit_seen = True
            # The exit event follows exit_notify (kernel/exit.c do_exit), so
            # its children have their new parent already: if that one is
            # outside the tree, its forks become suspects too.
            for kid in self._kids.pop(tgid, []):
                st = read_stat(kid.pid) if not kid.gone else None
                if st is None or st[4] != kid.start_time:
                    continue
                kid.ppid = st[1]
                self._kids.setdefault(st[1], []).append(kid)
                if st[1] not in self._live:
                    self._suspects.add(st[1])
