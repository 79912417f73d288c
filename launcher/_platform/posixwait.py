"""The owner loop's pieces on Linux (`_platform.host` here): the worker as
the owner watches it (`Root`), reaping orphans as child subreaper, the
owner's wake-ups (`Wakeups`) and the wait itself (`wait_ready`).
"""
from __future__ import annotations

import errno
import os
import select
from .. import _signals as signal
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable, Sequence

from .._procfs import read_stat
from .._record import evidence
from .exits import RootExit as RootExit
from .wall import InitClosed, InitEmpty, InitEvent, InitForwarded, InitNote, InitWorkerExit, read_init_events


# PIDFD_GET_INFO (linux/pidfd.h, 6.13; PIDFD_INFO_EXIT 6.15): the kernel's
# record of a process's exit, readable by any holder of its pidfd once it has
# been reaped, whoever reaped it. struct pidfd_info is 72 bytes with
# exit_code at offset 60; _IOWR(0xFF, 11, struct pidfd_info).
_PIDFD_INFO_EXIT = 1 << 3
_PIDFD_INFO_SIZE = 72
_PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11
_EXIT_VIA = "pidfd + PIDFD_GET_INFO(PIDFD_INFO_EXIT): the kernel's record of its exit"

# Whether this kernel keeps a reaped process's exit status for the holders
# of its pidfd (PIDFD_INFO_EXIT, Linux 6.15). Read from the release once: a
# kernel older than that, or one whose release cannot be read, keeps the
# wall's report socket open for the worker's status (the safe direction);
# one that names 6.15 or later but turns out to keep nothing (a worker
# reaped with no status on its pidfd) sets it False for the process.
_exit_info: bool | None = None


