"""`locks_released`: the file locks the tree held at the stop are gone.

An empty container proves no member is left; it does not prove the locks a
member took are free. An flock(2), OFD or lease lock belongs to an open file
description, not to a process: a member that passed the descriptor to a
process outside (SCM_RIGHTS, or a child that left the cgroup) leaves the
lock held after every member has exited, and the next attempt in the same
workspace blocks on it. A POSIX (fcntl) lock belongs to a files table and
survives only through a process sharing it (CLONE_FILES).

What the kernel shows (fs/locks.c, proc(5) "/proc/locks"):

- `/proc/locks`: `ID: KIND MODE ACCESS PID MAJ:MIN:INODE START END`, KIND
  one of FLOCK, POSIX, OFDLCK, LEASE (also DELEG, BREAKING/BREAKER for a
  lease being broken); lines with `->` are waiters and hold nothing. PID is
  the tgid that took the lock and, seen from the initial PID namespace, stays
  that number after it exits; for OFD locks it is always -1.
- `/proc/<pid>/fdinfo/<fd>`: a `lock:` line for each lock held through that
  very descriptor (for flock, OFD and leases: every process holding the
  description shows it; for POSIX: the files table that owns it). This is
  how the holder of a lock is named, whatever PID the lock shows.

At the stop (members alive) `held_by(pids)` collects the members' locks;
after the container is observed empty `locks_released(held)` re-reads
/proc/locks, and only for a lock still there scans every process's fds for
the one holding it.
"""
from __future__ import annotations

import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Iterable

from ._procfs import every_fd, read_stat
from ._record import evidence

LOCKS = "/proc/locks"
VIA = "/proc/locks against the locks members held at the stop; holders by /proc/*/fdinfo"


class Lock:
    """One lock line, parsed. `key` identifies the lock across two reads of
    /proc/locks (whose IDs are only positions)."""

    __slots__ = ("kind", "mode", "access", "pid", "major", "minor", "ino", "start", "end")

    def __init__(self, kind: str, mode: str, access: str, pid: int, major: int, minor: int, ino: int,
                 start: str, end: str) -> None:
        self.kind = kind
        self.mode = mode
        self.access = access
        self.pid = pid
        self.major = major
        self.minor = minor
        self.ino = ino
        self.start = start
        self.end = end

    @property
    def key(self) -> tuple[Any, ...]:
        # The access (READ/WRITE) is left out: flock can convert a lock in place.
        # The pid is part of it except for OFD locks, which show -1.
        return (self.kind, self.major, self.minor, self.ino, self.start, self.end,
                None if self.kind == "OFDLCK" else self.pid)

    @property
    def dev(self) -> int:
        return os.makedev(self.major, self.minor)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "mode": self.mode, "access": self.access, "pid": self.pid,
                "dev": f"{self.major}:{self.minor}", "inode": self.ino, "range": [self.start, self.end]}

    def __repr__(self) -> str:
        return f"Lock({self.kind} {self.access} pid={self.pid} {self.major}:{self.minor}:{self.ino})"


def parse_lock_line(line: str) -> Lock | None:
    """One line of /proc/locks, or the part after `lock:` in an fdinfo file.
    None for a waiter (`->`) or anything that does not parse."""
    parts = line.split()
    if not parts:
        return None
    if parts[0].endswith(":"):
        parts = parts[1:]
    if not parts or parts[0] == "->":
        return None
    # LEASE lines have a state (ACTIVE, BREAKING, BREAKER) where others say
    # ADVISORY/MANDATORY; both occupy one field.
    if len(parts) < 7:
        return None
    kind, mode, access, pid_s, devino, start, end = parts[:7]
    try:
        maj_s, min_s, ino_s = devino.split(":")
        return Lock(kind, mode, access, int(pid_s), int(maj_s, 16), int(min_s, 16), int(ino_s), start, end)
    except ValueError:
        return None


def parse_proc_locks(text: str) -> list[Lock]:
    out = []
    for line in text.splitlines():
        lk = parse_lock_line(line)
        if lk is not None:
            out.append(lk)
    return out


