"""Spawning through the C extension, and the errors it reports."""
from __future__ import annotations

import errno
import os
import select
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Sequence

from .._errors import SpawnFailed
from .._native import ffi, lib

_STAGES = {
    lib.CT_STAGE_CLONE: "clone",
    lib.CT_STAGE_BIRTH: "birth",
    lib.CT_STAGE_HOLD: "hold",
    lib.CT_STAGE_STDIO: "stdio",
    lib.CT_STAGE_CHDIR: "chdir",
    lib.CT_STAGE_PGROUP: "setsid/setpgid",
    lib.CT_STAGE_SEAL: "seal",
    lib.CT_STAGE_CAPS: "drop capabilities",
    lib.CT_STAGE_CREDS: "set credentials",
    lib.CT_STAGE_EXEC: "exec",
}


class CloneUnsupported(Exception):
    """clone3 or CLONE_INTO_CGROUP is not available: use the held fallback."""


class DiedAtBirth(Exception):
    """The child was killed before running any of our code."""


class SpawnRequest:
    __slots__ = ("argv", "env", "cwd", "stdio", "new_pgroup", "new_session", "uid", "gid",
                 "groups", "seal_ro_paths", "drop_caps", "no_new_privs", "seal_cg2_paths",
                 "seal_userns", "keep_ignored")

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                 stdio: tuple[int, int, int] = (-1, -1, -1), new_pgroup: bool = False,
                 new_session: bool = False, uid: int = -1, gid: int = -1, groups: Sequence[int] = (),
                 seal_ro_paths: Sequence[str] | None = None, drop_caps: Sequence[int] = (),
                 no_new_privs: bool = False, seal_cg2_paths: Sequence[str] = (),
                 seal_userns: bool = False) -> None:
        if not argv:
            raise ValueError("argv must not be empty")
        self.argv = [os.fsdecode(a) for a in argv]
        self.env = dict(os.environ) if env is None else env
        self.cwd = cwd
        self.stdio = stdio
        self.new_pgroup = new_pgroup
        self.new_session = new_session
        self.uid = uid
        self.gid = gid
        self.groups = list(groups)
        self.seal_ro_paths = seal_ro_paths    # None: no seal
        self.drop_caps = list(drop_caps)
        self.no_new_privs = no_new_privs
        self.seal_cg2_paths = list(seal_cg2_paths)   # replaced by the run's own view (seal.c)
        self.seal_userns = seal_userns
        # Signals the worker starts with SIG_IGN (the caller's ignored set);
        # every other disposition starts at SIG_DFL. The C spawn takes this
        # from the native rework on; until then it keeps every inherited
        # SIG_IGN but SIGPIPE and SIGXFSZ, which is the same set here.
        self.keep_ignored: list[int] = []


class Spawned:
    __slots__ = ("pid", "pidfd", "via")

    def __init__(self, pid: int, pidfd: int, via: str = "") -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.via = via


def candidates(argv0: str, env: dict[str, str]) -> list[str]:
    """What execvpe would try, in order (the search itself runs in the child)."""
    if "/" in argv0:
        return [argv0]
    return [os.path.join(d or ".", argv0) for d in os.get_exec_path(env)]


def _cstrs(items: Sequence[str], keep: list[Any]) -> Any:
    cs = [ffi.new("char[]", os.fsencode(s)) for s in items]
    arr = ffi.new("char*[]", cs + [ffi.NULL])
    keep.extend(cs)
    keep.append(arr)   # cffi struct fields hold no reference: keep the array alive
    return arr


