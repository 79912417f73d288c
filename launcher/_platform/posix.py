"""Spawning through the C extension, and the errors it reports.

What the worker inherits is decided here, not in C (spawn.c only does what
the request says):

- Signals. The worker starts with an empty signal mask, whatever the
  calling thread blocks, and every disposition at SIG_DFL except the set
  `SpawnRequest.keep_ignored`, which stays SIG_IGN. The rule the driver
  follows to fill it: what the supervisor's own caller chose to ignore stays
  ignored, as across any exec (`nohup contain run ...` keeps SIGHUP
  ignored); what Python itself ignores (SIGPIPE, SIGXFSZ, set by the
  interpreter at start-up) is restored, as `subprocess`'s
  `restore_signals` does; and an ignored SIGCHLD is never handed on (a
  library caller that ignores it for its own reasons would otherwise give
  the worker auto-reaped children, and `wait` in a shell would fail).
  `keep_ignored_now()` computes the set for a library caller from the
  dispositions at the time of the spawn; the CLI calls
  `caller_ignored_signals()` once at start-up, before it installs any
  handler, and passes that set (and should not install a cancelling
  handler over a signal its caller ignored).
- Descriptors. Every descriptor >= 3 is closed at exec except
  `SpawnRequest.pass_fds`, which stay open (made inheritable in the child,
  even if close-on-exec here), like `subprocess`'s `pass_fds`. The CLI
  calls `inherited_fds()` at start-up to pass on what its own caller handed
  it without close-on-exec (`<(...)`, `3<file`, make's jobserver), as `env`
  and `timeout` do.
- Exec follows execvp: the candidates of a PATH search in order, a file
  the kernel will not run (ENOEXEC) run by /bin/sh, and a file that exists
  but whose interpreter does not is "bad interpreter" (126), not "command
  not found".
- Spawned means exec'd: `spawn` returns once the kernel shows the child
  running the program (spawn.c says how), and a child that died before
  that is a failed spawn (`KilledBeforeExec` when a signal did it,
  `DiedAtBirth` when it never ran our code).

The PID-namespace wall (`SpawnRequest(pidns=True)`, init.c): the worker is
forked by an init of ours at pid 1 of a new PID namespace. `Spawned.pid`/
`pidfd` are then the worker's (not our child), `init_pid`/`init_pidfd` the
init's (our child), `report_fd` its message socket. The driver's side:
- wait on `report_fd` and `init_pidfd` together; `read_init_events` turns
  what the init said into typed events (`InitWorkerExit` carries the
  worker's status: its pidfd cannot be waited for);
- stop: SIGTERM to the init (`pidfd_send_signal(init_pidfd, ...)`; it
  forwards to every member, then SIGCONT), then SIGKILL to the init (and
  cgroup.kill where there is a cgroup): the kernel kills every member and
  holds the init's exit until they are gone;
- emptiness: the init reaped (`waitid` on `init_pidfd`; `os.wait4` on
  `init_pid` also gives the whole tree's CPU, as `InitEmpty` does when the
  init exits by itself). An adopter that is not the parent waits for
  `pidfd_open(init_pid)` to poll readable. `InitEmpty` alone is the init's
  word, not the kernel's: with a worker that is real root (no user
  namespace) a member can reach the init (ptrace) and speak for it.
"""
from __future__ import annotations

import errno
import os
import select
import signal as _signal
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Iterable, Sequence

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


class SpawnRequest:
    __slots__ = ("argv", "env", "cwd", "stdio", "new_pgroup", "new_session", "uid", "gid",
                 "groups", "seal_ro_paths", "drop_caps", "no_new_privs", "seal_cg2_paths",
                 "seal_userns", "keep_ignored", "pass_fds", "shell", "clear_caps",
                 "pidns", "userns", "uid_map", "gid_map", "mount_proc", "die_with_parent")

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                 stdio: tuple[int, int, int] = (-1, -1, -1), new_pgroup: bool = False,
                 new_session: bool = False, uid: int = -1, gid: int = -1, groups: Sequence[int] = (),
                 seal_ro_paths: Sequence[str] | None = None, drop_caps: Sequence[int] = (),
                 no_new_privs: bool = False, seal_cg2_paths: Sequence[str] = (),
                 seal_userns: bool = False, keep_ignored: Iterable[int] | None = None,
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
        self.seal_ro_paths = seal_ro_paths    # None: no seal
        self.drop_caps = list(drop_caps)
        self.no_new_privs = no_new_privs
        self.seal_cg2_paths = list(seal_cg2_paths)   # replaced by the run's own view (seal.c)
        self.seal_userns = seal_userns
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


