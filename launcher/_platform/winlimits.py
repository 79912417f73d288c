"""`--memory-max`, `--pids-max` and `--cpu-max` on a Job Object.

The same rules as the cgroup limits (_runcgroups.py): written before the
worker exists, read back, recorded with where they came from, and refused
(ContainmentUnavailable, exit 125, with the reason) when the kernel refuses
them or the read-back does not confirm them: never a silent no-op.

| limit | the job's | counts |
|---|---|---|
| `memory_max` | `JOB_OBJECT_LIMIT_JOB_MEMORY`, `JobMemoryLimit` | the committed (private) memory of every process in the job together; an allocation past it fails (there is no OOM kill), and the file cache is not counted |
| `pids_max` | `JOB_OBJECT_LIMIT_ACTIVE_PROCESS`, `ActiveProcessLimit` | processes, not threads (cgroup pids.max counts tasks); the worker is one; a process past it is not created. No process of contain's is in the job (no init, no helper), but a nested `contain run` is one of the outer run's |
| `cpu_max` | `JobObjectCpuRateControlInformation`, `ENABLE | HARD_CAP`, `CpuRate` | a share of all the machine's processors (below) |

CPU: `--cpu-max` means what cgroup v2's cpu.max means, `quota` µs of CPU
time per `period` µs of wall time, i.e. quota/period CPUs. `CpuRate` is a
share of the cycles of all N processors (GetActiveProcessorCount of every
group), in 1/100 of a percent, so

    CpuRate = floor(10000 * quota / (period * N)), at least 1, at most 10000

(integer arithmetic; rounded down so the cap is never looser than asked,
except that 1 is the smallest rate). The record keeps `cpu_rate`, N and the
`effective_cpus` (CpuRate * N / 10000). The period is not carried over:
Windows applies the cap over its own scheduling interval. More CPUs than
the machine has gives 10000, which caps nothing (as such a cpu.max does on
Linux): the record says so.

The limits are written with the handle ct_job_create returned, before
ct_job_restrict removes JOB_OBJECT_SET_ATTRIBUTES and before anything is
assigned, so the worker is limited from its first instruction and no
process of the tree can lift them (windows.py, "the limits guard").

Whether a limit was hit: JOB_OBJECT_MSG_JOB_MEMORY_LIMIT and
JOB_OBJECT_MSG_ACTIVE_PROCESS_LIMIT on the job's completion port, counted
by the owner's Waiter (winsync.c) and by ct_job_wait_empty. Their delivery
is "not guaranteed" (JOBOBJECT_ASSOCIATE_COMPLETION_PORT), so none arriving
is "not observed" (null), never false.

Measured under Wine 8 (docs/windows.md): the extended limits are accepted
but neither kept nor enforced (the query reads every field 0, KILL_ON_JOB_CLOSE
included; a child is created past ActiveProcessLimit 1; 300 MB are allocated
under a 100 MB JobMemoryLimit), and the CPU rate class is refused (error
87): every limit is refused there, with that reason.
"""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Mapping

    from .._limits import CpuMax, Limits

from .._errors import ContainmentUnavailable
from .winsync import error as _error

# winnt.h
LIMIT_ACTIVE_PROCESS = 0x8
LIMIT_JOB_MEMORY = 0x200
LIMIT_KILL_ON_JOB_CLOSE = 0x2000
CPU_RATE_CONTROL_ENABLE = 0x1
CPU_RATE_CONTROL_HARD_CAP = 0x4
CPU_RATE_FULL = 10000

SET_EXT = "SetInformationJobObject(JobObjectExtendedLimitInformation)"
SET_CPU = "SetInformationJobObject(JobObjectCpuRateControlInformation)"
QUERY_EXT = "QueryInformationJobObject(JobObjectExtendedLimitInformation)"
QUERY_CPU = "QueryInformationJobObject(JobObjectCpuRateControlInformation)"
MSG_MEMORY = "JOB_OBJECT_MSG_JOB_MEMORY_LIMIT"
MSG_PROCESS = "JOB_OBJECT_MSG_ACTIVE_PROCESS_LIMIT"
DOCTOR_HINT = "docs/windows.md, \"Limits\": what the job enforces here"


