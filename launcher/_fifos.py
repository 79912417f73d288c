"""The wake-ups of a run directory: the owner's `cancellations/wake` FIFO,
which requesters poke after appending to the inbox, and one FIFO per
waiting reader in `waiters/`, which the owner pokes after each record or
acknowledgement it writes.

A byte in a FIFO carries no authority, only "look again". Still, only the
directory's uid may write them: FIFOs are 0600 in 0700 directories, so no
other user can make an owner spin (the wake FIFO was 0622). A FIFO found
where one should be is checked to be a FIFO of this user before it is used:
a regular file in its place would read as always ready.
"""
from __future__ import annotations

import errno
import os
import stat
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from ._layout import RunDir

from . import _safefs as F
from ._safefs import UnsafePath
from ._statedir import FILE_MODE, RUN_DIR_MODE

# At most this many waiter FIFOs are poked after a write: a directory
# stuffed with entries costs bounded work.
MAX_WAITERS = 1024


def open_wake(d: RunDir) -> int:
    """The owner's end of the inbox's wake-up FIFO. Opened read-write, so the
    owner is always a writer too and never polls a hung-up FIFO (fifo(7)).
    Raises OSError (the owner then reads the inbox on a timer)."""
    cfd = d.cancellations_fd(write=True, create=True)
    path = f"{d.cancellations}/wake"
    try:
        for attempt in range(2):
            try:
                os.mkfifo("wake", FILE_MODE, dir_fd=cfd)
            except FileExistsError:
                pass
            fd = os.open("wake", os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cfd)
            st = os.fstat(fd)
            if stat.S_ISFIFO(st.st_mode) and st.st_uid == os.geteuid():
                os.fchmod(fd, FILE_MODE)
                return fd
            os.close(fd)
            if attempt == 0:
                os.unlink("wake", dir_fd=cfd)     # not our FIFO: replace it once
        raise UnsafePath(path, "is not a FIFO of this user")
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(path, "is a symlink (not followed)", errno.ELOOP) from None
        raise
    finally:
        os.close(cfd)


def poke_owner(d: RunDir) -> None:
    """Wake the owner to read the inbox. No FIFO, or no reader (ENXIO),
    means no owner is listening; whoever cares checks owner_alive()."""
    try:
        cfd = d.cancellations_fd()
    except (OSError, UnsafePath):
        return
    try:
        poke(cfd, "wake")
    finally:
        os.close(cfd)


def add_waiter(d: RunDir) -> tuple[int, str]:
    """A FIFO for this process to wait on: (read fd, path). It is opened
    before it is renamed into waiters/, so a FIFO found there without a
    reader (ENXIO) belongs to a waiter that is gone."""
    fd = d.dir_fd(write=True)
    try:
        wfd = F.open_private_dir(fd, "waiters", d.waiters, owners=(os.geteuid(),), create_mode=RUN_DIR_MODE)
    finally:
        os.close(fd)
    try:
        name = f"{os.getpid()}-{os.urandom(4).hex()}"
        tmp = "." + name
        os.mkfifo(tmp, FILE_MODE, dir_fd=wfd)
        try:
            rfd = os.open(tmp, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=wfd)
            try:
                if not stat.S_ISFIFO(os.fstat(rfd).st_mode):
                    raise UnsafePath(f"{d.waiters}/{tmp}", "is not a FIFO")
                os.fchmod(rfd, FILE_MODE)
                os.rename(tmp, name, src_dir_fd=wfd, dst_dir_fd=wfd)
            except BaseException:
                os.close(rfd)
                raise
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=wfd)
            except OSError:
                pass
            raise
    finally:
        os.close(wfd)
    return rfd, f"{d.waiters}/{name}"


def poke_waiters(d: RunDir) -> None:
    """Wake every waiter (after a write it may be waiting for)."""
    try:
        fd = d.dir_fd()
    except (OSError, UnsafePath):
        return
    try:
        poke_waiters_at(fd)
    finally:
        os.close(fd)


def poke_waiters_at(fd: int) -> None:
    """poke_waiters through `fd`, a descriptor of the run directory (the
    caller's, left open)."""
    try:
        wfd = os.open("waiters", F.O_DIR, dir_fd=fd)
    except OSError:
        return
    try:
        with os.scandir(wfd) as it:
            names = []
            for e in it:
                if not e.name.startswith("."):
                    names.append(e.name)
                    if len(names) >= MAX_WAITERS:
                        break
        for n in names:
            poke(wfd, n, reap=True)
    except OSError:
        pass
    finally:
        os.close(wfd)


def poke(dir_fd: int, name: str, reap: bool = False) -> None:
    """One byte into FIFO `name`, never blocking. With `reap`, a FIFO with
    no reader (its waiter is gone) is removed."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if reap and e.errno == errno.ENXIO:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                pass
        return
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, b"!")
    except OSError:
        pass         # full (EAGAIN): a wake-up is already pending
    finally:
        os.close(fd)
