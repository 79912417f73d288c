"""`--record PATH`: where the stop record also goes, checked before the spawn.

The rules (CONTRACT.md, "--record FILE never replaces anything but a
regular file"):
- `-` is this process's stdout (a dup of fd 1 taken now): the final record
  is written there once, after the run.
- A path that names the file already open as our stdout or stderr
  (`/dev/stdout`, `/dev/fd/2`, `/proc/self/fd/1`, or the file stdout is
  redirected to) is written through that descriptor, as a shell would:
  at its offset, never truncated, never replaced.
- A regular file (or no file yet) is replaced atomically: a temp file with a
  random name made O_EXCL|O_NOFOLLOW in the same directory, written
  completely, fsynced, renamed over it. Its mode is kept when it is ours,
  else 0600 (records carry argv). A read-only file is refused.
- A character device or a FIFO (`/dev/null`, `/dev/full`, `/dev/tty`, a
  named pipe with a reader) is written in place: opened without O_CREAT or
  O_TRUNC, the final record written once. `/dev/full` therefore fails, as
  it should, and stays a device.
- A symlink, in the last component or in any directory above it, is
  followed only when it belongs to root or to us (as fs.protected_symlinks
  would require in a sticky directory, everywhere); what it names then
  follows the rules above (a regular file is replaced where it is, the link
  itself never). Anything else, a directory, a socket, a block device, a
  dangling link, is refused, and so is a FIFO or a device that belongs to
  another user (it could hold the final write for ever).

prepare() applies these before anything runs and raises UnsafePath with one
line; a write that fails raises PersistError. The CLI turns both into
exit 125 (CONTRACT.md: "the record could not be written").
"""
from __future__ import annotations

import errno
import os
import stat
import sys
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from . import _safefs as F
from ._safefs import PersistError, UnsafePath
from ._safepath import link_trusted, open_dir_trusted_links


# Descriptors 0-2 that the caller closed and contain holds on /dev/null
# (_cli._hold_closed_stdio): a record "written" through one goes nowhere.
CLOSED_STDIO: set[int] = set()