def kernel_keeps_exit_status() -> bool:
    global _exit_info
    if _exit_info is None:
        try:
            major, minor = (int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
            _exit_info = (major, minor) >= (6, 15)
        except (ValueError, OSError):
            _exit_info = False
    return _exit_info


def _no_exit_status_here() -> None:
    global _exit_info
    _exit_info = False

# A worker seen exited (its pidfd readable) whose init has not reaped it
# yet has no status for its pidfd (PIDFD_INFO_EXIT is kept at the reaping,
# not the exit): the init reaps at once on SIGCHLD, so it is looked at again
# this soon, then at twice the wait each time, up to the second bound (an
# init that cannot run: frozen, stopped).
_REAP_WAIT_S = 0.001
_REAP_RETRY_MAX_S = 0.5


def pidfd_exit_status(pidfd: int) -> int | None:
    """The wait status of a reaped process, from its pidfd; None while it is
    not reaped yet, or where the kernel cannot say (before 6.15)."""
    import fcntl
    import struct

    buf = bytearray(_PIDFD_INFO_SIZE)
    struct.pack_into("=Q", buf, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf)
    except OSError:
        return None
    mask = struct.unpack_from("=Q", buf, 0)[0]
    return struct.unpack_from("=i", buf, 60)[0] if mask & _PIDFD_INFO_EXIT else None


def exit_of(status: int, via: str) -> "RootExit":
    if os.WIFEXITED(status):
        return RootExit("exited", os.WEXITSTATUS(status), None,
                        evidence(True, via, {"exit_code": os.WEXITSTATUS(status)}))
    return RootExit("signaled", None, os.WTERMSIG(status), evidence(True, via, {"signal": os.WTERMSIG(status)}))


def _send_by_pidfd(pidfd: int, sig: int) -> bool:
    """`sig` to the process a pidfd pins (pidfd_send_signal(2): never to a
    pid reused since). False once there is nothing to send it to: the
    pidfd is closed (its end was taken) or the process is gone."""
    if pidfd < 0:
        return False
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        return False
    return True


class Root:
    """The worker, pinned by its pidfd. Our child: `waitid(P_PIDFD)` takes
    its status. Adopted (not our child): its pidfd polls readable on exit,
    but the status went to whoever reaped it (pidfd_open(2))."""

    def __init__(self, pid: int, pidfd: int, *, adopted: bool = False) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.adopted = adopted

    @classmethod
    def reattach(cls, identity: Any) -> "Root | None":
        """The worker of an adopted run, if this very process still lives."""
        try:
            fd = os.pidfd_open(identity.pid)
        except OSError:
            return None
        if identity.is_alive():
            return cls(identity.pid, fd, adopted=True)   # pinned: the pid cannot be reused now
        os.close(fd)
        return None

    def source(self) -> tuple[int, int] | None:
        return (self.pidfd, select.POLLIN) if self.pidfd >= 0 else None

    def poll(self) -> RootExit | None:
        """The worker's end if it has ended (then the pidfd is closed)."""
        if self.pidfd < 0:
            return None
        if self.adopted:
            p = select.poll()
            p.register(self.pidfd, select.POLLIN)
            if not p.poll(0):
                return None
            status = pidfd_exit_status(self.pidfd)
            self.close()
            if status is not None:
                return exit_of(status, f"pidfd readable (adopted: not our child); {_EXIT_VIA}")
            return RootExit(None, None, None, evidence(True, "pidfd readable (adopted: not our child)",
                                                       "exit status unknown: reaped by another process"))
        try:
            info = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            self.close()
            return RootExit(None, None, None, evidence(None, "waitid(P_PIDFD)",
                                                       "ECHILD: status taken by another waiter"))
        if info is None:
            return None
        self.close()
        if info.si_code == os.CLD_EXITED:
            return RootExit("exited", info.si_status, None, evidence(
                True, "pidfd readable + waitid(P_PIDFD)", {"exit_code": info.si_status}))
        return RootExit("signaled", None, info.si_status, evidence(
            True, "pidfd readable + waitid(P_PIDFD)", {"signal": info.si_status}))

    def send_signal(self, sig: int) -> bool:
        """`sig` to the worker itself, by its pidfd (the CLI's signal
        forwarding, _sigproxy.py). False once it has ended."""
        return _send_by_pidfd(self.pidfd, sig)

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def reap_tree_children(run: Any) -> RootExit | None:
    """The owner's reaping of the orphans that reparent to this process:
    `contain run` (sole: every child of its process is its run's) reaps
    every child; a library run on the subreaper wall, only the tree's (its
    process has children of its own); anything else, nothing. Returns the
    worker's end when the reaping took its status."""
    if run.opts.sole:
        return reap_orphans(run.root, keep=run.container.owns)
    reap = getattr(run.container, "reap", None)
    if reap is not None:
        reap(run.pid)
    return None


def reap_orphans(root: Any, keep: Callable[[int], bool] = lambda pid: False) -> RootExit | None:
    """As child subreaper, reap whatever reparented to us. WNOWAIT first so
    the worker's own status is left for its pidfd (returned if it ended),
    and a child `keep` names (a wall's init, which its container reaps) is
    left alone: the loop stops there."""
    ended = None
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return ended
        if info is None or keep(info.si_pid):
            return ended
        if isinstance(root, Root) and info.si_pid == root.pid and root.pidfd >= 0:
            ended = root.poll() or ended
            continue
        try:
            os.waitpid(info.si_pid, os.WNOHANG)
        except ChildProcessError:
            return ended


POLLIN, POLLPRI, POLLERR = select.POLLIN, select.POLLPRI, select.POLLERR


# -- behind the PID-namespace wall (wall.py, init.c) ----------------------------

class Init:
    """The wall's init as its owner sees it: pid 1 of the run's PID
    namespace. Its pidfd polls readable only once it is a zombie, which
    exit_notify makes it only after zap_pid_ns_processes saw every other
    member gone (kernel/exit.c, kernel/pid_namespace.c; init.c's header
    says what was measured): so `reaped()` is the kernel's word that the
    namespace is empty. What the init says on its socket (the worker's
    status, notes, CPU time) is its word only; emptiness never rests on it."""

    def __init__(self, pid: int, pidfd: int, report_fd: int, events: Sequence[InitEvent] = (), *,
                 adopted: bool = False, start_time: int | None = None) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.report_fd = report_fd
        self.adopted = adopted
        self.start_time = start_time          # read right after the clone (our unreaped child then)
        self.dormant = False                  # its pidfd closed while the worker runs (rest, wake)
        self.worker_status: int | None = None
        self.reported_empty: InitEmpty | None = None
        self.notes: list[str] = []
        self.forwarded: list[tuple[int, int]] = []
        self.reaped_at: float | None = None
        self.status: int | None = None        # the init's own wait status, when we reaped it
        self.rusage: Any = None               # its rusage then: every member it reaped
        self._absorb(events)

    @classmethod
    def adopt(cls, pid: int, start_time: int) -> "Init | None":
        """The init of a run whose owner is gone, by identity: None if that
        very process no longer exists (it was reaped: the namespace is
        empty). The caller must have checked that its pid namespace is the
        one the pid was recorded in. Raises OSError if it cannot tell."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        st = read_stat(pid)
        if st is None or st[4] != start_time:
            os.close(fd)
            return None          # the pid names another process now: ours was reaped
        return cls(pid, fd, -1, adopted=True)

    def identity(self) -> dict[str, Any]:
        st = read_stat(self.pid)
        return {"pid": self.pid, "start_time": st[4] if st else None}

    def _absorb(self, events: Sequence[InitEvent]) -> None:
        for ev in events:
            if isinstance(ev, InitWorkerExit) and self.worker_status is None:
                self.worker_status = ev.status
            elif isinstance(ev, InitEmpty):
                self.reported_empty = ev
            elif isinstance(ev, InitNote):
                self.notes.append(ev.text)
            elif isinstance(ev, InitForwarded):
                self.forwarded.append((ev.signal, ev.errno))
            elif isinstance(ev, InitClosed):
                self._close_report()

    def sources(self) -> list[tuple[int, int]]:
        return [(fd, POLLIN) for fd in (self.pidfd if self.reaped_at is None else -1, self.report_fd) if fd >= 0]

    def pump(self) -> None:
        """Take in what the init said since the last look (never blocks)."""
        if self.report_fd < 0:
            return
        try:
            self._absorb(read_init_events(self.report_fd))
        except OSError as e:
            self.notes.append(f"the init's socket: {e}")
            self._close_report()

    def reaped(self) -> bool:
        """Whether the init is gone (and so every member of the namespace)."""
        if self.reaped_at is not None:
            return True
        if self.dormant and not self.wake():
            return False
        if self.reaped_at is not None:
            return True
        if self.pidfd < 0:
            return False
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        if not p.poll(0):
            return False
        self.pump()
        self.reaped_at = time.time()
        if not self.adopted:
            try:
                # Our child, unreaped until now: its pid cannot have been reused.
                _pid, self.status, self.rusage = os.wait4(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.notes.append("the init was reaped by another waiter of this process")
        else:
            try:
                # Adopted, and our own child after all (a library run whose
                # owner loop gave up UNCONFIRMED, stopped later from the same
                # process): reaped by its pidfd, which names this very
                # process, rather than left a zombie of ours for ever.
                os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)
            except OSError:
                pass              # another process's child (ECHILD): its parent reaps it
        return True

    def signal(self, sig: int) -> None:
        """Raises ProcessLookupError once the init is gone, OSError when it
        cannot be pinned now (no descriptor)."""
        if self.dormant and not self.wake():
            raise OSError(errno.EMFILE, "the init's pidfd could not be opened again")
        if self.reaped_at is not None and self.pidfd < 0:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self.pidfd, sig)

    def kill(self) -> None:
        try:
            self.signal(signal.SIGKILL)
        except ProcessLookupError:
            pass

    def rest(self) -> None:
        """Close the init's pidfd while the worker runs: the worker's pidfd
        is what wakes the owner then (the init cannot end before the worker
        does: its death ends every member), so a live walled run holds one
        descriptor (issue 27). The init stays our unreaped child, so its pid
        names no other process until we reap it; wake() pins it again,
        checking its start time all the same (another waiter of this
        process may have reaped it)."""
        if self.adopted or self.start_time is None or self.pidfd < 0 or self.reaped_at is not None:
            return
        os.close(self.pidfd)
        self.pidfd = -1
        self.dormant = True

    def wake(self) -> bool:
        """Pin the init by pidfd again (before a signal, or once the worker
        ended and emptiness is what the owner waits for). False when no
        descriptor could be had for it now (it stays dormant: asked again
        at the next look); True otherwise, the init pinned or found gone
        (reaped by another waiter of this process: then the namespace was
        empty, which the kernel's reaping order proves)."""
        if not self.dormant:
            return True
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            self._gone_elsewhere()
            return True
        except OSError:
            return False
        st = read_stat(self.pid)
        if st is None or st[4] != self.start_time:
            os.close(fd)
            self._gone_elsewhere()
            return True
        self.pidfd, self.dormant = fd, False
        return True

    def _gone_elsewhere(self) -> None:
        self.dormant = False
        if self.reaped_at is None:
            self.reaped_at = time.time()
            self.notes.append("the init was reaped by another waiter of this process")

    def quiet(self) -> None:
        """Stop listening to the init once the worker runs: what it says
        afterwards (the worker's status, forwarding, its CPU time) is the
        kernel's to tell, through the worker's pidfd (PIDFD_INFO_EXIT) and
        our own reaping of the init (wait4's rusage), so its socket is one
        descriptor per live run that buys nothing (issue 27: at most two
        per run). What it sent up to now is taken in first."""
        self.pump()
        self._close_report()

    def _close_report(self) -> None:
        if self.report_fd >= 0:
            os.close(self.report_fd)
            self.report_fd = -1

    def close(self) -> None:
        self._close_report()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class WallRoot:
    """The worker behind the wall: not our child (its status comes from the
    init, which reaped it), pinned by the pidfd the init passed us."""

    def __init__(self, init: Init, pid: int, pidfd: int) -> None:
        self.init = init
        self.pid = pid
        self.pidfd = pidfd
        self._ended = False
        self._unwatched = False     # seen exited, not reaped within _REAP_WAIT_S: looked at on a timer
        self.due: float | None = None   # then, when to look again (monotonic): the owner's deadline
        self._backoff = _REAP_WAIT_S

    def source(self) -> tuple[int, int] | None:
        """While the init's socket is open, the container waits on it (the
        init reports the worker's exit after reaping it). Once the init is
        quiet (Init.quiet), the worker's own pidfd is what wakes us."""
        if self._ended or self._unwatched or self.init.report_fd >= 0 or self.pidfd < 0:
            return None
        return (self.pidfd, select.POLLIN)

    def _status(self) -> RootExit | None:
        kernel = pidfd_exit_status(self.pidfd) if self.pidfd >= 0 else None
        if kernel is None and self.init.report_fd < 0 and self.pidfd >= 0 and self._exited():
            kernel = self._await_reaping()
        if kernel is not None:
            self._end()
            return exit_of(kernel, f"the init reaped the worker; {_EXIT_VIA}")
        st = self.init.worker_status
        if st is not None and self._exited():
            self._end()
            return exit_of(st, "the PID namespace's init reaped the worker (its wait status, on the init's socket)")
        return None

    def _await_reaping(self) -> int | None:
        """The worker has exited (its pidfd polls readable) and the init,
        no longer heard, has not reaped it yet: the kernel keeps the status
        at the reaping. Never waited for in the loop (a stop of thousands
        of runs would wait for each in turn): the pidfd is no longer
        watched (it would poll readable for ever) and the worker is looked
        at again on a timer (`due`, from 1 ms backing off to
        _REAP_RETRY_MAX_S): the init does not end while another member
        lives, so its end alone could leave the worker's exit unnoticed
        till the owner's guard (60 s on the shared loop)."""
        got = pidfd_exit_status(self.pidfd)
        if got is not None:
            return got
        if self.init.reaped():
            # Every member is gone, the worker with them: reaped by now,
            # so its status is there, or this kernel keeps none, whatever
            # its release says.
            got = pidfd_exit_status(self.pidfd)
            if got is None:
                _no_exit_status_here()
            return got
        self._unwatched = True
        self.due = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, _REAP_RETRY_MAX_S)
        return None

    def _exited(self) -> bool:
        """Whether the kernel says the worker exited (its pidfd polls
        readable): the init's report alone is no proof, since a root member
        can take the init's socket (pidfd_getfd) and report an exit of a
        worker that lives on."""
        if self.pidfd < 0:
            return True          # nothing to check the init's word against
        p = select.poll()
        p.register(self.pidfd, select.POLLIN)
        return bool(p.poll(0))

    def poll(self) -> RootExit | None:
        """The kernel's record of the worker's exit first (it cannot be
        forged from inside); the init's report where the kernel has none."""
        if self._ended:
            return None
        self.init.pump()
        got = self._status()
        if got is not None:
            return got
        # A resting init (Init.rest) cannot have ended while the worker's
        # pidfd says it lives: asked only once the worker is seen gone.
        if (not self.init.dormant or self._exited()) and self.init.reaped():
            # reaped() read the socket once more: the init may have said
            # EXIT and exited between the look above and this one.
            got = self._status()
            if got is not None:
                return got
            self._end()
            return RootExit(None, None, None, evidence(
                True, "the PID namespace's init was reaped (every member is gone)",
                "exit status unknown: the init ended before it reported the worker's" if self.init.report_fd >= 0
                or self.init.worker_status is not None or not self._unwatched
                else "exit status unknown: the kernel kept none on the worker's pidfd"))
        return None

    def send_signal(self, sig: int) -> bool:
        """`sig` to the worker itself, by the pidfd the init passed us, from
        outside its namespace: it reaches the worker, not the init (which
        would forward it to every member, init.c). False once it has ended."""
        return False if self._ended else _send_by_pidfd(self.pidfd, sig)

    def _end(self) -> None:
        self._ended = True
        self.close()
        self.init.wake()        # the owner now waits for the init's end: the namespace empty

    def close(self) -> None:
        self.due = None           # nothing left to look at: no timer (a past one would spin the loop)
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class Wakeups:
    """An owner's wake-ups besides the kernel's: a pipe for in-process
    callers and signal handlers (`wake()` is thread- and signal-safe), and the
    run directory's inbox FIFO, poked by any process that appends a cancel
    request. A FIFO rather than inotify on the inbox: closing an inotify fd
    that holds a watch waits for an SRCU grace period (0.1 to 24 ms here),
    and every run closes it (docs/performance.md)."""

    # The inbox is read this often even with the FIFO: a worker that can
    # write its run directory may swap cancellations/wake for a FIFO of its
    # own, and the owner (holding the old one) would never hear a cancel.
    # One wake-up and one failed open every few seconds; no spin.
    FIFO_GUARD_S = 2.0
    # Watched by the shared loop's inotify instance instead, a swap of
    # cancellations/ is an event of its own (IN_MOVE_SELF, IN_DELETE_SELF,
    # IN_IGNORED: _reactor.py watches the new one): the timer is only a
    # safety net there. At 2 s it was the loop's whole load with many runs
    # (1,000 live runs: 500 turns a second, most of a CPU).
    WATCH_GUARD_S = 60.0

    @property
    def guard_s(self) -> float:
        return self.WATCH_GUARD_S if self.watched else self.FIFO_GUARD_S

    def __init__(self, layout: Any, *, container: Any = None, run_uid: str | None = None, pipe: bool = True) -> None:
        # (`container` and `run_uid`: what the Windows host needs, winhost.py.)
        # `pipe` False: the owner loop is shared (_reactor.py), which has one
        # pipe for every run and watches every inbox through one inotify
        # instance (`watched`): no pipe and no FIFO of the run's own.
        self.r, self.w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK) if pipe else (-1, -1)
        self.inbox_fd = -1
        self.watched = False
        self.waker: Callable[[], None] | None = None    # the shared loop's wake-up for this run
        self.problem: str | None = None    # why the inbox has no wake-up (it is then read on a timer)
        if layout is not None and pipe:
            try:
                self.inbox_fd = layout.open_wake()
            except OSError as e:
                self.problem = f"cancel wake-up FIFO unavailable ({e})"

    @property
    def inbox_woken(self) -> bool:
        return self.inbox_fd >= 0 or self.watched

    def sources(self) -> list[tuple[int, int]]:
        return [(fd, POLLIN) for fd in (self.inbox_fd, self.r) if fd >= 0]

    def drain(self, ready: Sequence[int]) -> None:
        for fd in ready:
            if fd >= 0 and fd in (self.r, self.inbox_fd):
                try:
                    while os.read(fd, 4096):
                        pass
                except (BlockingIOError, InterruptedError):
                    pass

    def wake(self) -> None:
        if self.waker is not None:
            self.waker()
            return
        if self.w < 0:
            return
        try:
            os.write(self.w, b"!")
        except OSError:
            pass

    def close(self) -> None:
        for fd in (self.r, self.w, self.inbox_fd):
            if fd >= 0:
                os.close(fd)
        self.r = self.w = self.inbox_fd = -1


def wait_ready(sources: Sequence[tuple[int, int]], timeout: float) -> list[int]:
    """Block until one of `sources` ((fd, poll events)) is ready or `timeout`
    seconds pass; the ready fds. Any finite timeout is honoured: poll's
    millisecond argument is clamped and the caller's loop comes back."""
    p = select.poll()
    for fd, events in sources:
        p.register(fd, events)
    if timeout == float("inf"):
        ms = None
    else:
        ms = min(max(0, int(timeout * 1000) + 1), 2**31 - 1)
    return [fd for fd, _ in p.poll(ms)]
