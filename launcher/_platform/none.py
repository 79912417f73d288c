"""Degraded mode: no kernel container. Process group + child subreaper +
a /proc closure, kept current from the fork ledger where it runs.

Membership, over one /proc snapshot, iterated to a fixed point:
- every process the fork ledger tracked (forked by a member, wherever it
  went), identity checked;
- every process seen as a member before (pid + start time);
- the worker's process group, while that group is known to be ours;
- groups and sessions led by a member (a descendant that called setsid or
  setpgid leads them), for processes started after that leader;
- children of members.

It stops what it can see and says what it saw. It never reports `REAPED`:
without the ledger, a process that left the group and whose parent exited
between two scans is invisible; with it, a lost event can hide one too.
"""
from __future__ import annotations

import os
from .. import _signals as signal
import time
from typing import Any

from .. import _tags
from .._errors import ContainmentUnavailable
from .._identity import boot_id
from .._procfs import read_environ, read_stat
from .._scan import scan_processes
from . import posix
from .posixwait import Root

KIND = "none"
_LIST_CAP = 500   # entries kept in the record's lists; the count is always exact


def live_start(pid: int) -> int | None:
    """The start time of a live process, or None if it is gone (a zombie has
    exited; it only waits to be reaped)."""
    p = read_stat(pid)
    return None if p is None or p[0] in ("Z", "X") else p[4]


def _terminal_foreground(stdio: tuple[int, int, int]) -> bool:
    """Whether the worker's stdin, stdout or stderr is our controlling
    terminal with our process group in its foreground."""
    me = os.getpgrp()
    for i, fd in enumerate(stdio):
        try:
            if os.tcgetpgrp(i if fd < 0 else fd) == me:
                return True
        except OSError:      # not a terminal, or not our controlling one
            pass
    return False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _carrying(run_dir: str | None) -> list[int] | None:
    """Live processes whose environment names `run_dir` as their run's
    (CONTAIN_RUN_DIR, as every worker starts with it), or None if that
    cannot be told (no run directory, /proc not readable)."""
    if not run_dir:
        return None
    needle = f"CONTAIN_RUN_DIR={run_dir}".encode()
    found = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            env = read_environ(name)
        except OSError:
            continue          # gone, or not ours to read (then not ours to stop either)
        if needle in env.split(b"\0") and live_start(int(name)) is not None:
            found.append(int(name))
    return found


def _snapshot() -> dict[int, tuple[int, int, int, int]]:
    """Every live process, from one native pass over /proc. A Z there is the
    leader thread's state: read_stat tells a zombie from a process whose
    leader exited alone while another thread runs on."""
    return {p.pid: (p.ppid, p.pgid, p.sid, p.start_time)
            for p in scan_processes(cgroups=False) if p.state not in ("Z", "X") or live_start(p.pid) is not None}


