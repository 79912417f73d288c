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
import struct
import threading
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable

from ._identity import boot_id
from ._procfs import cgroup_of, read_stat


NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_NONE = 0x0
PROC_EVENT_FORK = 0x1
PROC_EVENT_EXIT = 0x80000000
NLMSG_DONE = 3
NLMSG_ERROR = 2

_NLMSGHDR = struct.Struct("=IHHII")       # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")        # idx, val, seq, ack, len, flags
_EVENT = struct.Struct("=IIQ")            # what, cpu, timestamp_ns (CLOCK_MONOTONIC)
_FORK = struct.Struct("=IIII")            # parent_pid, parent_tgid, child_pid, child_tgid
_EXIT = struct.Struct("=II")              # process_pid, process_tgid (exit code etc. follow)
_ACK = struct.Struct("=I")                # err
_HDR = _NLMSGHDR.size + _CN_MSG.size      # 36: where the proc_event starts
_DATA = _HDR + _EVENT.size                # 52: where the event's data starts

VIA = "fork ledger (netlink process connector)"
_COALESCE_S = 0.002

# Every worker this process spawned, as (pid, start time): a fork reported as
# a child of this process is one of these, or it is not ours to explain.
_OUR_SPAWNS: set[tuple[int, int]] = set()


def note_spawn(pid: int, start_time: int) -> None:
    """Called right after each spawn of this process (any run)."""
    _OUR_SPAWNS.add((pid, start_time))


class LedgerUnavailable(Exception):
    """The process connector cannot be used here; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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
        try:
            sock = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC, NETLINK_CONNECTOR)
        except OSError as e:
            raise LedgerUnavailable(f"socket(AF_NETLINK, NETLINK_CONNECTOR): {os.strerror(e.errno or 0)}") from e
        try:
            _bigger_buffer(sock)
            try:
                sock.bind((0, CN_IDX_PROC))
            except OSError as e:
                raise LedgerUnavailable(f"bind to the process connector: {os.strerror(e.errno or 0)}") from e
            token = (os.getpid() << 8 ^ time.monotonic_ns()) & 0x7FFFFFFF
            # The unfiltered form (4 bytes) is the one every kernel acks;
            # the acknowledgement is itself an event, which a filter drops.
            _control(sock, struct.pack("=I", PROC_CN_MCAST_LISTEN), token)
            err = _wait_ack(sock, token, ack_timeout)
            if err is None:
                raise LedgerUnavailable("the process connector did not acknowledge (another PID or user "
                                        "namespace than the initial one?)")
            if err:
                raise LedgerUnavailable(f"process connector refused to listen: {os.strerror(err)}")
            # Since 6.6 a listener may ask for some events only: forks and
            # exits are all the ledger reads. Older kernels ignore this form.
            _control(sock, struct.pack("=II", PROC_CN_MCAST_LISTEN, PROC_EVENT_FORK | PROC_EVENT_EXIT), token + 2)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

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

    def live(self) -> list[Tracked]:
        """Tracked processes that are alive now (identity checked)."""
        self.sync()
        return [t for t in list(self.tracked) if t.alive()]

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
            if start is not None and (pid, start) in _OUR_SPAWNS:
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
            off = 0
            while off + _DATA <= n:
                ln = _NLMSGHDR.unpack_from(buf, off)[0]
                if ln < _DATA or off + ln > n:
                    break
                what, _cpu, ts = _EVENT.unpack_from(buf, off + _HDR)
                if what == PROC_EVENT_FORK and ln >= _DATA + _FORK.size:
                    _pp, ptgid, cpid, ctgid = _FORK.unpack_from(buf, off + _DATA)
                    if cpid == ctgid:                      # a process, not a thread
                        if self._root is None:
                            self._pending.append((what, ptgid, ctgid, ts))
                        else:
                            self._on_fork(ptgid, ctgid, ts)
                elif what == PROC_EVENT_EXIT and ln >= _DATA + _EXIT.size:
                    pid, tgid = _EXIT.unpack_from(buf, off + _DATA)
                    if pid == tgid:
                        if self._root is None:
                            self._pending.append((what, tgid, 0, ts))
                        else:
                            self._on_exit(tgid, ts)
                off += (ln + 3) & ~3

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
            if where is None or self.inside is None or not self.inside(where):
                st0 = read_stat(child)
                self._unresolved.append((child, st0[4] if st0 else None, ptgid, where))
                return
            self.attributed += 1
            note = f"born in the run's cgroup; reported parent {ptgid} is outside the tree (CLONE_PARENT)"
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


def _bigger_buffer(sock: _socket.socket) -> None:
    """A fork storm on the host must not overflow the queue between two
    drains: ask for 8 MiB (SO_RCVBUFFORCE needs CAP_NET_ADMIN)."""
    size = 8 << 20
    try:
        sock.setsockopt(_socket.SOL_SOCKET, 33, size)      # SO_RCVBUFFORCE
    except OSError:
        try:
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVBUF, size)
        except OSError:
            pass


def _control(sock: _socket.socket, payload: bytes, token: int) -> None:
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, token, token, len(payload), 0) + payload
    sock.sendto(_NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, token, os.getpid()) + cn, (0, 0))


def _wait_ack(sock: _socket.socket, token: int, timeout: float) -> int | None:
    """The err of our acknowledgement (ack == token + 1), None on timeout.
    Acknowledgements go to every listener: ours is the one with our token."""
    deadline = time.monotonic() + timeout
    buf = bytearray(64 * 1024)
    p = select.poll()
    p.register(sock.fileno(), select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not p.poll(int(left * 1000) + 1):
            return None
        try:
            n = sock.recv_into(buf)
        except OSError as e:
            if e.errno in (errno.ENOBUFS, errno.EINTR):
                continue
            raise LedgerUnavailable(f"recv: {os.strerror(e.errno or 0)}") from e
        off = 0
        while off + _DATA <= n:
            ln, typ = _NLMSGHDR.unpack_from(buf, off)[:2]
            if ln < _HDR:
                break
            if typ == NLMSG_ERROR:
                err = -struct.unpack_from("=i", buf, off + 16)[0]
                if err:
                    return err
            else:
                _idx, _val, _seq, ack = _CN_MSG.unpack_from(buf, off + _NLMSGHDR.size)[:4]
                what = _EVENT.unpack_from(buf, off + _HDR)[0]
                if what == PROC_EVENT_NONE and ack == token + 1:
                    return int(_ACK.unpack_from(buf, off + _DATA)[0])
            off += (ln + 3) & ~3
