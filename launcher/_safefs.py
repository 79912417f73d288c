"""Files in directories we verified, always by a held directory fd.

Everything under the state directory is opened relative to a directory fd
with O_NOFOLLOW (openat), created with O_EXCL where it is new, and given its
mode with fchmod, never by the umask. The models are systemd's chase() and
openat_report_new() and runc's securejoin: a name is resolved one component
at a time against a directory already checked, so a symlink or a directory
swapped in by someone else is refused, not followed.

Errors are their own types, so callers can tell "this is not ours" from
"the disk is full":
- `UnsafePath`: a directory or file fails a check (owner, mode, type,
  symlink). Raised before anything is read from it or written to it.
- `PersistError`: a write could not be completed (ENOSPC, EIO, EDQUOT, a
  short write, a failed fsync or rename). The file it was replacing is
  untouched; no temp file is left behind.
Both are OSError too (with an errno that says the kind), so the handlers
that already catch OSError keep working.
"""
from __future__ import annotations

import errno
import os
import stat
import sys

from ._errors import LauncherError

if sys.platform == "win32":
    # Windows has no directory fds: there this module is imported for its
    # error types only, and the run directory is _platform/winlayout.py.
    O_DIR = O_DIR_PATH = O_READ = 0
else:
    O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    O_DIR_PATH = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    # O_NONBLOCK: a FIFO planted where a file should be must not block the open.
    O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC



class UnsafePath(LauncherError, OSError):
    """A path under the state directory (or a --record target) fails a check:
    it belongs to someone else, is writable by others, is a symlink, or is
    not the kind of file it should be. `path` names it, `problem` says why."""

    def __init__(self, path: str, problem: str, err: int = errno.EPERM) -> None:
        OSError.__init__(self, err, problem, path)
        self.path = path
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


class PersistError(LauncherError, OSError):
    """A file could not be written completely. Nothing torn was left in its
    place: the previous version (if any) is intact. `what` is the step that
    failed (open, write, fsync, rename), `path` the file meant."""

    def __init__(self, err: int, what: str, path: str, detail: str | None = None) -> None:
        OSError.__init__(self, err, detail or os.strerror(err), path)
        self.what = what
        self.path = path

    def __str__(self) -> str:
        return f"{self.path}: {self.strerror} ({self.what})"


def persist_error(e: OSError, what: str, path: str) -> PersistError:
    if isinstance(e, PersistError):
        return e
    return PersistError(e.errno or errno.EIO, what, path, e.strerror)


# -- checks ------------------------------------------------------------------

def check_private_dir(st: os.stat_result, path: str, owners: tuple[int, ...]) -> None:
    """A directory of ours: a real directory, owned by one of `owners`, not
    writable by group or others."""
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(path, "is not a directory", errno.ENOTDIR)
    if st.st_uid not in owners:
        raise UnsafePath(path, f"is owned by uid {st.st_uid}, not by uid {os.geteuid()} (this user)")
    if st.st_mode & 0o022:
        who = {0o020: "its group", 0o002: "others", 0o022: "its group and others"}[st.st_mode & 0o022]
        raise UnsafePath(path, f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}); it must be private")


def dir_error(e: OSError, path: str, parent_fd: int = -1, name: str = "") -> OSError:
    """O_DIRECTORY|O_NOFOLLOW on a symlink fails with ENOTDIR (or ELOOP):
    say which it was."""
    if e.errno == errno.ENOTDIR and name:
        try:
            if stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                return UnsafePath(path, "is a symlink (not followed)", errno.ELOOP)
        except OSError:
            pass
    if e.errno == errno.ELOOP:
        return UnsafePath(path, "is a symlink (not followed)", errno.ELOOP)
    if e.errno == errno.ENOTDIR:
        return UnsafePath(path, "is not a directory", errno.ENOTDIR)
    return e


def open_private_dir(parent_fd: int, name: str, path: str, *, owners: tuple[int, ...],
                     create_mode: int | None = None) -> int:
    """The directory `name` in `parent_fd`, checked (check_private_dir);
    created with exactly `create_mode` if it is missing and a mode is given.
    `path` is only for messages. Raises UnsafePath, FileNotFoundError, OSError."""
    for _ in range(3):
        try:
            fd = os.open(name, O_DIR, dir_fd=parent_fd)
        except FileNotFoundError:
            if create_mode is None:
                raise
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                continue              # made by someone else meanwhile: check what it is
            fd = os.open(name, O_DIR, dir_fd=parent_fd)
            try:
                os.fchmod(fd, create_mode)
            except BaseException:
                os.close(fd)
                raise
        except OSError as e:
            raise dir_error(e, path, parent_fd, name) from None
        try:
            check_private_dir(os.fstat(fd), path, owners)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise UnsafePath(path, "keeps changing while it is opened")


