"""What a run may use and what it cost, in one run's life (issue 14).

    RunUsage(opts)                 the limits asked (`--memory-max`, `--pids-max`, `--cpu-max`)
    .create(container, run_id)     the run's own cgroups beside its container (v1 on hybrid
                                   hosts), limits written and read back: before the spawn
    .join(req)                     the spawn's join fds: the child writes "0" to each before
                                   exec, so the whole tree is inside from its first instruction
    .spawned(pid, pidfd)           placement verified right after the spawn (None, or why not);
                                   `placement_note()` when it could not be (the worker had exited)
    .at_stop(members)              the locks members hold when the stop begins (`locks_released`)
    .finish(facts, container)      the final snapshot, after the container was observed empty and
                                   before anything is removed; then the run's cgroups removed

The numbers themselves and where each comes from are _accounting.py's; the
cgroups are _runcgroups.py's; the locks layer is _locks.py's.
"""
from __future__ import annotations

import os
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

    from ._evidence import RunEvidence
    from ._limits import Limits
    from ._runcgroups import RunCgroups


class RunUsage:
    def __init__(self, limits: Limits | None, *, check_locks: bool = False, accounting: bool = True) -> None:
        self.limits = limits
        self.check_locks = check_locks
        self.accounting = accounting               # v1 cgroups for the numbers alone (hybrid hosts)
        self.cgroups: RunCgroups | None = None
        self.problem: str | None = None          # why the run has no cgroups of its own
        self.spawned_mono: float | None = None
        self.empty_mono: float | None = None
        self.locks: Any = None
        self.worker_pid = -1
        self.placement: dict[str, Any] | None = None

    @classmethod
    def for_options(cls, opts: Any) -> "RunUsage":
        """v1 cgroups of the run's own (hybrid hosts) when their numbers are
        asked for (a limit, stats_json, accounting), and without the wall:
        there they are evidence too, a member that moved itself out of the
        v2 cgroup is still in them (_escapes.at_empty)."""
        return cls(opts.limits, check_locks=opts.check_locks,
                   accounting=opts.accounting or bool(opts.stats_json) or opts.pidns is False)

    def create(self, container: Any, run_id: str, uid: str | None = None) -> None:
        """Raises ContainmentUnavailable when a limit cannot be applied (the
        run then fails with 125, never runs unlimited)."""
        from ._errors import ContainmentUnavailable

        if container.backend == "job-object":
            # Windows: no cgroups; the job's own accounting (winacct.py) and
            # limits, written and read back as the job was made (winlimits.py).
            if self.limits and getattr(container, "job_limits", None) is None:
                raise ContainmentUnavailable("limits (--memory-max, --pids-max, --cpu-max) were asked, but the "
                                             "Job Object was made without them")
            self.problem = "no cgroups on Windows: the Job Object's own accounting is read"
            return
        from ._platform.cgroups import run_cgroup_name
        from ._runcgroups import RunCgroups

        v2_dir = getattr(container, "dir", None) if container.backend == "cgroup2" else None
        name = os.path.basename(v2_dir) if v2_dir else run_cgroup_name(run_id, uid)
        try:
            self.cgroups = RunCgroups.create(name, self.limits, v2_dir=v2_dir, env=os.environ,
                                             accounting=self.accounting)
        except ContainmentUnavailable:
            raise
        except (OSError, ValueError) as e:
            if self.limits:
                raise ContainmentUnavailable(f"limits: {e}") from e
            self.problem = f"no cgroups of the run's own for accounting: {e}"

    def unapplied(self, why: str) -> dict[str, Any] | None:
        """The record's `limits` for a run that ended before its own cgroups
        existed (spawn_failed: no container, or the limits could not be
        applied): what was asked, that nothing was applied, and why. None
        when nothing was asked or the cgroups exist (finish() reads them)."""
        if not self.limits or self.cgroups is not None:
            return None
        return {"asked": self.limits.asked(), "applied": {}, "notes": [why]}

    def adopt(self, info: dict[str, Any], container: Any) -> str | None:
        """An adopter takes over the run's own cgroups from run.json (checked
        by RunCgroups.attach: a forged description is refused), so the final
        numbers are read and the cgroups removed. None, or why not."""
        from ._runcgroups import RunCgroups

        desc = info.get("cgroups_v1")
        if desc is None:
            return None
        if not isinstance(desc, dict):
            return "run.json: cgroups_v1 is not an object"
        v2_dir = getattr(container, "dir", None) if container is not None and container.backend == "cgroup2" else None
        try:
            self.cgroups = RunCgroups.attach(desc, v2_dir=v2_dir)
        except (OSError, ValueError) as e:
            return f"the run's own cgroups were not taken over: {e}"
        return None

    def join(self, req: Any) -> None:
        if self.cgroups is not None:
            req.join_fds = list(req.join_fds) + self.cgroups.join_fds()
            req.worker_joins = self.cgroups.worker_joins()

    def close_join(self) -> None:
        if self.cgroups is not None:
            self.cgroups.close_join_fds()

    def spawned(self, pid: int, pidfd: int = -1) -> str | None:
        """None if the worker is in every cgroup it must be in, or if that
        could not be read (a worker that already exited: `placement_note`
        says what was and was not verified); else why not, in words (the
        caller stops it: a run must not go on as if limited)."""
        self.spawned_mono = time.monotonic()
        self.worker_pid = pid
        if self.cgroups is None:
            return None
        self.placement = self.cgroups.verify(pid, pidfd)
        if self.placement.get("observed") is False and self.limits:
            return str(self.placement["detail"]["note"])
        return None

    def explain_spawn_failure(self, err: Any, container: Any) -> Any:
        """A wall's init killed before it could start the worker, in a run
        with --memory-max whose memory cgroup counted an OOM kill: the
        limit was below what contain's own init needs (it sits in the run's
        memory cgroup: _runcgroups.RunCgroups.worker_joins_itself says why),
        said so instead of "the pid namespace init died killed by signal 9".
        Any other error is returned as it is."""
        from ._errors import SpawnFailed

        if not (isinstance(err, SpawnFailed) and err.stage == "pid namespace init" and self.cgroups is not None
                and self.limits is not None and self.limits.memory_max is not None):
            return err
        from ._accounting import final_snapshot

        v2_dir = getattr(container, "dir", None) if container is not None and container.backend == "cgroup2" else None
        kills = (final_snapshot(self.cgroups, v2_dir=v2_dir).get("oom_kills") or {}).get("value")
        if not kills:
            return err
        applied = (self.cgroups.applied.get("memory_max_bytes") or {}).get("value")
        new = SpawnFailed(f"{err.path or 'the worker'}: contain's init (pid 1 of the run's PID namespace) was "
                          f"killed by the OOM killer before it could start the worker: --memory-max counts the "
                          f"init's own pages (it is in the run's memory cgroup and needs about 100 KiB), and "
                          f"{applied} bytes leave it too few; ask for more, or use --no-pidns",
                          errno=err.errno or 0, stage=err.stage, path=err.path)
        new.wall_init = err.wall_init
        return new

    def placement_note(self) -> str | None:
        """The record's note for a placement that could not be verified."""
        if self.placement is None or self.placement.get("observed") is not None:
            return None
        return str(self.placement["detail"]["note"])

    def init_counted(self, container: Any) -> str | None:
        """How the wall's init is counted in the limits asked, in words
        (limits.notes), or None: --pids-max never counts it (the worker
        joins the pids cgroup itself), --memory-max does, --cpu-max does
        (an init that sleeps in signalfd uses next to no CPU)."""
        if self.limits is None or self.limits.memory_max is None or getattr(container, "wall", None) is None:
            return None
        return ("contain's init (pid 1 of the run's PID namespace) is in the run's memory cgroup: its own pages "
                "(about 100 KiB) count against memory_max; pids_max counts only the tree")

    def at_stop(self, members: list[int]) -> None:
        if self.check_locks and self.locks is None:
            from ._locks import held_by

            self.locks = held_by(members, exited=[self.worker_pid] if self.worker_pid > 0 else [])

    def at_empty(self) -> None:
        self.empty_mono = self.empty_mono or time.monotonic()

    def append_stats(self, path: str, rec: dict[str, Any]) -> str | None:
        """`--stats-json`: one compact line per run (_stats.py). None, or why
        it could not be written (the CLI's 125, as for --record)."""
        from ._stats import append_stats, stats_line

        try:
            append_stats(path, stats_line(rec))
        except OSError as e:
            return f"--stats-json {path}: {e.strerror or e}"
        return None

    def finish(self, facts: RunEvidence, container: Any, pid: int) -> None:
        """The final accounting and limits, the locks layer, then removal."""
        from ._accounting import final_snapshot, limit_hits, signal_cause, wall_time

        v2_dir = getattr(container, "dir", None) if container is not None and container.backend == "cgroup2" else None
        acct = final_snapshot(self.cgroups, v2_dir=v2_dir, wall_s=wall_time(self.spawned_mono, self.empty_mono),
                              wall_reason=None if self.empty_mono else "the container was not observed empty")
        if container is not None and container.backend == "pidns":
            facts.cpu = _pidns_cpu(acct, container.cpu_lower_bound())
        if container is not None and container.backend == "job-object" and getattr(container, "job", 0):
            # (An adopter's job that is gone, or was never opened, has no numbers to give.)
            from ._platform.winacct import fields

            acct.update(fields(container))        # `null` with the reason where Wine reads 0
        hits = limit_hits(acct)
        facts.accounting = acct
        moved = getattr(container, "can_move_out", None) if (v2_dir or self.cgroups is not None) else None
        caveat = f"{moved}: the run's cgroups count and limit only the members that stayed in them" if moved else None
        if caveat:
            acct["notes"] = [caveat]
        if self.cgroups is not None:
            facts.limits = dict(self.cgroups.limits_record(), hit=hits)
            if caveat and self.limits:
                facts.limits["notes"] = [*facts.limits.get("notes", []), caveat]
            counted = self.init_counted(container)
            if counted:
                facts.limits["notes"] = [*facts.limits.get("notes", []), counted]
            facts.cgroup_v1 = dict(self.cgroups.describe(), placement=self.placement)
        elif container is not None and container.backend == "job-object" and hasattr(container, "limits_record"):
            # The job's own read-back, `hit` from the port's limit messages.
            job_limits = container.limits_record()
            if job_limits is not None:
                facts.limits = job_limits
                hits = job_limits["hit"]
        steps = ((facts.layers.get("signal_sent") or {}).get("detail") or {})
        killed = any(s.get("kind") == "kill" and s.get("observed")
                     for s in (steps.get("steps") or [] if isinstance(steps, dict) else []))
        facts.signal_cause = signal_cause(facts.signal, hits, kill_sent_before_exit=killed)
        if self.check_locks:
            from ._locks import locks_released

            facts.layers["locks_released"] = locks_released(self.locks, exited_pids=[pid] if pid > 0 else [])
        if self.cgroups is not None:
            problem = self.cgroups.remove()
            facts.cleanup["cgroups_v1_removed"] = problem is None
            if problem:
                facts.cleanup["cgroups_v1_detail"] = problem


