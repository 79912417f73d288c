"""Windows waiting for the owner loop: one completion port, no polling.

On Linux the owner polls a pidfd, `cgroup.events`, the inbox FIFO and a wake
pipe. On Windows the run's Job Object reports to an I/O completion port,
and a port is not a waitable object, so every other input is turned into a
packet on that same port (winsync.c):

- the worker's process handle: a thread-pool wait (RegisterWaitForSingleObject)
  posts once when it is signalled;
- cancel requests from other processes: a named auto-reset event in the
  session's `Local\\` namespace, named from the run uid; a requester appends
  to the inbox, then sets it (`poke_owner`), and a thread-pool wait posts;
- in-process callers and signal handlers: `Waiter.wake()` posts directly;
- optionally the console's Ctrl-C/Ctrl-Break (`forward_console_ctrl`), which
  CPython would otherwise only see once the blocking call returned.

`Waiter.wait(timeout)` blocks in GetQueuedCompletionStatusEx until the
first packet or the timeout (the loop's next deadline), then takes whatever
else is queued. Packets are only wake-ups: the caller re-reads every input
afterwards (the worker's handle, ActiveProcesses, the inbox file), because
the job's messages are "not guaranteed" and a poke carries no authority.

Windows only: every entry point checks the platform first (mypy reads the
rest as Windows code with `--platform win32`).
"""
from __future__ import annotations

import re
import sys
import threading
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from .._errors import ContainmentUnavailable

_INFINITE = 0xFFFFFFFF
_ERROR_FILE_NOT_FOUND = 2
SE_FILE_OBJECT = 1
SE_KERNEL_OBJECT = 6

# A run uid as _layout.new_uid mints it (hex), or anything else that is
# safe inside a kernel object name: run.json is input, never trusted.
_NAME_PART = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

_COUNTERS = ("packets", "job_messages", "job_new_process", "job_exit_process", "job_abnormal_exit",
             "job_active_zero", "process_exits", "events", "wakes", "ctrls", "other", "job_memory_limit",
             "job_process_limit")


def require_windows(what: str = "this") -> None:
    if sys.platform != "win32":
        raise ContainmentUnavailable(f"{what} exists only on Windows")


def error(rc: int, what: str) -> OSError:
    """The one translation of a Windows C code (jobobject.c, winsync.c): an
    OSError carrying the Windows error, so PermissionError,
    FileNotFoundError, ... as Python maps them, with the call's name."""
    if sys.platform != "win32":
        import errno

        return OSError(errno.ENOSYS, f"{what}: Windows only")
    import ctypes

    return OSError(None, f"{what}: {ctypes.FormatError(rc).strip()}", None, rc)


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise error(rc, what)


def _part(s: str, what: str) -> str:
    if not isinstance(s, str) or not _NAME_PART.match(s):
        raise ValueError(f"{what} {s!r} cannot be part of a kernel object name")
    return s


def owner_event_name(run_uid: str) -> str:
    """The event a run's owner listens on for cancel requests. `Local\\`: the
    session's namespace (a `Global\\` name needs SeCreateGlobalPrivilege), so
    a requester must run in the owner's session."""
    return f"Local\\contain-{_part(run_uid, 'run uid')}-owner"


def job_name(run_uid: str) -> str:
    """A run's Job Object, by name, so that an adopter can open it once its
    owner is gone (windows.Container.open). `Local\\` as the owner event."""
    return f"Local\\contain-{_part(run_uid, 'run uid')}-job"


def session_id() -> int | None:
    """This process's terminal-services session (ProcessIdToSessionId), or
    None if it cannot be read. `Local\\` names live in the session's own
    object directory, so a name looked up from another session is another
    name."""
    if sys.platform != "win32":
        raise ContainmentUnavailable("sessions: Windows only")
    import ctypes
    from ctypes import wintypes

    k32 = ctypes.WinDLL("kernel32", use_last_error=True)
    sid = wintypes.DWORD()
    if not k32.ProcessIdToSessionId(k32.GetCurrentProcessId(), ctypes.byref(sid)):
        return None
    return int(sid.value)


def local_directory(session: int) -> str:
    """The object directory `Local\\` names of a session's ordinary (not
    AppContainer) processes resolve to."""
    return "\\BaseNamedObjects" if session == 0 else f"\\Sessions\\{session}\\BaseNamedObjects"


