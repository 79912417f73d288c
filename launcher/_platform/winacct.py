"""What a run on a Job Object cost, where the job's accounting is real.

QueryInformationJobObject gives whole-tree CPU (TotalUserTime +
TotalKernelTime of every process ever in the job) and peak memory
(PeakJobMemoryUsed). Wine fills neither (its 0 is not a reading), and on
Windows a 0 is ambiguous for a run that did next to nothing, so a number is
kept only where it is plausible, and otherwise it is `null` with the reason,
never 0:

- CPU: the job's total includes the worker's own time, so a total below
  the worker's own GetProcessTimes is not accounting; both reading 0 cannot
  be told from a counter that is not implemented either;
- peak memory: no job that held a process has a peak of 0.

`fields()` gives the same numbers in the shape of _accounting.py
(`{"value": ..., "source": ...}` or `{"value": None, "reason": ...}`).
"""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from .winsync import error as _error

VIA_CPU = "QueryInformationJobObject(JobObjectBasicAccountingInformation) TotalUserTime + TotalKernelTime"
VIA_MEM = "QueryInformationJobObject(JobObjectExtendedLimitInformation) PeakJobMemoryUsed"


def accounting(c: Any) -> dict[str, Any]:
    """`cpu` and `peak_memory` of Container `c`, each `{"observed", "via", "detail"}`."""
    from .._native import ffi, lib

    out: dict[str, Any] = {}
    try:
        acc = c.job_accounting()
    except OSError as e:
        out["cpu"] = {"observed": None, "via": VIA_CPU, "detail": f"query failed: {e}"}
        acc = None
    worker = c.worker_times()
    if acc is not None:
        user, kernel = int(acc.user_100ns) // 10, int(acc.kernel_100ns) // 10
        job_total = user + kernel
        own = None if worker is None else (worker["user"] + worker["kernel"]) // 10
        if own is not None and job_total < own:
            out["cpu"] = {"observed": None, "via": VIA_CPU, "detail": (
                f"not a measurement: the job's total ({job_total} us) is below the worker's own "
                f"GetProcessTimes ({own} us); Wine does not implement job CPU accounting")}
        elif job_total == 0:
            out["cpu"] = {"observed": None, "via": VIA_CPU, "detail": (
                "the job's CPU time reads 0" + (" and so does the worker's own" if own == 0 else "")
                + ": not distinguishable from accounting that is not implemented")}
        else:
            out["cpu"] = {"observed": True, "via": VIA_CPU,
                          "detail": {"usage_usec": job_total, "user_usec": user, "system_usec": kernel,
                                     "processes": int(acc.total), "worker_usec": own}}
    peak_job = ffi.new("uint64_t*")
    peak_proc = ffi.new("uint64_t*")
    rc = lib.ct_job_memory(c.job, peak_job, peak_proc)
    if rc != 0:
        out["peak_memory"] = {"observed": None, "via": VIA_MEM, "detail": f"query failed: {_error(rc, VIA_MEM)}"}
    elif peak_job[0] == 0:
        out["peak_memory"] = {"observed": None, "via": VIA_MEM, "detail": (
            "reads 0, which no job that held a process can have: not a measurement "
            "(Wine zero-fills this query)")}
    else:
        out["peak_memory"] = {"observed": True, "via": VIA_MEM,
                              "detail": {"peak_job_bytes": int(peak_job[0]),
                                         "peak_process_bytes": int(peak_proc[0])}}
    return out


def cpu_stat(c: Any) -> dict[str, int] | None:
    """The job's CPU totals where accounting() finds them plausible, else None."""
    try:
        cpu = accounting(c)["cpu"]
    except (OSError, KeyError):
        return None
    if cpu.get("observed") is not True:
        return None
    d = cpu["detail"]
    return {"usage_usec": d["usage_usec"], "user_usec": d["user_usec"], "system_usec": d["system_usec"]}


def fields(c: Any) -> dict[str, Any]:
    """accounting() in _accounting.py's shape: each number with its source,
    or `{"value": None, "reason": ...}`; what a job cannot say at all (OOM
    kills, I/O, peak tasks) says so."""
    a = accounting(c)
    cpu, mem = a.get("cpu") or {}, a.get("peak_memory") or {}
    out: dict[str, Any] = {}
    if cpu.get("observed") is True:
        d = cpu["detail"]
        out["cpu_usec"] = {"value": d["usage_usec"], "source": VIA_CPU}
        out["cpu_user_usec"] = {"value": d["user_usec"], "source": VIA_CPU}
        out["cpu_system_usec"] = {"value": d["system_usec"], "source": VIA_CPU}
    else:
        for k in ("cpu_usec", "cpu_user_usec", "cpu_system_usec"):
            out[k] = {"value": None, "reason": str(cpu.get("detail"))}
    if mem.get("observed") is True:
        out["memory_peak_bytes"] = {"value": mem["detail"]["peak_job_bytes"], "source": VIA_MEM}
    else:
        out["memory_peak_bytes"] = {"value": None, "reason": str(mem.get("detail"))}
    for k in ("oom_kills", "tasks_peak", "io_read_bytes", "io_write_bytes"):
        out[k] = {"value": None, "reason": "not read from the Job Object (JOBOBJECT_BASIC_AND_IO_ACCOUNTING "
                  "is not queried yet)"}
    return out