def fdinfo_locks(text: str) -> list[Lock]:
    out = []
    for line in text.splitlines():
        if line.startswith("lock:"):
            lk = parse_lock_line(line[5:])
            if lk is not None:
                out.append(lk)
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


class HeldLocks:
    """The locks members held at the stop: {key: {"lock", "held_via": [...],
    "origin"}}, the member pids, and what could not be read. `origin`:
    "member" (the lock's pid is a member), "outside" (its pid is a live
    process outside the container at the stop: a lock the tree inherited a
    descriptor of, e.g. a stdin the caller had flocked; not the run's), or
    "unknown" (OFD locks show no pid; a taker that already exited may have
    been a member): counted as the run's."""

    __slots__ = ("locks", "pids", "problems", "reused")

    def __init__(self) -> None:
        self.locks: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.pids: set[int] = set()
        self.problems: list[str] = []
        self.reused: set[int] = set()          # ex-member pids a live process now has

    def add(self, lk: Lock, via: dict[str, Any] | None) -> None:
        ent = self.locks.get(lk.key)
        if ent is None:
            if lk.pid in self.pids:
                origin = "member"
            elif lk.pid > 0 and _live_process(lk.pid):
                origin = "outside"
            else:
                origin = "unknown"
            ent = self.locks[lk.key] = {"lock": lk, "held_via": [], "origin": origin}
        if via is not None:
            ent["held_via"].append(via)


def held_by(pids: Iterable[int], *, exited: Iterable[int] = ()) -> HeldLocks:
    """At the stop, while members are alive: every lock they hold, from each
    member's fdinfo (flock, OFD, lease: through the descriptor; POSIX: the
    files table) and from /proc/locks (a POSIX or flock lock whose pid is a
    member, e.g. taken on an fd since closed in this member but open
    elsewhere). Only fds on a locked file are read: /proc/locks first, then
    one stat per member fd against its (dev, inode) set.

    `exited`: pids known to have been members that may have exited already
    (the worker): a lock /proc/locks still shows under one of them, when no
    live process has that number, was taken by the tree and is judged too
    (a worker that flocked, handed the file out and exited)."""
    held = HeldLocks()
    held.pids = set(pids)
    try:
        table = parse_proc_locks(_read(LOCKS))
    except OSError as e:
        held.problems.append(f"{LOCKS}: {os.strerror(e.errno or 0)}")
        return held
    _add_exited(held, table, set(exited) - held.pids)
    locked = {(lk.dev, lk.ino) for lk in table}
    for lk in table:
        if lk.pid in held.pids and lk.kind != "OFDLCK":
            held.add(lk, None)
    if not locked:
        return held
    for pid in sorted(held.pids):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue                       # exited meanwhile: its locks went with it or stay on a shared fd
        except OSError as e:
            held.problems.append(f"pid {pid}: fds not listable: {os.strerror(e.errno or 0)}")
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            except OSError as e:
                held.problems.append(f"pid {pid} fd {fd}: {os.strerror(e.errno or 0)}")
                continue
            if (st.st_dev, st.st_ino) not in locked:
                continue
            try:
                txt = _read(f"/proc/{pid}/fdinfo/{fd}")
                path: str | None = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            except OSError as e:
                held.problems.append(f"pid {pid} fd {fd}: {os.strerror(e.errno or 0)}")
                continue
            for lk in fdinfo_locks(txt):
                held.add(lk, {"pid": pid, "fd": int(fd), "path": path})
    return held


def _add_exited(held: HeldLocks, table: list[Lock], exited: set[int]) -> None:
    """Locks /proc/locks shows under a pid known to have been a member. The
    member is gone when no live process has its number; a live one with it
    is another process (the number was reused), whose lock may be its own:
    noted as not judged."""
    reused = set()
    for lk in table:
        if lk.pid in exited and lk.kind != "OFDLCK":
            if _live_process(lk.pid):
                reused.add(lk.pid)
                continue
            held.locks.setdefault(lk.key, {"lock": lk, "held_via": [], "origin": "member"})
    if reused:
        held.reused |= reused
        held.problems.append(f"pid(s) {sorted(reused)} now belong to other processes: their locks were not judged")