def _args(req: SpawnRequest, cgroup_fd: int, hold: bool, keep: list[Any]) -> Any:
    a = ffi.new("struct ct_spawn_args*")
    paths = candidates(req.argv[0], req.env)
    a.paths = _cstrs(paths, keep)
    a.npaths = len(paths)
    a.argv = _cstrs(req.argv, keep)
    a.envp = _cstrs([f"{k}={v}" for k, v in req.env.items()], keep)
    if req.cwd is not None:
        cwd = ffi.new("char[]", os.fsencode(req.cwd))
        keep.append(cwd)
        a.cwd = cwd
    a.cgroup_fd = cgroup_fd
    a.hold = 1 if hold else 0
    a.stdio = list(req.stdio)
    a.new_pgroup = int(req.new_pgroup)
    a.new_session = int(req.new_session)
    a.uid = req.uid
    a.gid = req.gid
    if req.groups:
        g = ffi.new("unsigned int[]", req.groups)
        keep.append(g)
        a.groups = g
    a.ngroups = len(req.groups)
    if req.seal_ro_paths is not None:
        a.seal = 1
        a.ro_paths = _cstrs(req.seal_ro_paths, keep)
        a.nro = len(req.seal_ro_paths)
        a.cg2_paths = _cstrs(req.seal_cg2_paths, keep)
        a.ncg2 = len(req.seal_cg2_paths)
        a.userns = int(req.seal_userns)
    if req.drop_caps:
        caps = ffi.new("int[]", req.drop_caps)
        keep.append(caps)
        a.drop_caps = caps
        a.ndrop = len(req.drop_caps)
    a.no_new_privs = int(req.no_new_privs)
    keep.append(a)
    return a


def _raise(rc: int, r: Any, req: SpawnRequest, cgroup: bool) -> None:
    err = -rc
    stage = _STAGES.get(r.stage, "spawn")
    if r.stage == lib.CT_STAGE_CLONE and cgroup and err in (errno.ENOSYS, errno.E2BIG, errno.EINVAL):
        raise CloneUnsupported(os.strerror(err))
    if r.stage == lib.CT_STAGE_BIRTH:
        raise DiedAtBirth()
    what = req.argv[0]
    if stage == "exec":
        msg = f"{what}: {'command not found' if err in (errno.ENOENT, errno.ENOTDIR) else os.strerror(err)}"
    else:
        msg = f"{what}: {stage} failed: {os.strerror(err)}"
    raise SpawnFailed(msg, errno=err, stage=stage, path=what)


def spawn(req: SpawnRequest, cgroup_fd: int = -1) -> Spawned:
    keep: list[Any] = []
    a = _args(req, cgroup_fd, False, keep)
    r = ffi.new("struct ct_spawn_result*")
    rc = lib.ct_spawn(a, r)
    if rc < 0:
        _raise(rc, r, req, cgroup_fd >= 0)
    return Spawned(r.pid, r.pidfd)


class Held:
    """A child stopped before exec, for placement by cgroup.procs."""

    def __init__(self, req: SpawnRequest, keep: list[Any], r: Any) -> None:
        self._req = req
        self._keep = keep
        self._r = r
        self.pid: int = r.pid

    def release(self) -> Spawned:
        rc = lib.ct_spawn_finish(self._r)
        if rc < 0:
            _raise(rc, self._r, self._req, False)
        return Spawned(self._r.pid, self._r.pidfd)

    def abort(self) -> None:
        """Kill the held child (it has run none of the worker's code) and reap it."""
        import signal

        try:
            signal.pidfd_send_signal(self._r.pidfd, signal.SIGKILL)
            os.waitid(os.P_PIDFD, self._r.pidfd, os.WEXITED)
        except OSError:
            pass
        for fd in (self._r.pidfd, self._r.err_fd, self._r.hold_fd):
            if fd >= 0:
                os.close(fd)


def spawn_held(req: SpawnRequest) -> Held:
    keep: list[Any] = []
    a = _args(req, -1, True, keep)
    r = ffi.new("struct ct_spawn_result*")
    rc = lib.ct_spawn(a, r)
    if rc < 0:
        _raise(rc, r, req, False)
    return Held(req, keep, r)


# -- the owner's view of the worker and its wake-ups ---------------------------

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