def cpu_rate(cm: CpuMax, ncpus: int) -> tuple[int, str | None]:
    """(CpuRate, a note or None) for a cpu.max-style limit on `ncpus` processors."""
    if ncpus < 1:
        raise ValueError(f"{ncpus} processors")
    exact = cm.quota_us * CPU_RATE_FULL // (cm.period_us * ncpus)
    if exact >= CPU_RATE_FULL:
        note = None if cm.quota_us == cm.period_us * ncpus else (
            f"--cpu-max asks for {cm.cpus} CPUs, more than the {ncpus} here: CpuRate {CPU_RATE_FULL} "
            "(all of them), which caps nothing")
        return CPU_RATE_FULL, note
    if exact < 1:
        return 1, (f"--cpu-max asks for {cm.cpus} CPUs, less than the smallest rate (1/10000 of {ncpus} "
                   f"CPUs): CpuRate 1, {ncpus / CPU_RATE_FULL} CPUs")
    return exact, None


def _refuse(flag: str, why: str) -> ContainmentUnavailable:
    return ContainmentUnavailable(f"{flag} cannot be applied to the Job Object: {why}", doctor=DOCTOR_HINT)


def _unreported(flags: int) -> str:
    """Why a read-back that lost our own KILL_ON_JOB_CLOSE proves nothing."""
    if flags & LIMIT_KILL_ON_JOB_CLOSE:
        return ""
    return (f"; the query does not report this job's limits at all (LimitFlags 0x{flags:x}, without the "
            "KILL_ON_JOB_CLOSE every job of ours has: Wine zero-fills this class), and a limit that cannot "
            "be read back is not applied")


