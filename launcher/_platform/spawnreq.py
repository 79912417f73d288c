"""What a spawn is asked to do and what it reports: the request, the result,
the errors, and the C arguments built from them (posix.py spawns; wall.py
spawns behind the PID-namespace wall). The rules for what a worker inherits
are in posix.py's docstring.
"""
from __future__ import annotations

import errno
import os
from .. import _signals as _signal
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable, Iterable, Sequence

    from .wall import InitEvent

from .._errors import SpawnFailed
from .._native import ffi, lib

_STAGES = {
    lib.CT_STAGE_CLONE: "clone",
    lib.CT_STAGE_BIRTH: "birth",
    lib.CT_STAGE_START: "start",
    lib.CT_STAGE_JOIN: "placement",
    lib.CT_STAGE_STDIO: "stdio",
    lib.CT_STAGE_CHDIR: "chdir",
    lib.CT_STAGE_PGROUP: "setsid/setpgid",
    lib.CT_STAGE_SEAL: "seal",
    lib.CT_STAGE_CAPS: "drop capabilities",
    lib.CT_STAGE_CREDS: "set credentials",
    lib.CT_STAGE_FDS: "descriptors",
    lib.CT_STAGE_SIGNALS: "signal mask",
    lib.CT_STAGE_EXEC: "exec",
    lib.CT_STAGE_VERIFY: "exec check",
    lib.CT_STAGE_USERNS: "user namespace",
    lib.CT_STAGE_INIT: "pid namespace init",
    lib.CT_STAGE_FORK: "fork in the pid namespace",
}

# Ignored by CPython itself at start-up (Python/pylifecycle.c), or never to
# be handed on (see the module docstring).
NEVER_KEPT = frozenset({_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGCHLD})

SHELL = "/bin/sh"


class CloneUnsupported(Exception):
    """clone3 or CLONE_INTO_CGROUP is not available: use the join fallback."""


def clone3_refused() -> str | None:
    """Why this process starts children with the legacy clone (clone.c:
    Docker's default seccomp profile answers clone3 with ENOSYS, older
    profiles with EPERM, kernels before 5.3 have none), or None while
    clone3 works. Found at the first refused clone3, kept for the process."""
    e = lib.ct_clone3_refused()
    if e == 0:
        return None
    return f"clone3 refused with {errno.errorcode.get(e, str(e))}: a seccomp filter, or a kernel without it"


def clone_call(*flags: str) -> str:
    """The system call that starts a child here, with `flags`, as the
    record says it: clone3, or the legacy clone and why."""
    why = clone3_refused()
    call = f"{'clone' if why else 'clone3'}({'|'.join(flags)})"
    return f"{call} ({why})" if why else call


class DiedAtBirth(Exception):
    """The child was killed before running any of our code."""


class BadInterpreter(SpawnFailed):
    """The file exists but execve says ENOENT: its #! interpreter (or ELF
    loader) is missing. Found but not runnable: 126, as POSIX shells say
    for a command that was found and cannot be executed."""

    @property
    def exit_code(self) -> int:
        return 126


class KilledBeforeExec(SpawnFailed):
    """The child died of a signal after our code began and before execve
    completed. `exit_code` is what a shell reports for a child killed by
    that signal."""

    def __init__(self, message: str, *, signal: int, stage: str, path: str = "") -> None:
        super().__init__(message, errno=errno.ECANCELED, stage=stage, path=path)
        self.signal = signal

    @property
    def exit_code(self) -> int:
        return 128 + self.signal


def _mask(signals: Iterable[int]) -> int:
    m = 0
    for s in signals:
        if not 1 <= s <= 64:
            raise ValueError(f"not a signal number: {s}")
        m |= 1 << (s - 1)
    return m


def ignored_signals() -> frozenset[int]:
    """Every signal whose disposition in this process is SIG_IGN now (as
    the kernel has it, whoever set it)."""
    m = int(lib.ct_sig_ignored_mask())
    return frozenset(s for s in range(1, 65) if m >> (s - 1) & 1)


