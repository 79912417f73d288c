"""The owner locks of every run a process owns, in one file: no descriptor
per run (issue 27: a live run holds at most two; an owner lock of its own
was one of them).

    <state>/owners/<pid>-<start>-<hex>
                                  one per owning process, 0600 (its pid and start time,
                                  /proc/PID/stat field 22, name it for a janitor that
                                  waits on its pidfd); byte 0 locked for the process's
                                  life, byte k for the run it gave slot k
    <state>/runs/<id>/owner       a symlink whose target names the run's slot,
                                  "<file>:<k>" (read with readlink, never followed)

A run's owner holds an OFD write lock on byte k of its process's owners file
(fcntl F_OFD_SETLK with a one-byte range): the kernel drops it when the
owner dies, as it dropped the old per-run `owner.lock` (still read:
_rundir). Observers ask with F_OFD_GETLK on a read-only descriptor and take
nothing; a listing reads /proc/locks once (_ofdlock.write_locked, locked_at).

An adopter takes the same byte of the same file through a descriptor of its
own (one per owners file it adopts from, shared by every slot of that file
it holds), so two adopters exclude each other exactly as before. A slot
taken twice inside one process would not conflict (one open file
description holds both), so this module keeps the slots of its process
(`_held`) and refuses a second taker itself.

An owners file is made under a temporary name and renamed into place once
its byte 0 is locked, so a file under its final name whose byte 0 is free
belongs to a process that is gone. `sweep()` removes owners files no lock is
held on at all, holding a lock on the whole file across the unlink; an
adopter that opened one just before it was removed either finds its byte
locked (and tries later) or, once it has it, finds its path no longer names
its file, and opens it again.
"""
from __future__ import annotations

import errno
import os
import stat
import _thread
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Literal

    from ._statedir import StateDir

from . import _safefs as F
from ._ofdlock import drop_lock, lock_held, take_lock
from ._procfs import read_stat

DIR = "owners"
LINK = "owner"
_MODE = 0o600
_DIR_MODE = 0o700
_NEW = ".new-"
_NEW_STALE_S = 60.0


class _File:
    __slots__ = ("key", "name", "fd", "next", "slots", "mine")

    def __init__(self, key: str, name: str, fd: int, mine: bool) -> None:
        self.key = key          # the state directory's path
        self.name = name
        self.fd = fd
        self.next = 1           # byte 0 is the process's own
        self.slots: set[int] = set()
        self.mine = mine


_mu = _thread.allocate_lock()
_mine: dict[str, _File] = {}                    # state path -> this process's owners file there
_open: dict[tuple[str, str], _File] = {}        # (state path, name) -> every owners file held open


def valid_name(name: str) -> bool:
    return (0 < len(name) <= 64 and not name.startswith(".")
            and all(c.isalnum() or c in "-_." for c in name) and name.isascii())


def target(name: str, slot: int) -> str:
    return f"{name}:{slot}"


def parse(text: str) -> tuple[str, int] | None:
    """(owners file, slot) from an `owner` link's target, None if it is not
    one (the run directory is untrusted: a target that does not fit is
    nobody's lock)."""
    name, sep, k = text.rpartition(":")
    if not sep or not valid_name(name) or not k.isdigit() or len(k) > 18:
        return None
    slot = int(k)
    return (name, slot) if slot >= 1 else None


def read_link(run_fd: int) -> tuple[str, int] | None | Literal[False]:
    """The slot the run directory names: (file, slot); False when it names
    none (an old layout: `owner.lock`), None when its `owner` is not a
    slot's name (not a symlink, or a target that does not parse)."""
    try:
        text = os.readlink(LINK, dir_fd=run_fd)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno == errno.EINVAL:       # not a symlink
            return None
        raise
    return parse(text)


def owner_of(name: str) -> tuple[int, int] | None:
    """(pid, start time) of the process that made owners file `name`, as
    its name says (untrusted: check it against /proc before relying on
    it); None for a name that does not say."""
    parts = name.split("-")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return int(parts[0]), int(parts[1])


def _owners_dir(st: "StateDir", create: bool) -> int:
    return F.open_private_dir(st.fd, DIR, os.path.join(st.path, DIR), owners=st.owners,
                              create_mode=_DIR_MODE if create else None)


def _new_file(st: "StateDir") -> _File:
    """This process's owners file in `st`, byte 0 locked before it has its
    name (so sweep() never takes a live process's file for a dead one's)."""
    dfd = _owners_dir(st, create=True)
    try:
        me = read_stat("self")
        name = f"{os.getpid()}-{me[4] if me else 0}-{os.urandom(6).hex()}"
        tmp = _NEW + name
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _MODE, dir_fd=dfd)
        try:
            os.fchmod(fd, _MODE)
            if not take_lock(fd, 0, 1):
                raise OSError(errno.EAGAIN, "a new owners file is locked by another process")
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)
    return _File(st.path, name, fd, mine=True)


def claim(st: "StateDir") -> tuple[str, int]:
    """A new slot of this process's owners file in `st`, locked: (file,
    slot). Raises OSError, UnsafePath."""
    with _mu:
        f = _mine.get(st.path)
        if f is None:
            f = _new_file(st)
            _mine[st.path] = f
            _open[(st.path, f.name)] = f
        while True:
            k = f.next
            f.next += 1
            if k in f.slots:
                # Taken by this very process through a forged link (take(): an
                # orphan's worker can name a slot not given out yet). A second
                # lock through the same open file description would succeed,
                # and the end of that adoption would then drop the new run's.
                continue
            if take_lock(f.fd, k, 1):     # held elsewhere only if a forged link made an adopter take it
                f.slots.add(k)
                return f.name, k


