"""OFD locks (fcntl(2), "Open file description locks"): the owner lock of a
run directory and of the state directory's claims.

    take_lock(fd)    an exclusive lock on the whole file, without waiting
    drop_lock(fd)    give it up now (a fork's copy of the fd would keep it)
    lock_held(fd)    whether another open file description holds one (takes nothing)
    write_locked()   every (file, first byte) an OFD write lock is held on now
                     (/proc/locks, one read)

Each takes an optional byte range (`start`, `length`; 0, 0 is the whole
file): an owner slot (_ownerslots) is one byte of a shared file.

A lock is owned by the open file description and dropped by the kernel when
its last fd closes (the owner's death included).
"""
from __future__ import annotations

import errno
import os
import struct

# write_locked(): (major, minor, inode) -> [(first byte, last byte or -1)]
Locks = dict[tuple[int, int, int], list[tuple[int, int]]]

_FLOCK = "hhqqi"                      # struct flock: l_type, l_whence, l_start, l_len, l_pid
_FLOCK_PAD = b"\0" * ((-struct.calcsize(_FLOCK)) % 8)


def _flock(kind: int, start: int = 0, length: int = 0) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, start, length, 0) + _FLOCK_PAD


def take_lock(fd: int, start: int = 0, length: int = 0) -> bool:
    """An exclusive OFD lock on the whole file of `fd` (open for writing),
    without waiting. False if another open file description holds one."""
    import fcntl

    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, start, length))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def drop_lock(fd: int, start: int = 0, length: int = 0) -> None:
    """Give up the OFD lock of `fd` now. Closing `fd` is not enough: a copy
    of the descriptor in a fork() of this process (a CI runner's worker
    pool) shares the open file description, and so would keep the lock."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, start, length))


def lock_held(fd: int, start: int = 0, length: int = 0) -> bool:
    """Whether any other open file description holds a lock on the file of
    `fd`. F_OFD_GETLK takes nothing, and works on a read-only fd: a reader
    can neither block the owner nor make a concurrent taker fail."""
    import fcntl

    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, start, length))
    return bool(struct.unpack_from("h", res)[0] != fcntl.F_UNLCK)


def write_locked(path: str = "/proc/locks") -> "Locks | None":
    """Every OFD write lock held now, as (major, minor, inode) -> the byte
    ranges locked ((first, last), last -1 for EOF), from one read of
    /proc/locks (proc(5): `1: OFDLCK ADVISORY WRITE -1 fe:00:2147140 0
    EOF`; a waiter's line starts `1: ->` and holds nothing). The kernel
    merges adjacent ranges of one open file description into one line, so
    a byte is asked about with `locked_at`. OFD locks are listed whatever
    PID namespace the reader is in (their owner pid is always -1,
    locks_translate_pid), so this answers for thousands of owner locks what
    lock_held answers for one, without opening any. None if /proc/locks
    cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    out: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for line in data.split(b"\n"):
        fields = line.split()
        if len(fields) < 8 or fields[1] != b"OFDLCK" or fields[3] != b"WRITE":
            continue
        dev = fields[5].split(b":")
        try:
            key = (int(dev[0], 16), int(dev[1], 16), int(dev[2]))
            last = -1 if fields[7] == b"EOF" else int(fields[7])
            out.setdefault(key, []).append((int(fields[6]), last))
        except (IndexError, ValueError):
            continue
    return out


def locked_at(locked: "Locks", key: tuple[int, int, int], byte: int = 0) -> bool:
    """Whether write_locked() saw `byte` of the file `key` locked."""
    return any(first <= byte and (last < 0 or byte <= last) for first, last in locked.get(key, ()))
