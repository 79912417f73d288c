"""The worker as a Windows process: its spawn into a job, its identity, its status.

- **Spawn** (`spawn_into`, winproc.c): created suspended and inside the
  job (PROC_THREAD_ATTRIBUTE_JOB_LIST, or AssignProcessToJobObject before
  ResumeThread), IsProcessInJob checked before the first instruction,
  never a breakaway flag. Always in a process group of its own
  (CREATE_NEW_PROCESS_GROUP), so CTRL_BREAK_EVENT can be sent to it alone.
- **Identity** is the pid plus the process's creation time (GetProcessTimes,
  a FILETIME in 100 ns since 1601), read from a handle. The run's owner
  holds the worker's handle from spawn to the end: Windows does not reuse a
  pid while a handle to the process is open. There is no boot id: a
  FILETIME is absolute, so pid + creation time does not recur across boots
  (`BOOT_ID` says so in the record, where Linux has the kernel's boot id).
- **Status** comes from the handle: signalled means exited, then
  GetExitCodeProcess; never STILL_ACTIVE (259 is a valid exit code).

Windows only: every entry point checks the platform first (mypy reads the
rest as Windows code with `--platform win32`).
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
        """What spawn_into() reads (`Request`, and the driver's request)."""
        argv: list[str]
        env: dict[str, str]
        cwd: str | None
        stdio: tuple[int, int, int]
        new_pgroup: bool

from .._errors import ContainmentUnavailable, SpawnFailed
from .winsync import check as _check, error as _error, require_windows

# What the record says where Linux puts the kernel's boot id (see above).
BOOT_ID = "windows: identities are pid + absolute FILETIME creation time"
START_TIME_UNIT = "FILETIME 100ns"
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
# The job's limits (or the host) had no room for the worker: not the command's fault.
_ERROR_QUOTA = {8: "ERROR_NOT_ENOUGH_MEMORY", 1455: "ERROR_COMMITMENT_LIMIT", 1816: "ERROR_NOT_ENOUGH_QUOTA"}


class Request:
    """A spawn request for Windows: what the driver's spawn_request gives
    the container (`_containers.spawn_request` builds one on Windows)."""

    __slots__ = ("argv", "env", "cwd", "stdio", "new_pgroup", "keep_ignored", "pass_fds")
    # What the driver asks of any request (_launch.py): no PID-namespace wall here.
    pidns = False
    userns = None

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
                 stdio: tuple[int, int, int] = (-1, -1, -1), new_pgroup: bool = True,
                 pass_fds: Sequence[int] = ()) -> None:
        if not argv:
            raise ValueError("argv must not be empty")
        if pass_fds:
            raise ValueError("pass_fds is not supported on Windows: only the three standard handles are passed")
        self.argv = [os.fsdecode(a) for a in argv]
        self.env = dict(os.environ) if env is None else env
        self.cwd = cwd
        self.stdio = stdio
        self.new_pgroup = new_pgroup
        self.keep_ignored: frozenset[int] = frozenset()   # no signal dispositions to carry over
        self.pass_fds: tuple[int, ...] = ()


class Spawned:
    """The worker: pid plus the process handle (owned by the Container; no
    pidfd on Windows), and its creation time read from that handle."""

    __slots__ = ("pid", "pidfd", "via", "handle", "start_time")

    def __init__(self, pid: int, handle: int, via: str, start_time: int | None = None) -> None:
        self.pid = pid
        self.pidfd = -1
        self.via = via
        self.handle = handle
        self.start_time = start_time


def environment_block(env: dict[str, str]) -> bytes:
    """`K=V\\0...\\0\\0` in UTF-8, sorted without regard to case as
    CreateProcess documents for an environment block."""
    items = []
    for k, v in sorted(env.items(), key=lambda kv: kv[0].upper()):
        if not k or "=" in k[1:] or "\0" in k or "\0" in v:
            raise ValueError(f"environment variable {k!r} cannot be passed to CreateProcess")
        items.append(f"{k}={v}")
    return ("\0".join(items) + "\0\0").encode("utf-8") if items else b"\0\0"


# -- spawning ----------------------------------------------------------------------

def spawn_into(job: int, req: SpawnRequestLike) -> tuple[Spawned, str]:
    """Start `req` inside `job`; (the worker, how it entered the job).
    Raises SpawnFailed (the command's fault: 126, 127; a bad cwd: 125) or
    ContainmentUnavailable (the job could not hold it: it never ran)."""
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
    a.job = job
    a.command_line = cstr(subprocess.list2cmdline(req.argv))
    block = environment_block(req.env)
    env = ffi.new("char[]", block)
    keep.append(env)
    a.environment = env
    a.env_len = len(block)
    if req.cwd is not None:
        a.cwd = cstr(req.cwd)
    a.stdio = [0 if fd < 0 else msvcrt.get_osfhandle(fd) for fd in req.stdio]
    # Always its own group: the polite stop sends CTRL_BREAK_EVENT to the
    # group the worker leads, never to a group that is not ours.
    a.new_process_group = 1
    a.try_job_list = 1
    r = ffi.new("struct ct_job_spawn_result*")
    rc = lib.ct_job_spawn(a, r)
    if rc != 0:
        _raise_spawn(rc, r, req)
    if r.via == lib.CT_JOB_VIA_JOB_LIST:
        via = "CreateProcessW(PROC_THREAD_ATTRIBUTE_JOB_LIST, CREATE_SUSPENDED) + IsProcessInJob"
    else:
        via = (f"CREATE_SUSPENDED + AssignProcessToJobObject + IsProcessInJob + ResumeThread "
               f"(job list unavailable: winerror {r.job_list_error})")
    try:
        start = process_times(int(r.process))["creation"]
    except OSError:
        start = None
    return Spawned(int(r.pid), int(r.process), via, start), via