# -- reading -------------------------------------------------------------------

def read_file(dir_fd: int, name: str, path: str, limit: int) -> bytes:
    """The whole of regular file `name`, at most `limit` bytes. Raises
    FileNotFoundError, UnsafePath (symlink, FIFO, device, too large) or
    OSError (EACCES ...)."""
    try:
        fd = os.open(name, O_READ, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(path, "is a symlink (not followed)", errno.ELOOP) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(path, "is not a regular file", errno.EINVAL)
        if st.st_size > limit:
            raise UnsafePath(path, f"is {st.st_size} bytes, more than the {limit} allowed", errno.EFBIG)
        chunks = []
        left = limit + 1
        # Ask for what fstat said (+1 to see EOF): os.read allocates what it
        # is asked for, and a 1 MiB buffer per 7 KB record is most of a read.
        ask = st.st_size + 1
        while left > 0:
            b = os.read(fd, min(left, ask, 1 << 20))
            ask = 1 << 16
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
        if len(data) > limit:
            raise UnsafePath(path, f"grew past the {limit} bytes allowed", errno.EFBIG)
        return data
    finally:
        os.close(fd)


# -- writing -------------------------------------------------------------------

def write_all(fd: int, data: bytes) -> None:
    """Write every byte, looping on short writes (a full disk returns a short
    count first, then ENOSPC)."""
    view = memoryview(data)
    off = 0
    while off < len(view):
        n = os.write(fd, view[off:])
        if n <= 0:
            raise OSError(errno.EIO, "write wrote nothing")
        off += n


_MEMORY_FS = ("tmpfs", "ramfs")
_fs_kind: dict[int, bool] = {}


def in_memory(fd: int) -> bool:
    """Whether the file system of `fd` keeps everything in memory (tmpfs,
    ramfs), where fsync buys nothing: what it would protect does not survive
    the crash it protects against. Decided by the mount's type in
    /proc/self/mountinfo for the fd's st_dev (statfs(2)'s TMPFS_MAGIC is not
    reachable from Python); a device with a real major number is a disk.
    When in doubt: not in memory (fsync)."""
    dev = os.fstat(fd).st_dev
    known = _fs_kind.get(dev)
    if known is not None:
        return known
    mem = False
    if os.major(dev) == 0:
        want = f"{os.major(dev)}:{os.minor(dev)}"
        try:
            with open("/proc/self/mountinfo", "rb") as f:
                for line in f:
                    fields = line.split(b" ")
                    if len(fields) > 3 and fields[2].decode() == want:
                        _left, _, right = line.partition(b" - ")
                        mem = right.split(b" ", 1)[0].decode() in _MEMORY_FS
                        break
        except OSError:
            mem = False
    _fs_kind[dev] = mem
    return mem


# Crash-consistent, not power-loss durable (the owner's decision, issue 27):
# what contain promises is written to the file before the action it guards,
# which every other process sees at once (the page cache is shared), so it
# survives the supervisor's death (a crash, SIGKILL, an OOM kill). It need
# not survive the machine's: a reboot ends every process of every run, and
# the boot id in run.json proves it to whoever reads the run afterwards. An
# fsync cost 0.3 to 2.5 ms on the disks measured (docs/performance.md), more
# than a whole run's budget; so none is made.
POWER_LOSS_DURABLE = False


def sync(fd: int) -> None:
    """fsync where writes must survive power loss (never, by the decision
    above), and then not for a file that lives in memory (in_memory)."""
    if POWER_LOSS_DURABLE and not in_memory(fd):
        os.fsync(fd)


def temp_name(name: str) -> str:
    return f".{name}.{os.urandom(6).hex()}.tmp"


def replace_file(dir_fd: int, name: str, data: bytes, path: str, *, mode: int = 0o600,
                 durable: bool = False, keep_old: bool = True) -> os.stat_result:
    """Replace `name` in `dir_fd` with `data`, atomically: a temp file with
    a random name, created O_EXCL|O_NOFOLLOW in the same directory, written
    completely (short writes looped, the size checked), fsynced when
    `durable`, then renamed over `name`. Readers see the old file or the new
    one. Returns the new file's stat (the rename keeps its inode, size and
    mtime). Raises PersistError; the old file is then untouched and the
    temp file removed.

    `keep_old=False` (with `durable`): the file replaced, if any, need not
    survive a crash (a run's record while it is live, which a final one
    replaces: run.json says as much). The rename then comes before the
    fsyncs: a journalling filesystem (ext4, xfs) commits the rename with
    the file's own fsync, and the directory's finds nothing left to
    commit, one journal commit instead of two (about 1 ms of a cold
    `contain run` on this ext4). A crash before they return leaves the old file,
    the new one, or (where the data was not yet written, as ext4's
    auto_da_alloc ensures it is) one a reader finds incomplete and says
    so; a failed fsync removes it."""
    early = durable and not keep_old        # renamed before the fsyncs
    tmp = temp_name(name)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                     dir_fd=dir_fd)
    except OSError as e:
        raise persist_error(e, "create", path) from None
    step, placed = "write", False
    try:
        try:
            os.fchmod(fd, mode)
            write_all(fd, data)
            st = os.fstat(fd)
            if st.st_size != len(data):
                raise OSError(errno.EIO, "file size differs from what was written")
            if early:
                step = "rename"
                os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                placed = True
            if durable:
                step = "fsync"
                sync(fd)
        finally:
            os.close(fd)
        if placed:
            step = "fsync of the directory"
            sync(dir_fd)
        else:
            step = "rename"
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as e:
        try:
            os.unlink(name if placed else tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise persist_error(e, step, path) from None
    if durable and not early:
        try:
            sync(dir_fd)
        except OSError as e:
            raise persist_error(e, "fsync of the directory", path) from None
    return st


def open_append(dir_fd: int, name: str, path: str, *, mode: int = 0o600) -> tuple[int, bool]:
    """An O_APPEND fd (read-write, see append_line) of regular file `name`,
    and whether it was created now (with exactly `mode`). Raises UnsafePath
    (not a regular file, a symlink) or PersistError."""
    fd, created, _size = open_append_sized(dir_fd, name, path, mode=mode)
    return fd, created


def open_append_sized(dir_fd: int, name: str, path: str, *, mode: int = 0o600,
                      existing: bool = False) -> tuple[int, bool, int]:
    """open_append, and the file's size as its fstat said (append_line's
    `size`). `existing`: the caller made the file before (a run's own
    journal, appended to a few times a run): it is opened without O_CREAT
    first, and made only if it is gone, which saves the failed O_EXCL open
    of every later line."""
    flags = os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = -1
        if existing:
            try:
                fd = os.open(name, flags, dir_fd=dir_fd)
                created = False
            except FileNotFoundError:
                fd = -1
        if fd < 0:
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=dir_fd)
                created = True
            except FileExistsError:
                fd = os.open(name, flags, dir_fd=dir_fd)
                created = False
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(path, "is a symlink (not followed)", errno.ELOOP) from None
        raise persist_error(e, "open", path) from None
    try:
        if created:
            os.fchmod(fd, mode)
            size = 0
        else:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePath(path, "is not a regular file", errno.EINVAL)
            size = st.st_size
    except BaseException:
        os.close(fd)
        raise
    return fd, created, size


