"""What a run cost: the final snapshot, and the live numbers.

Every number is read from a cgroup that held the whole tree, so a grandchild
that was never waited for, or that called setsid, is counted like the
worker. Each number says where it came from; a number that could not be
read is `{"value": null, "reason": ...}`, never 0.

The final snapshot is taken after the container is observed empty and
before its cgroups are removed: the kernel keeps a cgroup's counters only
as long as the cgroup exists (systemd#28542 lost `memory.peak` that way).

Where each number comes from (and the kernel that first has it):

| field | cgroup v2 (run directory) | cgroup v1 (the run's own cgroup) |
|---|---|---|
| cpu_user_usec, cpu_system_usec, cpu_usec | cpu.stat (4.15; no controller needed) | cpuacct.usage_user/_sys (4.7), only without v2 |
| memory_peak_bytes | memory.peak (5.19) | memory.max_usage_in_bytes |
| oom_kills | memory.events oom_kill (4.13) | memory.oom_control oom_kill (4.13) |
| memory_max_events | memory.events max | memory.failcnt |
| tasks_peak | pids.peak (6.1) | pids.peak (6.1) |
| pids_max_events | pids.events max (4.3; hierarchical from 6.13, pids.events.local) | pids.events max (fork failures in that very cgroup: summed over the run's subtree) |
| io_read_bytes, io_write_bytes | io.stat rbytes/wbytes (4.16) | not used: blkio.throttle.* counts only throttled devices |
"""
from __future__ import annotations

import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Mapping

    from ._runcgroups import RunCgroups

from ._record import now_iso

FIELDS = ("wall_s", "cpu_usec", "cpu_user_usec", "cpu_system_usec", "memory_peak_bytes", "memory_limit_bytes",
          "memory_max_events",
          "oom_kills", "tasks_peak", "pids_max_events", "io_read_bytes", "io_write_bytes")


def metric(value: int | float, source: str) -> dict[str, Any]:
    return {"value": value, "source": source}


def unknown(reason: str) -> dict[str, Any]:
    return {"value": None, "reason": reason}


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


def parse_flat_keyed(text: str) -> dict[str, int]:
    """"key value" lines (cpu.stat, memory.events, memory.oom_control,
    pids.events), cgroup-v2.rst "Interface Files: Flat keyed"."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        k, _, v = line.strip().partition(" ")
        v = v.strip()
        if k and v.lstrip("-").isdigit():
            out[k] = int(v)
    return out


def parse_io_stat(text: str) -> tuple[int, int]:
    """(rbytes, wbytes) summed over every device of an io.stat (nested keyed:
    "MAJ:MIN rbytes=.. wbytes=.. rios=.. ...")."""
    r = w = 0
    for line in text.splitlines():
        for item in line.split()[1:]:
            k, _, v = item.partition("=")
            if k == "rbytes" and v.isdigit():
                r += int(v)
            elif k == "wbytes" and v.isdigit():
                w += int(v)
    return r, w


class _Src:
    """Where the run's controllers are: its v2 directory and its v1 cgroups."""

    def __init__(self, cg: RunCgroups | None, v2_dir: str | None) -> None:
        self.cg = cg
        self.v2 = v2_dir if v2_dir else (cg.v2_dir if cg is not None else None)

    def v2_file(self, name: str) -> str | None:
        if self.v2 is None:
            return None
        p = os.path.join(self.v2, name)
        return p if os.path.exists(p) else None

    def v1_dir(self, controller: str) -> str | None:
        if self.cg is None:
            return None
        w = self.cg.where(controller)
        return w[0] if w is not None and w[1] != "cgroup2" else None

    def why_not(self, controller: str) -> str:
        if self.cg is not None:
            r = self.cg.routes.get(controller)
            if r is not None and r.reason:
                return r.reason
        if self.v2 is None and self.cg is None:
            return "no cgroup held the run"
        return f"no {controller} controller holds the run"


def _one(read: Any, source: str) -> dict[str, Any]:
    try:
        v = read()
    except (OSError, ValueError, KeyError) as e:
        why = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else f"{type(e).__name__}: {e}"
        return unknown(f"{source}: {why}")
    return metric(v, source)