def object_directory(handle: int) -> str | None:
    """The object directory a named kernel object's name lives in, read
    from its handle (NtQueryObject ObjectNameInformation), e.g.
    `\\Sessions\\1\\BaseNamedObjects`; None if it cannot be read."""
    if sys.platform != "win32":
        raise ContainmentUnavailable("object names: Windows only")
    import ctypes
    from ctypes import wintypes

    nt = ctypes.WinDLL("ntdll")
    nt.NtQueryObject.argtypes = [wintypes.HANDLE, ctypes.c_int, ctypes.c_void_p, wintypes.ULONG,
                                 ctypes.POINTER(wintypes.ULONG)]
    nt.NtQueryObject.restype = ctypes.c_long
    buf = ctypes.create_string_buffer(4096)
    got = wintypes.ULONG()
    if nt.NtQueryObject(handle, 1, buf, len(buf), ctypes.byref(got)) != 0:   # ObjectNameInformation
        return None
    # OBJECT_NAME_INFORMATION: a UNICODE_STRING (USHORT Length, USHORT
    # MaximumLength, padding, PWSTR Buffer) whose buffer follows it.
    length = int.from_bytes(buf.raw[0:2], "little")
    ptr = int.from_bytes(buf.raw[8:16], "little")
    if not length or not ptr:
        return None
    name = ctypes.wstring_at(ptr, length // 2)
    return name.rsplit("\\", 1)[0] if "\\" in name else None


def in_app_container() -> bool | None:
    """Whether this process's token is an AppContainer's (whose `Local\\` is
    a directory of its own); None if the token cannot say."""
    if sys.platform != "win32":
        raise ContainmentUnavailable("tokens: Windows only")
    import ctypes
    from ctypes import wintypes

    k32 = ctypes.WinDLL("kernel32", use_last_error=True)
    adv = ctypes.WinDLL("advapi32", use_last_error=True)
    k32.GetCurrentProcess.restype = wintypes.HANDLE
    k32.CloseHandle.argtypes = [wintypes.HANDLE]
    adv.OpenProcessToken.argtypes = [wintypes.HANDLE, wintypes.DWORD, ctypes.POINTER(wintypes.HANDLE)]
    adv.GetTokenInformation.argtypes = [wintypes.HANDLE, ctypes.c_int, ctypes.c_void_p, wintypes.DWORD,
                                        ctypes.POINTER(wintypes.DWORD)]
    tok = wintypes.HANDLE()
    if not adv.OpenProcessToken(k32.GetCurrentProcess(), 0x0008, ctypes.byref(tok)):   # TOKEN_QUERY
        return None
    try:
        val, ret = wintypes.DWORD(), wintypes.DWORD()
        if not adv.GetTokenInformation(tok, 29, ctypes.byref(val), 4, ctypes.byref(ret)):   # TokenIsAppContainer
            return None
        return bool(val.value)
    finally:
        k32.CloseHandle(tok)


def waiter_event_name(token: str) -> str:
    """The event one waiting process (`contain wait`, `cancel --wait`)
    listens on, named by the token file it puts in the run's `waiters\\`
    (winlayout.py); the owner sets it after writing a record or an ack."""
    return f"Local\\contain-waiter-{_part(token, 'waiter token')}"


def poke(name: str) -> bool:
    """Set the named event: True if someone listens on it, False if nobody
    holds that name (no owner, or a waiter that is gone). Other failures
    (access denied: another user's object) raise OSError. A poke carries no
    authority, only "look at your inputs"."""
    require_windows("poke")
    from .._native import lib

    rc = lib.ct_sync_event_set(name.encode("utf-8"))
    if rc == _ERROR_FILE_NOT_FOUND:
        return False
    check(rc, f"OpenEventW/SetEvent({name})")
    return True


def poke_owner(run_uid: str) -> bool:
    """What a cancel requester calls after appending its request to the
    inbox: wake the run's owner. False: no owner listens (whoever cares
    checks the owner lock)."""
    return poke(owner_event_name(run_uid))


class Waiter:
    """Where the owner loop blocks: `wait(timeout)` returns on the first
    input or at the timeout; `wake()` (any thread) makes it return now.

    `port`: the run's completion port (the Container's, which the job posts
    to), or 0 for a port of its own (a waiting client). `job`: the job
    handle, the key its messages carry, so they are counted apart."""

    def __init__(self, port: int = 0, *, job: int = 0) -> None:
        require_windows("Waiter")
        from .._native import ffi, lib

        self._own_port = port == 0
        if self._own_port:
            p = ffi.new("uintptr_t*")
            check(lib.ct_sync_port_create(p), "CreateIoCompletionPort")
            port = int(p[0])
        self.port = port
        self.job = job
        self._watches: list[int] = []
        self._processes: dict[int, int] = {}    # process handle -> its watch
        self._events: list[int] = []
        self._ctrl = False
        self._closed = False
        # Re-entrant: a signal handler that calls wake() runs on the thread
        # that may be inside close().
        self._lock = threading.RLock()
        self._r = ffi.new("struct ct_sync_wait_result*")
        self.seen: dict[str, int] = dict.fromkeys(_COUNTERS, 0)   # since creation
        self.last: dict[str, int] = dict.fromkeys(_COUNTERS, 0)   # the last wait
        self.last_ctrl: int | None = None
        self.listening: list[str] = []

    # -- what wakes it -----------------------------------------------------

    def _watch(self, handle: int, key: int, once: bool) -> int:
        from .._native import ffi, lib

        w = ffi.new("uintptr_t*")
        check(lib.ct_sync_watch(self.port, handle, key, int(once), w), "RegisterWaitForSingleObject")
        self._watches.append(int(w[0]))
        return int(w[0])

    def watch_process(self, handle: int) -> None:
        """One packet when the process exits (the handle stays signalled,
        so the wait is registered once only; watching a handle again does
        nothing). The handle must stay open until close() or unwatch_process()."""
        from .._native import lib

        with self._lock:
            self._check_open()
            if handle not in self._processes:
                self._processes[handle] = self._watch(handle, lib.CT_SYNC_KEY_PROCESS, True)

    def watching(self, handle: int) -> bool:
        return handle in self._processes

    def unwatch_process(self, handle: int) -> None:
        """Stop watching `handle` (waits for a running callback), so that it
        may be closed. A no-op for a handle not watched, or once closed."""
        from .._native import lib

        with self._lock:
            w = self._processes.pop(handle, None)
            if w is None or self._closed:
                return
            self._watches.remove(w)
            check(lib.ct_sync_unwatch_take(w), "UnregisterWaitEx")

    def listen(self, name: str) -> None:
        """Create the named event `name` and wake on every poke of it.
        Refused (OSError, EEXIST) if the name exists and is not ours: a
        squatter could reset it and swallow pokes."""
        from .._native import ffi, lib

        with self._lock:
            self._check_open()
            h = ffi.new("uintptr_t*")
            existed = ffi.new("int*")
            check(lib.ct_sync_event_create(name.encode("utf-8"), h, existed), f"CreateEventW({name})")
            ev = int(h[0])
            if existed[0]:
                mine = ffi.new("int*")
                rc = lib.ct_sync_owned_by_caller(ev, SE_KERNEL_OBJECT, mine)
                if rc != 0 or mine[0] != 1:
                    lib.ct_job_close_take(ev)
                    import errno

                    why = (str(error(rc, "GetSecurityInfo")) if rc else
                           "it belongs to another user" if mine[0] == 0 else "its owner cannot be read")
                    raise OSError(errno.EEXIST, f"{name}: exists already and {why}")
            self._events.append(ev)
            try:
                self._watch(ev, lib.CT_SYNC_KEY_EVENT, False)
            except OSError:
                self._events.remove(ev)
                lib.ct_job_close_take(ev)
                raise
            self.listening.append(name)

    def forward_console_ctrl(self) -> None:
        """Wake on Ctrl-C / Ctrl-Break / console close. CPython's own
        handling (KeyboardInterrupt, a signal.SIGBREAK handler) still runs,
        once the wait has returned and the interpreter is back in Python."""
        from .._native import lib

        with self._lock:
            self._check_open()
            check(lib.ct_sync_ctrl_forward(self.port, 1), "SetConsoleCtrlHandler")
            self._ctrl = True

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the Waiter is closed")

    # -- the owner loop's calls --------------------------------------------

    def wait(self, timeout: float | None) -> None:
        """Block until any input, or `timeout` seconds (None: no limit).
        Returns None: the caller looks at every input again."""
        from .._native import lib

        if timeout is None or timeout == float("inf"):
            ms = _INFINITE
        else:
            # Rounded up: a loop that wakes before its deadline would go
            # round again at once with a zero timeout.
            ms = min(_INFINITE - 1, max(0, int(timeout * 1000 + 0.999)))
        r = self._r
        check(lib.ct_sync_wait(self.port, self.job, ms, r), "GetQueuedCompletionStatusEx")
        for k in _COUNTERS:
            v = int(getattr(r, k))
            self.last[k] = v
            self.seen[k] += v
        if r.ctrls:
            self.last_ctrl = int(r.last_ctrl)

    def wake(self) -> None:
        """Make wait() return now. Thread-safe; a no-op once closed."""
        from .._native import lib

        with self._lock:
            if not self._closed:
                lib.ct_sync_post(self.port, lib.CT_SYNC_KEY_WAKE, 0)

    def close(self) -> None:
        """Stop every wait (blocking until no callback runs), close the
        events, and the port if it is our own. The Container's port and the
        process handle are the Container's to close, after this."""
        from .._native import lib

        with self._lock:
            if self._closed:
                return
            self._closed = True
            problems = []
            if self._ctrl:
                lib.ct_sync_ctrl_forward(self.port, 0)
            for w in self._watches:
                rc = lib.ct_sync_unwatch_take(w)
                if rc:
                    problems.append(str(error(rc, "UnregisterWaitEx")))
            for ev in self._events:
                lib.ct_job_close_take(ev)
            if self._own_port:
                lib.ct_job_close_take(self.port)
            self._watches, self._events, self._processes = [], [], {}
        if problems:
            raise OSError(f"closing the waiter: {'; '.join(problems)}")

    def __enter__(self) -> "Waiter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def owner_waiter(container: Any, run_uid: str, *, console_ctrl: bool = False) -> Waiter:
    """The waiting piece of a run's owner loop on Windows: the container's
    port (its job's messages), the worker's process handle once it exists
    (`watch_process` again after a spawn that follows), the run's owner
    event, and the console if asked. Call before the spawn: a cancel poked
    in between is a packet waiting for the first wait()."""
    w = Waiter(container.port, job=getattr(container, "key", container.job))
    try:
        w.listen(owner_event_name(run_uid))
        if getattr(container, "process", 0):
            w.watch_process(container.process)
        if console_ctrl:
            w.forward_console_ctrl()
    except BaseException:
        w.close()
        raise
    return w