def append_line(fd: int, line: bytes, path: str, *, durable: bool = False, size: int | None = None) -> None:
    """One O_APPEND write of `line` (atomic towards other appenders of a
    regular file), fsynced when `durable`. If the file does not end with a
    newline (a writer before us was cut short by a full disk), the line is
    started with one: the torn fragment then reads as one bad line, and this
    line stays whole. `size`: the file's size as the caller's fstat of this
    fd just said (open_append_sized), else it is asked here. Raises
    PersistError."""
    try:
        if size is None:
            size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        write_all(fd, line)
        if durable:
            sync(fd)
    except OSError as e:
        raise persist_error(e, "fsync" if durable else "write", path) from None


# -- removing ------------------------------------------------------------------

# remove_tree holds at most this many directory fds; deeper directories are
# first moved up into the top one.
_MAX_OPEN = 64


def remove_tree(parent_fd: int, name: str) -> None:
    """Remove directory `name` under `parent_fd` and everything in it,
    without following any symlink (each level by its own fd), however deep:
    a directory past _MAX_OPEN levels is first renamed up into the top one.
    (A fixed depth bound refused the tree of a worker that nested six
    directories in its run directory, and the `.gc-*` it had been set aside
    as stayed for ever, every later `gc` failing on it.) Raises OSError."""
    stack = [(os.open(name, O_DIR, dir_fd=parent_fd), name)]
    moved = 0
    try:
        while stack:
            fd = stack[-1][0]
            with os.scandir(fd) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            sub = None
            for n, is_dir in entries:
                if is_dir:
                    sub = sub or n
                    continue
                try:
                    os.unlink(n, dir_fd=fd)
                except FileNotFoundError:
                    pass
            if sub is None:                    # empty: remove it from its parent
                _fd, n = stack.pop()
                os.close(_fd)
                os.rmdir(n, dir_fd=stack[-1][0] if stack else parent_fd)
            elif len(stack) < _MAX_OPEN:
                stack.append((os.open(sub, O_DIR, dir_fd=fd), sub))
            else:
                moved += 1
                os.rename(sub, f".deep-{moved}-{os.urandom(4).hex()}", src_dir_fd=fd, dst_dir_fd=stack[0][0])
    finally:
        for fd, _n in stack:
            os.close(fd)
