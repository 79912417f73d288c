"""The suite's own view of processes, through ctypes and toolhelp: never
through launcher's code, so what is under test is not its own witness.

A helper process marks itself with a file `<tag>.<pid>` holding its own
creation time (GetProcessTimes of itself, 100 ns). A marked process is alive
when the toolhelp snapshot lists its pid AND a handle opened by pid has
that creation time AND is not signalled: a pid alone is a number Windows
hands out again.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time
from ctypes import wintypes as w

assert sys.platform == "win32"

k32 = ctypes.WinDLL("kernel32", use_last_error=True)

SYNCHRONIZE = 0x00100000
PROCESS_TERMINATE = 0x0001
PROCESS_QUERY_INFORMATION = 0x0400
PROCESS_QUERY_LIMITED_INFORMATION = 0x1000
TH32CS_SNAPPROCESS = 0x2
WAIT_OBJECT_0, WAIT_TIMEOUT = 0, 258
ERROR_INVALID_PARAMETER = 87


class PROCESSENTRY32W(ctypes.Structure):
    _fields_ = [("dwSize", w.DWORD), ("cntUsage", w.DWORD), ("th32ProcessID", w.DWORD),
                ("th32DefaultHeapID", ctypes.c_size_t), ("th32ModuleID", w.DWORD), ("cntThreads", w.DWORD),
                ("th32ParentProcessID", w.DWORD), ("pcPriClassBase", w.LONG), ("dwFlags", w.DWORD),
                ("szExeFile", w.WCHAR * 260)]


k32.CreateToolhelp32Snapshot.restype = w.HANDLE
k32.CreateToolhelp32Snapshot.argtypes = [w.DWORD, w.DWORD]
k32.Process32FirstW.argtypes = [w.HANDLE, ctypes.POINTER(PROCESSENTRY32W)]
k32.Process32NextW.argtypes = [w.HANDLE, ctypes.POINTER(PROCESSENTRY32W)]
k32.OpenProcess.restype = w.HANDLE
k32.OpenProcess.argtypes = [w.DWORD, w.BOOL, w.DWORD]
k32.CloseHandle.argtypes = [w.HANDLE]
k32.WaitForSingleObject.argtypes = [w.HANDLE, w.DWORD]
k32.WaitForSingleObject.restype = w.DWORD
k32.GetProcessTimes.argtypes = [w.HANDLE] + [ctypes.POINTER(w.FILETIME)] * 4
k32.TerminateProcess.argtypes = [w.HANDLE, w.UINT]
k32.GetCurrentProcess.restype = w.HANDLE
k32.IsProcessInJob.argtypes = [w.HANDLE, w.HANDLE, ctypes.POINTER(w.BOOL)]
k32.GetSystemTimeAsFileTime.argtypes = [ctypes.POINTER(w.FILETIME)]


def snapshot() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, exe name) of every process toolhelp lists."""
    snap = k32.CreateToolhelp32Snapshot(TH32CS_SNAPPROCESS, 0)
    if snap in (None, w.HANDLE(-1).value):
        raise OSError(ctypes.get_last_error(), "CreateToolhelp32Snapshot")
    out = {}
    try:
        e = PROCESSENTRY32W()
        e.dwSize = ctypes.sizeof(e)
        ok = k32.Process32FirstW(snap, ctypes.byref(e))
        while ok:
            out[int(e.th32ProcessID)] = (int(e.th32ParentProcessID), e.szExeFile)
            ok = k32.Process32NextW(snap, ctypes.byref(e))
    finally:
        k32.CloseHandle(snap)
    return out


def _open(pid: int, extra: int = 0) -> int | None:
    h = k32.OpenProcess(SYNCHRONIZE | PROCESS_QUERY_INFORMATION | extra, False, pid)
    if not h:
        h = k32.OpenProcess(SYNCHRONIZE | PROCESS_QUERY_LIMITED_INFORMATION | extra, False, pid)
    return int(h) if h else None


