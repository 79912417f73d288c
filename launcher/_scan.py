"""A snapshot of every process: identity, tree and cgroup v2 path, from /proc.

The work is done in C (`_native/procscan.c`): cgroups come from one walk of
the cgroup v2 hierarchy (every cgroup.procs) rather than one
/proc/<pid>/cgroup per process, the /proc/<pid>/stat files are shared by a
few threads when there are CPUs to spare, and the entries come back as
columns that this module turns into `ProcessInfo` values in a few bulk
calls. `parse_stat` (built on _procfs.stat_fields) and `parse_cgroup` (from
_procfs) are the Python parsers, for fixture tests and for the fallback used
when the extension is not built.

The snapshot is not atomic: /proc is read one process at a time. A process
that exits while it is read is left out; one that starts during the scan may
or may not appear. A process's cgroup is where it was at some moment of the
scan, as /proc/<pid>/cgroup would have said then: the walk ends before any
stat is read and is trusted only for processes older than it, everyone else
(zombies, newborns, processes that moved during the walk or sit under a
threaded domain) has its own file read. A file that exists but cannot be
read is reported, never skipped: a stat that cannot be read fails the scan,
a cgroup file that cannot be read gives `cgroup=None` with the reason in
`cgroup_error`.

Imported on hot paths: no psutil, nothing heavier than `os`.
"""
from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterable
from itertools import repeat
from typing import Any, NamedTuple

from ._procfs import parse_cgroup, stat_fields

try:
    from ._native import ffi as _ffi, lib as _lib
except ImportError as err:  # not built: the Python reader below takes over
    _ffi = _lib = None
    _native_missing: str | None = str(err)
else:
    _native_missing = None
    # The C side writes every field of the entries it reports and Python
    # reads no others, so the buffer need not be zeroed first.
    _new_uncleared = _ffi.new_allocator(should_clear_after_alloc=False)

__all__ = ["ProcessInfo", "scan_processes", "parse_stat", "parse_cgroup", "members_of"]


