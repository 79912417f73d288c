"""The one parser of each /proc file format we read (STYLE.md, "Rooms").

    /proc/<pid>/stat        stat_fields, read_stat, start_time, stat_flags, read_exiting
    /proc/<pid>/comm        read_comm
    /proc/<pid>/status      read_nspid (the NSpid line), parse_status, read_status
    /proc/<pid>/cgroup      parse_cgroups, cgroups_of (every hierarchy), parse_cgroup, cgroup_of (v2)
    /proc/self/mountinfo    mounts; below, mount_path, hierarchy_path (a path
                            through a mount, and back)

Everything read here is input: a malformed line is a ValueError (or None
where the caller asked for "unreadable means unknown"), never a guess. Paths
are decoded as the os module decodes them (surrogateescape): a member may
name a cgroup or a mount point in bytes that are not UTF-8. The C
scanner (_native/procscan.c) keeps its own readers for speed; tests hold the
two to the same answers.
"""
from __future__ import annotations

import errno
import os
import posixpath


# -- where /proc is read ------------------------------------------------------

_view_at: tuple[int, int, int] | None = None     # (fd, st_dev, st_ino) of the clone
_view_pid = -1                                   # the process that took it
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)           # none on Windows, where /proc is not there (OSError)


def _view(check: bool = False) -> tuple[int, int, int]:
    """A descriptor of /proc that nothing mounted below it can lie through
    (procscan.c, ct_proc_view_take: an unwalled root worker shares our mount
    namespace and can bind a file over /proc/<pid>/stat), with its identity;
    fd -1 where the kernel will not clone the mount (no CAP_SYS_ADMIN: then
    nothing we run can mount in our namespace either) and /proc is read by
    its path. A library caller may close descriptors it did not open: after
    a failed read (`check`) the clone is checked to be still ours (fstat),
    and taken again if not.

    A view is the taking process's own: a child of a fork may live in
    another PID namespace (unshare(CLONE_NEWPID) before the fork: a
    container's first process) and mount namespace, where the parent's
    /proc names other processes by the same numbers (its pid 3 was a host
    kernel thread, and a run in the child recorded that as its worker). So
    a process whose pid is not the taker's takes its own."""
    global _view_at, _view_pid
    if _view_at is not None and _view_pid != os.getpid():
        _view_at = None             # inherited across fork (its descriptor is the parent's clone: left as is)
    if _view_at is not None:
        fd, dev, ino = _view_at
        if fd < 0 or not check:
            return _view_at
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (dev, ino):
                return _view_at
        except OSError:
            pass
    fd, dev, ino = -1, 0, 0
    try:
        from ._native import ffi, lib

        out = ffi.new("int*")
        if lib.ct_proc_view_take(out) == 0:
            fd = out[0]
            st = os.fstat(fd)
            dev, ino = st.st_dev, st.st_ino
    except (ImportError, AttributeError, OSError):
        pass
    _view_at, _view_pid = (fd, dev, ino), os.getpid()
    return _view_at


def _read(rel: str, limit: int = 1 << 16) -> bytes:
    """The first `limit` bytes of /proc/`rel`, through the view. Raises OSError."""
    view = _view()
    if view[0] < 0:
        fd = os.open("/proc/" + rel, os.O_RDONLY | _CLOEXEC)
    else:
        try:
            fd = os.open(rel, os.O_RDONLY | _CLOEXEC, dir_fd=view[0])
        except OSError:
            if _view(check=True) is view:
                raise
            return _read(rel, limit)     # our descriptor was closed under us: taken again
    try:
        chunks, left = [], limit
        while left > 0:
            got = os.read(fd, min(left, 1 << 16))
            if not got:
                break
            chunks.append(got)
            left -= len(got)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _listdir(rel: str) -> list[str]:
    view = _view()
    if view[0] < 0:
        return os.listdir("/proc/" + rel)
    try:
        d = os.open(rel, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC, dir_fd=view[0])
    except OSError:
        if _view(check=True) is view:
            raise
        return _listdir(rel)
    try:
        return os.listdir(d)
    finally:
        os.close(d)


# -- /proc/<pid>/stat ---------------------------------------------------------

def stat_fields(data: bytes) -> tuple[str, int, int, int, int]:
    """(state, ppid, pgid, sid, start_time) of one /proc/<pid>/stat line
    (proc(5)). comm (field 2) may hold spaces and parentheses: the fields
    after it start after the LAST ')'. Raises ValueError on a malformed line."""
    rp = data.rfind(b")")
    rest = data[rp + 2 :].split() if rp >= 0 else []
    if len(rest) < 20:
        raise ValueError(f"not a /proc/<pid>/stat line: {data[:80]!r}")
    return rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19])


