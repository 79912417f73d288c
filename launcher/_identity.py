"""Process identity: pid + /proc start time + boot id + PID namespace.

A pid alone is a number the kernel hands out again (pid_max is 32768 on
common hosts). Before signalling, the identity is re-read and compared; where
a pidfd exists its inode (unique for the boot) is recorded too.

On Windows the start time is the process's creation FILETIME (100 ns since
1601), read from a handle (winproc.py): absolute, so pid + creation time
does not recur across boots, and `boot_id` says so instead of naming a boot.
"""
from __future__ import annotations

import os
import sys
import time

from ._procfs import start_time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

_boot_id: str | None = None
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# Every worker this process spawned, as (pid, start time): a fork the fork
# ledger sees reported as a child of this process is one of these, or it is
# not ours to explain (_ledger.py). Kept for every spawn, ledger or not: a
# later run's ledger must know the earlier runs' workers too.
_our_spawns: set[tuple[int, int]] = set()


def note_spawn(pid: int, start_time: int) -> None:
    """Called right after each spawn of this process (any run)."""
    _our_spawns.add((pid, start_time))


def spawned_here(pid: int, start_time: int) -> bool:
    return (pid, start_time) in _our_spawns


# The runs of this process whose trees may hold processes that could be
# orphaned to it, once it is a child subreaper or PID 1: run uid -> a tick
# (clock ticks since boot, as /proc/<pid>/stat's start times) no later than
# its worker's start. Noted before every spawn, whatever the run's options
# (a run of another backend leaves its orphans to a subreaper process too),
# forgotten once the spawn made a PID-namespace wall (its orphans stay in
# it) or the tree was proven gone (REAPED). The subreaper wall tells which
# run an orphan may belong to by it (_platform/subreaper.py).
_orphan_sources: dict[str, int] = {}


def note_orphan_source(uid: str) -> None:
    """Before the spawn of run `uid` (its worker starts after this tick)."""
    if sys.platform != "win32":
        _orphan_sources.setdefault(uid, max(0, int(time.clock_gettime(time.CLOCK_BOOTTIME) * _CLK_TCK) - 1))


def forget_orphan_source(uid: str) -> None:
    _orphan_sources.pop(uid, None)


def orphan_sources() -> dict[str, int]:
    return _orphan_sources


def escapers_alive(rec: dict[str, Any]) -> list[int]:
    """The escapers a BREACHED record names (`evidence.escapes.detail`,
    each with its identity) that are alive now, by pid + start time + boot
    id; a zombie is not. The record is input: what does not fit is skipped,
    so a forged one can only keep its own run longer, never remove another."""
    ev = rec.get("evidence")
    esc = ev.get("escapes") if isinstance(ev, dict) else None
    detail = esc.get("detail") if isinstance(esc, dict) else None
    if not isinstance(detail, list):
        return []
    from ._procfs import read_stat

    out = []
    for e in detail[:1000]:
        ident = e.get("identity") if isinstance(e, dict) else None
        if not isinstance(ident, dict) or ident.get("boot_id") != boot_id():
            continue
        pid, start = ident.get("pid"), ident.get("start_time")
        if type(pid) is not int or type(start) is not int or pid <= 0:
            continue
        st = read_stat(pid)
        if st is not None and st[4] == start and st[0] not in ("Z", "X"):
            out.append(pid)
    return out


def boot_id() -> str:
    global _boot_id
    if _boot_id is None:
        if sys.platform == "win32":
            from ._platform.winproc import BOOT_ID

            _boot_id = BOOT_ID
        else:
            with open("/proc/sys/kernel/random/boot_id") as f:
                _boot_id = f.read().strip()
    return _boot_id


def pidns_inode(pid: int) -> int | None:
    if sys.platform == "win32":
        return None
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


_own: tuple[int, int | None, dict[str, Any]] | None = None


def own_pidns() -> int | None:
    """This process's PID-namespace inode (a process never changes its own:
    unshare and setns change its children's), read once per pid."""
    return _own_facts()[1]


def own_identity() -> dict[str, Any]:
    """This process's ProcessIdentity.to_dict(), read once per pid: run.json
    names its supervisor three times a run."""
    return dict(_own_facts()[2])


def _own_facts() -> tuple[int, int | None, dict[str, Any]]:
    global _own
    pid = os.getpid()
    if _own is None or _own[0] != pid:       # a fork's child is another process
        ident = ProcessIdentity.read(pid)
        _own = (pid, ident.pidns, ident.to_dict())
    return _own


class ProcessIdentity:
    __slots__ = ("pid", "start_time", "boot_id", "pidns", "pidfd_inode")

    def __init__(self, pid: int, start_time: int, boot_id: str, pidns: int | None,
                 pidfd_inode: int | None = None) -> None:
        self.pid = pid
        self.start_time = start_time
        self.boot_id = boot_id
        self.pidns = pidns
        self.pidfd_inode = pidfd_inode

    @classmethod
    def read(cls, pid: int, pidfd: int | None = None) -> "ProcessIdentity":
        if sys.platform == "win32":
            from ._platform.winproc import creation_time

            return cls(pid, creation_time(pid), boot_id(), None, None)
        ino = os.fstat(pidfd).st_ino if pidfd is not None else None
        return cls(pid, start_time(pid), boot_id(), pidns_inode(pid), ino)

    @classmethod
    def of_spawn(cls, pid: int, start: int, pidfd: int, init_pid: int,
                 init_ns: int | None = None) -> "ProcessIdentity":
        """A worker behind the wall that is gone already: its start time as
        the init read it, its namespace as its init's (read by the spawn
        while the init lived, else now)."""
        ns = init_ns or (pidns_inode(init_pid) if init_pid > 0 else None)
        return cls(pid, start, boot_id(), ns, os.fstat(pidfd).st_ino if pidfd >= 0 else None)

    def is_alive(self) -> bool | None:
        """True if this very process exists now, False if provably not, None
        if that could not be told (e.g. another boot, an unreadable /proc)."""
        if sys.platform == "win32":
            from ._platform.winproc import identity_alive

            return identity_alive(self.pid, self.start_time)
        try:
            if boot_id() != self.boot_id:
                return False
            return start_time(self.pid) == self.start_time
        except FileNotFoundError:
            return False
        except ProcessLookupError:
            return False
        except OSError:
            return None

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time, "boot_id": self.boot_id,
                "pidns": self.pidns, "pidfd_inode": self.pidfd_inode}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProcessIdentity":
        return cls(d["pid"], d["start_time"], d["boot_id"], d.get("pidns"), d.get("pidfd_inode"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessIdentity) and (self.pid, self.start_time, self.boot_id) == (
            other.pid, other.start_time, other.boot_id)

    def __repr__(self) -> str:
        return f"ProcessIdentity(pid={self.pid}, start_time={self.start_time})"
