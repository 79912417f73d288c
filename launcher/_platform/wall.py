"""The PID-namespace wall: spawning behind our own init (init.c), and what
the init says. See posix.py's docstring for the driver's side of it.
"""
from __future__ import annotations

import errno
import os
import select
from .. import _signals as _signal
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Sequence

from .._errors import ResourceExhausted, SpawnFailed
from .._native import ffi, lib
from .spawnreq import (DiedAtBirth, SpawnRequest, Spawned, candidates, clone3_refused, clone_call, close_fds,
                       raise_failure, spawn_args)

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

    __slots__ = ("ns_pid", "host_pid", "pidfd", "start_time")
    kind = "exec"

    def __init__(self, ns_pid: int, host_pid: int, pidfd: int, start_time: int = -1) -> None:
        self.ns_pid = ns_pid
        self.host_pid = host_pid
        self.pidfd = pidfd
        self.start_time = start_time     # proc(5) field 22, read by the init while the worker was its child


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
    lib.CT_NOTE_MOUNT_PROC: ("a /proc of the namespace could not be mounted, so the worker sees the outer /proc "
                             "(the wall holds all the same; a container's masked /proc paths make the kernel "
                             "refuse the mount to a user namespace)"),
    lib.CT_NOTE_DEVNULL: "the init could not point its stdio at /dev/null",
    lib.CT_NOTE_SHED: ("the init could not let go of the supervisor's memory (shared copy-on-write "
                       "until the run ends)"),
    lib.CT_NOTE_HIDE: ("the state directory could not be hidden from the worker, or a directory above it pinned "
                       "(it can write its run directory, or move the state directory aside for another)"),
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
        return InitExec(m.a, m.b, fd, m.x)
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


def write_go(fd: int) -> None:
    """The one byte that lets a held init go on. An init already gone has
    closed its end: EPIPE (BrokenPipeError), never a SIGPIPE that kills the
    owner, also in a library caller that set SIGPIPE back to SIG_DFL
    (Python ignores it), through `signal` or in C, which Python's own table
    of handlers never sees: blocked around the write in this thread
    whatever the disposition, and the one this write raised (thread-directed,
    pipe_write) taken off again, unless this thread already blocked SIGPIPE
    and one was pending then (the caller's: it stays, and ours is merged
    into it). The mask is read before it is changed, and changed inside the
    `try`: an exception from a signal handler (KeyboardInterrupt) at any
    point leaves this thread's mask as the caller had it."""
    old = _signal.pthread_sigmask(_signal.SIG_BLOCK, ())      # only reads the mask
    mine = _signal.SIGPIPE not in old
    theirs = not mine and _signal.SIGPIPE in _signal.sigpending()
    try:
        if mine:
            _signal.pthread_sigmask(_signal.SIG_BLOCK, (_signal.SIGPIPE,))
        os.write(fd, b"G")
    except BrokenPipeError:
        if not theirs:
            _signal.sigtimedwait((_signal.SIGPIPE,), 0)     # ours, dequeued before any process-wide one
        raise
    finally:
        if mine:
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, (_signal.SIGPIPE,))


def pid_of_pidfd(pidfd: int) -> int:
    """The pid of a pidfd's process as this /proc names it (fdinfo "Pid:"),
    -1 once it has been reaped. Raises OSError."""
    pid = ffi.new("long*")
    rc = lib.ct_pid_via_fdinfo(pidfd, pid)
    if rc < 0:
        raise OSError(-rc, f"/proc/self/fdinfo/{pidfd}: {os.strerror(-rc)}")
    return int(pid[0])


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


def reap_init(pidfd: int) -> os.waitid_result | None:
    try:
        return os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
    except ChildProcessError:
        return None


# This process's own pidfd, for every run that dies with its owner: one
# descriptor per process, not per run. A pidfd of the thread-group leader
# (pidfd_open(getpid()), never PIDFD_THREAD) polls readable once the whole
# process has exited, not when one thread does (pidfd_poll:
# thread_group_exited), so a library caller's thread that spawned and ended
# does not end the tree. Above 2: the exec'd init keeps 0-2 for stdio.
_owner: tuple[int, int] | None = None          # (pid, pidfd)


def owner_pidfd() -> int:
    """A pidfd of this process (close-on-exec), opened once. Raises OSError."""
    global _owner
    pid = os.getpid()
    if _owner is not None and _owner[0] == pid:
        return _owner[1]
    fd = os.pidfd_open(pid)
    if fd < 3:
        import fcntl

        try:
            moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
        finally:
            os.close(fd)
        fd = moved
    _owner = (pid, fd)
    return fd