class ProcessInfo(NamedTuple):
    """One process as /proc showed it during a scan."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str          # one letter, proc(5) field 3: R S D Z T t X I ...
    start_time: int     # proc(5) field 22: clock ticks after boot; with pid, the process's identity
    comm: str           # undecodable bytes kept as surrogates (os.fsdecode's rule)
    cgroup: str | None  # v2 path from "0::", as the kernel prints it; None if not read
    cgroup_error: str | None = None  # why cgroup is None


NOT_REQUESTED = "not requested"
NO_V2 = "no cgroup v2 hierarchy"

# Reading many processes without a per-process Python call needs the buffer
# sized up front; the previous scan's count is the best guess for the next.
_cap_hint = 512
_RETRIES = 8


def parse_stat(text: str) -> ProcessInfo:
    """Parse one /proc/<pid>/stat line (proc(5)).

    comm may contain spaces, parentheses and newlines, so it runs from the
    first '(' to the LAST ')'; every field after it is a number.
    """
    lp = text.find("(")
    rp = text.rfind(")")
    if lp < 0 or rp < lp:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    try:
        state, ppid, pgid, sid, start = stat_fields(text.encode())
        return ProcessInfo(pid=int(text[:lp]), ppid=ppid, pgid=pgid, sid=sid, state=state,
                           start_time=start, comm=text[lp + 1 : rp], cgroup=None,
                           cgroup_error=NOT_REQUESTED)
    except ValueError as err:
        raise ValueError(f"bad /proc/<pid>/stat line: {text[:80]!r}") from err


def members_of(cgroup_path: str, procs: Iterable[ProcessInfo]) -> list[ProcessInfo]:
    """The processes in `cgroup_path` or below it.

    A process whose cgroup could not be read is not a member here; callers
    that must account for every process check `cgroup is None` themselves.
    The kernel prints a removed cgroup as "<path> (deleted)"; such a process
    is not a member of `<path>` either.
    """
    path = cgroup_path.rstrip("/")
    prefix = path + "/"
    return [p for p in procs if p.cgroup is not None and (p.cgroup == path or p.cgroup.startswith(prefix))]


def scan_processes(*, cgroups: bool = True) -> list[ProcessInfo]:
    """Every process in this pid namespace's /proc, in /proc's order.

    With `cgroups=False` the cgroup hierarchy is not walked (about a tenth
    of the work with 3,000 processes); `cgroup` is then None with
    `cgroup_error` "not requested".
    Raises OSError if /proc cannot be listed or a process's stat cannot be
    read for any reason but its exit.

    On Windows: one Toolhelp snapshot (_platform/winproc.snapshot). `ppid`
    is the parent's pid as Windows kept it (that pid may since name another
    process: compare creation times); `start_time` is the creation time as
    a FILETIME (100 ns since 1601), 0 for a process this token cannot open
    (System, protected processes); `state` is "R", or "Z" for an exited
    process whose object an open handle keeps; `comm` is the image's file
    name; `pgid` and `sid` are -1 (Windows has neither); `cgroup` is None.
    """
    if sys.platform == "win32":
        return _scan_windows()
    if _lib is None:
        return _scan_python(cgroups)
    return _scan_native(cgroups)


NO_CGROUPS = "Windows has no cgroups"


def _scan_windows() -> list[ProcessInfo]:
    from ._platform.winproc import snapshot

    return [ProcessInfo(pid, ppid, -1, -1, "R" if threads else "Z", created, name, None, NO_CGROUPS)
            for pid, ppid, threads, created, _err, name in snapshot()]


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")


def _read_all(cgroups: bool, threads: int = 0, walk: bool = True, stats: Any = None) -> tuple[Any, int]:
    global _cap_hint
    cap = _cap_hint
    n = _ffi.new("int *")
    flags = (_lib.CT_PROCSCAN_CGROUP if cgroups else 0) | (0 if walk else _lib.CT_PROCSCAN_NO_WALK)
    for _ in range(_RETRIES):
        buf = _new_uncleared("struct ct_proc[]", cap)
        rc = _lib.ct_procscan_read(buf, cap, n, flags, threads, stats if stats is not None else _ffi.NULL)
        if rc == -errno.ENOSPC:
            # Processes may keep appearing: leave headroom beyond the count.
            cap = n[0] + n[0] // 4 + 64
            continue
        _check(rc, "ct_procscan_read /proc")
        _cap_hint = max(512, n[0] + n[0] // 4 + 64)
        return buf, n[0]
    raise OSError(errno.ENOSPC, f"ct_procscan_read /proc: still growing after {_RETRIES} tries")


def _scan_native(cgroups: bool, *, threads: int = 0, walk: bool = True, stats: Any = None) -> list[ProcessInfo]:
    """The C scan. threads=0 lets C choose; walk=False reads every
    /proc/<pid>/cgroup instead of walking the hierarchy; stats, a
    `struct ct_procscan_stats *`, says how the scan went. The last three are
    for tests and benchmarks: the result is the same either way."""
    buf, n = _read_all(cgroups, threads, walk, stats)
    if not n:
        return []
    # Field-by-field access through cffi cost ~1 us per process, a third of
    # the scan; C lays the entries out as columns and each column converts
    # in one C-level call.
    lib, unpack = _lib, _ffi.unpack
    ids = _new_uncleared("int[]", 4 * n)
    starts = _new_uncleared("unsigned long long[]", n)
    states = _new_uncleared("char[]", n)
    comms = _new_uncleared("char[]", n * (lib.CT_PROC_COMM_MAX + 1))
    refs = _new_uncleared("int[]", n)
    odd = _new_uncleared("int[]", n)
    cols = _ffi.new("struct ct_procscan_cols *", {
        "ids": ids, "start_time": starts, "state": states, "comm": comms, "cgroup": refs, "odd": odd,
    })
    bad = (
        lib.CT_PROC_STAT_UNREADABLE
        | lib.CT_PROC_CGROUP_DENIED
        | lib.CT_PROC_CGROUP_UNREADABLE
        | lib.CT_PROC_CGROUP_ABSENT
        | lib.CT_PROC_CGROUP_TRUNCATED
    )
    _check(lib.ct_procscan_pack(buf, n, bad, cols), "ct_procscan_pack")
    v = unpack(ids, 4 * n)
    # A comm holds any byte but NUL: NUL-joined, they decode and split as
    # one string, each undecodable byte becoming the same surrogate as alone.
    names = unpack(comms, cols.comm_len).decode("utf-8", "surrogateescape").split("\0")
    if cgroups:
        # Most processes share a handful of cgroups: one str per distinct path.
        first = unpack(refs, n)
        string = _ffi.string
        path = {i: string(buf[i].cgroup).decode("utf-8", "surrogateescape") for i in set(first)}
        cgroup_col: Iterable[str | None] = map(path.__getitem__, first)
        error = None
    else:
        cgroup_col, error = repeat(None), NOT_REQUESTED
    out: list[ProcessInfo] = list(map(
        tuple.__new__,  # skips NamedTuple's Python-level __new__
        repeat(ProcessInfo),
        zip(v[:n], v[n : 2 * n], v[2 * n : 3 * n], v[3 * n :], unpack(states, n).decode("latin-1"),
            unpack(starts, n), names, cgroup_col, repeat(error)),
    ))
    if cols.n_odd:
        gone = []
        for i in unpack(odd, cols.n_odd):
            info = _odd_entry(buf[i], cgroups)
            if info is None:
                gone.append(i)
            else:
                out[i] = info
        for i in reversed(gone):
            del out[i]
    return out


def _odd_entry(p: Any, cgroups: bool) -> ProcessInfo | None:
    """An entry that carries a CT_PROC_* failure flag: rare, so plain code."""
    lib = _lib
    if p.flags & lib.CT_PROC_STAT_UNREADABLE:
        # Not a race (the C side drops exited processes): a scan that cannot
        # see a live process must not claim to be complete.
        err = p.stat_errno
        raise OSError(err, f"read /proc/{p.pid}/stat: {os.strerror(err)}")
    cgroup: str | None = None
    error: str | None = None
    if not cgroups:
        error = NOT_REQUESTED
    elif p.flags & (lib.CT_PROC_CGROUP_DENIED | lib.CT_PROC_CGROUP_UNREADABLE):
        error = os.strerror(p.cgroup_errno).lower()
    elif p.flags & lib.CT_PROC_CGROUP_ABSENT:
        error = NO_V2
    elif p.flags & lib.CT_PROC_CGROUP_TRUNCATED:
        # Longer than the C buffer: read this one file again, whole.
        try:
            cgroup, error = _read_cgroup_py(p.pid, p.start_time)
        except ProcessLookupError:
            return None  # exited since: as if the scan had missed it
    else:
        cgroup = _ffi.string(p.cgroup).decode("utf-8", "surrogateescape")
    return ProcessInfo(
        p.pid,
        p.ppid,
        p.pgid,
        p.sid,
        chr(p.state[0]),
        p.start_time,
        _ffi.string(p.comm).decode("utf-8", "surrogateescape"),
        cgroup,
        error,
    )


def _read_cgroup_py(pid: int, start_time: int) -> tuple[str | None, str | None]:
    """(path, error) for a process known by pid and start time.

    Raises ProcessLookupError if that process is gone, including when its pid
    now names another process (the start time differs).
    """
    try:
        dfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as err:
        raise ProcessLookupError(pid) from err
    try:
        stat = _read_at(dfd, "stat")
        if parse_stat(stat).start_time != start_time:
            raise ProcessLookupError(pid)
        try:
            text = _read_at(dfd, "cgroup")
        except ProcessLookupError:
            raise
        except OSError as err:
            return None, _reason(err)
        path = parse_cgroup(text)
        return path, None if path is not None else NO_V2
    finally:
        os.close(dfd)


def _reason(err: OSError) -> str:
    return (err.strerror or str(err)).lower()


def _read_at(dfd: int, name: str) -> str:
    """A whole procfs file under a /proc/<pid> descriptor.

    Opening relative to the directory keeps the read on the process the
    directory was opened for; a reaped one gives ENOENT or ESRCH.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError as err:
        raise ProcessLookupError(err.errno, err.strerror) from err
    try:
        chunks = []
        while True:
            b = os.read(fd, 65536)  # ESRCH once reaped: ProcessLookupError
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks).decode("utf-8", "surrogateescape")
    finally:
        os.close(fd)


def _scan_python(cgroups: bool) -> list[ProcessInfo]:
    """The same scan without the extension: correct, about ten times slower."""
    out: list[ProcessInfo] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            dfd = os.open(f"/proc/{name}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                info = parse_stat(_read_at(dfd, "stat"))
            except ProcessLookupError:
                continue
            if cgroups:
                try:
                    path = parse_cgroup(_read_at(dfd, "cgroup"))
                    info = info._replace(cgroup=path, cgroup_error=None if path is not None else NO_V2)
                except ProcessLookupError:
                    continue
                except OSError as err:
                    info = info._replace(cgroup_error=_reason(err))
        finally:
            os.close(dfd)
        out.append(info)
    return out