class JobLimits:
    """What was asked, applied (read back) and noted for one run's job."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.applied: dict[str, Any] = {}
        self.notes: list[str] = []

    def record(self, counts: Mapping[str, int]) -> dict[str, Any]:
        """The record's `limits`, `hit` from the port's limit messages."""
        out: dict[str, Any] = {"asked": self.limits.asked(), "applied": dict(self.applied),
                               "hit": hits(self.limits, counts)}
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def apply(job: int, limits: Limits, path: str) -> JobLimits:
    """Write `limits` on `job` (a handle with JOB_OBJECT_SET_ATTRIBUTES and
    QUERY: ct_job_create's, before ct_job_restrict) and read them back.
    Raises ContainmentUnavailable naming the flag and the reason."""
    from .._native import ffi, lib

    out = JobLimits(limits)
    mem, procs = limits.memory_max, limits.pids_max
    if mem is not None or procs is not None:
        names = " and ".join(f for f, v in (("--memory-max", mem), ("--pids-max", procs)) if v is not None)
        asked = ", ".join(f"{k}={v}" for k, v in (("JobMemoryLimit", mem), ("ActiveProcessLimit", procs))
                          if v is not None)
        rc = lib.ct_job_set_limits(job, mem or 0, procs or 0)
        if rc != 0:
            raise _refuse(names, f"{SET_EXT} {asked}: {_error(rc, SET_EXT)}")
        got = ffi.new("struct ct_job_limit_values*")
        rc = lib.ct_job_read_limits(job, got)
        if rc != 0:
            raise _refuse(names, f"not read back ({_error(rc, QUERY_EXT)})")
        flags = int(got.flags)
        back: dict[str, Any] = {"LimitFlags": f"0x{flags:x}"}
        if mem is not None:
            value = int(got.job_memory_limit)
            back["JobMemoryLimit"] = value
            # Windows may round to pages; never above what was asked.
            if not flags & LIMIT_JOB_MEMORY or not mem - 65536 <= value <= mem:
                raise _refuse("--memory-max", f"{QUERY_EXT} read back JobMemoryLimit {value}, LimitFlags "
                              f"0x{flags:x} after writing {mem}" + _unreported(flags))
        if procs is not None:
            value = int(got.active_process_limit)
            back["ActiveProcessLimit"] = value
            if not flags & LIMIT_ACTIVE_PROCESS or value != procs:
                raise _refuse("--pids-max", f"{QUERY_EXT} read back ActiveProcessLimit {value}, LimitFlags "
                              f"0x{flags:x} after writing {procs}" + _unreported(flags))
        if mem is not None:
            out.applied["memory_max_bytes"] = {
                "value": int(got.job_memory_limit), "via": "job-object", "job": path,
                "set": f"{SET_EXT} JOB_OBJECT_LIMIT_JOB_MEMORY, JobMemoryLimit", "read_back": dict(back)}
            out.notes.append("--memory-max bounds the committed memory of all the job's processes together: "
                             "an allocation past it fails (no OOM kill), and the file cache is not counted")
        if procs is not None:
            out.applied["pids_max"] = {
                "value": procs, "via": "job-object", "job": path,
                "set": f"{SET_EXT} JOB_OBJECT_LIMIT_ACTIVE_PROCESS, ActiveProcessLimit", "read_back": dict(back)}
            out.notes.append("--pids-max counts the job's processes, not threads; the worker is one of them "
                             "(contain puts no process of its own in the job)")
    if limits.cpu_max is not None:
        out.applied["cpu_max"] = _apply_cpu(job, limits.cpu_max, path, out.notes)
    return out


def _apply_cpu(job: int, cm: CpuMax, path: str, notes: list[str]) -> dict[str, Any]:
    from .._native import ffi, lib

    n = ffi.new("uint32_t*")
    rc = lib.ct_job_cpu_count(n)
    if rc != 0:
        raise _refuse("--cpu-max", f"the processor count: {_error(rc, 'GetActiveProcessorCount')}")
    ncpus = int(n[0])
    rate, note = cpu_rate(cm, ncpus)
    rc = lib.ct_job_set_cpu_rate(job, rate)
    if rc != 0:
        raise _refuse("--cpu-max", f"{SET_CPU} ENABLE|HARD_CAP CpuRate={rate}: {_error(rc, SET_CPU)}")
    flags, got = ffi.new("uint32_t*"), ffi.new("uint32_t*")
    rc = lib.ct_job_read_cpu_rate(job, flags, got)
    if rc != 0:
        raise _refuse("--cpu-max", f"not read back ({_error(rc, QUERY_CPU)})")
    want = CPU_RATE_CONTROL_ENABLE | CPU_RATE_CONTROL_HARD_CAP
    if int(flags[0]) & want != want or int(got[0]) != rate:
        raise _refuse("--cpu-max", f"{QUERY_CPU} read back ControlFlags 0x{int(flags[0]):x}, CpuRate "
                      f"{int(got[0])} after writing ENABLE|HARD_CAP, CpuRate {rate}")
    if note:
        notes.append(note)
    notes.append("--cpu-max on a Job Object is a share of all the machine's processors; its period is not "
                 "carried over (Windows caps over its own interval)")
    return {"value": cm.to_dict(), "via": "job-object", "job": path,
            "set": f"{SET_CPU} JOB_OBJECT_CPU_RATE_CONTROL_ENABLE | HARD_CAP, CpuRate",
            "cpu_rate": rate, "cpus_on_host": ncpus, "effective_cpus": round(rate * ncpus / CPU_RATE_FULL, 6),
            "conversion": "CpuRate = floor(10000 * quota_us / (period_us * cpus_on_host)), 1..10000",
            "read_back": {"ControlFlags": f"0x{int(flags[0]):x}", "CpuRate": int(got[0])}}


def _hit(asked: bool, flag: str, msg: str, n: int) -> dict[str, Any]:
    via = f"{msg} on the job's completion port"
    if not asked:
        return {"observed": False, "via": "no limit on the job", "detail": f"no {flag} was asked"}
    if n > 0:
        return {"observed": True, "via": via, "detail": {"messages": n}}
    return {"observed": None, "via": via, "detail": (
        f"not observed: no {msg} came on the completion port, whose delivery is not guaranteed "
        "(JOBOBJECT_ASSOCIATE_COMPLETION_PORT): not a no")}


def hits(limits: Limits, counts: Mapping[str, int]) -> dict[str, Any]:
    """`limits.hit` in _accounting.limit_hits' shape. `counts`: the port's
    `job_memory_limit` and `job_process_limit` messages over the run."""
    return {
        "oom_kill": {"observed": None, "via": "none", "detail": (
            "a Job Object has no OOM killer: at its memory limit allocations fail")},
        "memory_max": _hit(limits.memory_max is not None, "--memory-max", MSG_MEMORY,
                           int(counts.get("job_memory_limit", 0))),
        "pids_max": _hit(limits.pids_max is not None, "--pids-max", MSG_PROCESS,
                         int(counts.get("job_process_limit", 0))),
    }