def _forget_owner_in_child() -> None:
    """A fork's copy names the parent: closed, so the child opens its own."""
    global _owner
    if _owner is not None:
        try:
            os.close(_owner[1])
        except OSError:
            pass
        _owner = None


os.register_at_fork(after_in_child=_forget_owner_in_child)


# The init exec'd from its image (launcher/_native/initbin/) where this process
# can, else forked (wall.c); False: forked always (benchmarks compare the two).
EXEC_INIT = True


def wall_via(req: SpawnRequest, into_cgroup: bool = False, execd: bool = False) -> str:
    flags = ["CLONE_NEWPID"] + (["CLONE_NEWUSER"] if req.userns else []) + \
        (["CLONE_NEWIPC"] if req.userns == "map" else []) + \
        (["CLONE_NEWNS"] if req.mount_proc else []) + (["CLONE_INTO_CGROUP"] if into_cgroup else [])
    how = f"{clone_call(*['CLONE_VM', 'CLONE_VFORK'] + flags)}, and exec of contain's init" if execd else \
        f"{clone_call(*flags)}, init"
    return how + " at pid 1, worker forked by it"


def spawn_wall(req: SpawnRequest, cgroup_fd: int = -1, join_fds: Sequence[int] = (),
               expect_cgroup: Sequence[str] = ()) -> Spawned:
    keep: list[Any] = []
    a = spawn_args(req, cgroup_fd, join_fds, expect_cgroup, keep)
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
    if req.hide is not None and req.mount_proc:
        c = ffi.new("char[]", os.fsencode(req.hide))
        keep.append(c)
        w.hide = c
    w.die_with_parent = int(req.die_with_parent)
    w.owner_pidfd = req.owner_pidfd
    w.hold = int(req.on_init is not None)
    w.exec_init = int(EXEC_INIT)
    # The last of the request's own joins (the run's v1 `pids` cgroup:
    # _runcgroups.RunCgroups.worker_joins_itself) are the worker's to join,
    # not the init's, so that --pids-max counts the tree and not our init.
    w.worker_joins = min(req.worker_joins, len(req.join_fds))
    r = ffi.new("struct ct_wall_result*")
    r.init_pidfd = r.report_fd = r.go_fd = -1
    paths = candidates(req.argv[0], req.env)
    try:
        return _after_clone(req, r, lib.ct_wall_spawn(a, w, r), paths, cgroup_fd)
    except BaseException:
        # Whatever came after the clone (an interrupt raised the moment the
        # call returned, EMFILE, a failed on_init): nothing of it is left,
        # no init, no descriptor (all three are -1 once closed or passed on).
        if r.init_pidfd >= 0:
            kill_init(r.init_pidfd)
            if select.select([r.init_pidfd], [], [], 5.0)[0]:
                reap_init(r.init_pidfd)
        close_fds(r.init_pidfd, r.report_fd, r.go_fd)
        raise