def keep_ignored_now() -> frozenset[int]:
    """What a worker spawned now keeps ignored: this process's ignored
    signals minus SIGPIPE, SIGXFSZ and SIGCHLD."""
    return ignored_signals() - NEVER_KEPT


def caller_ignored_signals() -> frozenset[int]:
    """For the CLI, at start-up and before it installs any handler: what
    its caller chose to ignore (nohup's SIGHUP, a shell's SIGINT for a
    background job), to keep ignored in the worker and not to cancel on.
    SIGPIPE and SIGXFSZ are not the caller's word (the interpreter ignored
    them before any of our code ran) and SIGCHLD is never kept."""
    return keep_ignored_now()


def inherited_fds() -> list[int]:
    """For the CLI, at start-up: the descriptors >= 3 it was given without
    close-on-exec (every descriptor Python opens is close-on-exec, PEP 446),
    to pass on to the worker as `env` and `timeout` would."""
    import fcntl

    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd < 3:
            continue
        try:
            if not fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC:
                out.append(fd)
        except OSError:
            continue    # the listing's own descriptor, closed by now
    return sorted(out)


_worker_nofile: tuple[int, int] | None = None


def raise_own_limit() -> None:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit, as systemd
    does for itself (`contain run` owns its process; the library never
    does this to a caller), while every worker it spawns still starts with
    the limits this process had (set in the child before exec)."""
    global _worker_nofile
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):
        return                         # kept as it was: check_spawn counts against it
    _worker_nofile = (soft, hard)


def worker_nofile() -> tuple[int, int] | None:
    """The RLIMIT_NOFILE a worker is started with, where it differs from
    this process's own (raise_own_limit); None: inherited."""
    return _worker_nofile


class SpawnRequest:
    __slots__ = ("argv", "env", "cwd", "stdio", "new_pgroup", "new_session", "uid", "gid",
                 "groups", "drop_caps", "no_new_privs", "keep_ignored", "pass_fds", "shell", "clear_caps",
                 "pidns", "userns", "uid_map", "gid_map", "mount_proc", "die_with_parent", "join_fds", "worker_joins", "on_init",
                 "hide", "owner_pidfd")

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                 stdio: tuple[int, int, int] = (-1, -1, -1), new_pgroup: bool = False,
                 new_session: bool = False, uid: int = -1, gid: int = -1, groups: Sequence[int] = (),
                 drop_caps: Sequence[int] = (), no_new_privs: bool = False,
                 keep_ignored: Iterable[int] | None = None,
                 pass_fds: Iterable[int] = (), shell: str | None = SHELL,
                 clear_caps: bool = False, pidns: bool = False, userns: str | None = None,
                 uid_map: str | None = None, gid_map: str | None = None, mount_proc: bool = False,
                 die_with_parent: bool = False) -> None:
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
        self.drop_caps = list(drop_caps)
        self.no_new_privs = no_new_privs
        # None: what this process ignores now, minus NEVER_KEPT (the library's rule)
        self.keep_ignored = keep_ignored_now() if keep_ignored is None else frozenset(keep_ignored) - NEVER_KEPT
        fds = [int(fd) for fd in pass_fds]
        if any(fd < 0 for fd in fds):
            raise ValueError("pass_fds: negative descriptor")
        self.pass_fds = sorted({fd for fd in fds if fd > 2})   # 0..2 are stdio's
        self.shell = shell         # ENOEXEC: run the file with this, as execvp does (None: don't)
        self.clear_caps = clear_caps
        # The PID-namespace wall (init.c): the worker is forked by an init of
        # ours at pid 1 of a new PID namespace. userns: None (a root caller),
        # "self" (the caller's euid/egid mapped to themselves: for callers
        # without root), "map" (uid_map/gid_map, e.g. "0 61184 1", written by
        # this process: root makes the worker root of the namespace and an
        # unprivileged uid outside it). mount_proc: a mount namespace with
        # every mount private and a /proc of the new namespace.
        if userns not in (None, "self", "map"):
            raise ValueError(f"userns must be None, 'self' or 'map', not {userns!r}")
        if userns is not None and not pidns:
            raise ValueError("userns needs pidns (it is the wall's user namespace)")
        if userns == "map" and not (uid_map and gid_map):
            raise ValueError("userns 'map' needs uid_map and gid_map")
        self.pidns = pidns
        self.userns = userns
        self.uid_map = uid_map
        self.gid_map = gid_map
        self.mount_proc = mount_proc
        self.die_with_parent = die_with_parent
        # With mount_proc: a directory the worker must not reach (the state
        # directory of a run whose worker has the caller's own uid): the
        # init mounts an empty tmpfs over it in the run's mount namespace.
        self.hide: str | None = None
        # More cgroup.procs fds the child (or the wall's init) joins before
        # the worker's first instruction: the run's v1 cgroups (_usage.py).
        self.join_fds: list[int] = []
        # Behind the wall: the last this many of join_fds are the worker's to
        # join before exec, not the init's (the run's v1 pids cgroup).
        self.worker_joins = 0
        # Behind the wall: called with the init's pid right after its clone,
        # before the init does anything for the worker (it waits for the
        # go). The run describes the init durably here, so an owner killed
        # at any later point leaves a wall its adopter can find. An exception
        # kills the init and fails the spawn.
        self.on_init: Callable[[int, int | None, int | None], None] | None = None   # (pid, start time, pid ns inode)
        # Behind the wall: die with the owner (--die-with-owner). A pidfd of
        # this process, which the init polls beside its signals and exits on
        # (wall.owner_pidfd; init.c). -1: the tree outlives its owner.
        self.owner_pidfd = -1


