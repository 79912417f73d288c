"""The owner loop's pieces on Linux (`_platform.host` here): the worker as
the owner watches it (`Root`), reaping orphans as child subreaper, the
owner's wake-ups (`Wakeups`) and the wait itself (`wait_ready`).
"""
from __future__ import annotations

import os
import select
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Sequence

class RootExit:
    """How the worker ended, as observed: its status (None where it could
    not be known) and the `root_exit` evidence layer saying how."""

    __slots__ = ("how", "exit_code", "signal", "layer")

    def __init__(self, how: str | None, exit_code: int | None, signal: int | None, layer: dict[str, Any]) -> None:
        self.how = how          # "exited", "signaled", or None (status unknown)
        self.exit_code = exit_code
        self.signal = signal
        self.layer = layer


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
        from .._record import evidence

        if self.adopted:
            p = select.poll()
            p.register(self.pidfd, select.POLLIN)
            if not p.poll(0):
                return None
            self.close()
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

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def reap_orphans(root: Root | None) -> RootExit | None:
    """As child subreaper, reap whatever reparented to us. WNOWAIT first so
    the worker's own status is left for its pidfd (returned if it ended)."""
    ended = None
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return ended
        if info is None:
            return ended
        if root is not None and info.si_pid == root.pid and root.pidfd >= 0:
            ended = root.poll() or ended
            continue
        try:
            os.waitpid(info.si_pid, os.WNOHANG)
        except ChildProcessError:
            return ended


POLLIN, POLLPRI, POLLERR = select.POLLIN, select.POLLPRI, select.POLLERR


class Wakeups:
    """An owner's wake-ups besides the kernel's: a pipe for in-process
    callers and signal handlers (`wake()` is thread- and signal-safe), and the
    run directory's inbox FIFO, poked by any process that appends a cancel
    request. A FIFO rather than inotify on the inbox: closing an inotify fd
    that holds a watch waits for an SRCU grace period (0.1 to 24 ms here),
    and every run closes it (docs/performance.md)."""

    def __init__(self, layout: Any) -> None:
        self.r, self.w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.inbox_fd = -1
        self.problem: str | None = None    # why the inbox has no wake-up (it is then read on a timer)
        if layout is not None:
            try:
                self.inbox_fd = layout.open_wake()
            except OSError as e:
                self.problem = f"cancel wake-up FIFO unavailable ({e})"

    @property
    def inbox_woken(self) -> bool:
        return self.inbox_fd >= 0

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