# -- the PID-namespace wall: the init's messages (init.c) ------------------------

class InitEvent:
    """One message of the wall's init, parsed from its fixed shape. The init
    runs inside the run's namespaces, so a member could never have written
    it (the socket is the init's alone), but it is still input: anything
    that does not fit is an `InitUnknown`, never an exception."""

    __slots__ = ()
    kind = ""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in getattr(self, "__slots__", ()))
        return f"{type(self).__name__}({fields})"


class InitStarted(InitEvent):
    __slots__ = ()
    kind = "started"


class InitExec(InitEvent):
    """The worker exec'd. `pidfd`: the worker's, passed by the init (ours to
    close). `host_pid`: its pid in the supervisor's /proc as the init read
    it (-1: unknown). The init says EXEC once per spawn: another one is not
    its word (close its pidfd)."""

    __slots__ = ("ns_pid", "host_pid", "pidfd")
    kind = "exec"

    def __init__(self, ns_pid: int, host_pid: int, pidfd: int) -> None:
        self.ns_pid = ns_pid
        self.host_pid = host_pid
        self.pidfd = pidfd


class InitFailed(InitEvent):
    """The worker never ran: its set-up or exec failed, or the init's own
    set-up did (stage `user namespace`, `placement`, ...)."""

    __slots__ = ("stage", "errno", "candidate", "signal", "wstatus")
    kind = "failed"

    def __init__(self, stage: int, errno: int, candidate: int, signal: int, wstatus: int) -> None:
        self.stage = stage
        self.errno = errno
        self.candidate = candidate
        self.signal = signal
        self.wstatus = wstatus


class InitWorkerExit(InitEvent):
    """The init reaped the worker: its wait status."""

    __slots__ = ("ns_pid", "status")
    kind = "worker_exit"

    def __init__(self, ns_pid: int, status: int) -> None:
        self.ns_pid = ns_pid
        self.status = status

    @property
    def exit_code(self) -> int | None:
        return os.WEXITSTATUS(self.status) if os.WIFEXITED(self.status) else None

    @property
    def signal(self) -> int | None:
        return os.WTERMSIG(self.status) if os.WIFSIGNALED(self.status) else None


_NOTES = {
    lib.CT_NOTE_MOUNT_PRIVATE: "mounts could not be made private (no /proc of the namespace's own)",
    lib.CT_NOTE_MOUNT_PROC: "a /proc of the namespace could not be mounted",
    lib.CT_NOTE_DEVNULL: "the init could not point its stdio at /dev/null",
}


class InitNote(InitEvent):
    __slots__ = ("what", "errno")
    kind = "note"

    def __init__(self, what: int, errno: int) -> None:
        self.what = what
        self.errno = errno

    @property
    def text(self) -> str:
        return f"{_NOTES.get(self.what, f'note {self.what}')}: {os.strerror(self.errno)}"


class InitEmpty(InitEvent):
    """No member is left and the init exits 0. The CPU time and peak RSS of
    every member the init reaped (it reaps them all): whole-tree
    accounting without a cgroup."""

    __slots__ = ("utime_us", "stime_us", "maxrss_kib")
    kind = "empty"

    def __init__(self, utime_us: int, stime_us: int, maxrss_kib: int) -> None:
        self.utime_us = utime_us
        self.stime_us = stime_us
        self.maxrss_kib = maxrss_kib


class InitForwarded(InitEvent):
    """A signal from outside, forwarded to every member (errno ESRCH: none left)."""

    __slots__ = ("signal", "errno")
    kind = "forwarded"

    def __init__(self, signal: int, errno: int) -> None:
        self.signal = signal
        self.errno = errno


class InitClosed(InitEvent):
    """The init's end of the socket is closed. A hint only: the init's pidfd
    says whether it exited."""

    __slots__ = ()
    kind = "closed"


class InitUnknown(InitEvent):
    __slots__ = ("raw",)
    kind = "unknown"

    def __init__(self, raw: tuple[int, ...]) -> None:
        self.raw = raw