class Spawned:
    """A started worker. Without a wall, `pidfd` is our child's (waitid
    works). With the PID-namespace wall (`wall == "pidns"`), `pid`/`pidfd`
    are the worker's (not our child: its pidfd polls readable when it exits,
    and its status comes as an `InitWorkerExit` event), `init_pid`/
    `init_pidfd` the init's (our child: reaped means the namespace is
    empty), `report_fd` the init's message socket (nonblocking: read with
    `read_init_events` when it polls readable), and `events` what the init
    said before `spawn` returned (notes, or even the worker's exit)."""

    __slots__ = ("pid", "pidfd", "via", "wall", "init_pid", "init_pidfd", "report_fd", "events", "start_time",
                 "init_ns", "init_start")

    def __init__(self, pid: int, pidfd: int, via: str = "", *, wall: str | None = None,
                 init_pid: int = -1, init_pidfd: int = -1, report_fd: int = -1,
                 events: list[InitEvent] | None = None, start_time: int | None = None) -> None:
        self.start_time = start_time     # the worker's, when the spawn learned it (the wall's init)
        self.pid = pid
        self.pidfd = pidfd
        self.via = via
        self.wall = wall
        self.init_pid = init_pid
        self.init_pidfd = init_pidfd
        self.report_fd = report_fd
        self.events: list[InitEvent] = events if events is not None else []
        self.init_ns: int | None = None   # the wall's PID namespace (inode), read while the init waited
        self.init_start: int | None = None   # the init's start time, read right after the clone


def candidates(argv0: str, env: dict[str, str]) -> list[str]:
    """What execvpe would try, in order (the search itself runs in the child).
    An empty name is no search (execvp(3): ENOENT), not each PATH directory
    tried as the program."""
    if "/" in argv0 or not argv0:
        return [argv0]
    return [os.path.join(d or ".", argv0) for d in os.get_exec_path(env)]


def _cstrs(items: Sequence[str], keep: list[Any]) -> Any:
    """A NULL-terminated char*[] of `items`, all in one buffer (one
    allocation, not one per string: the worker's environment is forty of
    them, 30 us less a spawn)."""
    bs = [os.fsencode(s) for s in items]
    buf = ffi.new("char[]", b"\0".join(bs) + b"\0")
    base = ffi.cast("char*", buf)
    ptrs = []
    off = 0
    for b in bs:
        ptrs.append(base + off)
        off += len(b) + 1
    ptrs.append(ffi.NULL)
    arr = ffi.new("char*[]", ptrs)
    keep.append(buf)
    keep.append(arr)   # cffi struct fields hold no reference: keep the buffer and the array alive
    return arr