def _cpu(src: _Src, out: dict[str, Any]) -> None:
    p = src.v2_file("cpu.stat")
    if p is not None:
        try:
            st = parse_flat_keyed(_read(p))
        except OSError as e:
            for k in ("cpu_usec", "cpu_user_usec", "cpu_system_usec"):
                out[k] = unknown(f"{p}: {os.strerror(e.errno or 0)}")
            return
        for k, key in (("cpu_usec", "usage_usec"), ("cpu_user_usec", "user_usec"), ("cpu_system_usec", "system_usec")):
            out[k] = metric(st[key], f"cgroup2 {p} {key}") if key in st else unknown(f"{p} has no {key}")
        return
    d = src.v1_dir("cpuacct")
    if d is not None:
        def ns(f: str) -> int:
            return int(_read(os.path.join(d, f)).strip()) // 1000
        out["cpu_usec"] = _one(lambda: ns("cpuacct.usage"), f"cgroup1 {d}/cpuacct.usage (ns / 1000)")
        out["cpu_user_usec"] = _one(lambda: ns("cpuacct.usage_user"), f"cgroup1 {d}/cpuacct.usage_user (ns / 1000)")
        out["cpu_system_usec"] = _one(lambda: ns("cpuacct.usage_sys"), f"cgroup1 {d}/cpuacct.usage_sys (ns / 1000)")
        return
    why = src.why_not("cpuacct") if src.v2 is None else f"{src.v2}/cpu.stat does not exist"
    for k in ("cpu_usec", "cpu_user_usec", "cpu_system_usec"):
        out[k] = unknown(why)


def _memory(src: _Src, out: dict[str, Any]) -> None:
    if src.v2_file("memory.events") is not None:
        assert src.v2 is not None
        p = os.path.join(src.v2, "memory.peak")
        out["memory_peak_bytes"] = (_one(lambda: int(_read(p).strip()), f"cgroup2 {p}") if os.path.exists(p)
                                    else unknown(f"{p} does not exist (kernel before 5.19)"))
        mx = os.path.join(src.v2, "memory.max")
        out["memory_limit_bytes"] = _limit(mx, f"cgroup2 {mx}")
        ev = os.path.join(src.v2, "memory.events")
        out["oom_kills"] = _one(lambda: parse_flat_keyed(_read(ev))["oom_kill"], f"cgroup2 {ev} oom_kill")
        out["memory_max_events"] = _one(lambda: parse_flat_keyed(_read(ev))["max"], f"cgroup2 {ev} max")
        return
    d = src.v1_dir("memory")
    if d is not None:
        p = os.path.join(d, "memory.max_usage_in_bytes")
        out["memory_peak_bytes"] = _one(lambda: int(_read(p).strip()), f"cgroup1 {p}")
        lf = os.path.join(d, "memory.limit_in_bytes")
        out["memory_limit_bytes"] = _limit(lf, f"cgroup1 {lf}")
        oc = os.path.join(d, "memory.oom_control")
        out["oom_kills"] = _one(lambda: parse_flat_keyed(_read(oc))["oom_kill"], f"cgroup1 {oc} oom_kill")
        # With swap accounting the memory+swap counter is charged first and
        # takes the failure when both limits are equal: count both.
        fcs = [os.path.join(d, f) for f in ("memory.failcnt", "memory.memsw.failcnt")
               if os.path.exists(os.path.join(d, f))]
        out["memory_max_events"] = _one(lambda: sum(int(_read(f).strip()) for f in fcs),
                                        "cgroup1 " + " + ".join(fcs))
        return
    why = src.why_not("memory")
    for k in ("memory_peak_bytes", "memory_limit_bytes", "oom_kills", "memory_max_events"):
        out[k] = unknown(why)


def _limit(path: str, source: str) -> dict[str, Any]:
    """The memory limit in force: v2 "max" and v1's page-rounded LONG_MAX
    both mean none (null with that reason: there is no number to give)."""
    try:
        txt = _read(path).strip()
    except OSError as e:
        return unknown(f"{source}: {os.strerror(e.errno or 0)}")
    if txt == "max" or (txt.isdigit() and int(txt) >= 1 << 62):
        return unknown(f"{source}: no limit ({txt})")
    return metric(int(txt), source) if txt.isdigit() else unknown(f"{source}: {txt!r}")


def _sum_subtree(top: str, fname: str, key: str) -> int:
    from ._platform.cgroups import walk_dirs     # (this module is loaded on Windows too)

    total = 0
    for d in walk_dirs(top):
        total += parse_flat_keyed(_read(os.path.join(d, fname)))[key]
    return total


def _pids(src: _Src, out: dict[str, Any]) -> None:
    if src.v2_file("pids.current") is not None:
        assert src.v2 is not None
        top, via = src.v2, "cgroup2"
        # From 6.13 pids.events is hierarchical (and pids.events.local exists);
        # before, "max" was counted only in the forking task's own cgroup.
        hierarchical = os.path.exists(os.path.join(top, "pids.events.local"))
    else:
        d = src.v1_dir("pids")
        if d is None:
            why = src.why_not("pids")
            out["tasks_peak"] = unknown(why)
            out["pids_max_events"] = unknown(why)
            return
        top, via, hierarchical = d, "cgroup1", False   # v1: fork failures of that very cgroup
    p = os.path.join(top, "pids.peak")
    out["tasks_peak"] = (_one(lambda: int(_read(p).strip()), f"{via} {p}") if os.path.exists(p) else
                         unknown(f"{p} does not exist (kernel before 6.1): the peak was not recorded"))
    ev = os.path.join(top, "pids.events")
    if hierarchical:
        out["pids_max_events"] = _one(lambda: parse_flat_keyed(_read(ev))["max"], f"{via} {ev} max")
    else:
        out["pids_max_events"] = _one(lambda: _sum_subtree(top, "pids.events", "max"),
                                      f"{via} {ev} max, summed over the run's subtree (counted where the fork failed)")


