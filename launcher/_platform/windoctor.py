"""`contain doctor` on Windows: what this host gives, found by trying it.

- a Job Object with its completion port and the restricted handle
  (windows.Container.create), and what a process of this token could get on
  it (the probe: whether the job can be left, so whether REAPED is possible);
- a real spawn of `cmd.exe /c exit 0` into such a job: whether the job list
  (PROC_THREAD_ATTRIBUTE_JOB_LIST) is honoured or the suspended fallback is
  used, and, when this process runs in a job itself, whether that job lets
  ours nest (a job that forbids it refuses the assignment: debugpy#545);
- the job this process runs in, if any, and its limits;
- each resource limit (`--memory-max`, `--pids-max`, `--cpu-max`) written on a
  job of its own and read back as a run does it (winlimits.py), or why not;
- whether this process has a console (the polite CTRL_BREAK_EVENT travels
  through one).
"""
from __future__ import annotations

import os
import sys
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

_BREAKAWAY_OK, _SILENT_BREAKAWAY_OK, _KILL_ON_JOB_CLOSE = 0x800, 0x1000, 0x2000


def _probe(fn: Any) -> dict[str, Any]:
    """One probe: its answer; an exception is its own answer (as in _doctor.py)."""
    try:
        out = fn()
    except Exception as e:   # a probe failing is a finding, not a crash
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return out if isinstance(out, dict) else {"ok": bool(out)}


def _wrap(text: str, first: str, rest: str, width: int = 100) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=width, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False, break_long_words=False)


def _wine() -> str | None:
    if sys.platform != "win32":   # also tells mypy that what follows is Windows code
        return None
    import ctypes

    try:
        f = ctypes.WinDLL("ntdll").wine_get_version
    except (AttributeError, OSError):
        return None
    f.restype = ctypes.c_char_p
    v = f()
    return v.decode() if v else "unknown"


def _own_job() -> dict[str, Any]:
    from .._native import ffi, lib
    from .winsync import error

    in_job = ffi.new("int*")
    flags = ffi.new("uint32_t*")
    rc = lib.ct_job_self(in_job, flags)
    if rc != 0:
        return {"ok": None, "error": str(error(rc, "IsProcessInJob/QueryInformationJobObject"))}
    f = int(flags[0])
    out: dict[str, Any] = {"ok": True, "in_job": bool(in_job[0])}
    if in_job[0]:
        out.update(limit_flags=f"0x{f:x}", breakaway_ok=bool(f & _BREAKAWAY_OK),
                   silent_breakaway_ok=bool(f & _SILENT_BREAKAWAY_OK), kill_on_close=bool(f & _KILL_ON_JOB_CLOSE))
    return out


def _spawn_probe() -> dict[str, Any]:
    """A Job Object made as a run makes it, and `cmd.exe /c exit 0` spawned
    into it, observed empty, removed."""
    from . import windows, winproc

    c = windows.Container.create("doctor")
    try:
        guard = dict(c.guard)
        comspec = os.environ.get("COMSPEC") or os.path.join(os.environ.get("SystemRoot", r"C:\Windows"),
                                                            "System32", "cmd.exe")
        t0 = time.perf_counter()
        try:
            c.spawn(winproc.Request([comspec, "/c", "exit 0"], stdio=(-1, -1, -1)))
        except Exception as e:   # a refusal is the finding (an enclosing job that forbids nesting)
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "guard": guard}
        ms = (time.perf_counter() - t0) * 1000
        deadline = time.monotonic() + 10
        while c.populated() and time.monotonic() < deadline:
            c.wait_change(deadline - time.monotonic())
        empty = not c.populated()
        return {"ok": empty, "via": c.spawn_via, "job_list": "JOB_LIST" in (c.spawn_via or ""),
                "spawn_ms": round(ms, 3), "observed_empty": empty, "guard": guard}
    finally:
        if c.populated():
            c.kill()
        c.remove()


def _limits_probe() -> dict[str, Any]:
    """Each limit on a job of its own, as `contain run` would apply it."""
    from .._errors import ContainmentUnavailable
    from .._limits import Limits, parse_cpu_max
    from . import windows

    out: dict[str, Any] = {}
    for flag, lim in (("--memory-max", Limits(memory_max=256 << 20)), ("--pids-max", Limits(pids_max=64)),
                      ("--cpu-max", Limits(cpu_max=parse_cpu_max("1")))):
        try:
            windows.Container.create("doctor-limits", lim).remove()
        except ContainmentUnavailable as e:
            out[flag] = {"ok": False, "error": e.reason}
        else:
            out[flag] = {"ok": True, "via": "job-object, read back"}
    return out