def _raise_spawn(rc: int, r: Any, req: SpawnRequestLike) -> None:
    from .._native import lib

    err = _error(rc, "CreateProcessW")
    what = req.argv[0]
    if r.stage == lib.CT_JOB_STAGE_CREATE and rc == _ERROR_DIRECTORY:
        raise SpawnFailed(f"{what}: working directory {req.cwd!r}: {err}", errno=errno.ENOTDIR,
                          stage="chdir", path=what) from err
    if r.stage == lib.CT_JOB_STAGE_CREATE and rc in _ERROR_QUOTA:
        raise SpawnFailed(f"{what}: no room for the worker ({_ERROR_QUOTA[rc]}: the job's --memory-max or "
                          f"--pids-max, or the host's memory): {err}", errno=errno.ENOMEM, stage="limits",
                          path=what) from err
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


# -- identity and status -------------------------------------------------------------

def process_times(handle: int) -> dict[str, int]:
    """GetProcessTimes in 100 ns units: creation and exit (FILETIME, 0 while
    running), kernel and user. Raises OSError."""
    require_windows("process_times")
    from .._native import ffi, lib

    t = ffi.new("struct ct_job_times*")
    _check(lib.ct_job_process_times(handle, t), "GetProcessTimes")
    return {"creation": int(t.creation_100ns), "exit": int(t.exit_100ns), "kernel": int(t.kernel_100ns),
            "user": int(t.user_100ns)}


def identity(pid: int, handle: int) -> dict[str, Any]:
    """The worker's identity as the record stores it (ProcessIdentity's
    fields): `start_time` is the creation FILETIME."""
    return {"pid": pid, "start_time": process_times(handle)["creation"], "start_time_unit": START_TIME_UNIT,
            "boot_id": BOOT_ID, "pidns": None, "pidfd_inode": None}


def open_process(pid: int) -> int | None:
    """A handle (SYNCHRONIZE + query) to process `pid`, or None if there is
    no such process. Raises OSError when it cannot be opened (access denied)."""
    require_windows("open_process")
    from .._native import ffi, lib

    h = ffi.new("uintptr_t*")
    rc = lib.ct_job_process_open(pid, h)
    if rc == _ERROR_INVALID_PARAMETER:   # no such process
        return None
    _check(rc, f"OpenProcess({pid})")
    return int(h[0])


def close_handle(handle: int) -> None:
    from .._native import lib

    lib.ct_job_close_take(handle)


def status(handle: int) -> tuple[bool, int | None]:
    """(running, exit code) from a process handle: its signalled state
    decides, never STILL_ACTIVE. Raises OSError."""
    from .._native import ffi, lib

    running = ffi.new("int*")
    code = ffi.new("uint32_t*")
    _check(lib.ct_job_process_status(handle, running, code), "GetExitCodeProcess")
    return bool(running[0]), None if running[0] else int(code[0])


def creation_time(pid: int) -> int:
    """The creation FILETIME of the running process `pid` (ProcessIdentity.read
    on Windows). Raises ProcessLookupError when there is none, OSError."""
    h = open_process(pid)
    if h is None:
        raise ProcessLookupError(errno.ESRCH, f"no process {pid}")
    try:
        return process_times(h)["creation"]
    finally:
        close_handle(h)


def open_identity(pid: int, start_time: int) -> int | None:
    """A handle to the process `pid` if it is still the one created at
    `start_time` and still running (pinned while the handle is open: the
    adopter's pidfd), else None. Raises OSError when that cannot be told."""
    handle = open_process(pid)
    if handle is None:
        return None
    keep = False
    try:
        keep = status(handle)[0] and process_times(handle)["creation"] == start_time
    finally:
        if not keep:
            close_handle(handle)
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
    close_handle(h)
    return True


def console_pids() -> tuple[set[int] | None, str | None]:
    """The processes attached to our console (a CTRL_BREAK_EVENT reaches
    only those), or None and why (no console at all)."""
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


def snapshot() -> list[tuple[int, int, int, int, int, str]]:
    """Every process, from one Toolhelp snapshot (ct_proc_snapshot): (pid,
    parent pid, thread count, creation time as a FILETIME or 0 where this
    token cannot open the process, its GetLastError, image name). OSError
    if the snapshot itself fails."""
    require_windows("Toolhelp snapshots")
    from .._native import ffi, lib

    cap = 512
    for _ in range(8):
        buf = ffi.new("struct ct_winproc[]", cap)
        n = ffi.new("uint32_t*")
        rc = lib.ct_proc_snapshot(buf, cap, n)
        if rc == _ERROR_MORE_DATA:
            cap = int(n[0]) + int(n[0]) // 4 + 64    # processes may keep appearing
            continue
        _check(rc, "CreateToolhelp32Snapshot")
        out = []
        for i in range(n[0]):
            p = buf[i]
            out.append((int(p.pid), int(p.ppid), int(p.threads), int(p.creation_100ns), int(p.times_error),
                        ffi.string(p.name).decode("utf-8", "surrogateescape")))
        return out
    raise _error(_ERROR_MORE_DATA, "CreateToolhelp32Snapshot: still growing after 8 tries")