def _io(src: _Src, out: dict[str, Any]) -> None:
    p = src.v2_file("io.stat")
    if p is not None:
        try:
            r, w = parse_io_stat(_read(p))
        except OSError as e:
            out["io_read_bytes"] = out["io_write_bytes"] = unknown(f"{p}: {os.strerror(e.errno or 0)}")
            return
        out["io_read_bytes"] = metric(r, f"cgroup2 {p} rbytes (all devices)")
        out["io_write_bytes"] = metric(w, f"cgroup2 {p} wbytes (all devices)")
        return
    why = src.why_not("io")
    out["io_read_bytes"] = unknown(why)
    out["io_write_bytes"] = unknown(why)


def _empty_now(src: _Src) -> dict[str, Any]:
    """Whether the snapshot was taken with the run's cgroups empty: v2
    `populated 0`, and no pid left in any v1 cgroup of the run."""
    via = []
    if src.v2 is not None:
        via.append("cgroup.events populated")
        try:
            ev = parse_flat_keyed(_read(os.path.join(src.v2, "cgroup.events")))
        except OSError as e:
            return {"observed": None, "via": via[0], "detail": f"unreadable: {os.strerror(e.errno or 0)}"}
        if ev.get("populated") != 0:
            return {"observed": False, "via": via[0], "detail": "the run's cgroup is populated"}
    if src.cg is not None and src.cg.v1:
        via.append("v1 cgroup.procs")
        left = src.cg.v1_members()
        if left is None:
            return {"observed": None, "via": " + ".join(via), "detail": "a v1 cgroup.procs could not be read"}
        stay = {k: v for k, v in left.items() if v}
        if stay:
            return {"observed": False, "via": " + ".join(via), "detail": {"v1_members": stay}}
    if not via:
        return {"observed": None, "via": "none", "detail": "no cgroup held the run"}
    return {"observed": True, "via": " + ".join(via), "detail": None}


def final_snapshot(cg: RunCgroups | None, *, v2_dir: str | None = None, wall_s: float | None = None,
                   wall_reason: str | None = None, at: float | None = None) -> dict[str, Any]:
    """The record's `accounting`: call after the container was observed empty
    and before any of its cgroups is removed. `wall_s` is spawn to empty
    (monotonic clock) as the driver measured it."""
    src = _Src(cg, v2_dir)
    out: dict[str, Any] = {"taken_at": now_iso(at)}
    out["wall_s"] = (metric(round(wall_s, 6), "monotonic clock, spawn to container observed empty")
                     if wall_s is not None else unknown(wall_reason or "spawn or emptiness not observed"))
    _cpu(src, out)
    _memory(src, out)
    _pids(src, out)
    _io(src, out)
    out["empty_when_taken"] = _empty_now(src)
    return out