def _event(m: Any, fd: int) -> InitEvent:
    k = m.kind
    if k == lib.CT_EV_EXEC and fd >= 0:
        return InitExec(m.a, m.b, fd)
    if fd >= 0:
        os.close(fd)        # a descriptor with any other message is not ours to keep
    if k == lib.CT_EV_STARTED:
        return InitStarted()
    if k == lib.CT_EV_FAILED:
        return InitFailed(m.a, m.b, m.c, m.d, m.x)
    if k == lib.CT_EV_EXIT:
        return InitWorkerExit(m.a, m.b)
    if k == lib.CT_EV_NOTE:
        return InitNote(m.a, m.b)
    if k == lib.CT_EV_EMPTY and m.x >= 0 and m.y >= 0:
        return InitEmpty(m.x, m.y, m.c)
    if k == lib.CT_EV_FORWARDED:
        return InitForwarded(m.a, m.b)
    return InitUnknown((k, m.a, m.b, m.c, m.d, m.x, m.y))


def read_init_events(fd: int) -> list[InitEvent]:
    """Every message waiting on the init's socket, without blocking ([] when
    there is none). Ends with `InitClosed` once the init's end is closed."""
    out: list[InitEvent] = []
    m = ffi.new("struct ct_init_msg*")
    passed = ffi.new("int*")
    while True:
        rc = lib.ct_init_recv(fd, m, passed)
        if rc == 0:
            return out
        if rc == 2:
            out.append(InitClosed())
            return out
        if rc < 0:
            if rc == -errno.EPROTO:
                out.append(InitUnknown(()))
                continue
            raise OSError(-rc, f"recvmsg from the init: {os.strerror(-rc)}")
        out.append(_event(m, passed[0]))


def pid_of_pidfd(pidfd: int) -> int:
    """The pid of a pidfd's process as this /proc names it (fdinfo "Pid:"),
    -1 once it has been reaped."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    raise OSError(errno.ENOTSUP, "fdinfo of a pidfd has no Pid line")


INIT_NAME = "ct/init"     # init.h CT_INIT_NAME: set by the init's first instruction of ours


def _comm_of_pidfd(pidfd: int) -> str | None:
    """comm of a pidfd's (unreaped) process, or None."""
    try:
        pid = pid_of_pidfd(pidfd)
        if pid <= 0:
            return None
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().rstrip("\n")
        _signal.pidfd_send_signal(pidfd, 0)        # still unreaped: the read was of it
        return comm
    except OSError:
        return None


