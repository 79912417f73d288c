"""The `job-object` backend: one run, one Windows Job Object.

The worker is created suspended and inside the job (PROC_THREAD_ATTRIBUTE_JOB_LIST,
or AssignProcessToJobObject before ResumeThread); `jobobject.c` checks
IsProcessInJob before the first instruction runs. The job never allows
breakaway and kills its tree when its last handle closes, so the
supervisor's death stops the run. Emptiness is `ActiveProcesses == 0` from
QueryInformationJobObject; completion-port messages only wake the waiter
(they are "not guaranteed", JOBOBJECT_ASSOCIATE_COMPLETION_PORT).

Imported only on Windows (`_run._make_container` chooses it); every entry
point checks the platform first, so mypy reads the rest as Windows code
(`mypy --platform win32` checks it).
"""
from __future__ import annotations

import errno
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from .._errors import ContainmentUnavailable, SpawnFailed

if TYPE_CHECKING:
    from .posix import SpawnRequest

KIND = "job-object"
KILL_EXIT_CODE = 1   # what TerminateProcess uses in CPython's Popen.kill

# winnt.h
_LIMIT_BREAKAWAY_OK = 0x800
_LIMIT_SILENT_BREAKAWAY_OK = 0x1000
_LIMIT_KILL_ON_JOB_CLOSE = 0x2000

# What a shell would say about a worker that cannot start (126/127).
_SPAWN_ERRNO = {2: errno.ENOENT, 3: errno.ENOENT, 5: errno.EACCES, 193: errno.ENOEXEC, 216: errno.ENOEXEC}
_INFINITE = 0xFFFFFFFF


def _require_windows() -> None:
    if sys.platform != "win32":
        raise ContainmentUnavailable("Job Objects exist only on Windows")


def _error(rc: int, what: str) -> OSError:
    """The one translation of a jobobject.c code: an OSError carrying the
    Windows error (so PermissionError, FileNotFoundError, ... as Python maps
    them) with the call's name in the message."""
    if sys.platform != "win32":
        return OSError(errno.ENOSYS, f"{what}: Job Objects exist only on Windows")
    import ctypes

    return OSError(None, f"{what}: {ctypes.FormatError(rc).strip()} (winerror {rc})", None, rc)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise _error(rc, what)


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


class Container:
    """One run's Job Object, its completion port and the worker's handle."""

    backend = KIND
    dir = None
    leaf = None
    hierarchy = None
    events_fd = -1   # no fd to poll: wait_change blocks on the completion port
    empty_via = "QueryInformationJobObject ActiveProcesses == 0"

    def __init__(self, run_id: str, job: int, port: int) -> None:
        self.run_id = run_id
        self.job = job
        self.port = port
        self.process = 0
        self.pid = -1
        self.spawn_via: str | None = None
        # Anonymous on purpose: a named job could be opened by the tree.
        self.path = f"anonymous job of run {run_id}"
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

    def prepare(self, req: "SpawnRequest", opts: Any) -> None:
        if getattr(opts, "seal", None):
            raise ContainmentUnavailable(
                "--seal is not available for Job Objects: a worker running as the supervisor's user "
                "can duplicate the job handle out of the supervisor and allow breakaway")
        req.new_pgroup = True   # CTRL_BREAK_EVENT reaches the worker's group

    def seal_status(self, req: "SpawnRequest") -> tuple[bool, str | None]:
        return False, ("the worker runs as the supervisor's user: it can open the supervisor with "
                       "PROCESS_DUP_HANDLE, copy the job handle and allow breakaway")

    def spawn(self, req: "SpawnRequest") -> Spawned:
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
        a.new_process_group = int(req.new_pgroup)
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

    def _raise_spawn(self, rc: int, r: Any, req: "SpawnRequest") -> None:
        from .._native import lib

        err = _error(rc, "CreateProcessW")
        what = req.argv[0]
        if r.stage == lib.CT_JOB_STAGE_CREATE:
            code = _SPAWN_ERRNO.get(rc, errno.EINVAL)
            msg = f"{what}: command not found" if code == errno.ENOENT else f"{what}: {err}"
            raise SpawnFailed(msg, errno=code, stage="exec", path=what) from err
        stage = {lib.CT_JOB_STAGE_ASSIGN: "AssignProcessToJobObject", lib.CT_JOB_STAGE_VERIFY: "IsProcessInJob",
                 lib.CT_JOB_STAGE_RESUME: "ResumeThread", lib.CT_JOB_STAGE_ATTRS: "UpdateProcThreadAttribute"
                 }.get(r.stage, "spawn arguments")
        # The child, if one existed, was terminated while still suspended.
        raise ContainmentUnavailable(f"{what}: {stage} failed, the worker never ran: {err}") from err

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
        query) or `timeout` passes."""
        from .._native import lib

        ms = _INFINITE - 1 if timeout == float("inf") else max(0, int(timeout * 1000))
        _check(lib.ct_job_wait_empty(self.job, self.port, ms, self._wait), "GetQueuedCompletionStatus")

    def root_status(self) -> tuple[bool, int | None]:
        """(running, exit code) of the worker, from its handle."""
        from .._native import ffi, lib

        running = ffi.new("int*")
        code = ffi.new("uint32_t*")
        _check(lib.ct_job_process_status(self.process, running, code), "GetExitCodeProcess")
        return bool(running[0]), None if running[0] else int(code[0])

    def members(self) -> list[int]:
        from .._native import ffi, lib

        cap = 64
        while True:
            pids = ffi.new("uint64_t[]", cap)
            assigned = ffi.new("uint32_t*")
            listed = ffi.new("uint32_t*")
            rc = lib.ct_job_pids(self.job, pids, cap, assigned, listed)
            if rc == 234 and cap < 1 << 20:   # ERROR_MORE_DATA: it grew; ask again, larger
                cap = max(cap * 2, int(assigned[0]) + 16)
                continue
            _check(rc, "QueryInformationJobObject(JobObjectBasicProcessIdList)")
            return sorted(int(pids[i]) for i in range(listed[0]))

    def cpu_stat(self) -> dict[str, int] | None:
        try:
            acc = self._accounting()
        except OSError:
            return None
        user, kernel = int(acc.user_100ns) // 10, int(acc.kernel_100ns) // 10
        return {"usage_usec": user + kernel, "user_usec": user, "system_usec": kernel}

    # -- stopping ----------------------------------------------------------

    def terminate(self, sig: int = 15) -> tuple[int, int]:
        """The polite stop: CTRL_BREAK_EVENT to the worker's process group,
        whatever `sig` asked for (Windows has no signals to forward). It
        reaches only console processes sharing our console; the kill that
        follows is what the record relies on. Returns (signalled, failed)."""
        from .._native import lib

        if self.pid < 0:
            return 0, 0
        return (1, 0) if lib.ct_job_ctrl_break(self.pid) == 0 else (0, 1)

    def kill(self) -> str:
        from .._native import lib

        _check(lib.ct_job_terminate(self.job, KILL_EXIT_CODE), "TerminateJobObject")
        return "TerminateJobObject"

    def remove(self) -> str | None:
        """Close our handles. The job's last handle closing kills whatever is
        left (KILL_ON_JOB_CLOSE), so this is only called once it is empty."""
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