_AUTOREAP = ("no cgroup of the run counts the tree's CPU, and the PID namespace's init counts only the members "
             "reaped by a wait: a member that ignores SIGCHLD (or sets SA_NOCLDWAIT) has its children reaped by "
             "the kernel, and their CPU reaches no rusage")


def _pidns_cpu(acct: dict[str, Any], bound: dict[str, int] | None) -> dict[str, int] | None:
    """Whole-tree CPU of a `pidns` run: the run's own cpuacct cgroup (it
    counts every member, auto-reaped ones too) where the snapshot read one;
    else null with the reason, the init's rusage kept as `at_least`. Returns
    the record's `cpu` (None when not proven)."""
    keys = (("cpu_usec", "usage_usec"), ("cpu_user_usec", "user_usec"), ("cpu_system_usec", "system_usec"))
    if all(isinstance(acct.get(k), dict) and acct[k].get("value") is not None for k, _ in keys):
        return {key: acct[k]["value"] for k, key in keys}
    for k, key in keys:
        entry: dict[str, Any] = {"value": None, "reason": _AUTOREAP}
        if bound is not None:
            entry["at_least"] = bound[key]
            entry["at_least_source"] = "rusage of the PID namespace's init (the members reaped by a wait)"
        acct[k] = entry
    return None
