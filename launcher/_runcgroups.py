"""One run's own cgroups beside its v2 leaf: the v1 cgroups on hybrid hosts,
the limits written into them and read back, the fds its spawn joins, and
their removal (the layout is in _controllers.py's docstring).
"""
from __future__ import annotations

import errno
import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Mapping

from ._controllers import (DOCTOR_HINT, Route, V1Hierarchy, host_v1_hierarchies, plan, read_file, v1_base_for,
                           v1_hierarchies)
from ._errors import ContainmentUnavailable
from ._limits import Limits
from ._procfs import cgroups_of, read_exiting
from ._platform.cgroups import mkdir_under, remove_bases, rmdir_known, walk_dirs
from ._names import run_name
from ._policy import policy_env

def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _swap_total() -> int | None:
    """SwapTotal in kB from /proc/meminfo, None if unreadable."""
    txt = read_file("/proc/meminfo")
    for line in (txt or "").splitlines():
        if line.startswith("SwapTotal:"):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def _read_back(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


class RunCgroups:
    """The controllers holding one run: its cgroup v2 directory (made by the
    backend, `linux.Container`) and the v1 cgroups made here.

    Life: `create()` before the spawn (v1 cgroups made, limits written and
    read back), `join_fds()` for the spawn, `close_join_fds()` right after
    it, `verify(pid)` on the spawned pid, the accounting reads while the run
    lives and after it is empty (`_accounting`), `remove()` after the final
    snapshot."""

    def __init__(self, name: str, v2_dir: str | None, routes: dict[str, Route],
                 limits: Limits | None = None) -> None:
        self.name = name
        self.v2_dir = v2_dir
        self.routes = routes
        self.limits = limits or Limits()
        self.v1: dict[str, str] = {}          # hierarchy name -> fs dir of our cgroup
        self.v1_hier: dict[str, V1Hierarchy] = {}
        self.made: list[str] = []             # v1 dirs created here (removed by remove())
        self.bases: list[tuple[str, bool]] = []   # named bases we sit in, and whether we made each
        self._described: tuple[Any, dict[str, Any]] | None = None
        self.applied: dict[str, Any] = {}
        self.notes: list[str] = []
        self._fds: list[int] = []
        self._v1_failed = False               # a v1 cgroup planned could not be made

    # -- making -------------------------------------------------------------

    @classmethod
    def create(cls, name: str, limits: Limits | None = None, *, v2_dir: str | None,
               env: Mapping[str, str] | None = None, hierarchies: list[V1Hierarchy] | None = None,
               accounting: bool = True) -> "RunCgroups":
        """Plan, make the v1 cgroups and apply the limits, all before the
        spawn. On any failure nothing made here is left behind and
        ContainmentUnavailable says why (the CLI's 125)."""
        env = os.environ if env is None else env
        limits = limits or Limits()
        if not run_name(name):
            raise ValueError(f"not a run cgroup name: {name!r}")
        v2_base = os.path.dirname(v2_dir) if v2_dir else None
        # Planned from the v1 mounts probed once per process: when a v1
        # cgroup planned from them cannot be made, the mounts are probed
        # again and the plan made once more before the failure counts.
        for retry in (hierarchies is None, False):
            rc: RunCgroups | None = None
            try:
                routes = plan(limits, v2_base=v2_base, env=env, hierarchies=hierarchies, accounting=accounting)
                rc = cls(name, v2_dir, routes, limits)
                rc._make_v1(env)
                if retry and rc._v1_failed:
                    raise ContainmentUnavailable("a v1 cgroup could not be made")
                rc._apply()
                return rc
            except BaseException as e:
                if rc is not None:
                    rc.remove()
                if not (retry and isinstance(e, (ContainmentUnavailable, OSError))):
                    raise
                hierarchies = host_v1_hierarchies(refresh=True)
        raise AssertionError("unreachable")

    def _make_v1(self, env: Mapping[str, str]) -> None:
        if not any(r.kind == "v1" and r.hierarchy is not None for r in self.routes.values()):
            return                             # none to make (the usual run: v1 accounting on demand)
        try:
            own = cgroups_of("self")
        except OSError:
            own = {}
        asked = set(self.limits.controllers())
        named = bool(policy_env("CONTAIN_CGROUP_V1_BASE", env))     # a base named for the run, not root's /contain
        for c, r in list(self.routes.items()):
            if r.kind != "v1" or r.hierarchy is None:
                continue
            h = r.hierarchy
            if h.name in self.v1:
                continue                       # co-mounted with one already made (cpu,cpuacct)
            parent, why, is_base = v1_base_for(h, env, own)
            problem = None
            if parent is not None:
                d = ""
                try:
                    pdir = h.fs_path(parent)
                    d = os.path.join(pdir, self.name)
                    self.made.append(d)        # before the mkdir: an interrupt after it left one remove() missed
                    made_base = mkdir_under(pdir, d, make_base=is_base, mark=is_base and named)
                    if is_base and named:      # named for runs (not root's /contain): the last run out removes it
                        self.bases.append((pdir, made_base))
                except (OSError, ValueError) as e:
                    self._v1_failed = True
                    self.made = [m for m in self.made if m != d]     # not made (or not ours: EEXIST)
                    problem = f"cgroup v1 {h.name}: cannot create {self.name} under {parent}: " + (
                        os.strerror(e.errno or 0) if isinstance(e, OSError) else str(e))
                else:
                    self.v1[h.name] = d
                    self.v1_hier[h.name] = h
                    mine = own.get(h.name)
                    if mine not in (None, "/") and not (parent == mine or parent.startswith(str(mine).rstrip("/") + "/")):
                        # Root's runs go to the contain base, beside the supervisor's own cgroup.
                        self.notes.append(f"cgroup v1 {h.name}: the run is under {parent}, outside the supervisor's own "
                                          f"{mine}: a limit set there does not bind the run")
                    for cc in h.controllers:
                        if cc in self.routes and self.routes[cc].kind == "v1":
                            self.routes[cc].note = why
                    continue
            else:
                problem = why
            # Not made: a limit on it is refused, an accounting-only controller says why.
            for cc in h.controllers:
                if cc in self.routes:
                    self.routes[cc] = Route(cc, None, reason=problem)
            hit = asked & set(h.controllers)
            if hit:
                raise ContainmentUnavailable(
                    f"--{'-'.join(k for k in ('memory', 'pids', 'cpu') if k in hit)}-max cannot be applied: {problem}",
                    doctor=DOCTOR_HINT)

    def _dir_for(self, controller: str) -> tuple[str, str]:
        """(fs dir, how to name it) holding `controller` for this run."""
        r = self.routes[controller]
        if r.kind == "v2" and self.v2_dir:
            return self.v2_dir, "cgroup2"
        h = r.hierarchy
        assert h is not None
        return self.v1[h.name], f"cgroup1 {h.name}"

    def where(self, controller: str) -> tuple[str, str] | None:
        """(fs dir, "cgroup2" or "cgroup1 <hierarchy>") for a controller the
        run has, or None."""
        r = self.routes.get(controller)
        if r is None or r.kind is None:
            return None
        if r.kind == "v2":
            return (self.v2_dir, "cgroup2") if self.v2_dir else None
        return self._dir_for(controller) if r.hierarchy is not None and r.hierarchy.name in self.v1 else None

    def cg_path(self, fs_dir: str) -> str:
        for name, d in self.v1.items():
            if fs_dir == d:
                return self.v1_hier[name].cg_path(d)
        return fs_dir

    def _set(self, d: str, fname: str, value: str) -> str:
        path = os.path.join(d, fname)
        try:
            _write(path, value)
            return _read_back(path)
        except OSError as e:
            raise ContainmentUnavailable(f"cannot write {value!r} to {path}: {os.strerror(e.errno or 0)}",
                                         doctor=DOCTOR_HINT) from e

    def _apply(self) -> None:
        lim = self.limits
        if lim.memory_max is not None:
            d, via = self._dir_for("memory")
            files: dict[str, str] = {}
            if via == "cgroup2":
                files["memory.max"] = self._set(d, "memory.max", str(lim.memory_max))
                # RAM only, unless swap is capped too: the tree could page its
                # way past the limit (cgroup-v2.rst "memory.swap.max").
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    files["memory.swap.max"] = self._set(d, "memory.swap.max", "0")
                else:
                    self.notes.append("memory.swap.max absent (no swap accounting): swap use is not limited")
                value = int(files["memory.max"]) if files["memory.max"].isdigit() else None
            else:
                files["memory.limit_in_bytes"] = self._set(d, "memory.limit_in_bytes", str(lim.memory_max))
                # memory+swap, set after the RAM limit (memsw may not be below
                # it), only where swap exists: with both limits equal the
                # memsw counter takes every failure, and it keeps no failcnt
                # (measured on 6.18: memory.failcnt and memory.memsw.failcnt
                # both 0 after an OOM kill at the limit; 76 without memsw).
                swap = _swap_total()
                if swap == 0:
                    self.notes.append("no swap on this host: memory.memsw.limit_in_bytes not set "
                                      "(swap enabled later during the run would not be limited)")
                elif os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                    files["memory.memsw.limit_in_bytes"] = self._set(d, "memory.memsw.limit_in_bytes",
                                                                     str(lim.memory_max))
                else:
                    self.notes.append("memory.memsw.limit_in_bytes absent (swapaccount off): swap use is not limited")
                value = int(files["memory.limit_in_bytes"])
            if value is None or value > lim.memory_max or value < lim.memory_max - 65536:
                raise ContainmentUnavailable(f"memory limit read back as {_read_back_text(files)} after writing "
                                             f"{lim.memory_max}")
            # The kernel rounds down to whole pages: say what holds.
            self.applied["memory_max_bytes"] = {"value": value, "via": via, "cgroup": self.cg_path(d),
                                                "files": files}
        if lim.pids_max is not None:
            d, via = self._dir_for("pids")
            got = self._set(d, "pids.max", str(lim.pids_max))
            if got != str(lim.pids_max):
                raise ContainmentUnavailable(f"pids.max read back as {got!r} after writing {lim.pids_max}")
            self.applied["pids_max"] = {"value": lim.pids_max, "via": via, "cgroup": self.cg_path(d),
                                        "files": {"pids.max": got}}
        if lim.cpu_max is not None:
            d, via = self._dir_for("cpu")
            cm = lim.cpu_max
            if via == "cgroup2":
                got = self._set(d, "cpu.max", f"{cm.quota_us} {cm.period_us}")
                files = {"cpu.max": got}
                ok = got.split() == [str(cm.quota_us), str(cm.period_us)]
            else:
                # Period first: the quota is checked against it.
                files = {"cpu.cfs_period_us": self._set(d, "cpu.cfs_period_us", str(cm.period_us)),
                         "cpu.cfs_quota_us": self._set(d, "cpu.cfs_quota_us", str(cm.quota_us))}
                ok = (files["cpu.cfs_period_us"], files["cpu.cfs_quota_us"]) == (str(cm.period_us), str(cm.quota_us))
            if not ok:
                raise ContainmentUnavailable(f"cpu limit read back as {_read_back_text(files)} after writing "
                                             f"{cm.quota_us} {cm.period_us}")
            self.applied["cpu_max"] = {"value": cm.to_dict(), "via": via, "cgroup": self.cg_path(d), "files": files}

    # -- the spawn ----------------------------------------------------------

    def join_fds(self) -> list[int]:
        """One `tasks` fd per v1 cgroup of the run, opened O_WRONLY |
        O_CLOEXEC by this (privileged) process: the child writes "0" to each
        before exec, and since 5.16 the kernel checks a migration against the
        opener's credentials (the fix for CVE-2021-4197), so a child that has
        already dropped privileges can still join. `tasks`, not
        `cgroup.procs`: the child is single-threaded, so moving its thread
        moves the process, and a write of "0" to `tasks` (one thread, the
        writer) skips the global cgroup_threadgroup_rwsem that a
        `cgroup.procs` write takes (cgroup_procs_write_start, "If we migrate
        a single thread ... we can skip the global lock", Linux 5.19). Taking
        that lock first waits for an RCU grace period (rcu_sync_enter), 5 to
        15 ms here on every move that follows a quiet spell: most of a
        one-shot `contain run`'s cost on a hybrid host (docs/performance.md).
        The caller passes them to the spawn and calls `close_join_fds()`
        right after it."""
        self.close_join_fds()
        try:
            for name in sorted(self.v1, key=lambda n: (self.worker_joins_itself(n), n)):
                self._fds.append(os.open(os.path.join(self.v1[name], "tasks"),
                                         os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
        except OSError as e:
            self.close_join_fds()
            raise ContainmentUnavailable(f"cannot open the tasks file of {self.name}: {os.strerror(e.errno or 0)}") from e
        return list(self._fds)

    def worker_joins_itself(self, name: str) -> bool:
        """Whether, behind the PID-namespace wall, the worker joins this v1
        hierarchy itself (its fds come last in join_fds) rather than the
        wall's init: the `pids` hierarchy, so that `--pids-max N` counts
        the tree's N tasks and not our init (with the init inside,
        `--pids-max 1 -- true` could not fork the worker at all). A move
        is not a fork: pids.max binds forks only (pids.rst), so the worker
        always gets in. Not `memory`: a vfork child joining a memory cgroup
        at its limit faults for ever on the first page it must copy (the
        OOM killer passes over a task in vfork, in_vfork() in oom_badness,
        mm/oom_kill.c), so the init stays in it and its few pages are
        charged to the run (limits.notes says so)."""
        ctrls = set(self.v1_hier[name].controllers)
        return "pids" in ctrls and "memory" not in ctrls

    def worker_joins(self) -> int:
        """How many of join_fds (the last ones) the worker joins itself."""
        return sum(1 for n in self.v1 if self.worker_joins_itself(n))

    def close_join_fds(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []

    def holds(self, pid: int) -> bool:
        """Whether `pid` is in one of the run's own v1 cgroups now (or in a
        cgroup below one). A process is born in its creator's cgroups: a
        fork found here was made inside the run, even if it has left the
        cgroup v2 container since (a root member can move itself there, and
        need not think of v1)."""
        if not self.v1:
            return False
        try:
            where = cgroups_of(pid)
        except OSError:
            return False
        for hname, d in self.v1.items():
            mine = self.v1_hier[hname].cg_path(d)
            got = where.get(hname)
            if got is not None and (got == mine or got.startswith(mine.rstrip("/") + "/")):
                return True
        return False

    def verify(self, pid: int, pidfd: int = -1) -> dict[str, Any]:
        """Right after the spawn: /proc/<pid>/cgroup names our cgroup on every
        v1 hierarchy the run joined. Evidence-shaped: observed True (all
        placed), False (one is elsewhere: the caller must not let the run go
        on as if limited), None (no statement could be read: `detail.note`
        says why, in words). `pidfd`: the worker's, when `pid` is not our
        unreaped child (behind the wall its parent is the init, which may
        reap it and free the pid before we read).

        A task that has begun to exit is no evidence either way: for it the
        kernel prints `/` on every v1 hierarchy (proc_cgroup_show() in
        kernel/cgroup/cgroup.c tests PF_EXITING; cgroup_exit() has already
        dropped it from its css_set), so a fast worker such as `true` read
        `/` there and was once taken for misplaced. The task's flags are read
        after its cgroup file: PF_EXITING is never cleared, so a task not
        exiting then was not exiting when its cgroup file was read."""
        via = f"/proc/{pid}/cgroup"
        if not self.v1:
            return {"observed": True, "via": via, "detail": {"v1": {}, "note": "no v1 cgroup to join"}}
        unread = ""
        try:
            where: dict[str, str] | None = cgroups_of(pid)
        except OSError as e:
            where, unread = None, os.strerror(e.errno or 0)
        exiting = read_exiting(pid)
        if pidfd >= 0 and not _unreaped(pidfd):
            exiting, where, unread = True, None, "the worker was reaped before it could be read"
        detail: dict[str, Any] = {}
        ok = where is not None
        for name, d in sorted(self.v1.items()):
            want = self.v1_hier[name].cg_path(d)
            got = where.get(name) if where is not None else None
            inside = got is not None and (got == want or got.startswith(want.rstrip("/") + "/"))
            detail[name] = {"expected": want, "found": got, "ok": inside}
            ok = ok and inside
        if ok:
            return {"observed": True, "via": via, "detail": {"v1": detail}}
        joined = ("what was verified: the worker's clone wrote itself into each of them before exec "
                  "(a write that fails fails the spawn at its 'placement' stage)")
        if exiting:
            return {"observed": None, "via": via, "detail": {"v1": detail, "note": (
                f"the worker's place in the run's v1 cgroups ({', '.join(sorted(self.v1))}) was not "
                f"verified: it had already exited when {via} was read (an exiting task shows '/' "
                f"on every v1 hierarchy); {joined}")}}
        if where is None or exiting is None:
            return {"observed": None, "via": via, "detail": {"v1": detail, "note": (
                f"the worker's place in the run's v1 cgroups was not verified: {via} or its stat "
                f"could not be read ({unread if where is None else 'stat unreadable'}); {joined}")}}
        return {"observed": False, "via": via, "detail": {"v1": detail, "note": misplaced_text(detail)}}

    # -- reading and ending -------------------------------------------------

    def v1_members(self) -> dict[str, list[int]] | None:
        """Pids still listed in the run's v1 cgroups (and below). After the v2
        container is observed empty, any pid here is a member that left the
        v2 container but not this one. None if a list could not be read."""
        out: dict[str, list[int]] = {}
        for name, top in self.v1.items():
            pids: list[int] = []
            failed: list[OSError] = []
            for d in walk_dirs(top, failed.append):
                txt = read_file(os.path.join(d, "cgroup.procs"))
                if txt is None:
                    if os.path.isdir(d):
                        return None
                    continue
                pids.extend(int(x) for x in txt.split())
            if any(getattr(e, "errno", None) != errno.ENOENT for e in failed):
                return None            # a subtree that could not be listed hides who is in it
            out[name] = sorted(set(pids))
        return out

    def remove(self) -> str | None:
        """Remove the v1 cgroups made here, bottom-up (nested runs' first).
        Returns None, or why not (a cgroup with a task cannot be removed:
        EBUSY, cgroup-v1 docs)."""
        import time

        self.close_join_fds()
        problems = []
        for top in self.made:
            if rmdir_known([top]):
                continue                  # the usual end: no child cgroup, no task
            failed: list[OSError] = []
            dirs = walk_dirs(top, failed.append) or [top]
            for d in sorted(dirs, key=len, reverse=True):
                for attempt in range(50):
                    try:
                        os.rmdir(d)
                        break
                    except FileNotFoundError:
                        break
                    except OSError as e:
                        # The last task can still be leaving when the v2
                        # container reads empty; EBUSY then clears by itself.
                        if e.errno == errno.EBUSY and attempt < 49:
                            time.sleep(0.002)
                            continue
                        left = read_file(os.path.join(d, "cgroup.procs"))
                        problems.append(f"rmdir {d}: {os.strerror(e.errno or 0)}"
                                        + (f" (still holds pid {' '.join(left.split()[:8])})" if left and left.strip() else ""))
                        break
            if os.path.isdir(top) and not problems:
                # os.walk swallowed why it could not list the subtree (EMFILE):
                # never "removed" for a cgroup that is still there.
                why = "; ".join(f"{e.filename}: {os.strerror(e.errno or 0)}" for e in failed[:3]) or "still there"
                problems.append(f"rmdir {top}: not removed ({why})")
        self.made = [d for d in self.made if os.path.isdir(d)]
        if not self.made:
            remove_bases(self.bases)   # only while empty: another run's cgroup keeps it (EBUSY)
            self.bases = []
        return "; ".join(problems) or None

    # -- the record ---------------------------------------------------------

    def limits_record(self) -> dict[str, Any]:
        """The record's `limits`: what was asked and what was applied (the
        driver adds `hit` from `_accounting.limit_hits` at the end)."""
        out: dict[str, Any] = {"asked": self.limits.asked(), "applied": dict(self.applied)}
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def describe(self) -> dict[str, Any]:
        """What an adopter needs to read and remove these cgroups later (the
        run info), and what the record's containment says about them. Made
        once per state of the cgroups (run.json has it thrice); read-only."""
        key = (tuple(self.v1.items()), tuple(self.made), tuple((c, r.kind, r.hierarchy, r.reason, r.note)
                                                               for c, r in self.routes.items()))
        if self._described is None or self._described[0] != key:
            self._described = (key, {
                "name": self.name,
                "v1": {name: {"mount": self.v1_hier[name].mount, "root": self.v1_hier[name].root,
                              "cgroup": self.v1_hier[name].cg_path(d), "dir": d,
                              "created": d in self.made} for name, d in sorted(self.v1.items())},
                "controllers": {c: r.to_dict() for c, r in sorted(self.routes.items())}})
        return self._described[1]

    @classmethod
    def attach(cls, desc: Mapping[str, Any], *, v2_dir: str | None) -> "RunCgroups":
        """Take over a run's cgroups from its run info (orphan adoption, or
        `status` of a live run). The info is untrusted: every v1 directory
        must sit on a v1 mount that is really there with those controllers,
        carry the run's name, and contain no symlink; anything else is
        refused with ValueError, so a forged file cannot make us read or
        remove another cgroup."""
        name = desc.get("name")
        if not run_name(name):
            raise ValueError("run cgroups: no valid name")
        if v2_dir is not None and os.path.basename(v2_dir) != name:
            raise ValueError(f"run cgroups: {name} does not match the v2 directory {v2_dir}")
        hs = {h.name: h for h in v1_hierarchies()}
        routes: dict[str, Route] = {}
        rc = cls(name, v2_dir, routes)
        v1 = desc.get("v1") or {}
        if not isinstance(v1, dict):
            raise ValueError("run cgroups: v1 is not a mapping")
        for hname, info in v1.items():
            h = hs.get(hname)
            if h is None or not isinstance(info, dict):
                raise ValueError(f"run cgroups: no v1 hierarchy {hname!r} is mounted")
            cg = info.get("cgroup")
            if (not isinstance(cg, str) or not cg.startswith("/") or os.path.normpath(cg) != cg
                    or os.path.basename(cg) != name):
                raise ValueError(f"run cgroups: {cg!r} is not the run's cgroup")
            d = h.fs_path(cg)
            if os.path.realpath(d) != d:
                raise ValueError(f"run cgroups: {d} is not a plain path")
            rc.v1[hname] = d
            rc.v1_hier[hname] = h
            if info.get("created"):
                rc.made.append(d)
                rc.bases.append((os.path.dirname(d), False))     # removed only if a run marked it (MADE_MARK)
            for c in h.controllers:
                routes[c] = Route(c, "v1", h)
        ctl = desc.get("controllers") or {}
        if isinstance(ctl, dict) and v2_dir is not None:
            for c, r in ctl.items():
                if isinstance(r, dict) and r.get("via") == "cgroup2" and c not in routes:
                    routes[c] = Route(str(c), "v2")
        return rc


def _unreaped(pidfd: int) -> bool:
    """Whether a pidfd's process is not yet reaped (signal 0 reaches a
    zombie, and fails with ESRCH only once it is reaped). Unknown (another
    error) counts as reaped: the reads made under its pid prove nothing."""
    from . import _signals

    try:
        _signals.pidfd_send_signal(pidfd, 0)
    except OSError:
        return False
    return True


def misplaced_text(detail: dict[str, Any]) -> str:
    """The words for a worker found outside its run's v1 cgroups."""
    wrong = [f"on the v1 {name} hierarchy it is in {d.get('found') or 'no cgroup'}, not {d.get('expected')}"
             for name, d in sorted(detail.items()) if not d.get("ok")]
    return "the worker is not in its limited cgroups: " + "; ".join(wrong)


def _read_back_text(files: dict[str, str]) -> str:
    """What each limit file read back, in words (a message a user reads)."""
    return ", ".join(f"{name} {value!r}" for name, value in files.items())