def capabilities() -> dict[str, Any]:
    """What `contain doctor` reports on Windows (also `launcher.capabilities()`)."""
    from . import winproc
    from .winsync import require_windows

    require_windows("this report")
    if sys.platform != "win32":
        raise AssertionError
    v = sys.getwindowsversion()
    caps: dict[str, Any] = {"schema": "contain.capabilities/1", "platform": "win32",
                            "windows": f"{v.major}.{v.minor}.{v.build}", "wine": _wine()}
    spawn = _probe(_spawn_probe)
    caps["job_object"] = spawn
    caps["own_job"] = _probe(_own_job)
    caps["limits"] = _probe(_limits_probe)
    console, why = winproc.console_pids()
    caps["console"] = {"ok": console is not None, "error": why}
    guard = spawn.get("guard") or {}
    ok = bool(spawn.get("ok"))
    unleavable = ok and guard.get("obtainable") == []
    caps["modes"] = [{
        "mode": "job-object", "backend": "job-object", "available": ok,
        "strongest_state": ("REAPED" if unleavable else "EXITED") if ok else None,
        "escapes": (("prevented: the job allows no breakaway and no process of this token can obtain a handle "
                     "that changes that (probed with every privilege enabled)") if unleavable else
                    f"possible: a process of this token can obtain {', '.join(guard.get('obtainable') or [])} "
                    "on the job (an administrator's privileges)" if guard.get("obtainable") else
                    f"unknown: {guard.get('why')}") if ok else None,
        "why_not": None if ok else spawn.get("error"),
    }]
    caps["containment_possible"] = ok
    caps["next_steps"] = next_steps(caps)
    return caps


def next_steps(caps: dict[str, Any]) -> list[str]:
    steps: list[str] = []
    spawn, own = caps["job_object"], caps["own_job"]
    if not spawn.get("ok"):
        if own.get("in_job"):
            steps.append(f"this process runs in a job ({own.get('limit_flags')}) that refused ours "
                         f"({spawn.get('error')}): run contain outside it (jobs nest only since Windows 8, and "
                         "not under a job with UI limits)")
        else:
            steps.append(f"no Job Object could hold a worker here: {spawn.get('error')}")
    elif (spawn.get("guard") or {}).get("obtainable"):
        steps.append("this token holds privileges that can take the job's limits (an elevated administrator): "
                     "its runs end EXITED, never REAPED; run contain from a non-elevated prompt")
    if spawn.get("ok") and not spawn.get("job_list"):
        steps.append("PROC_THREAD_ATTRIBUTE_JOB_LIST is not honoured (Windows before 10): workers are created "
                     "suspended and assigned before their first instruction instead")
    if not caps["console"]["ok"]:
        steps.append("no console: the polite CTRL_BREAK_EVENT cannot be delivered, so every stop is the kill "
                     "after --grace (TerminateJobObject)")
    refused = [f for f, v in (caps.get("limits") or {}).items() if isinstance(v, dict) and v.get("ok") is False]
    if refused:
        first = caps["limits"][refused[0]].get("error") or ""
        if len(first) > 200:
            first = first[:200] + "..."
        steps.append(f"{', '.join(refused)}: refused here (a run asking for one exits 125, it never runs "
                     f"unlimited): {first}")
    if caps.get("wine"):
        steps.append(f"Wine {caps['wine']}: job CPU times and peak memory read 0 (recorded as not measured), "
                     "CTRL_BREAK_EVENT is not implemented, and the job's memory, process and CPU limits are "
                     "neither kept nor enforced (docs/windows.md)")
    if not steps:
        steps.append("nothing to do: this host gives the strongest container contain knows on Windows")
    return steps


def render(caps: dict[str, Any]) -> str:
    lines = [f"Windows {caps['windows']}" + (f" (Wine {caps['wine']})" if caps.get("wine") else "")]
    spawn, own = caps["job_object"], caps["own_job"]
    lines.append(f"  job object      {'yes' if spawn.get('ok') else 'no'}"
                 + (f", spawn via {spawn.get('via')}" if spawn.get("via") else f": {spawn.get('error')}"))
    guard = spawn.get("guard") or {}
    lines.append(f"  limits guard    owner {guard.get('owner')}; obtainable by this token: "
                 f"{', '.join(guard.get('obtainable') or []) or 'nothing'}")
    lines.append("  own job         " + ("none" if not own.get("in_job") else own.get("limit_flags", "?")))
    lines.append(f"  console         {'yes' if caps['console']['ok'] else 'no'}")
    lim = caps.get("limits") or {}
    if lim.get("error"):
        lines.append(f"  limits          unknown: {lim['error']}")
    else:
        lines.append("  limits          " + ", ".join(f"{f} {'yes' if v.get('ok') else 'no'}" for f, v in lim.items()
                                                     if isinstance(v, dict)))
    lines.append("")
    for m in caps["modes"]:
        lines.append(f"{m['mode']}: {'available' if m['available'] else 'unavailable'}"
                     + (f", at best {m['strongest_state']}" if m["strongest_state"] else ""))
        if m.get("escapes"):
            lines.extend(_wrap(f"escapes: {m['escapes']}", "  ", "  "))
        if m.get("why_not"):
            lines.extend(_wrap(f"why not: {m['why_not']}", "  ", "  "))
    lines.append("")
    lines.append("next steps")
    for step in caps["next_steps"]:
        lines.extend(_wrap(step, "  - ", "    "))
    return "\n".join(lines) + "\n"