def _close(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def _reap_init(pidfd: int) -> os.waitid_result | None:
    try:
        return os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
    except ChildProcessError:
        return None


def wall_via(req: SpawnRequest, into_cgroup: bool = False) -> str:
    flags = ["CLONE_NEWPID"] + (["CLONE_NEWUSER"] if req.userns else []) + \
        (["CLONE_NEWNS"] if req.mount_proc else []) + (["CLONE_INTO_CGROUP"] if into_cgroup else [])
    return f"clone3({'|'.join(flags)}) init at pid 1, worker forked by it"


def _spawn_wall(req: SpawnRequest, cgroup_fd: int, join_fds: Sequence[int],
                expect_cgroup: Sequence[str]) -> Spawned:
    keep: list[Any] = []
    a = _args(req, cgroup_fd, join_fds, expect_cgroup, keep)
    w = ffi.new("struct ct_wall_args*")
    w.userns = {None: lib.CT_USERNS_NONE, "self": lib.CT_USERNS_SELF, "map": lib.CT_USERNS_MAP}[req.userns]
    w.uid = os.geteuid()
    w.gid = os.getegid()
    for name in ("uid_map", "gid_map"):
        text = getattr(req, name)
        if text is not None:
            c = ffi.new("char[]", (text if text.endswith("\n") else text + "\n").encode())
            keep.append(c)
            setattr(w, name, c)
    w.mount_proc = int(req.mount_proc)
    w.die_with_parent = int(req.die_with_parent)
    r = ffi.new("struct ct_wall_result*")
    paths = candidates(req.argv[0], req.env)
    rc = lib.ct_wall_spawn(a, w, r)
    if rc < 0:
        fail = ffi.new("struct ct_spawn_result*")
        fail.stage = r.stage
        fail.child_errno = r.child_errno
        fail.candidate = -1
        _raise(rc, fail, req, paths, cgroup_fd >= 0)
    via = wall_via(req, cgroup_fd >= 0)
    events: list[InitEvent] = []
    worker: InitExec | None = None
    failed: InitFailed | None = None
    p = select.poll()
    p.register(r.report_fd, select.POLLIN)
    p.register(r.init_pidfd, select.POLLIN)
    try:
        init_gone = closed = False
        while worker is None and failed is None:
            for ev in read_init_events(r.report_fd) if not closed else []:
                if isinstance(ev, InitExec) and worker is None:
                    worker = ev
                elif isinstance(ev, InitFailed) and failed is None:
                    failed = ev
                elif isinstance(ev, InitClosed):
                    closed = True
                    p.unregister(r.report_fd)
                else:
                    events.append(ev)
            if worker is not None or failed is not None or init_gone:
                break
            for fd, _ev in p.poll():
                if fd == r.init_pidfd:
                    init_gone = True      # read what it said once more, then decide
    except BaseException:
        _kill_init(r.init_pidfd)
        _close(r.init_pidfd, r.report_fd, worker.pidfd if worker else -1)
        raise
    if worker is None:
        ran = _comm_of_pidfd(r.init_pidfd) == INIT_NAME     # read before the reaping
        info = _reap_init(r.init_pidfd) if failed is not None or init_gone else None
        _close(r.init_pidfd, r.report_fd)
        if failed is not None:
            res = ffi.new("struct ct_spawn_result*")
            res.stage, res.child_errno, res.candidate, res.signal = (failed.stage, failed.errno,
                                                                     failed.candidate, failed.signal)
            _raise(-(failed.errno or errno.ECANCELED), res, req, paths, False)
        if not ran:
            raise DiedAtBirth()
        how = "without a word"
        if info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            how = f"killed by signal {info.si_status}"
        elif info is not None:
            how = f"with status {info.si_status} and no report"
        raise SpawnFailed(f"{req.argv[0]}: the pid namespace init died {how}", errno=errno.ECHILD,
                          stage="pid namespace init", path=req.argv[0])
    # The pidfd's word first; once the init has reaped a worker that exited
    # at once, the pidfd names no pid, and the init's reading (made while the
    # worker was its unreaped child) stands in.
    pid = pid_of_pidfd(worker.pidfd)
    if pid <= 0:
        pid = worker.host_pid
    return Spawned(pid, worker.pidfd, via, wall="pidns", init_pid=r.init_pid, init_pidfd=r.init_pidfd,
                   report_fd=r.report_fd, events=events)


def wall_available(userns: str | None = None, mount_proc: bool = True) -> str | None:
    """None if a PID-namespace wall of this shape can be made here (it
    spawns /bin/true behind one and waits for the init to say EMPTY), else
    the reason. For `contain doctor` and for `auto` to choose with."""
    shell = "/bin/true" if os.path.exists("/bin/true") else "/usr/bin/true"
    try:
        sp = spawn(SpawnRequest([shell], env={"PATH": "/usr/bin:/bin"}, pidns=True, userns=userns,
                                mount_proc=mount_proc, clear_caps=True, no_new_privs=True,
                                keep_ignored=()))
    except (SpawnFailed, DiedAtBirth, OSError) as e:
        return str(e)
    notes: list[str] = [e.text for e in sp.events if isinstance(e, InitNote)]
    try:
        p = select.poll()
        p.register(sp.init_pidfd, select.POLLIN)
        if not p.poll(5000):
            return "the init of a probe did not exit within 5 s"
        info = os.waitid(os.P_PIDFD, sp.init_pidfd, os.WEXITED)
        evs = read_init_events(sp.report_fd)
        notes += [e.text for e in evs if isinstance(e, InitNote)]
        if info is None or info.si_code != os.CLD_EXITED or info.si_status != 0 or \
                not any(isinstance(e, InitEmpty) for e in sp.events + evs):
            return f"the probe's init did not report an empty namespace ({evs})"
    finally:
        _kill_init(sp.init_pidfd)
        _close(sp.pidfd, sp.init_pidfd, sp.report_fd)
    if mount_proc and notes:
        return "; ".join(notes)
    return None


def _kill_init(init_pidfd: int) -> None:
    try:
        _signal.pidfd_send_signal(init_pidfd, _signal.SIGKILL)
    except OSError:
        pass
    _reap_init(init_pidfd)


class Spawned:
    """A started worker. Without a wall, `pidfd` is our child's (waitid
    works). With the PID-namespace wall (`wall == "pidns"`), `pid`/`pidfd`
    are the worker's (not our child: its pidfd polls readable when it exits,
    and its status comes as an `InitWorkerExit` event), `init_pid`/
    `init_pidfd` the init's (our child: reaped means the namespace is
    empty), `report_fd` the init's message socket (nonblocking: read with
    `read_init_events` when it polls readable), and `events` what the init
    said before `spawn` returned (notes, or even the worker's exit)."""

    __slots__ = ("pid", "pidfd", "via", "wall", "init_pid", "init_pidfd", "report_fd", "events")

    def __init__(self, pid: int, pidfd: int, via: str = "", *, wall: str | None = None,
                 init_pid: int = -1, init_pidfd: int = -1, report_fd: int = -1,
                 events: list[InitEvent] | None = None) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.via = via
        self.wall = wall
        self.init_pid = init_pid
        self.init_pidfd = init_pidfd
        self.report_fd = report_fd
        self.events: list[InitEvent] = events if events is not None else []


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


def _ints(ctype: str, items: Sequence[int], keep: list[Any]) -> Any:
    arr = ffi.new(ctype, list(items))
    keep.append(arr)
    return arr


def _args(req: SpawnRequest, cgroup_fd: int, join_fds: Sequence[int], expect_cgroup: Sequence[str],
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
    if req.seal_ro_paths is not None:
        a.seal = 1
        a.ro_paths = _cstrs(req.seal_ro_paths, keep)
        a.nro = len(req.seal_ro_paths)
        a.cg2_paths = _cstrs(req.seal_cg2_paths, keep)
        a.ncg2 = len(req.seal_cg2_paths)
        a.userns = int(req.seal_userns)
    if req.drop_caps:
        a.drop_caps = _ints("int[]", req.drop_caps, keep)
        a.ndrop = len(req.drop_caps)
    a.no_new_privs = int(req.no_new_privs)
    a.clear_caps = int(req.clear_caps)
    a.sig_ignore = _mask(req.keep_ignored)
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


def _raise(rc: int, r: Any, req: SpawnRequest, paths: Sequence[str], cgroup: bool) -> None:
    err = -rc
    stage = _STAGES.get(r.stage, "spawn")
    if r.stage == lib.CT_STAGE_CLONE and cgroup and err in (errno.ENOSYS, errno.E2BIG, errno.EINVAL):
        raise CloneUnsupported(os.strerror(err))
    if r.stage == lib.CT_STAGE_BIRTH:
        raise DiedAtBirth()
    what = req.argv[0]
    if r.signal and not r.child_errno:
        try:
            name = _signal.Signals(r.signal).name
        except ValueError:
            name = f"signal {r.signal}"
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


def spawn(req: SpawnRequest, cgroup_fd: int = -1, join_fds: Sequence[int] = (),
          expect_cgroup: Sequence[str] = ()) -> Spawned:
    """Start the worker; return once it has exec'd (or raise).

    `cgroup_fd`: a cgroup2 directory fd for clone3(CLONE_INTO_CGROUP), -1
    for the caller's cgroup. `join_fds`: cgroup.procs files (v2 or v1,
    opened for writing by the caller) the child writes "0" to before
    anything else, and `expect_cgroup`: lines /proc/self/cgroup must then
    hold (e.g. "0::/contain/run-x/main"), or the spawn fails at "placement"
    without running a worker instruction."""
    if req.pidns:
        return _spawn_wall(req, cgroup_fd, join_fds, expect_cgroup)
    keep: list[Any] = []
    a = _args(req, cgroup_fd, join_fds, expect_cgroup, keep)
    r = ffi.new("struct ct_spawn_result*")
    rc = lib.ct_spawn(a, r)
    if rc < 0:
        _raise(rc, r, req, candidates(req.argv[0], req.env), cgroup_fd >= 0)
    return Spawned(r.pid, r.pidfd)


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