def _ints(ctype: str, items: Sequence[int], keep: list[Any]) -> Any:
    arr = ffi.new(ctype, list(items))
    keep.append(arr)
    return arr


def spawn_args(req: SpawnRequest, cgroup_fd: int, join_fds: Sequence[int], expect_cgroup: Sequence[str],
          keep: list[Any]) -> Any:
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
    if join_fds:
        a.join_fds = _ints("int[]", join_fds, keep)
        a.njoin = len(join_fds)
    if expect_cgroup:
        a.cg_expect = _cstrs(expect_cgroup, keep)
        a.ncg_expect = len(expect_cgroup)
    a.stdio = list(req.stdio)
    a.new_pgroup = int(req.new_pgroup)
    a.new_session = int(req.new_session)
    a.uid = req.uid
    a.gid = req.gid
    if req.groups:
        a.groups = _ints("unsigned int[]", req.groups, keep)
    a.ngroups = len(req.groups)
    if req.drop_caps:
        a.drop_caps = _ints("int[]", req.drop_caps, keep)
        a.ndrop = len(req.drop_caps)
    a.no_new_privs = int(req.no_new_privs)
    a.clear_caps = int(req.clear_caps)
    a.path_search = int(bool(req.argv[0]) and "/" not in req.argv[0])     # candidates() searched PATH
    a.sig_ignore = _mask(req.keep_ignored)
    nofile = worker_nofile()
    if nofile is not None:
        import resource

        a.set_nofile = 1
        a.nofile_cur, a.nofile_max = (2**64 - 1 if v == resource.RLIM_INFINITY else v for v in nofile)
    if req.pass_fds:
        a.pass_fds = _ints("int[]", req.pass_fds, keep)
        a.npass = len(req.pass_fds)
    if req.shell:
        sh = ffi.new("char[]", os.fsencode(req.shell))
        keep.append(sh)
        a.shell = sh
        # slot 1 is the candidate, filled in by the child
        a.shell_argv = _cstrs(["sh", req.argv[0], *req.argv[1:]], keep)
    keep.append(a)
    return a


def _interpreter(path: str) -> str | None:
    """The #! line's interpreter of `path`, for a message only."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].strip()
    return os.fsdecode(line.split()[0]) if line else ""


def raise_failure(rc: int, r: Any, req: SpawnRequest, paths: Sequence[str], cgroup: bool) -> None:
    err = -rc
    stage = _STAGES.get(r.stage, "spawn")
    if r.stage == lib.CT_STAGE_CLONE and cgroup and err in (errno.ENOSYS, errno.E2BIG, errno.EINVAL):
        raise CloneUnsupported(os.strerror(err))
    if r.stage == lib.CT_STAGE_BIRTH:
        raise DiedAtBirth()
    what = req.argv[0]
    if r.signal and not r.child_errno:
        name = _signal.signal_name(r.signal)
        raise KilledBeforeExec(f"{what}: killed by {name} (signal {r.signal}) before exec, "
                               f"during {stage}", signal=r.signal, stage=stage, path=what)
    if stage == "exec":
        path = paths[r.candidate] if 0 <= r.candidate < len(paths) else what
        if err == errno.ENOENT and r.candidate >= 0:
            interp = _interpreter(path)
            if interp is not None:
                raise BadInterpreter(f"{path}: {interp}: bad interpreter: No such file or directory",
                                     errno=err, stage=stage, path=path)
            raise BadInterpreter(f"{path}: cannot execute: required file not found",
                                 errno=err, stage=stage, path=path)
        if err in (errno.ENOENT, errno.ENOTDIR):
            raise SpawnFailed(f"{what}: command not found", errno=err, stage=stage, path=what)
        raise SpawnFailed(f"{path}: {os.strerror(err)}", errno=err, stage=stage, path=path)
    raise SpawnFailed(f"{what}: {stage} failed: {os.strerror(err)}", errno=err, stage=stage, path=what)




def close_fds(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)