def _live_process(pid: int) -> bool:
    """A process with this pid exists and is not a zombie (an unreaped
    member is still that member)."""
    st = read_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _comm(pid: int) -> str | None:
    try:
        return _read(f"/proc/{pid}/comm").strip()
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    st = read_stat(pid)
    return None if st is None else st[4]


def holders_of(survivors: list[Lock]) -> tuple[list[dict[str, Any]], int]:
    """Processes holding these locks now: any process with an fd on the same
    file (dev, inode) whose fdinfo shows the lock. Returns (holders, number
    of processes that could not be inspected). A full /proc scan: only run
    when a lock survived."""
    want = {(lk.dev, lk.ino) for lk in survivors}
    keys = {lk.key for lk in survivors}
    found: list[dict[str, Any]] = []
    fds, denied = every_fd()
    for pid, fd in fds:
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in want:
            continue
        try:
            locks = [lk for lk in fdinfo_locks(_read(f"/proc/{pid}/fdinfo/{fd}")) if lk.key in keys]
            path = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        for lk in locks:
            found.append({"pid": pid, "start_time": _start_time(pid), "comm": _comm(pid), "fd": int(fd),
                          "path": path, "lock": lk.to_dict()})
    return found, denied


def locks_released(held: HeldLocks | None, *, exited_pids: Iterable[int] = ()) -> dict[str, Any]:
    """After the container was observed empty: whether every lock the members
    held at the stop is gone. False names each survivor and the processes
    holding it; null when /proc/locks could not be read or a member's locks
    could not be listed at the stop (and nothing survived).

    `held` None: the container was already empty when the stop began, so
    nothing was collected; then only locks whose pid is in `exited_pids`
    (the worker, and any member the driver knows has exited) are checked,
    and the detail says the check was narrower."""
    try:
        now = parse_proc_locks(_read(LOCKS))
    except OSError as e:
        return evidence(None, VIA, f"{LOCKS} not readable: {os.strerror(e.errno or 0)}")
    note = None
    if held is None:
        held = HeldLocks()
        _add_exited(held, now, set(exited_pids))
        note = ("the container was already empty when the stop began: only locks taken by pids known to have "
                "been members are checked, not locks handed out before that")
    current = {lk.key: lk for lk in now}
    survivors = [current[k] for k, ent in held.locks.items() if k in current and ent["origin"] != "outside"]
    inherited = [{"lock": current[k].to_dict(), "held_at_stop_via": ent["held_via"]}
                 for k, ent in held.locks.items() if k in current and ent["origin"] == "outside"]
    detail: dict[str, Any] = {"held_at_stop": len(held.locks)}
    if inherited:
        # Taken by a live process outside the tree: the tree only held a
        # descriptor of it (an inherited stdin, say). Not the run's lock.
        detail["inherited"] = inherited
    if note:
        detail["note"] = note
    if held.reused:
        detail["pid_reused"] = sorted(held.reused)
    if survivors:
        holders, denied = holders_of(survivors)
        detail["still_held"] = [
            {"lock": lk.to_dict(), "origin": held.locks[lk.key]["origin"],
             "held_at_stop_via": held.locks[lk.key]["held_via"],
             "holders": [h for h in holders if _same(h["lock"], lk)]} for lk in survivors]
        if denied:
            detail["not_inspected"] = denied
        # OFD locks carry no pid: one taken afresh on the same range by
        # another process after the stop would look the same.
        if any(lk.kind == "OFDLCK" for lk in survivors):
            detail["ofd_note"] = "OFD locks show no owner pid: a matching one may be a new lock on the same range"
        return evidence(False, VIA, detail)
    if held.problems:
        detail["unobservable"] = held.problems[:20]
        return evidence(None, VIA, detail)
    return evidence(True, VIA, detail)


def _same(d: dict[str, Any], lk: Lock) -> bool:
    return (d["kind"], d["dev"], d["inode"], tuple(d["range"])) == (lk.kind, f"{lk.major}:{lk.minor}", lk.ino,
                                                                     (lk.start, lk.end))
