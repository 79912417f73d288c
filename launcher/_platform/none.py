"""Degraded mode: no kernel container. Process group + child subreaper +
a /proc closure over process group, session and ancestry.

It stops what it can see and says what it saw. It never reports `REAPED`:
a process that left the group and whose parent exited between two scans is
invisible to it (the fourth counterexample in background/004).
"""
from __future__ import annotations

import os
import signal
from typing import Any

from .._identity import ProcessIdentity
from . import posix

KIND = "none"


def _stat(pid: int) -> tuple[int, int, int, int] | None:
    """(ppid, pgid, sid, start_time) from /proc/<pid>/stat, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(b")") + 2:].split()
    if rest[0] in (b"Z", b"X"):
        return None   # a zombie has exited; it only waits to be reaped
    return int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19])


class Container:
    backend = KIND
    path = None
    dir = None
    leaf = None
    hierarchy = None
    events_fd = -1
    empty_via = "/proc scan (process group, session, ancestry)"

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.root_pid = -1
        self.pgid = -1
        self.sid = -1
        self.seen: dict[int, int] = {}      # pid -> start_time, every member ever seen
        self.signalled: set[tuple[int, int]] = set()

    def prepare(self, req: posix.SpawnRequest, opts: Any) -> None:
        req.new_pgroup = True

    def seal_status(self, req: posix.SpawnRequest) -> tuple[bool, str]:
        return False, "no kernel container (degraded mode): nothing keeps the tree together"

    def escape_evidence(self) -> dict[str, Any]:
        return {"observed": None, "at": None, "via": "none",
                "detail": "degraded mode: a process that leaves the group unseen cannot be detected"}

    def spawn(self, req: posix.SpawnRequest) -> posix.Spawned:
        sp = posix.spawn(req)
        sp.via = "clone3(CLONE_PIDFD) + setpgid (no container)"
        self.root_pid = self.pgid = sp.pid
        st = _stat(sp.pid)
        self.sid = st[2] if st else -1
        if st:
            self.seen[sp.pid] = st[3]
        return sp

    def placed(self, pid: int) -> str | None:
        return None

    def _closure(self) -> dict[int, int]:
        """Members alive now: the group, plus anything whose ancestry reaches a
        member. Iterated to a fixed point over one /proc snapshot."""
        procs: dict[int, tuple[int, int, int, int]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                st = _stat(int(name))
                if st is not None:
                    procs[int(name)] = st
        me = os.getpid()
        members = {p: st[3] for p, st in procs.items()
                   if p != me and (st[1] == self.pgid or (p in self.seen and self.seen[p] == st[3]))}
        changed = True
        while changed:
            changed = False
            for p, st in procs.items():
                if p not in members and p != me and st[0] in members:
                    members[p] = st[3]
                    changed = True
        self.seen.update(members)
        return members

    def populated(self) -> bool:
        return bool(self._closure())

    def wait_change(self, timeout: float) -> None:
        import time

        time.sleep(min(timeout, 0.02))

    def _signal_all(self, sig: int) -> tuple[int, int]:
        sent = failed = 0
        for pid, start in self._closure().items():
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if ProcessIdentity.read(pid).start_time != start:
                    continue
                signal.pidfd_send_signal(fd, sig)
                if sig == signal.SIGTERM:
                    signal.pidfd_send_signal(fd, signal.SIGCONT)
                sent += 1
            except ProcessLookupError:
                pass
            except OSError:
                failed += 1
            finally:
                os.close(fd)
        return sent, failed

    def terminate(self) -> tuple[int, int]:
        return self._signal_all(signal.SIGTERM)

    def kill(self) -> str:
        for _ in range(10):
            sent, _failed = self._signal_all(signal.SIGKILL)
            if sent == 0:
                break
        return "SIGKILL by pidfd to each process seen (group, ancestry)"

    def members(self) -> list[int]:
        return sorted(self._closure())

    def seen_summary(self) -> dict[str, Any]:
        return {"seen": sorted(self.seen), "unprovable": "processes that left the group and lost their "
                "ancestry between scans are invisible without a kernel container"}

    def cpu_stat(self) -> dict[str, int] | None:
        return None

    def remove(self) -> str | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"backend": KIND}