def _after_clone(req: SpawnRequest, r: Any, rc: int, paths: Any, cgroup_fd: int) -> Spawned:
    if rc < 0:
        fail = ffi.new("struct ct_spawn_result*")
        fail.stage = r.stage
        fail.child_errno = r.child_errno
        fail.candidate = -1
        raise_failure(rc, fail, req, paths, cgroup_fd >= 0)
    # Read by ct_wall_spawn right after the clone, while the init was alive
    # and unreaped: once it has exited its ns links are gone.
    init_ns = int(r.init_ns) or None
    init_start = int(r.init_start) if r.init_start >= 0 else None
    if r.go_fd >= 0:
        try:
            assert req.on_init is not None
            # raises: spawn_wall kills the init (it never went on)
            req.on_init(r.init_pid, init_start, init_ns)
            try:
                write_go(r.go_fd)
            except BrokenPipeError:
                # The init is gone before the go (killed at birth, or failed
                # at a step of its own before the hold): what it said, or
                # that it never ran our code, is read below, as without a hold.
                pass
        finally:
            os.close(r.go_fd)
            r.go_fd = -1
    via = wall_via(req, cgroup_fd >= 0, bool(r.init_execd))
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
                elif isinstance(ev, InitUnknown) and not ev.raw and worker is None:
                    # A report cut short (MSG_CTRUNC: no descriptor left here
                    # for the worker's pidfd it carried): the EXEC is lost,
                    # and waiting for it waited for ever. The init is killed
                    # (spawn_wall), with the worker it may have started.
                    raise ResourceExhausted("the wall's init report was cut short (no descriptor left for the "
                                            "worker's pidfd it passed): the spawn is undone")
                else:
                    events.append(ev)
            if worker is not None or failed is not None or init_gone:
                break
            for fd, _ev in p.poll():
                if fd == r.init_pidfd:
                    init_gone = True      # read what it said once more, then decide
    except BaseException:
        close_fds(worker.pidfd if worker else -1)      # the init's: spawn_wall
        raise
    if worker is None:
        ran = _comm_of_pidfd(r.init_pidfd) == INIT_NAME     # read before the reaping
        info = reap_init(r.init_pidfd) if failed is not None or init_gone else None
        close_fds(r.init_pidfd, r.report_fd)
        r.init_pidfd = r.report_fd = -1
        if failed is not None:
            res = ffi.new("struct ct_spawn_result*")
            res.stage, res.child_errno, res.candidate, res.signal = (failed.stage, failed.errno,
                                                                     failed.candidate, failed.signal)
            try:
                raise_failure(-(failed.errno or errno.ECANCELED), res, req, paths, False)
            except SpawnFailed as e:       # the wall existed, held nothing else, and its init is reaped
                e.wall_init = (r.init_pid, init_ns, info is not None)
                raise
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
    try:
        pid = pid_of_pidfd(worker.pidfd)
    except BaseException:
        # EMFILE, say: nothing is left running or open on a failed spawn
        # (the init and its socket: spawn_wall).
        close_fds(worker.pidfd)
        raise
    if pid <= 0:
        pid = worker.host_pid
    sp = Spawned(pid, worker.pidfd, via, wall="pidns", init_pid=r.init_pid, init_pidfd=r.init_pidfd,
                 report_fd=r.report_fd, events=events,
                 start_time=worker.start_time if worker.start_time > 0 else None)
    sp.init_ns = init_ns
    sp.init_start = init_start
    return sp


def wall_available(userns: str | None = None, mount_proc: bool = True) -> str | None:
    """None if a PID-namespace wall of this shape can be made here (it
    spawns /bin/true behind one and waits for the init to say EMPTY), else
    the reason. For `contain doctor` and for `auto` to choose with."""
    shell = "/bin/true" if os.path.exists("/bin/true") else "/usr/bin/true"
    try:
        sp = spawn_wall(SpawnRequest([shell], env={"PATH": "/usr/bin:/bin"}, pidns=True, userns=userns,
                                mount_proc=mount_proc, clear_caps=True, no_new_privs=True,
                                keep_ignored=()))
    except SpawnFailed as e:
        if getattr(e, "stage", None) == "clone":
            flags = "|".join(["CLONE_NEWPID"] + (["CLONE_NEWUSER"] if userns else []))
            return (f"{'clone' if clone3_refused() else 'clone3'}({flags}) refused: {os.strerror(e.errno or 0)} "
                    f"(a seccomp filter that refuses namespaces, or "
                    f"{'no user namespaces for this user' if userns else 'no CAP_SYS_ADMIN'})")
        return str(e)
    except (DiedAtBirth, OSError) as e:
        return str(e)
    # A /proc of its own is what the wall is nicer with, not what makes it a
    # wall: refused (masked /proc paths: the kernel's mount_too_revealing),
    # the wall is kept and its record says the worker sees the outer /proc.
    notes: list[str] = [e.text for e in sp.events if isinstance(e, InitNote) and e.what != lib.CT_NOTE_MOUNT_PROC]
    try:
        p = select.poll()
        p.register(sp.init_pidfd, select.POLLIN)
        if not p.poll(5000):
            return "the init of a probe did not exit within 5 s"
        info = reap_init(sp.init_pidfd)     # None: the kernel reaped it (our caller ignores SIGCHLD)
        evs = read_init_events(sp.report_fd)
        notes += [e.text for e in evs if isinstance(e, InitNote) and e.what != lib.CT_NOTE_MOUNT_PROC]
        if (info is not None and (info.si_code != os.CLD_EXITED or info.si_status != 0)) or \
                not any(isinstance(e, InitEmpty) for e in sp.events + evs):
            return f"the probe's init did not report an empty namespace ({evs})"
    finally:
        kill_init(sp.init_pidfd)
        close_fds(sp.pidfd, sp.init_pidfd, sp.report_fd)
    if mount_proc and notes:
        return "; ".join(notes)
    return None


def kill_init(init_pidfd: int) -> None:
    try:
        _signal.pidfd_send_signal(init_pidfd, _signal.SIGKILL)
    except OSError:
        pass
    reap_init(init_pidfd)