class Container:
    backend = KIND
    path: str | None = None
    dir = None
    leaf = None
    hierarchy = None
    events_fd = -1
    seal_detail = None
    weaker: str | None = None     # why `auto` got this and not a cgroup (_containers.make_container)
    empty_via = "/proc scan (process group, sessions and groups led by members, ancestry, fork ledger)"

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.root_pid = -1
        self.root_start = -1
        self.pgid = -1
        self._group_ours = False
        self.seen: dict[int, int] = {}        # pid -> start_time, every member ever seen
        self.how: dict[tuple[int, int], str] = {}   # (pid, start) -> how it was first found
        self.ledger: Any = None               # set by the run when the fork ledger runs
        self._seal_error: str | None = None
        self._subreaper = False
        self.last_alive: list[int] = []
        self._tag: _tags.RunTag | None = None  # where a later owner finds the members (bind)
        self.adopted: str | None = None        # how an adopter rebuilt the membership
        self.unknown: str | None = None        # why an adopter cannot tell the members at all

    def bind(self, tag: _tags.RunTag) -> str | None:
        """Keep the run directory's tag current with what a later owner needs
        to stop the tree: the worker, its group and the members alive at the
        last scan (_tags.py). Written when they change, never on a timer."""
        self._tag = tag
        return self._persist(dict(self.seen))

    def _persist(self, members: dict[int, int]) -> str | None:
        if self._tag is None:
            return None
        alive = sorted(members.items())
        worker = {"pid": self.root_pid, "start_time": self.root_start} if self.root_start >= 0 else None
        return self._tag.update(worker=worker, pgid=self.pgid if self.pgid > 0 else None,
                                members=[list(m) for m in alive[:_tags.MAX_MEMBERS]],
                                more=len(alive) > _tags.MAX_MEMBERS)

    @classmethod
    def adopt(cls, run_id: str, tag: dict[str, Any], may_have_run: bool = True,
              run_dir: str | None = None) -> "Container":
        """The container of a degraded run whose owner died, rebuilt from the
        identities it persisted (`tag`: the run directory's tag, or run.json's
        worker where no tag could be kept). Each is re-read: only a process
        with that pid and that start time, in this boot, is a member; a bare
        pid never is. The worker's group counts only while its leader lives
        (an emptied group's number can be reused). The closure then adds what
        descends from the members or sits in sessions and groups they lead.
        `may_have_run`: False only when the run's journal shows that its
        owner never came to the spawn; then that no member is known is no
        mystery. Else, with no member known, a process that still carries
        the run's environment (`run_dir`) keeps the stop UNCONFIRMED: it is
        never acted on (anyone can put a variable in their environment),
        only never read as an empty tree."""
        c = cls(run_id)
        how = "persisted by the previous owner, identity re-read"
        worker = tag.get("worker") if isinstance(tag.get("worker"), dict) else None
        same_boot = tag.get("boot_id") == boot_id()
        known: list[tuple[int, int]] = []
        if worker is not None and _is_int(worker.get("pid")) and _is_int(worker.get("start_time")):
            c.root_pid, c.root_start = int(worker["pid"]), int(worker["start_time"])
            known.append((c.root_pid, c.root_start))
        for m in tag.get("members") or []:
            if isinstance(m, list) and len(m) == 2 and _is_int(m[0]) and _is_int(m[1]):
                known.append((int(m[0]), int(m[1])))
        if not known and same_boot and may_have_run:
            # The owner died about the spawn, before it described the worker
            # (the first tag or run.json that names it): nothing says what to
            # look for, so that nothing was found is no observation of an
            # empty tree while something of the run's may be alive.
            carriers = _carrying(run_dir)
            if carriers != []:
                c.unknown = ("no member is known: the previous owner died before it recorded the worker's "
                             "identity, and " + (f"pid {', '.join(map(str, carriers[:5]))} carries the run's "
                             "environment" if carriers else "the processes' environments could not be read")
                             + ": the tree cannot be found")
        alive = 0
        for pid, start in known if same_boot else []:
            if pid > 1 and pid != os.getpid() and live_start(pid) == start:
                c._remember(pid, start, how)
                alive += 1
        pgid = tag.get("pgid")
        if isinstance(pgid, int) and _is_int(pgid) and c.root_pid > 0 and c.seen.get(c.root_pid) == c.root_start:
            c.pgid, c._group_ours = pgid, pgid == c.root_pid
        c.adopted = (f"adopted: {len(known)} persisted identit{'y' if len(known) == 1 else 'ies'}, "
                     f"{alive} alive when re-read" + ("" if same_boot else " (another boot: none can be)")
                     + ("; the previous owner kept only the first members" if tag.get("more") else ""))
        return c

    def prepare(self, req: posix.SpawnRequest, opts: Any) -> None:
        # As child subreaper (the CLI), every orphan of the tree reparents to
        # this process: its children other than the worker are the tree's.
        self._subreaper = bool(getattr(opts, "subreaper", False))
        # A group of its own, so the group finds the tree; but not when this
        # process is the foreground job of its terminal: a worker in another
        # group would be stopped (SIGTTIN) at its first read of the terminal
        # it inherited (tty(4), "job control"), and miss the terminal's
        # Ctrl-C. There it shares our group, as under a container, and the
        # group is no evidence of membership (it holds us, and a pipeline's
        # other commands): only as subreaper, which finds every orphan
        # without it.
        req.new_pgroup = req.new_pgroup or not (self._subreaper and _terminal_foreground(req.stdio))
        if opts.seal:
            self._seal_error = "--seal needs a kernel container: degraded mode has nothing to seal"

    def seal_status(self, req: posix.SpawnRequest) -> tuple[bool, str]:
        return False, "no kernel container (degraded mode): nothing keeps the tree together"

    def escape_evidence(self) -> dict[str, Any]:
        return {"observed": None, "at": None, "via": "none",
                "detail": "degraded mode: a process that leaves the group unseen cannot be detected"}

    def spawn(self, req: posix.SpawnRequest) -> posix.Spawned:
        if self._seal_error:
            raise ContainmentUnavailable(self._seal_error)
        sp = posix.spawn(req)
        sp.via = f"{posix.clone_call('CLONE_VM', 'CLONE_VFORK', 'CLONE_PIDFD')} + setpgid (no container)"
        self.root_pid = sp.pid
        if req.new_pgroup:
            self.pgid, self._group_ours = sp.pid, True
        start = live_start(sp.pid)
        if start is not None:
            self.root_start = start
            self._remember(sp.pid, start, "worker")
            self._persist({sp.pid: start})
        return sp

    def sources(self) -> list[tuple[int, int]]:
        return []            # nothing to wait on: the owner loop re-scans on a short deadline

    def root(self, sp: posix.Spawned) -> Root:
        return Root(sp.pid, sp.pidfd)

    def unleavable(self) -> str | None:
        return None

    def walls(self) -> list[dict[str, Any]]:
        return []

    def owns(self, pid: int) -> bool:
        return False

    def drain(self, ready: Any) -> None:
        pass

    def placed(self, pid: int) -> str | None:
        return None

    def _remember(self, pid: int, start: int, how: str) -> None:
        if self.seen.get(pid) != start:
            self.seen[pid] = start
            self.how.setdefault((pid, start), how)

    def _closure(self) -> dict[int, int]:
        """Members alive now (pid -> start time)."""
        if self.ledger is not None:
            self.ledger.sync()
        procs = _snapshot()
        me = os.getpid()
        members: dict[int, int] = {}

        def add(p: int, how: str) -> None:
            members[p] = procs[p][3]
            self._remember(p, procs[p][3], how)

        if self.ledger is not None:
            for t in list(self.ledger.tracked):
                st = procs.get(t.pid)
                if st is not None and t.start_time == st[3] and t.pid != me:
                    add(t.pid, "fork ledger")
        for p, start in list(self.seen.items()):
            st = procs.get(p)
            if st is not None and st[3] == start and p != me:
                members[p] = start
        # The worker's group is ours while its leader lives, and after that
        # only while it never emptied: an empty group frees its number for
        # reuse (pid_max is small). Started-before-the-worker never qualifies.
        if self._group_ours:
            in_group = [p for p, st in procs.items() if st[1] == self.pgid and p != me and st[3] >= self.root_start]
            if in_group:
                for p in in_group:
                    add(p, "process group")
            elif not (self.root_pid in procs and procs[self.root_pid][3] == self.root_start):
                self._group_ours = False
        changed = True
        while changed:
            changed = False
            for p, st in procs.items():
                if p in members or p == me:
                    continue
                ppid, pgid, sid, start = st
                if ppid in members:
                    add(p, "ancestry")
                    changed = True
                elif ppid == me and self._subreaper and start >= self.root_start:
                    add(p, "reparented to the supervisor (child subreaper)")
                    changed = True
                elif (pgid in members and start >= members[pgid]) or (sid in members and start >= members[sid]):
                    add(p, "group or session led by a member")
                    changed = True
        self.last_alive = sorted(members)
        self._persist(members)
        return members

    def populated(self) -> bool:
        if self.unknown is not None:
            raise OSError(self.unknown)        # the stop is UNCONFIRMED with the reason
        return bool(self._closure())

    def refresh(self) -> None:
        """One /proc pass, so the tag names the members alive now (for a
        later owner). The owner loop has no event for "the tree changed" in
        degraded mode: a driver that wants adoption to find members whose
        parents died calls this now and then while the run is running."""
        self._closure()

    def wait_change(self, timeout: float) -> None:
        time.sleep(min(timeout, 0.02))

    def _signal_all(self, sig: int) -> tuple[int, int]:
        sent = failed = 0
        for pid, start in self._closure().items():
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                # The pidfd pins the process; it must still be the one seen.
                if live_start(pid) != start:
                    continue
                signal.pidfd_send_signal(fd, sig)
                if sig != signal.SIGKILL:
                    signal.pidfd_send_signal(fd, signal.SIGCONT)
                sent += 1
            except ProcessLookupError:
                pass
            except OSError:
                failed += 1
            finally:
                os.close(fd)
        return sent, failed

    def terminate(self, sig: int = signal.SIGTERM) -> tuple[str, dict[str, Any]]:
        sent, failed = self._signal_all(sig)
        return (f"{signal.signal_name(sig)}+SIGCONT by pidfd to {sent} process(es) seen",
                {"signalled": sent, "failed": failed})

    def kill(self) -> str:
        for _ in range(10):
            sent, _failed = self._signal_all(signal.SIGKILL)
            if sent == 0:
                break
        return "SIGKILL by pidfd to each process seen (group, sessions, ancestry, fork ledger)"

    def members(self) -> list[int]:
        return sorted(self._closure())

    def seen_summary(self) -> dict[str, Any]:
        """What the run saw and what it cannot prove (the record's
        descendants_exit detail in degraded mode)."""
        by: dict[str, int] = {}
        for how in self.how.values():
            by[how] = by.get(how, 0) + 1
        seen = [{"pid": p, "start_time": s, "found_by": self.how.get((p, s))}
                for (p, s) in sorted(self.how)][:_LIST_CAP]
        ledger = self.ledger
        if self.adopted is not None:
            unprovable = (f"{self.adopted}: only those, what descends from them and what sits in "
                          "sessions or groups they lead can be found; a process that left earlier is invisible")
        elif ledger is None:
            unprovable = ("no fork ledger: a process that left the group and lost its ancestry between "
                          "two scans is invisible without a kernel container")
        elif not ledger.complete():
            unprovable = (f"the fork ledger lost events ({ledger.summary()}): a process forked then "
                          "would be invisible")
        else:
            unprovable = ("every fork of the tree was seen by the fork ledger, but without a kernel "
                          "container nothing held the tree: emptiness is not proven")
        return {"seen_count": len(self.how), "found_by": by, "seen": seen,
                "alive_at_last_scan": self.last_alive[:_LIST_CAP],
                "fork_ledger": ledger.summary() if ledger is not None else None,
                "unprovable": unprovable}

    def cpu_stat(self) -> dict[str, int] | None:
        return None

    def remove(self) -> str | None:
        return None