def live(cg: RunCgroups | None, *, v2_dir: str | None = None) -> dict[str, Any]:
    """Numbers for `status` and `ls` while a run goes on: three small reads
    (CPU so far, memory now, tasks now), each with its source."""
    src = _Src(cg, v2_dir)
    out: dict[str, Any] = {"at": now_iso()}
    p = src.v2_file("cpu.stat")
    if p is not None:
        out["cpu_usec"] = _one(lambda: parse_flat_keyed(_read(p))["usage_usec"], f"cgroup2 {p} usage_usec")
    elif src.v1_dir("cpuacct") is not None:
        q = os.path.join(src.v1_dir("cpuacct") or "", "cpuacct.usage")
        out["cpu_usec"] = _one(lambda: int(_read(q).strip()) // 1000, f"cgroup1 {q} (ns / 1000)")
    else:
        out["cpu_usec"] = unknown(src.why_not("cpuacct"))
    p = src.v2_file("memory.current")
    d = src.v1_dir("memory")
    if p is not None:
        out["memory_bytes"] = _one(lambda: int(_read(p).strip()), f"cgroup2 {p}")
    elif d is not None:
        q = os.path.join(d, "memory.usage_in_bytes")
        out["memory_bytes"] = _one(lambda: int(_read(q).strip()), f"cgroup1 {q}")
    else:
        out["memory_bytes"] = unknown(src.why_not("memory"))
    p = src.v2_file("pids.current")
    d = src.v1_dir("pids")
    if p is not None:
        out["tasks"] = _one(lambda: int(_read(p).strip()), f"cgroup2 {p}")
    elif d is not None:
        q = os.path.join(d, "pids.current")
        out["tasks"] = _one(lambda: int(_read(q).strip()), f"cgroup1 {q}")
    else:
        out["tasks"] = unknown(src.why_not("pids"))
    return out


# -- what the numbers say about the run's end ------------------------------------

def _count_layer(m: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    if not m:
        return {"observed": None, "via": "none", "detail": f"{what}: not in the snapshot"}
    if m.get("value") is None:
        return {"observed": None, "via": "none", "detail": m.get("reason") or "not read"}
    n = m["value"]
    return {"observed": n > 0, "via": m.get("source"), "detail": {"count": n}}


def _memory_max_layer(acct: Mapping[str, Any]) -> dict[str, Any]:
    """Whether memory reached its limit: the kernel's count of limit hits
    (v2 memory.events max, v1 failcnt), or the peak at the limit (usage can
    never exceed it, so a peak within two pages of it means it was reached;
    v1 failcnt misses hits taken by the memory+swap counter)."""
    ev = acct.get("memory_max_events") or {}
    peak_m = acct.get("memory_peak_bytes") or {}
    lim_m = acct.get("memory_limit_bytes") or {}
    peak, lim, n = peak_m.get("value"), lim_m.get("value"), ev.get("value")
    no_limit = lim is None and "no limit" in str(lim_m.get("reason") or "")
    at_limit = None if peak is None or lim is None else peak >= lim - 8192
    detail = {"count": n, "peak_bytes": peak, "limit_bytes": lim}
    if n:
        return {"observed": True, "via": ev.get("source"), "detail": detail}
    if at_limit:
        return {"observed": True, "via": f"{peak_m.get('source')} reached {lim_m.get('source')}", "detail": detail}
    if n == 0 and (at_limit is False or no_limit):
        return {"observed": False, "via": ev.get("source"), "detail": detail}
    return {"observed": None, "via": "none",
            "detail": ev.get("reason") or peak_m.get("reason") or lim_m.get("reason") or "not read"}


def limit_hits(acct: Mapping[str, Any]) -> dict[str, Any]:
    """From a final snapshot: whether the OOM killer acted in the run
    (`oom_kill`: counted for any kill of a member, the run's limit or the
    host's), whether memory reached its limit (`memory_max`: reclaim at the
    limit, with or without a kill), and whether a fork failed at the pids
    limit (`pids_max`). Each is evidence-shaped: true/false only when the
    counter was read, null with the reason otherwise."""
    return {
        "oom_kill": _count_layer(acct.get("oom_kills"), "oom_kills"),
        "memory_max": _memory_max_layer(acct),
        "pids_max": _count_layer(acct.get("pids_max_events"), "pids_max_events"),
    }


def signal_cause(signal: int | None, hits: Mapping[str, Any], *, kill_sent_before_exit: bool) -> dict[str, Any] | None:
    """Why the worker died of SIGKILL, as far as the counters say, so that an
    OOM kill never reads as a plain `signaled 9`. `kill_sent_before_exit`:
    contain's own stop had written cgroup.kill (or sent SIGKILL) before the
    worker's exit was seen. None when the worker did not die of SIGKILL.

    cause: "oom_kill" (the OOM killer killed a member and contain sent no
    SIGKILL), "contain_stop", "other" (no OOM kill counted, no SIGKILL from
    contain: another process sent it), or None (OOM kills not countable)."""
    if signal != 9:
        return None
    oom = hits.get("oom_kill") or {}
    seen = oom.get("observed")
    n = oom.get("detail", {}).get("count") if isinstance(oom.get("detail"), dict) else None
    if kill_sent_before_exit:
        return {"cause": "contain_stop", "via": "the run's own signal_sent steps", "oom_kills_in_run": n,
                "basis": "contain's stop sent SIGKILL before the worker died"}
    if seen is True:
        return {"cause": "oom_kill", "via": oom.get("via"), "oom_kills_in_run": n,
                "basis": "the OOM killer killed a member of the run, and contain sent no SIGKILL"}
    if seen is False:
        return {"cause": "other", "via": oom.get("via"), "oom_kills_in_run": 0,
                "basis": "no OOM kill was counted in the run and contain sent no SIGKILL: another process did"}
    return {"cause": None, "via": "none", "oom_kills_in_run": None,
            "basis": f"OOM kills could not be counted: {oom.get('detail')}"}


def wall_time(spawned_mono: float | None, empty_mono: float | None) -> float | None:
    """Spawn to empty, from two monotonic readings (None if either is missing)."""
    if spawned_mono is None or empty_mono is None or empty_mono < spawned_mono:
        return None
    return empty_mono - spawned_mono