def take(st: "StateDir", name: str, slot: int) -> bool:
    """Adopt slot `slot` of owners file `name` (an adopter's take-over):
    False if a live owner (or another adopter, in this process or not)
    holds it. Raises OSError, UnsafePath."""
    with _mu:
        f = _open.get((st.path, name))
        if f is not None:
            if slot in f.slots or (f.mine and slot == 0):
                return False
            if take_lock(f.fd, slot, 1):
                f.slots.add(slot)
                return True
            return False
        dfd = _owners_dir(st, create=True)
        try:
            for _ in range(3):
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                             _MODE, dir_fd=dfd)
                try:
                    s = os.fstat(fd)
                    if not stat.S_ISREG(s.st_mode) or s.st_uid != os.geteuid():
                        raise F.UnsafePath(os.path.join(st.path, DIR, name), "is not an owners file of this user's")
                    if not take_lock(fd, slot, 1):
                        os.close(fd)
                        return False
                    try:
                        now = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    except FileNotFoundError:
                        now = None
                    if now is not None and (now.st_dev, now.st_ino) == (s.st_dev, s.st_ino):
                        f = _File(st.path, name, fd, mine=False)
                        f.slots.add(slot)
                        _open[(st.path, name)] = f
                        return True
                except BaseException:
                    os.close(fd)
                    raise
                os.close(fd)          # swept meanwhile (its lock went with it): open the path again
            raise OSError(errno.EAGAIN, f"{os.path.join(st.path, DIR, name)} keeps being replaced")
        finally:
            os.close(dfd)


def drop(key: str, name: str, slot: int) -> None:
    """Give up a slot this process holds (unlocked, not only closed: a
    fork's copy of the descriptor would go on holding it)."""
    with _mu:
        f = _open.get((key, name))
        if f is None or slot not in f.slots:
            return
        f.slots.discard(slot)
        try:
            drop_lock(f.fd, slot, 1)
        except OSError:
            pass
        if not f.mine and not f.slots:
            del _open[(key, name)]
            os.close(f.fd)


def held(st: "StateDir", name: str, slot: int) -> bool | None:
    """Whether some process holds slot `slot` of owners file `name` now
    (this one included): True, False, or None when that cannot be told.
    Takes nothing (F_OFD_GETLK)."""
    with _mu:
        f = _open.get((st.path, name))
        if f is not None and slot in f.slots:
            return True
    try:
        dfd = _owners_dir(st, create=False)
    except FileNotFoundError:
        return False
    except (OSError, F.UnsafePath):
        return None
    try:
        fd = os.open(name, F.O_READ, dir_fd=dfd)
    except FileNotFoundError:
        return False          # swept: no lock was held on it
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return lock_held(fd, slot, 1)
    except OSError:
        return None
    finally:
        os.close(fd)


def file_key(st: "StateDir", name: str) -> tuple[int, int, int] | None:
    """(major, minor, inode) of owners file `name`, as /proc/locks names
    it; None if it does not exist (or is not a regular file)."""
    try:
        s = os.stat(f"{DIR}/{name}", dir_fd=st.fd, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(s.st_mode):
        return None
    return (os.major(s.st_dev), os.minor(s.st_dev), s.st_ino)


def sweep(st: "StateDir", now: float) -> int:
    """Remove the owners files no lock is held on (their process and every
    adopter of their runs are gone), and temporary ones left by a process
    that died making one. Returns how many."""
    try:
        dfd = _owners_dir(st, create=False)
    except (OSError, F.UnsafePath):
        return 0
    gone = 0
    try:
        with _mu:
            ours = {f.name for (k, _n), f in _open.items() if k == st.path}
        for e in os.scandir(dfd):
            if e.name in ours:
                continue
            try:
                if e.name.startswith(_NEW):
                    if now - e.stat(follow_symlinks=False).st_mtime > _NEW_STALE_S:
                        os.unlink(e.name, dir_fd=dfd)
                        gone += 1
                    continue
                if not valid_name(e.name):
                    continue
                # Lock the whole file and unlink it while holding that lock:
                # an adopter that opened it meanwhile either fails to take its
                # byte (and tries again later) or takes it only after the
                # unlink, when its re-stat finds the name gone and it opens
                # the path again. A check without a lock, then an unlink,
                # would leave such an adopter's lock on a nameless file (two
                # owners of one run).
                fd = os.open(e.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
                try:
                    s = os.fstat(fd)
                    if not stat.S_ISREG(s.st_mode) or not take_lock(fd):
                        continue
                    try:
                        now_s = os.stat(e.name, dir_fd=dfd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if (now_s.st_dev, now_s.st_ino) != (s.st_dev, s.st_ino):
                        continue
                    os.unlink(e.name, dir_fd=dfd)
                    gone += 1
                finally:
                    os.close(fd)
            except OSError:
                continue
    finally:
        os.close(dfd)
    return gone


def forget_in_child() -> None:
    """After fork(), in the child: its copies of the owners files' descriptors
    are closed, not unlocked (that would free the parent's slots), and the
    child, if it owns runs, makes a file of its own."""
    global _mu
    _mu = _thread.allocate_lock()
    for f in list(_open.values()):
        try:
            os.close(f.fd)
        except OSError:
            pass
    _open.clear()
    _mine.clear()