def read_stat(pid: int | str) -> tuple[str, int, int, int, int] | None:
    """stat_fields of a process, or None if it is gone or unreadable. The
    state is the process's: /proc/<pid>/stat is its leader thread's, which
    says Z once that thread exited alone (SYS_exit), while another thread
    of the process may run on for ever (the leader stays a zombie until the
    last thread exits: delay_group_leader, kernel/exit.c). Every caller
    reads Z as "exited", so a Z is checked against the other threads."""
    try:
        fields = stat_fields(_read(f"{pid}/stat"))
    except (OSError, ValueError):
        return None
    if fields[0] in ("Z", "X"):
        live = _live_thread_state(pid)
        if live is not None:
            return (live,) + fields[1:]
    return fields


PF_EXITING = 0x4        # include/linux/sched.h: set by do_exit(), never cleared


def stat_flags(data: bytes) -> int:
    """The task flags (field 9, `PF_*`) of one /proc/<pid>/stat line.
    Raises ValueError on a malformed line."""
    rp = data.rfind(b")")
    rest = data[rp + 2 :].split() if rp >= 0 else []
    if len(rest) < 7:
        raise ValueError(f"not a /proc/<pid>/stat line: {data[:80]!r}")
    return int(rest[6])


def read_exiting(pid: int | str) -> bool | None:
    """Whether the process (its leader thread, the task /proc/<pid> shows)
    has begun to exit: PF_EXITING set, a zombie, or gone. None if its stat
    could not be read for another reason. PF_EXITING is never cleared, so
    False read after another /proc/<pid> file means the task was not
    exiting when that file was read either."""
    try:
        data = _read(f"{pid}/stat")
    except OSError as e:
        return True if e.errno in (errno.ENOENT, errno.ESRCH) else None
    try:
        fields = stat_fields(data)
        flags = stat_flags(data)
    except ValueError:
        return None
    return bool(flags & PF_EXITING) or fields[0] in ("Z", "X")


def read_environ(pid: int | str, limit: int = 1 << 20) -> bytes:
    """/proc/<pid>/environ (at most `limit` bytes). Raises OSError. A process
    whose leader thread exited alone cannot be read there (ESRCH: the leader
    has no mm any more): then a live thread's, which is the same memory."""
    try:
        return _read(f"{pid}/environ", limit)
    except OSError as e:
        if e.errno != errno.ESRCH:
            raise
        err = e
    try:
        tids = _listdir(f"{pid}/task")
    except OSError:
        raise err from None
    for tid in tids:
        try:
            return _read(f"{pid}/task/{tid}/environ", limit)
        except OSError:
            continue
    raise err