def creation_time(handle: int) -> int:
    ft = [w.FILETIME() for _ in range(4)]
    if not k32.GetProcessTimes(handle, *[ctypes.byref(f) for f in ft]):
        raise OSError(ctypes.get_last_error(), "GetProcessTimes")
    return (ft[0].dwHighDateTime << 32) | ft[0].dwLowDateTime


def my_creation_time() -> int:
    return creation_time(k32.GetCurrentProcess())


def alive(pid: int, created: int) -> bool:
    """This very process runs now (see the module's docstring)."""
    if pid not in snapshot():
        return False
    h = _open(pid)
    if h is None:
        err = ctypes.get_last_error()
        if err == ERROR_INVALID_PARAMETER:
            return False
        raise OSError(err, f"OpenProcess({pid})")
    try:
        if creation_time(h) != created:
            return False
        return k32.WaitForSingleObject(h, 0) == WAIT_TIMEOUT
    finally:
        k32.CloseHandle(h)


def named_since(exe: str, since: int) -> dict[int, int]:
    """pid -> creation time of every live process whose image is `exe`
    (case-insensitive) and that was created at or after `since` (FILETIME):
    what a test started, found without any mark of its own (cmd's `start`)."""
    out = {}
    for pid, (_ppid, name) in snapshot().items():
        if name.lower() != exe.lower():
            continue
        h = _open(pid)
        if h is None:
            continue
        try:
            created = creation_time(h)
            if created >= since and k32.WaitForSingleObject(h, 0) == WAIT_TIMEOUT:
                out[pid] = created
        finally:
            k32.CloseHandle(h)
    return out


def filetime_now() -> int:
    ft = w.FILETIME()
    k32.GetSystemTimeAsFileTime(ctypes.byref(ft))
    return (ft.dwHighDateTime << 32) | ft.dwLowDateTime


def in_job(pid: int, job: int) -> bool | None:
    h = _open(pid)
    if h is None:
        return None
    try:
        inside = w.BOOL()
        if not k32.IsProcessInJob(h, job, ctypes.byref(inside)):
            return None
        return bool(inside.value)
    finally:
        k32.CloseHandle(h)


def mark(directory: str, tag: str) -> None:
    """Called by a helper about itself: `<tag>.<pid>` holding its creation time."""
    path = os.path.join(directory, f"{tag}.{os.getpid()}")
    with open(path + ".tmp", "w") as f:
        f.write(str(my_creation_time()))
    os.replace(path + ".tmp", path)


def marks(directory: str, tag: str) -> dict[int, int]:
    """pid -> creation time of every helper marked with `tag`."""
    out = {}
    for n in os.listdir(directory):
        base, _, pid = n.rpartition(".")
        if base == tag and pid.isdigit():
            try:
                with open(os.path.join(directory, n)) as f:
                    out[int(pid)] = int(f.read())
            except (OSError, ValueError):
                continue
    return out


def wait_marks(directory: str, tag: str, n: int, timeout: float = 30.0) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    found = marks(directory, tag)
    while len(found) < n and time.monotonic() < deadline:
        time.sleep(0.02)
        found = marks(directory, tag)
    return found


def wait_gone(procs: dict[int, int], timeout: float = 15.0) -> list[int]:
    """Pids of `procs` still alive after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    left = [p for p, c in procs.items() if alive(p, c)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p, c in procs.items() if alive(p, c)]
    return left


def kill(pid: int, created: int) -> None:
    """End a helper the test started, by pid checked against its creation
    time (cleanup; never a process the test did not start)."""
    h = _open(pid, PROCESS_TERMINATE)
    if h is None:
        return
    try:
        if creation_time(h) == created and k32.WaitForSingleObject(h, 0) == WAIT_TIMEOUT:
            k32.TerminateProcess(h, 1)
            k32.WaitForSingleObject(h, 5000)
    finally:
        k32.CloseHandle(h)


def wine_version() -> str | None:
    """Wine's version if this runs under Wine (ntdll exports wine_get_version):
    only to say which documented Wine gap an assertion skips."""
    ntdll = ctypes.WinDLL("ntdll")
    try:
        f = ntdll.wine_get_version
    except AttributeError:
        return None
    f.restype = ctypes.c_char_p
    v = f()
    return v.decode() if v else "unknown"
