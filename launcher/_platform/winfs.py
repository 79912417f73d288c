"""Windows file primitives for the run directory: the owner lock, atomic
replace under Windows sharing rules, reads that never block a writer, and
the state directory under %LOCALAPPDATA%.

- **Owner lock.** `LockFileEx` on byte 0 of `owner.lock`. Windows drops a
  process's byte-range locks when it dies (its handles are closed at
  rundown, before its process object is signalled), whatever happens to
  its pid. The file is opened without FILE_SHARE_DELETE, so nobody can
  delete or rename it while it is held and lock a fresh file of that
  name, and not inheritable, so no child holds it after us.
- **Probe.** `lock_held` takes a *shared* lock with LOCKFILE_FAIL_IMMEDIATELY
  and releases it at once: refused means an exclusive holder exists. Two
  probes never disturb each other; a claimant racing a probe can be refused
  for that instant, as with flock(LOCK_SH|LOCK_NB) on Linux.
- **Atomic replace.** `os.replace` (MoveFileExW with REPLACE_EXISTING) fails
  while any process has the target open: with the classic rename
  semantics even FILE_SHARE_DELETE does not help (Wine 8 behaves so too),
  so a reader makes the writer's rename fail with access denied or a
  sharing violation. `replace` retries for a bounded time and then raises.
  `read_bytes` holds the file only while it reads, and with every share
  mode, so it never blocks a delete (gc) and blocks a rename only for that
  moment.
- **No links followed.** Reads and the state directory check open with
  FILE_FLAG_OPEN_REPARSE_POINT and refuse a reparse point (a symlink or a
  junction) rather than following it.

Windows only: every entry point checks the platform first.
"""
from __future__ import annotations

import errno
import os
import sys
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Mapping

from .winsync import SE_FILE_OBJECT, check, error, require_windows

_GENERIC_READ = 0x80000000
_GENERIC_WRITE = 0x40000000
_READ_CONTROL = 0x00020000
_SYNCHRONIZE = 0x00100000
_FILE_APPEND_DATA = 0x0004
_FILE_FLAG_WRITE_THROUGH = 0x80000000
_FILE_SHARE_READ, _FILE_SHARE_WRITE, _FILE_SHARE_DELETE = 1, 2, 4
_OPEN_EXISTING, _OPEN_ALWAYS = 3, 4
_FILE_FLAG_BACKUP_SEMANTICS = 0x02000000    # needed to open a directory
_FILE_FLAG_OPEN_REPARSE_POINT = 0x00200000
_FILE_ATTRIBUTE_REPARSE_POINT = 0x400
_FILE_ATTRIBUTE_DIRECTORY = 0x10
_ERROR_LOCK_VIOLATION = 33
# What a reader holding the target open makes MoveFileExW fail with: sharing
# violation (32) on most file systems, access denied (5) where the target
# is open (Wine reports 5; so does Windows for a file pending deletion).
_RETRY_WINERRORS = (5, 32)
REPLACE_TIMEOUT = 2.0
APPEND_LOCK_OFFSET = 1 << 62      # the appenders' lock: far past any data a reader reads


def _open_handle(path: str, access: int, share: int, disposition: int, flags: int = 0) -> int:
    require_windows("winfs")
    if sys.platform != "win32":   # also tells mypy that what follows is Windows code
        raise AssertionError
    import _winapi

    return int(_winapi.CreateFile(path, access, share, 0, disposition, flags, 0))


def _close_handle(h: int) -> None:
    if sys.platform == "win32":
        import _winapi

        _winapi.CloseHandle(h)


def _refuse_reparse(fd: int, path: str) -> None:
    st = os.fstat(fd)
    attrs = getattr(st, "st_file_attributes", 0)
    if attrs & _FILE_ATTRIBUTE_REPARSE_POINT:
        raise OSError(errno.ELOOP, f"{path}: a reparse point (link or junction): not followed")


# -- the owner lock ------------------------------------------------------------