class RecordTarget:
    """A checked --record destination. `update()` for each record the run
    writes (only a regular-file target follows along), `final()` once with
    the last one. Raise PersistError."""

    __slots__ = ("path", "kind", "_dir_fd", "_name", "_fd", "_mode")

    def __init__(self, path: str, kind: str, *, dir_fd: int = -1, name: str = "", fd: int = -1,
                 mode: int = 0o600) -> None:
        self.path = path
        self.kind = kind          # "file" (replaced atomically) or "stream" (written in place)
        self._dir_fd = dir_fd
        self._name = name
        self._fd = fd
        self._mode = mode

    def update(self, data: bytes) -> None:
        if self.kind in ("file", "winfile"):
            self._swap(data, durable=False)

    def final(self, data: bytes) -> None:
        if self.kind in ("file", "winfile"):
            self._swap(data, durable=True)
            return
        if self._fd < 0:
            raise PersistError(errno.EBADF, "write", self.path, "already written or closed")
        try:
            F.write_all(self._fd, data)
        except OSError as e:
            raise F.persist_error(e, "write", self.path) from None
        finally:
            self.close()

    def _swap(self, data: bytes, durable: bool) -> None:
        if self.kind == "winfile":       # Windows: by path, a held target retried (winfs.replace)
            from ._platform import winfs

            if os.path.lexists(self.path) and (os.path.islink(self.path) or not os.path.isfile(self.path)):
                raise PersistError(errno.EEXIST, "replace", self.path, "is no longer a regular file: not replaced")
            try:
                winfs.write_bytes_atomic(self.path, data, fsync=durable)
            except OSError as e:
                raise F.persist_error(e, "rename", self.path) from None
            return
        try:
            st = os.stat(self._name, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise F.persist_error(e, "stat", self.path) from None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise PersistError(errno.EEXIST, "replace", self.path,
                               "is no longer a regular file: not replaced")
        F.replace_file(self._dir_fd, self._name, data, self.path, mode=self._mode, durable=durable)

    def fileno(self) -> int:
        """The descriptor a stream target writes through (-1 for a file)."""
        return self._fd

    def close(self) -> None:
        for attr in ("_fd", "_dir_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, attr, -1)

    def __repr__(self) -> str:
        return f"RecordTarget({self.path!r}, {self.kind})"


def _dup(fd: int) -> int:
    if sys.platform == "win32":
        return os.dup(fd)              # not inheritable (PEP 446)
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)


def _prepare_windows(path: str) -> RecordTarget:
    """Windows: a regular file (or none yet) replaced atomically by path, or
    refused; a link or a reparse point is never followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise UnsafePath(path, e.strerror or str(e), e.errno or errno.EIO) from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise UnsafePath(path, "is a directory", errno.EISDIR)
        if stat.S_ISLNK(st.st_mode) or getattr(st, "st_file_attributes", 0) & 0x400 or not stat.S_ISREG(st.st_mode):
            raise UnsafePath(path, "is not a regular file (a link or a reparse point): not followed", errno.ELOOP)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UnsafePath(path, f"its directory {parent} does not exist", errno.ENOENT)
    return RecordTarget(os.path.abspath(path), "winfile")


def _stdio_match(st: os.stat_result, path: str) -> int:
    """The fd of ours that `path` names: 1 or 2 when open on the same file
    as `st` (however named), or N for /dev/fd/N or /proc/self/fd/N (a
    process substitution, `--record >(jq .)`, or a descriptor the caller
    opened) when fd N is open on it; else -1. Those magic links read back
    as `pipe:[...]`, not as paths, and are ours: they are written through."""
    cands = [1, 2]
    n = fd_named(path)
    if n is not None:
        cands.insert(0, n)
    for fd in cands:
        try:
            s = os.fstat(fd)
        except (OSError, OverflowError):
            continue
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
            return fd
    return -1


def fd_named(path: str) -> int | None:
    """N when `path` names our descriptor N: /dev/fd/N, /proc/self/fd/N,
    or /dev/stdin, /dev/stdout, /dev/stderr (root's links to
    /proc/self/fd/0-2 on Linux; other links are left to _resolve, which
    follows only root's or ours)."""
    std = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}.get(path)
    if std is not None:
        return std
    for pre in ("/dev/fd/", "/proc/self/fd/", f"/proc/{os.getpid()}/fd/"):
        if path.startswith(pre) and path[len(pre):].isascii() and path[len(pre):].isdigit():
            return int(path[len(pre):])
    return None


def prepare(path: str) -> RecordTarget:
    """Check `path` as a --record destination before anything runs.
    Raises UnsafePath with the reason (one line)."""
    if path == "-":
        try:
            if 1 in CLOSED_STDIO:
                raise OSError(errno.EBADF, "closed")
            return RecordTarget("stdout", "stream", fd=_dup(1))
        except OSError:
            raise UnsafePath("-", "stdout is closed", errno.EBADF) from None
    if not path:
        raise UnsafePath("''", "is an empty path", errno.ENOENT)
    if sys.platform == "win32":
        return _prepare_windows(path)
    euid = os.geteuid()
    try:
        # Our own stdout or stderr, however named (/dev/stdout and /proc's
        # magic links included), or a /dev/fd/N of ours: written through the
        # fd we hold, so no link leads anywhere else.
        std = _stdio_match(os.stat(path), path)
    except OSError:
        n = fd_named(path)
        if n is not None:
            # Nothing to create there (/proc/self/fd takes no new file):
            # said now, not after the run (`--record /dev/fd/3` without `3>`).
            raise UnsafePath(path, f"names our descriptor {n}, which is not open", errno.EBADF) from None
        std = -1
    if std in CLOSED_STDIO:
        raise UnsafePath(path, f"is our descriptor {std}, which the caller closed", errno.EBADF)
    if std >= 0:
        import fcntl

        if fcntl.fcntl(std, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise UnsafePath(path, f"is our descriptor {std}, open only for reading", errno.EBADF)
        return RecordTarget(path, "stream", fd=_dup(std))
    dfd, name, target = _resolve(path, euid)
    try:
        if target is not None:
            m = target.st_mode
            if stat.S_ISDIR(m):
                raise UnsafePath(path, "is a directory", errno.EISDIR)
            if stat.S_ISCHR(m) or stat.S_ISFIFO(m):
                return _in_place(path, dfd, name, target, euid)
            if not stat.S_ISREG(m):
                kind = "a socket" if stat.S_ISSOCK(m) else "a block device" if stat.S_ISBLK(m) else "not a file"
                raise UnsafePath(path, f"is {kind}: not written", errno.EINVAL)
            if not os.access(name, os.W_OK, dir_fd=dfd, effective_ids=True, follow_symlinks=False):
                raise UnsafePath(path, "is not writable", errno.EACCES)
            dst = os.fstat(dfd)
            if dst.st_mode & stat.S_ISVTX and euid not in (0, target.st_uid, dst.st_uid):
                # The rename over it would fail (EPERM, the sticky bit:
                # unlink(2)) after the run; said now.
                raise UnsafePath(path, f"belongs to uid {target.st_uid} in a sticky directory: it cannot be "
                                 f"replaced by uid {euid}", errno.EPERM)
        if not os.access(".", os.W_OK | os.X_OK, dir_fd=dfd, effective_ids=True):
            raise UnsafePath(path, f"its directory {os.path.dirname(path) or '.'} is not writable", errno.EACCES)
        mode = 0o600
        if target is not None and target.st_uid == euid:
            mode = stat.S_IMODE(target.st_mode) & 0o666
        kept, dfd = dfd, -1           # the target owns it now
        return RecordTarget(path, "file", dir_fd=kept, name=name, mode=mode)
    finally:
        if dfd >= 0:
            os.close(dfd)


def _resolve(path: str, euid: int) -> tuple[int, str, os.stat_result | None]:
    """The directory that holds what `path` names (a held fd), the name in
    it, and its lstat (None when nothing is there yet). Every symlink on the
    way, the last component's included, is followed only when it belongs to
    root or to us (_safepath.open_dir_trusted_links); the name returned is
    never a link."""
    cur = path
    followed = False
    for _ in range(40):
        parent, name = os.path.split(cur.rstrip("/") or "/")
        if not name:
            raise UnsafePath(path, "is a directory", errno.EISDIR)
        dfd = open_dir_trusted_links(parent or ".", path)
        try:
            try:
                lst: os.stat_result | None = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                lst = None
            except OSError as e:
                raise UnsafePath(path, os.strerror(e.errno or errno.EIO), e.errno or errno.EIO) from None
            if lst is None and followed:
                raise UnsafePath(path, "is a symlink to nothing usable (No such file or directory): not followed",
                                 errno.ELOOP)
            if lst is None or not stat.S_ISLNK(lst.st_mode):
                return dfd, name, lst
            if not link_trusted(lst, os.fstat(dfd), euid):
                raise UnsafePath(path, f"is a symlink owned by uid {lst.st_uid}: not followed", errno.ELOOP)
            link = os.readlink(name, dir_fd=dfd)
        except BaseException:
            os.close(dfd)
            raise
        os.close(dfd)
        cur = link if link.startswith("/") else os.path.join(parent or ".", link)
        followed = True
    raise UnsafePath(path, "too many levels of symbolic links: not followed", errno.ELOOP)


def _in_place(path: str, dfd: int, name: str, expect: os.stat_result, euid: int) -> RecordTarget:
    """A device or FIFO (`name` in `dfd`, borrowed), opened for writing now (no O_CREAT, no O_TRUNC;
    O_NONBLOCK so a FIFO with no reader fails instead of waiting), then
    checked to be what was examined. Only one of root's or ours: another
    user's FIFO can be held open and full (and another user's tty stopped
    with ^S), and the final write would then block for ever."""
    if expect.st_uid not in (0, euid):
        kind = "a FIFO" if stat.S_ISFIFO(expect.st_mode) else "a device"
        raise UnsafePath(path, f"is {kind} owned by uid {expect.st_uid}: not written (its owner could "
                         f"keep the write from ever finishing)", errno.EPERM)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ENXIO and stat.S_ISFIFO(expect.st_mode):
            why = "is a FIFO with no reader"
        elif e.errno == errno.ENXIO and path == "/dev/tty":
            why = "this process has no controlling terminal"
        else:
            why = os.strerror(e.errno or errno.EIO)
        raise UnsafePath(path, why, e.errno or errno.EIO) from None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino, st.st_mode) != (expect.st_dev, expect.st_ino, expect.st_mode):
        os.close(fd)
        raise UnsafePath(path, "changed while it was opened", errno.EAGAIN)
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    return RecordTarget(path, "stream", fd=fd)


def resume_terminals(*fds: int) -> None:
    """Resume output on any of `fds` that is a terminal taking no output
    now. A worker sharing our terminal can stop its output (tcflow TCOOFF,
    what ^S does): that ioctl needs no controlling terminal, so a sealed
    worker in a session of its own can do it too, and contain's own last
    writes after the stop (its messages, `--record -` or /dev/stdout) then
    blocked for ever, the tree long gone. Called once the tree is gone; a
    terminal whose output the user stopped with ^S just then is resumed too."""
    if sys.platform == "win32":
        return
    import select
    import termios

    for fd in fds:
        try:
            if fd < 0 or not os.isatty(fd):
                continue
            p = select.poll()
            p.register(fd, select.POLLOUT)
            if not p.poll(0):            # a stopped pty has no write room (pty_write_room)
                termios.tcflow(fd, termios.TCOON)
        except (OSError, termios.error, ValueError):
            continue


def finish(run: Any, target: RecordTarget | None, status: int) -> int:
    """`contain run`'s last step: the final record to --record's target (if
    any). Returns `status`, or 125 with one line on stderr when the record
    cannot be written (CONTRACT.md), naming where it is instead."""
    if target is None or run.layout is None:
        if target is not None:
            target.close()
        return status
    from ._runfiles import encode

    try:
        target.final(encode(run.record().to_dict(), pretty=True))
    except OSError as e:
        try:
            sys.stderr.write(f"contain: run {run.id}: the record could not be written to --record {e}; "
                             f"it is in {os.path.join(run.layout.path, 'record.json')}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        return 125
    finally:
        target.close()
    return status
