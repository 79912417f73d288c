"""The `job-object` backend: one run, one Windows Job Object.

The worker is created suspended and inside the job (PROC_THREAD_ATTRIBUTE_JOB_LIST,
or AssignProcessToJobObject before ResumeThread); `jobobject.c` checks
IsProcessInJob before the first instruction runs. The job never allows
breakaway and kills its tree when its last handle closes, so the
supervisor's death stops the run. Emptiness is `ActiveProcesses == 0` from
QueryInformationJobObject; completion-port messages only wake the waiter
(they are "not guaranteed", JOBOBJECT_ASSOCIATE_COMPLETION_PORT), which
lives in winsync.py.

Identity is the pid plus the process's creation time (GetProcessTimes,
100 ns), with the worker's handle held from spawn to remove(): Windows does
not reuse a pid while a handle to the process is open.

Imported only on Windows (`_run._make_container` chooses it); every entry
point checks the platform first, so mypy reads the rest as Windows code
(`mypy --platform win32` checks it).
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Protocol, Sequence

    class SpawnRequestLike(Protocol):
        """What spawn() reads (posix.SpawnRequest and `Request` both fit)."""
        argv: list[str]
        env: dict[str, str]
        cwd: str | None
        stdio: tuple[int, int, int]
        new_pgroup: bool

from .._errors import ContainmentUnavailable, SpawnFailed
from .winsync import check as _check, error as _error

KIND = "job-object"
KILL_EXIT_CODE = 1   # what TerminateProcess uses in CPython's Popen.kill

# winnt.h
_LIMIT_BREAKAWAY_OK = 0x800
_LIMIT_SILENT_BREAKAWAY_OK = 0x1000
_LIMIT_KILL_ON_JOB_CLOSE = 0x2000
_ERROR_INVALID_PARAMETER = 87
_ERROR_MORE_DATA = 234

# CreateProcessW's errors that belong to the command, as a shell would say
# them (errno: SpawnFailed maps ENOENT to 127, the others to 126).
_SPAWN_ERRNO = {
    2: errno.ENOENT,      # ERROR_FILE_NOT_FOUND
    3: errno.ENOENT,      # ERROR_PATH_NOT_FOUND
    123: errno.ENOENT,    # ERROR_INVALID_NAME: no file can have that name
    5: errno.EACCES,      # ERROR_ACCESS_DENIED: a directory, or no execute right
    11: errno.ENOEXEC,    # ERROR_BAD_FORMAT
    193: errno.ENOEXEC,   # ERROR_BAD_EXE_FORMAT: not a Windows executable
    216: errno.ENOEXEC,   # ERROR_EXE_MACHINE_TYPE_MISMATCH
    740: errno.EACCES,    # ERROR_ELEVATION_REQUIRED
}
_ERROR_DIRECTORY = 267    # the working directory is not one: the spawn's, not the command's
_INFINITE = 0xFFFFFFFF


def _require_windows() -> None:
    if sys.platform != "win32":
        raise ContainmentUnavailable("Job Objects exist only on Windows")


class Request:
    """A spawn request for Windows (posix.SpawnRequest has the same fields)."""

    __slots__ = ("argv", "env", "cwd", "stdio", "new_pgroup")

    def __init__(self, argv: "Sequence[str]", *, env: dict[str, str] | None = None, cwd: str | None = None,
                 stdio: tuple[int, int, int] = (-1, -1, -1)) -> None:
        if not argv:
            raise ValueError("argv must not be empty")
        self.argv = [os.fsdecode(a) for a in argv]
        self.env = dict(os.environ) if env is None else env
        self.cwd = cwd
        self.stdio = stdio
        self.new_pgroup = True


class Spawned:
    """The worker: pid plus an owned process handle (no pidfd on Windows)."""

    __slots__ = ("pid", "pidfd", "via", "handle")

    def __init__(self, pid: int, handle: int, via: str) -> None:
        self.pid = pid
        self.pidfd = -1
        self.via = via
        self.handle = handle


def environment_block(env: dict[str, str]) -> bytes:
    """`K=V\\0...\\0\\0` in UTF-8, sorted without regard to case as
    CreateProcess documents for an environment block."""
    items = []
    for k, v in sorted(env.items(), key=lambda kv: kv[0].upper()):
        if not k or "=" in k[1:] or "\0" in k or "\0" in v:
            raise ValueError(f"environment variable {k!r} cannot be passed to CreateProcess")
        items.append(f"{k}={v}")
    return ("\0".join(items) + "\0\0").encode("utf-8") if items else b"\0\0"


# -- identity --------------------------------------------------------------------

def process_times(handle: int) -> dict[str, int]:
    """GetProcessTimes in 100 ns units: creation and exit (FILETIME, 0 while
    running), kernel and user. Raises OSError."""
    _require_windows()
    from .._native import ffi, lib

    t = ffi.new("struct ct_job_times*")
    _check(lib.ct_job_process_times(handle, t), "GetProcessTimes")
    return {"creation": int(t.creation_100ns), "exit": int(t.exit_100ns), "kernel": int(t.kernel_100ns),
            "user": int(t.user_100ns)}


def identity(pid: int, handle: int) -> dict[str, Any]:
    """The worker's identity as the record stores it: `start_time` is the
    creation FILETIME (100 ns since 1601, UTC). There is no boot id or PID
    namespace; pid + a 100 ns creation time does not repeat across boots."""
    return {"pid": pid, "start_time": process_times(handle)["creation"], "start_time_unit": "FILETIME 100ns",
            "boot_id": None, "pidns": None, "pidfd_inode": None}


def open_identity(pid: int, start_time: int) -> int | None:
    """A handle to the process `pid` if it is still the one created at
    `start_time` and still running (pinned while the handle is open: the
    adopter's pidfd), else None. Raises OSError when that cannot be told."""
    _require_windows()
    from .._native import ffi, lib

    h = ffi.new("uintptr_t*")
    rc = lib.ct_job_process_open(pid, h)
    if rc == _ERROR_INVALID_PARAMETER:   # no such process
        return None
    _check(rc, f"OpenProcess({pid})")
    handle = int(h[0])
    keep = False
    try:
        running = ffi.new("int*")
        code = ffi.new("uint32_t*")
        _check(lib.ct_job_process_status(handle, running, code), "WaitForSingleObject")
        keep = bool(running[0]) and process_times(handle)["creation"] == start_time
    finally:
        if not keep:
            lib.ct_job_close_take(handle)
    return handle if keep else None


def identity_alive(pid: int, start_time: int) -> bool | None:
    """True if this very process runs now, False if provably not, None if
    that cannot be told (access denied)."""
    try:
        h = open_identity(pid, start_time)
    except OSError:
        return None
    if h is None:
        return False
    from .._native import lib

    lib.ct_job_close_take(h)
    return True


class Container:
    """One run's Job Object, its completion port and the worker's handle."""

    backend = KIND
    dir = None
    leaf = None
    hierarchy = None
    events_fd = -1   # no fd to poll: winsync.owner_waiter blocks on the completion port
    empty_via = "QueryInformationJobObject ActiveProcesses"
    empty_proof = "QueryInformationJobObject ActiveProcesses == 0"

    def __init__(self, run_id: str, job: int, port: int) -> None:
        self.run_id = run_id
        self.job = job
        self.port = port
        self.process = 0
        self.pid = -1
        self.spawn_via: str | None = None
        # Anonymous on purpose: a named job could be opened by the tree.
        self.path = f"anonymous job of run {run_id}"
        self.last_terminate: dict[str, Any] | None = None
        self._worker_times: dict[str, int] | None = None
        self._wait: Any = None

    @classmethod
    def create(cls, run_id: str) -> "Container":
        _require_windows()
        from .._native import ffi, lib

        job = ffi.new("uintptr_t*")
        rc = lib.ct_job_create(job)
        if rc != 0:
            raise ContainmentUnavailable(f"CreateJobObjectW/SetInformationJobObject: {_error(rc, 'job')}")
        # The port must be associated before the worker is assigned, or its
        # NEW_PROCESS message is never posted.
        port = ffi.new("uintptr_t*")
        rc = lib.ct_job_port_create(job[0], port)
        if rc != 0:
            lib.ct_job_close_take(job[0])
            raise ContainmentUnavailable(f"CreateIoCompletionPort: {_error(rc, 'completion port')}")
        c = cls(run_id, job[0], port[0])
        c._wait = ffi.new("struct ct_job_wait_result*")
        return c

    # -- spawning ----------------------------------------------------------

    def prepare(self, req: "SpawnRequestLike", opts: Any) -> None:
        if getattr(opts, "seal", None):
            raise ContainmentUnavailable(
                "--seal is not available for Job Objects: a worker running as the supervisor's user "
                "can duplicate the job handle out of the supervisor and allow breakaway")
        if getattr(opts, "user", None):
            raise ContainmentUnavailable("--user is not available for Job Objects (it would need a logon token)")
        req.new_pgroup = True   # CTRL_BREAK_EVENT reaches the worker's group

    def seal_status(self, req: "SpawnRequestLike") -> tuple[bool, str | None]:
        return False, ("the worker runs as the supervisor's user: it can open the supervisor with "
                       "PROCESS_DUP_HANDLE, copy the job handle and allow breakaway")

    def spawn(self, req: "SpawnRequestLike") -> Spawned:
        if sys.platform != "win32":   # also tells mypy that what follows is Windows code
            raise ContainmentUnavailable("Job Objects exist only on Windows")
        import msvcrt

        from .._native import ffi, lib

        keep: list[Any] = []

        def cstr(s: str) -> Any:
            b = ffi.new("char[]", s.encode("utf-8"))
            keep.append(b)
            return b

        a = ffi.new("struct ct_job_spawn_args*")
        a.job = self.job
        a.command_line = cstr(subprocess.list2cmdline(req.argv))
        block = environment_block(req.env)
        env = ffi.new("char[]", block)
        keep.append(env)
        a.environment = env
        a.env_len = len(block)
        if req.cwd is not None:
            a.cwd = cstr(req.cwd)
        a.stdio = [0 if fd < 0 else msvcrt.get_osfhandle(fd) for fd in req.stdio]
        # Always its own group: terminate() sends CTRL_BREAK_EVENT to the
        # group the worker leads, never to a group that is not ours.
        a.new_process_group = 1
        a.try_job_list = 1
        r = ffi.new("struct ct_job_spawn_result*")
        rc = lib.ct_job_spawn(a, r)
        if rc != 0:
            self._raise_spawn(rc, r, req)
        self.process, self.pid = r.process, r.pid
        if r.via == lib.CT_JOB_VIA_JOB_LIST:
            self.spawn_via = "CreateProcessW(PROC_THREAD_ATTRIBUTE_JOB_LIST, CREATE_SUSPENDED) + IsProcessInJob"
        else:
            self.spawn_via = (f"CREATE_SUSPENDED + AssignProcessToJobObject + IsProcessInJob + ResumeThread "
                              f"(job list unavailable: winerror {r.job_list_error})")
        return Spawned(r.pid, r.process, self.spawn_via)

    def _raise_spawn(self, rc: int, r: Any, req: "SpawnRequestLike") -> None:
        from .._native import lib

        err = _error(rc, "CreateProcessW")
        what = req.argv[0]
        if r.stage == lib.CT_JOB_STAGE_CREATE and rc == _ERROR_DIRECTORY:
            raise SpawnFailed(f"{what}: working directory {req.cwd!r}: {err}", errno=errno.ENOTDIR,
                              stage="chdir", path=what) from err
        if r.stage == lib.CT_JOB_STAGE_CREATE:
            code = _SPAWN_ERRNO.get(rc, errno.EINVAL)
            if code == errno.ENOENT and os.path.isdir(what):
                # Windows says access denied for a directory, Wine "not
                # found"; as execve(2) says EACCES: 126, not 127.
                code, err = errno.EACCES, OSError(errno.EACCES, f"{what}: is a directory")
            msg = f"{what}: command not found" if code == errno.ENOENT else f"{what}: {err}"
            raise SpawnFailed(msg, errno=code, stage="exec", path=what) from err
        stage = {lib.CT_JOB_STAGE_ASSIGN: "AssignProcessToJobObject", lib.CT_JOB_STAGE_VERIFY: "IsProcessInJob",
                 lib.CT_JOB_STAGE_RESUME: "ResumeThread", lib.CT_JOB_STAGE_ATTRS: "UpdateProcThreadAttribute"
                 }.get(r.stage, "spawn arguments")
        # The child, if one existed, was terminated while still suspended.
        raise ContainmentUnavailable(f"{what}: {stage} failed, the worker never ran: {err}") from err

    def identity(self) -> dict[str, Any]:
        """The worker's identity (pid + creation time), read from its handle."""
        return identity(self.pid, self.process)

    def placed(self, pid: int) -> str | None:
        """The job's path if the kernel says `pid` is in it, "outside" if not,
        None if it cannot be asked."""
        from .._native import ffi, lib

        inside = ffi.new("int*")
        if lib.ct_job_contains(self.job, pid, inside) != 0:
            return None
        return self.path if inside[0] else "outside"

    def escape_evidence(self) -> dict[str, Any]:
        """No API removes a process from a job; leaving needs breakaway at
        creation, which needs a breakaway flag on the job. So: are they set?"""
        from .._native import ffi, lib

        flags = ffi.new("uint32_t*")
        rc = lib.ct_job_limits(self.job, flags)
        via = "QueryInformationJobObject(JobObjectExtendedLimitInformation)"
        if rc != 0:
            return {"observed": None, "at": None, "via": via, "detail": f"query failed: {_error(rc, via)}"}
        f = int(flags[0])
        if f & (_LIMIT_BREAKAWAY_OK | _LIMIT_SILENT_BREAKAWAY_OK):
            return {"observed": True, "at": None, "via": via,
                    "detail": f"limit flags 0x{f:x} allow breakaway: something in the tree changed them"}
        if not f & _LIMIT_KILL_ON_JOB_CLOSE:
            return {"observed": None, "at": None, "via": via,
                    "detail": f"limit flags read back as 0x{f:x} without our KILL_ON_JOB_CLOSE: not a reliable "
                    "read (Wine zero-fills this query)"}
        return {"observed": None, "at": None, "via": via,
                "detail": "breakaway not allowed now; an unsealed worker could have allowed it and "
                "cleared it again in between"}

    # -- observing ---------------------------------------------------------

    def _accounting(self) -> Any:
        from .._native import ffi, lib

        acc = ffi.new("struct ct_job_accounting*")
        _check(lib.ct_job_accounting(self.job, acc), "QueryInformationJobObject(JobObjectBasicAccountingInformation)")
        return acc

    def populated(self) -> bool:
        """ActiveProcesses != 0: the only emptiness the record trusts."""
        return int(self._accounting().active) != 0

    def wait_change(self, timeout: float) -> None:
        """Block on the completion port until the job is observed empty (by
        query) or `timeout` passes. Only while no winsync.Waiter shares the
        port: this drops every packet that is not the job's."""
        from .._native import lib

        ms = _INFINITE - 1 if timeout == float("inf") else max(0, int(timeout * 1000))
        _check(lib.ct_job_wait_empty(self.job, self.port, ms, self._wait), "GetQueuedCompletionStatus")

    def root_status(self) -> tuple[bool, int | None]:
        """(running, exit code) of the worker, from its handle: the handle's
        signalled state decides, never STILL_ACTIVE (259 is a valid code)."""
        from .._native import ffi, lib

        running = ffi.new("int*")
        code = ffi.new("uint32_t*")
        _check(lib.ct_job_process_status(self.process, running, code), "GetExitCodeProcess")
        if not running[0] and self._worker_times is None:
            try:
                self._worker_times = process_times(self.process)
            except OSError:
                pass
        return bool(running[0]), None if running[0] else int(code[0])

    def members(self) -> list[int]:
        from .._native import ffi, lib

        cap = 64
        while True:
            pids = ffi.new("uint64_t[]", cap)
            assigned = ffi.new("uint32_t*")
            listed = ffi.new("uint32_t*")
            rc = lib.ct_job_pids(self.job, pids, cap, assigned, listed)
            if rc == _ERROR_MORE_DATA and cap < 1 << 20:   # it grew; ask again, larger
                cap = max(cap * 2, int(assigned[0]) + 16)
                continue
            _check(rc, "QueryInformationJobObject(JobObjectBasicProcessIdList)")
            return sorted(int(pids[i]) for i in range(listed[0]))

    def accounting(self) -> dict[str, Any]:
        """Whole-tree CPU and peak memory from the job's accounting, each
        `{"observed": ..., "via": ..., "detail": ...}`, and `null` with the
        reason where the job's number cannot be a measurement. Wine fills
        neither (its 0 is not a reading), and on Windows a 0 is ambiguous
        for a run that did next to nothing, so a number is kept only where
        it is plausible:
        - CPU: the job's total counts the worker's own time too, so a total
          below the worker's own GetProcessTimes is not accounting; both 0
          cannot be told from an unimplemented counter either;
        - peak memory: no job that held a process has a peak of 0."""
        from .._native import ffi, lib

        via_cpu = "QueryInformationJobObject(JobObjectBasicAccountingInformation) TotalUserTime + TotalKernelTime"
        out: dict[str, Any] = {}
        try:
            acc = self._accounting()
        except OSError as e:
            out["cpu"] = {"observed": None, "via": via_cpu, "detail": f"query failed: {e}"}
            acc = None
        worker = self._worker_times
        if worker is None and self.process:
            try:
                worker = process_times(self.process)
            except OSError:
                worker = None
        if acc is not None:
            user, kernel = int(acc.user_100ns) // 10, int(acc.kernel_100ns) // 10
            job_total = user + kernel
            own = None if worker is None else (worker["user"] + worker["kernel"]) // 10
            if own is not None and job_total < own:
                out["cpu"] = {"observed": None, "via": via_cpu, "detail": (
                    f"not a measurement: the job's total ({job_total} us) is below the worker's own "
                    f"GetProcessTimes ({own} us); Wine does not implement job CPU accounting")}
            elif job_total == 0:
                out["cpu"] = {"observed": None, "via": via_cpu, "detail": (
                    "the job's CPU time reads 0" + (" and so does the worker's own" if own == 0 else "")
                    + ": not distinguishable from accounting that is not implemented")}
            else:
                out["cpu"] = {"observed": True, "via": via_cpu,
                              "detail": {"usage_usec": job_total, "user_usec": user, "system_usec": kernel,
                                         "processes": int(acc.total),
                                         "worker_usec": own}}
        via_mem = "QueryInformationJobObject(JobObjectExtendedLimitInformation) PeakJobMemoryUsed"
        peak_job = ffi.new("uint64_t*")
        peak_proc = ffi.new("uint64_t*")
        rc = lib.ct_job_memory(self.job, peak_job, peak_proc)
        if rc != 0:
            out["peak_memory"] = {"observed": None, "via": via_mem, "detail": f"query failed: {_error(rc, via_mem)}"}
        elif peak_job[0] == 0:
            out["peak_memory"] = {"observed": None, "via": via_mem, "detail": (
                "reads 0, which no job that held a process can have: not a measurement "
                "(Wine zero-fills this query)")}
        else:
            out["peak_memory"] = {"observed": True, "via": via_mem,
                                  "detail": {"peak_job_bytes": int(peak_job[0]),
                                             "peak_process_bytes": int(peak_proc[0])}}
        return out

    def cpu_stat(self) -> dict[str, int] | None:
        """The job's CPU totals where accounting() finds them plausible, else None."""
        try:
            cpu = self.accounting()["cpu"]
        except (OSError, KeyError):
            return None
        if cpu.get("observed") is not True:
            return None
        d = cpu["detail"]
        return {"usage_usec": d["usage_usec"], "user_usec": d["user_usec"], "system_usec": d["system_usec"]}

    # -- stopping ----------------------------------------------------------

    def _console_pids(self) -> tuple[set[int] | None, str | None]:
        from .._native import ffi, lib

        cap = 64
        while True:
            buf = ffi.new("uint32_t[]", cap)
            n = ffi.new("uint32_t*")
            rc = lib.ct_job_console_pids(buf, cap, n)
            if rc == _ERROR_MORE_DATA and cap < 1 << 16:
                cap = int(n[0]) + 16
                continue
            if rc != 0:
                return None, str(_error(rc, "GetConsoleProcessList"))
            return {int(buf[i]) for i in range(n[0])}, None

    def terminate(self, sig: int = 15) -> tuple[int, int]:
        """The polite stop: CTRL_BREAK_EVENT to the worker's process group
        (whatever `sig` asked for: Windows has no signals to forward).
        It reaches only the group's processes attached to our console (a
        GUI program, a DETACHED_PROCESS child or a process of another
        console gets nothing), so it is sent only when at least one member
        of the job is attached to our console, and `last_terminate` says
        what was sent and to whom it could be delivered. Windows has no
        SIGTERM for the others: the kill after the grace is what the record
        relies on. Returns (members it could reach, members it could not)."""
        from .._native import lib

        detail: dict[str, Any] = {"event": "CTRL_BREAK_EVENT", "process_group": self.pid,
                                  "via": "GenerateConsoleCtrlEvent", "sent": False, "delivered": False}
        self.last_terminate = detail
        if self.pid < 0:
            detail["reason"] = "no worker"
            return 0, 0
        try:
            members = set(self.members())
        except OSError as e:
            detail["reason"] = f"job members unknown: {e}"
            detail["delivered"] = None
            return 0, 0
        console, why = self._console_pids()
        if console is None:
            detail["reason"] = f"this process has no console: {why}"
            return 0, len(members)
        reach = sorted(members & console)
        detail["attached_to_our_console"] = reach
        if not reach:
            detail["reason"] = "no member of the job is attached to this process's console"
            return 0, len(members)
        rc = lib.ct_job_ctrl_break(self.pid)
        if rc != 0:
            # Wine 8 implements only CTRL_C_EVENT (server/console.c,
            # propagate_console_signal).
            detail["reason"] = str(_error(rc, "GenerateConsoleCtrlEvent"))
            return 0, len(members)
        detail["sent"] = True
        # Posted to those processes; whether their handlers exit is theirs.
        detail["delivered"] = True
        return len(reach), len(members) - len(reach)

    def terminate_step(self) -> tuple[bool | None, str, dict[str, Any]]:
        """terminate(), as (observed, via, detail) for the `signal_sent` layer."""
        try:
            reached, missed = self.terminate()
        except OSError as e:
            return None, "GenerateConsoleCtrlEvent(CTRL_BREAK_EVENT)", {"error": str(e)}
        d = dict(self.last_terminate or {}, reached=reached, not_reached=missed)
        return bool(d.get("sent")), "GenerateConsoleCtrlEvent(CTRL_BREAK_EVENT) to the worker's process group", d

    def kill(self) -> str:
        from .._native import lib

        _check(lib.ct_job_terminate(self.job, KILL_EXIT_CODE), "TerminateJobObject")
        return "TerminateJobObject"

    def remove(self) -> str | None:
        """Close our handles. The job's last handle closing kills whatever is
        left (KILL_ON_JOB_CLOSE), so this is only called once it is empty;
        a winsync.Waiter on this port is closed first."""
        from .._native import lib

        problem = None
        for name in ("process", "port", "job"):
            h = getattr(self, name)
            if h:
                rc = lib.ct_job_close_take(h)
                setattr(self, name, 0)
                if rc != 0 and problem is None:
                    problem = str(_error(rc, f"CloseHandle({name})"))
        return problem


def available() -> str | None:
    """None if a Job Object can be made here, else the reason."""
    try:
        Container.create("probe").remove()
    except ContainmentUnavailable as e:
        return e.reason
    except OSError as e:
        return str(e)
    return None