def _live_thread_state(pid: int | str) -> str | None:
    """The state of a thread of `pid` that has not exited, or None if there
    is none (a true zombie lists only its leader in /proc/<pid>/task)."""
    try:
        tids = _listdir(f"{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            state = stat_fields(_read(f"{pid}/task/{tid}/stat"))[0]
        except (OSError, ValueError):
            continue
        if state not in ("Z", "X"):
            return state
    return None


def start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot). Raises OSError."""
    return stat_fields(_read(f"{pid}/stat"))[4]


# -- /proc/<pid>/status --------------------------------------------------------

def read_nspid(pid: int | str) -> list[int] | None:
    """The NSpid line of /proc/<pid>/status (4.1): the process's pid in each
    PID namespace from the reader's down to its own, so the last is its pid
    in its own namespace (1 for a namespace's init). None if it is gone or
    unreadable, or the line is missing or malformed."""
    try:
        data = _read(f"{pid}/status", 16384)
    except OSError:
        return None
    for line in data.splitlines():
        if line.startswith(b"NSpid:"):
            try:
                out = [int(x) for x in line[6:].split()]
            except ValueError:
                return None
            return out if out and all(x > 0 for x in out) else None
    return None


def parse_status(data: bytes) -> dict[str, str]:
    """/proc/<pid>/status as {field: value} (proc(5): one "Name:\tvalue"
    per line; the value stripped). A line without a colon is skipped."""
    out: dict[str, str] = {}
    for line in data.decode(errors="surrogateescape").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.strip()
    return out


def read_status(pid: int | str) -> dict[str, str]:
    """parse_status of a live process. Raises OSError."""
    return parse_status(_read(f"{pid}/status", 16384))


# -- /proc/<pid>/comm ---------------------------------------------------------

def read_comm(pid: int | str) -> str | None:
    """The command name (at most 15 bytes, set by the process itself: a
    label, never an identity), or None if it is gone or unreadable."""
    try:
        return _read(f"{pid}/comm", 64).rstrip(b"\n").decode("utf-8", "replace")
    except OSError:
        return None


# -- /proc/<pid>/cgroup -------------------------------------------------------

def parse_cgroups(text: str) -> dict[str, str]:
    """/proc/<pid>/cgroup as {hierarchy: path}: the v2 line ("0::<path>") is
    "", each v1 hierarchy is named by its sorted controllers ("cpu,cpuacct",
    as its mount shows them); named hierarchies (name=systemd) are skipped.
    Hybrid hosts list v1 hierarchies first (cgroups(7))."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if not hid.isdigit():
            continue
        if hid == "0" and ctrls == "":
            out[""] = path
        elif ctrls and not ctrls.startswith("name="):
            out[",".join(sorted(ctrls.split(",")))] = path
    return out


def cgroups_of(pid: int | str) -> dict[str, str]:
    """parse_cgroups of a live process. Raises OSError."""
    return parse_cgroups(_read(f"{pid}/cgroup", 1 << 20).decode(errors="surrogateescape"))


def parse_cgroup(text: str) -> str | None:
    """The cgroup v2 path of a /proc/<pid>/cgroup file, or None if it has none."""
    for line in text.split("\n"):
        if line.startswith("0::"):
            return line[3:]
    return None


def cgroup_of(pid: int | str, *, missing_ok: bool = False) -> str | None:
    """The v2 path of a process. Raises OSError when the file cannot be
    read, unless `missing_ok` (then None: the caller treats it as unknown)."""
    try:
        return parse_cgroup(_read(f"{pid}/cgroup", 1 << 20).decode(errors="surrogateescape"))
    except OSError:
        if missing_ok:
            return None
        raise


# -- /proc/self/mountinfo -----------------------------------------------------

class Mount:
    """One line of mountinfo. A class, not a namedtuple: `collections`
    costs `contain run` 1 ms to import (see _state.py)."""

    __slots__ = ("point", "root", "fstype", "options", "super_options")

    def __init__(self, point: str, root: str, fstype: str, options: tuple[str, ...],
                 super_options: tuple[str, ...]) -> None:
        self.point = point                   # field 5: where it is mounted
        self.root = root                     # field 4: the mount's root inside its filesystem
        self.fstype = fstype                 # after " - "
        self.options = options               # per-mount options (field 6), in the kernel's order
        self.super_options = super_options   # superblock options (last field)

    def __repr__(self) -> str:
        return f"Mount({self.point!r}, {self.root!r}, {self.fstype!r}, {self.options!r}, {self.super_options!r})"


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (proc(5));
    # every other byte is the path's own (undone through its raw bytes).
    if "\\" not in field:
        return field
    return os.fsdecode(os.fsencode(field).decode("unicode_escape").encode("latin-1"))


_parsed: tuple[str, list[Mount]] | None = None


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text. The last text's parse is kept: a
    run reads /proc/self/mountinfo twice (cgroup v2, then v1), and the same
    text parses the same (a changed one is parsed again)."""
    global _parsed
    last = _parsed
    if last is not None and last[0] == text:
        return list(last[1])
    out = []
    for line in text.split("\n"):
        left, sep, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if not sep or len(lf) < 6 or not rf:
            continue
        out.append(Mount(_unescape(lf[4]), _unescape(lf[3]), rf[0], tuple(lf[5].split(",")),
                         tuple(rf[2].split(",")) if len(rf) > 2 else ()))
    _parsed = (text, out)
    return list(out)


def mounts() -> list[Mount]:
    """Every mount visible to this process. Raises OSError."""
    with open("/proc/self/mountinfo", errors="surrogateescape") as f:
        return parse_mountinfo(f.read())


def every_fd() -> tuple[list[tuple[int, str]], int]:
    """(pid, fd number) of every open descriptor of every process whose fd
    directory could be listed (this process's too), and how many processes'
    could not be (a scan that found nothing there proves nothing)."""
    out: list[tuple[int, str]] = []
    denied = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except FileNotFoundError:
            continue                    # gone meanwhile
        except OSError:
            denied += 1
            continue
        out.extend((int(name), fd) for fd in fds)
    return out, denied


def below(path: str, top: str) -> str:
    """`os.path.relpath(path, top)` for absolute paths, without its two
    abspath calls where `path` is `top` or written plainly below it (the
    common case: every cgroup path here is made by joining onto a mount)."""
    if path == top:
        return "."
    prefix = top if top.endswith("/") else top + "/"
    if (path.startswith(prefix) and "//" not in path and posixpath.normpath(path) == path
            and (top == "/" or posixpath.normpath(top) == top)):
        return path[len(prefix):]
    return posixpath.relpath(path, top)


def mount_path(cg_path: str, root: str, mount: str) -> str:
    """Where the hierarchy path `cg_path` is seen through a mount of the
    hierarchy's `root` at `mount` (mountinfo fields 4 and 5). A path outside
    the mount's root comes out starting with ".." relative to it: callers
    that must refuse that check `hierarchy_rel` first."""
    rel = hierarchy_rel(cg_path, root)
    return posixpath.normpath(posixpath.join(mount, rel)) if rel not in ("", ".") else mount


def hierarchy_rel(cg_path: str, root: str) -> str:
    return below(cg_path, root) if root != "/" else cg_path.lstrip("/")


def hierarchy_path(fs_path: str, mount: str, root: str) -> str:
    """The hierarchy path of `fs_path`, a path through the mount at `mount`
    of the hierarchy's `root`: mount_path's inverse."""
    rel = below(fs_path, mount)
    if rel == ".":
        return root
    return posixpath.normpath(posixpath.join(root, rel))