class OwnerLock:
    """An exclusive lock held for the owner's lifetime (`acquire`, `release`)."""

    __slots__ = ("path", "fd")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def acquire(cls, path: str, *, wait: bool = False) -> "OwnerLock | None":
        """Take the lock, creating the file if needed. None: someone else
        holds it (with `wait`, block until they are gone instead: the claim
        guard). Raises OSError when the file cannot be opened."""
        if sys.platform != "win32":
            require_windows("OwnerLock")
            raise AssertionError
        import msvcrt

        from .._native import lib

        # No FILE_SHARE_DELETE: the held file cannot be swapped for another.
        # _winapi handles are not inheritable; the fd keeps it that way.
        h = _open_handle(path, _GENERIC_READ | _GENERIC_WRITE, _FILE_SHARE_READ | _FILE_SHARE_WRITE, _OPEN_ALWAYS,
                         _FILE_FLAG_OPEN_REPARSE_POINT)
        fd = msvcrt.open_osfhandle(h, os.O_RDWR)
        try:
            _refuse_reparse(fd, path)
            rc = lib.ct_sync_lock(h, 1, 0 if wait else 1)
            if rc == _ERROR_LOCK_VIOLATION:
                os.close(fd)
                return None
            check(rc, f"LockFileEx({path})")
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Unlock and close (closing alone would do: the lock goes with the handle)."""
        if self.fd >= 0 and sys.platform == "win32":
            import msvcrt

            from .._native import lib

            lib.ct_sync_unlock(msvcrt.get_osfhandle(self.fd))
            os.close(self.fd)
        self.fd = -1


def lock_held(path: str) -> bool | None:
    """Whether some process holds the owner lock on `path` now: True, False
    (free, or no such file), or None when that could not be told."""
    if sys.platform != "win32":
        require_windows("lock_held")
        raise AssertionError
    import msvcrt

    from .._native import lib

    try:
        h = _open_handle(path, _GENERIC_READ, _FILE_SHARE_READ | _FILE_SHARE_WRITE, _OPEN_EXISTING,
                         _FILE_FLAG_OPEN_REPARSE_POINT)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    fd = msvcrt.open_osfhandle(h, os.O_RDONLY)
    try:
        try:
            _refuse_reparse(fd, path)
        except OSError:
            return None
        rc = lib.ct_sync_lock(h, 0, 1)
        if rc == 0:
            lib.ct_sync_unlock(h)
            return False
        return True if rc == _ERROR_LOCK_VIOLATION else None
    finally:
        os.close(fd)


# -- reads and atomic writes -----------------------------------------------------

def read_bytes(path: str, limit: int | None = None) -> bytes:
    """The whole file, opened with every share mode for as long as the read
    takes, and without following a reparse point. With `limit`, a file
    larger than that raises OSError(EFBIG) (at most limit + 1 bytes read)."""
    data, _size, _prev = read_at(path, 0, None if limit is None else limit + 1)
    if limit is not None and len(data) > limit:
        raise OSError(errno.EFBIG, f"{path}: more than the {limit} bytes allowed")
    return data


def read_at(path: str, offset: int, size: int | None) -> tuple[bytes, int, bytes]:
    """At most `size` bytes (None: all) from `offset`, opened as read_bytes
    opens; also the file's size and the byte before `offset` (b"" at 0 or
    past the end). Raises FileNotFoundError, OSError(ELOOP) for a reparse
    point, OSError(EINVAL) for what is not a regular file."""
    if sys.platform != "win32":
        require_windows("read_at")
        raise AssertionError
    import msvcrt
    import stat

    h = _open_handle(path, _GENERIC_READ, _FILE_SHARE_READ | _FILE_SHARE_WRITE | _FILE_SHARE_DELETE,
                     _OPEN_EXISTING, _FILE_FLAG_OPEN_REPARSE_POINT)
    fd = msvcrt.open_osfhandle(h, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        _refuse_reparse(f.fileno(), path)
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path}: not a regular file")
        prev = b""
        if 0 < offset <= st.st_size:
            f.seek(offset - 1)
            prev = f.read(1)
        f.seek(offset)
        return (f.read() if size is None else f.read(size)), st.st_size, prev


def append_line(path: str, data: bytes, *, fsync: bool = False) -> None:
    """Append `data` (one record, newline included) in one WriteFile on a
    handle opened for FILE_APPEND_DATA only: the system puts each write at
    the end of the file. os.open(O_APPEND) does not give that on Windows:
    the C runtime seeks to the end and then writes, two steps. Appenders
    also serialise on a lock of one byte far past the data
    (APPEND_LOCK_OFFSET): under Wine 8, concurrent FILE_APPEND_DATA writes
    lost a line now and then (399 of 400 in test_concurrent_appenders...),
    and a lost line of the cancel inbox is a lost intent."""
    if sys.platform != "win32":
        require_windows("append_line")
        raise AssertionError
    import _winapi

    from .._native import lib

    h = _open_handle(path, _FILE_APPEND_DATA | _SYNCHRONIZE, _FILE_SHARE_READ | _FILE_SHARE_WRITE | _FILE_SHARE_DELETE,
                     _OPEN_ALWAYS, _FILE_FLAG_OPEN_REPARSE_POINT | (_FILE_FLAG_WRITE_THROUGH if fsync else 0))
    # LockFileEx needs read or write access, which an append-only handle
    # lacks: a second handle takes the appenders' lock.
    lk = _open_handle(path, _GENERIC_READ, _FILE_SHARE_READ | _FILE_SHARE_WRITE | _FILE_SHARE_DELETE, _OPEN_EXISTING,
                      _FILE_FLAG_OPEN_REPARSE_POINT)
    try:
        check(lib.ct_sync_lock_at(lk, APPEND_LOCK_OFFSET, 0), f"LockFileEx({path})")
        try:
            written, err = _winapi.WriteFile(h, data)
        finally:
            lib.ct_sync_unlock_at(lk, APPEND_LOCK_OFFSET)
        if err or written != len(data):
            raise OSError(errno.EIO, f"{path}: appended {written} of {len(data)} bytes (winerror {err})")
    finally:
        _close_handle(lk)
        _close_handle(h)


def replace(src: str, dst: str, *, timeout: float = REPLACE_TIMEOUT) -> int:
    """os.replace(src, dst), retried while a reader holds `dst` open without
    FILE_SHARE_DELETE, for at most `timeout` seconds; then the last error is
    raised. Returns how many attempts failed before it held (0: at once)."""
    require_windows("replace")
    deadline = time.monotonic() + timeout
    delay = 0.001
    failed = 0
    while True:
        try:
            os.replace(src, dst)
            return failed
        except PermissionError as e:
            if getattr(e, "winerror", None) not in _RETRY_WINERRORS or time.monotonic() >= deadline:
                raise
        failed += 1
        # A bounded retry of a refused rename, not a wait for an event:
        # Windows has no notification for "a handle to this file closed".
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.05)


def write_bytes_atomic(path: str, data: bytes, *, fsync: bool = False, timeout: float = REPLACE_TIMEOUT) -> None:
    """Write a temp file beside `path` (created new: O_EXCL), then `replace`."""
    require_windows("write_bytes_atomic")
    d, base = os.path.split(path)
    tmp = os.path.join(d, f".{base}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        replace(tmp, path, timeout=timeout)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# -- the state directory -------------------------------------------------------

def state_dir(env: "Mapping[str, str]" = os.environ) -> str:
    """CONTAIN_STATE_DIR, else %LOCALAPPDATA%\\contain (per user, not
    roamed; the profile's ACL already keeps other users out)."""
    explicit = env.get("CONTAIN_STATE_DIR")
    if explicit:
        return explicit
    local = env.get("LOCALAPPDATA")
    if not local:
        profile = env.get("USERPROFILE")
        if not profile:
            raise OSError(errno.ENOENT, "neither CONTAIN_STATE_DIR, LOCALAPPDATA nor USERPROFILE is set")
        local = os.path.join(profile, "AppData", "Local")
    return os.path.join(local, "contain")


def ensure_private_dir(path: str, *, create: bool = True) -> None:
    """Create `path` if missing (with `create`; else FileNotFoundError) and
    verify it: a directory, not a reparse point, owned by this user (or,
    for an elevated administrator, by the token's default owner). Raises
    OSError with the reason. On Windows a new directory inherits its
    parent's ACL; under %LOCALAPPDATA% that is the user, SYSTEM and
    Administrators."""
    if sys.platform != "win32":
        require_windows("ensure_private_dir")
        raise AssertionError
    from .._native import ffi, lib

    if create:
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
    h = _open_handle(path, _READ_CONTROL, _FILE_SHARE_READ | _FILE_SHARE_WRITE | _FILE_SHARE_DELETE,
                     _OPEN_EXISTING, _FILE_FLAG_BACKUP_SEMANTICS | _FILE_FLAG_OPEN_REPARSE_POINT)
    try:
        st = os.lstat(path)
        attrs = getattr(st, "st_file_attributes", 0)
        if attrs & _FILE_ATTRIBUTE_REPARSE_POINT:
            raise OSError(errno.ELOOP, f"{path}: a reparse point (link or junction), not a directory of ours")
        if not attrs & _FILE_ATTRIBUTE_DIRECTORY:
            raise OSError(errno.ENOTDIR, f"{path}: not a directory")
        mine = ffi.new("int*")
        rc = lib.ct_sync_owned_by_caller(h, SE_FILE_OBJECT, mine)
        if rc:
            raise error(rc, f"GetSecurityInfo({path})")
        if mine[0] == 0:
            raise OSError(errno.EPERM, f"{path}: owned by another user")
        if mine[0] < 0:
            raise OSError(errno.EPERM, f"{path}: its owner cannot be read")
    finally:
        _close_handle(h)
