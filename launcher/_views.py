"""What a reader shows of a run: its view (from the layout, and its cgroup
as it is now) and the text for people that `ls` and `status` print.

Readers never trust the run directory: every file comes through the typed
parsers (_runfiles, via RunDir.load_*), a file that does not parse makes the
run UNREADABLE with the reason, and a directory this user may not read is
UNREADABLE too ("permission denied"), never a traceback.
"""
from __future__ import annotations

import json
import os
import re
from . import _signals as signal
import time
from typing import Any

from ._layout import RunDir, Summary
from ._record import LAYERS
from ._runfiles import TERMINAL, RunInfo, Unreadable, iso_epoch, memory_peak
from ._safefs import UnsafePath
from ._ofdlock import Locks

UNREADABLE = "UNREADABLE"
ID_WIDTH = 24               # `ls` truncates longer ids (`--no-trunc` shows them whole)
MAX_MEMBER_DIRS = 1000      # a live view walks at most this many cgroups of one run
_LEAF_RE = re.compile(r"^(run|sub)-[A-Za-z0-9._-]+-[0-9a-f]{8}$")


parse_iso = iso_epoch


def age(s: Any, now: float | None = None) -> str:
    t = parse_iso(s)
    if t is None:
        return "-"
    d = max(0.0, (time.time() if now is None else now) - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= n:
            return f"{int(d // n)}{unit}"
    return f"{int(d)}s"


def signame(n: Any) -> str:
    return signal.signal_name(n)


# -- one run as a reader sees it --------------------------------------------------

def members_now(cgroup_dir: str | None) -> tuple[int | None, int | None]:
    """(processes in the run's cgroup subtree, its cpu usage in µs) now, or
    None where that cannot be read. `cgroup_dir` comes from run.json, so it
    is read only if it is one of our leaves on a cgroup2 mount, and the walk
    is bounded."""
    if not cgroup_dir or not _LEAF_RE.match(os.path.basename(cgroup_dir)):
        return None, None
    try:
        from ._platform import linux

        mounts = [h.mount.rstrip("/") + "/" for h in linux.hierarchies()]
    except Exception:      # noqa: BLE001 - a reader shows "-" rather than fail
        return None, None
    if os.path.normpath(cgroup_dir) != cgroup_dir or not any(cgroup_dir.startswith(m) for m in mounts):
        return None, None
    members, seen, stack = 0, 0, [cgroup_dir]
    try:
        os.stat(cgroup_dir)
    except OSError:
        return None, None
    while stack and seen < MAX_MEMBER_DIRS:
        d = stack.pop()
        seen += 1
        try:
            with open(os.path.join(d, "cgroup.procs"), "rb") as f:
                members += len(f.read(1 << 20).split())
            with os.scandir(d) as it:
                stack.extend(e.path for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    cpu = None
    try:
        with open(os.path.join(cgroup_dir, "cpu.stat"), "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"usage_usec "):
                    cpu = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return members, cpu


def usage_now(info: RunInfo) -> dict[str, Any] | None:
    """CPU, memory and tasks of a live run now, from its own cgroups
    (_accounting.live); run.json's description of them is untrusted and
    checked by RunCgroups.attach. None when the run has none."""
    desc = info.raw.get("cgroups_v1")
    v2_dir = info.cgroup_dir if info.backend == "cgroup2" else None
    if not isinstance(desc, dict) and v2_dir is None:
        return None
    from ._accounting import live
    from ._runcgroups import RunCgroups

    try:
        cg = RunCgroups.attach(desc, v2_dir=v2_dir) if isinstance(desc, dict) else None
    except (OSError, ValueError) as e:
        return {"unreadable": str(e)}
    if v2_dir is not None and members_now(v2_dir)[0] is None:
        v2_dir = None                      # not one of our leaves on a cgroup2 mount: not read
    return live(cg, v2_dir=v2_dir)


def live_view(d: RunDir, *, live: bool = True, summary: bool = False,
              owner_of_ended: bool = True,
              locked: Locks | None = None) -> dict[str, Any]:
    """What a reader can tell from the layout alone, plus (with `live`) the
    run's cgroup as it is now. `state` is the record's, or UNREADABLE with
    `unreadable` saying why; `owner_alive` is True, False or None (cannot
    tell). Without `owner_of_ended`, an ended run's owner lock is looked up
    in `locked` (_ofdlock.write_locked, read once by a listing: opening
    every lock was a third of `ls`'s time over 10,000 ended runs), or not
    at all without it (`owner_alive` stays None).

    A final record whose owner still holds the lock is not final (the
    owner's last moments, or a record forged by a worker that can write its
    run directory): `not_final` says so and a listing shows the run."""
    view = empty_view(d)
    try:
        with d.opened():
            return fill_view(d, view, live, summary, owner_of_ended, locked)
    except (OSError, UnsafePath) as e:
        view["unreadable"] = why(e)
        return view


def why(e: BaseException) -> str:
    if isinstance(e, UnsafePath):
        return e.problem
    if isinstance(e, OSError) and e.errno:
        return os.strerror(e.errno).lower() if e.errno == 13 else os.strerror(e.errno)
    return str(e)


def fill_view(d: RunDir, view: dict[str, Any], live: bool, summary: bool = False,
              owner_of_ended: bool = True,
              locked: Locks | None = None) -> dict[str, Any]:
    rec = d.load_record(summary=summary)
    if isinstance(rec, dict):
        view.update(run_uid=rec.get("run_uid"), state=rec["state"], outcome=rec.get("outcome"),
                    exit_code=rec.get("exit_code"), signal=rec.get("signal"), argv=rec.get("argv"),
                    pid=(rec.get("identity") or {}).get("pid"))
        timings = rec.get("timings") or {}
        view["started_at"] = timings.get("spawned_at")
        view["ended_at"] = timings.get("ended_at")
        view["cpu_usec"] = (rec.get("cpu") or {}).get("usage_usec") if isinstance(rec.get("cpu"), dict) else None
        view["memory_peak_bytes"] = memory_peak(rec)
        if rec["state"] in TERMINAL:
            if owner_of_ended:
                view["owner_alive"] = d.owner()
            elif locked is not None:
                view["owner_alive"] = d.owner_among(locked)
            if view["owner_alive"] is True:
                # The owner writes its last record, then lets go of the lock.
                view["not_final"] = f"its record says {rec['state']} but its owner still holds the run"
            elif (view["owner_alive"] is False and rec["state"] in ("REAPED", "EXITED")
                  and not isinstance(rec, Summary)):
                # A final record whose owner is gone while what the tag
                # names lives was not the owner's (_tags.still_alive;
                # `contain wait` says "not final", `ls` shows the orphan).
                # A listing asks only where no summary.json names the
                # record, as the owner's final records have (58 us a
                # run: `ls` over 10,000 ended runs would double).
                # BREACHED already says a member lives (an escaper).
                from ._tags import still_alive

                alive = still_alive(d.path)
                if alive is not None:
                    view["orphaned"] = True
                    view["not_final"] = f"its record says {rec['state']} but {alive}"
            return view
    owner = d.owner()
    view["owner_alive"] = owner
    info = d.load_run()
    if isinstance(info, RunInfo):
        view["run_uid"] = view["run_uid"] or info.run_uid
        view["argv"] = view["argv"] or info.argv
        view["started_at"] = view["started_at"] or info.started_at
        view["pid"] = view["pid"] or (info.worker or {}).get("pid")
    if isinstance(rec, Unreadable):
        view["state"], view["unreadable"] = UNREADABLE, rec.reason
    elif rec is None:
        if isinstance(info, Unreadable):
            view["state"], view["unreadable"] = UNREADABLE, info.reason
        elif info is None and owner is not True:
            view["state"], view["unreadable"] = UNREADABLE, (
                "cannot be read" if owner is not False else "no run.json and no record: it never started"
                if d.never_described() else "no run.json and no record, but its tag says it was described")
        else:
            view["state"] = "RUNNING"       # being born, or an orphan before its first record
    if view["state"] == UNREADABLE and owner is False:
        # Files a worker scrambled, and its owner gone: if what the tag names
        # lives, this is a live orphan (cancel adopts it from the tag), not
        # only an unreadable directory.
        from ._tags import still_alive

        alive = still_alive(d.path)
        if alive is not None:
            view["orphaned"] = True
            view["not_final"] = f"its files are unreadable but {alive}"
    if view["state"] in ("RUNNING", "UNCONFIRMED"):
        view["orphaned"] = owner is False
        if live and isinstance(info, RunInfo) and info.backend == "cgroup2":
            members, cpu = members_now(info.cgroup_dir)
            view["members"] = members
            view["cpu_usec"] = cpu if cpu is not None else view["cpu_usec"]
        if live and isinstance(info, RunInfo):
            view["usage"] = usage_now(info)       # live runs only: `ls` of 10,000 ended runs reads none
    return view


def exit_text(v: dict[str, Any]) -> str:
    if v.get("signal") is not None:
        return signame(v["signal"])
    if v.get("exit_code") is not None:
        return str(v["exit_code"])
    return "-"


def cut(s: str, width: int) -> str:
    return s if len(s) <= width else s[:width - 1] + "…"


def text(v: Any, budget: int = 240) -> str:
    """A value from the record as text for people: strings whole, numbers
    and booleans as words, objects as `key: value` lists, long lists
    summarised by their count. Never a Python repr, never cut mid-word."""
    s = render(v)
    if len(s) <= budget:
        return s
    if isinstance(v, dict):
        keys = ", ".join(str(k) for k in list(v)[:8])
        return f"{len(v)} fields ({keys}{', ...' if len(v) > 8 else ''}): `contain status ID --json` shows them"
    if isinstance(v, list):
        return f"{len(v)} entries: `contain status ID --json` shows them"
    return s


_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def printable(s: str) -> str:
    """`s` for a terminal: control characters (a newline that would forge a
    row of `ls`, an escape sequence that would reach the terminal) and
    undecodable bytes (surrogate escapes) spelled as backslash escapes. The
    text comes from argv and record.json, which a worker may have written."""
    if s.isprintable():
        return s
    out = []
    for c in s:
        if c.isprintable():
            out.append(c)
        elif c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif 0xDC80 <= ord(c) <= 0xDCFF:
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        else:
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    return "".join(out)


def command(argv: list[Any] | None) -> str:
    return " ".join(printable(str(a)) for a in argv or [])


def render(v: Any) -> str:
    if v is None:
        return "-"
    if v is True:
        return "yes"
    if v is False:
        return "no"
    if isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, dict):
        return ", ".join(f"{k}: {render(x)}" for k, x in v.items())
    if isinstance(v, list):
        if all(isinstance(x, (str, int, float)) for x in v):
            return ", ".join(render(x) for x in v) or "none"
        return "; ".join(f"({render(x)})" for x in v) or "none"
    return json.dumps(v)


def observed(v: Any) -> str:
    return {True: "yes", False: "no"}.get(v, "unknown") if v is not None else "unknown"


def layers(evidence: dict[str, Any]) -> list[str]:
    """Layers in the one fixed order (_record.LAYERS), then any others."""
    return [x for x in LAYERS if x in evidence] + sorted(x for x in evidence if x not in LAYERS)


def empty_view(d: RunDir) -> dict[str, Any]:
    return {"id": d.id, "run_uid": None, "state": UNREADABLE, "outcome": None, "exit_code": None, "signal": None,
            "orphaned": False, "owner_alive": None, "pid": None, "started_at": None, "ended_at": None,
            "argv": None, "members": None, "cpu_usec": None, "memory_peak_bytes": None, "usage": None,
            "unreadable": None}


# -- cancel, wait -----------------------------------------------------------------



# -- what a run used --------------------------------------------------------------

def size(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def _metric(m: Any, fmt: Any) -> str | None:
    """One accounting metric as text: its value, or `unknown (reason)`;
    None when the snapshot has no such metric."""
    if not isinstance(m, dict):
        return None
    if m.get("value") is None:
        return f"unknown ({cut(str(m.get('reason') or 'not read'), 60)})"
    return _shown(fmt, m["value"])


def _shown(fmt: Any, v: Any) -> str:
    """A metric's value through `fmt` when it is a number; anything else (a
    record a worker rewrote) as plain text, never a traceback."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return cut(render(v), 40)
    return str(fmt(v))


_COST = (("cpu", "cpu_usec", lambda v: f"{v / 1e6:.2f} s"),
         ("wall", "wall_s", lambda v: f"{v:.2f} s"),
         ("memory peak", "memory_peak_bytes", size),
         ("tasks peak", "tasks_peak", str),
         ("oom kills", "oom_kills", str),
         ("io read", "io_read_bytes", size),
         ("io written", "io_write_bytes", size))


def cost_lines(record: dict[str, Any]) -> list[str]:
    """`status`: what the run cost (the record's accounting; what could not
    be measured is named, its reason is in --json), the limits it ran under,
    any it hit, and what the kernel says killed the worker."""
    out = []
    acct = record.get("accounting")
    if isinstance(acct, dict):
        parts, missing = [], []
        for label, key, fmt in _COST:
            m = acct.get(key)
            if isinstance(m, dict):
                if m.get("value") is None:
                    missing.append(label)
                else:
                    parts.append(f"{label} {_shown(fmt, m['value'])}")
        if parts or missing:
            out.append("  cost       " + ", ".join(parts)
                       + (f"; not measured: {', '.join(missing)} (why: --json)" if missing else ""))
    lim = record.get("limits")
    if isinstance(lim, dict) and isinstance(lim.get("applied"), dict) and lim["applied"]:
        hit = lim.get("hit")
        hits = [k for k, v in (hit if isinstance(hit, dict) else {}).items() if isinstance(v, dict) and v.get("observed") is True]
        out.append("  limits     " + ", ".join(_limit_text(k, v) for k, v in lim["applied"].items())
                   + (f"; hit: {', '.join(hits)}" if hits else ""))
    cause = record.get("signal_cause")
    if isinstance(cause, dict) and cause.get("cause"):
        out.append(f"  killed by  {cause['cause']}" + (f" ({cut(str(cause['basis']), 100)})" if cause.get("basis") else ""))
    return out


def _limit_text(name: str, v: Any) -> str:
    if not isinstance(v, dict):
        return f"{name} {render(v)}"
    value = v.get("value")
    if isinstance(value, dict) and "cpus" in value:
        shown = f"{value['cpus']} CPUs (quota {value.get('quota_us')} us a {value.get('period_us')} us period)"
    else:
        shown = size(value) if name.endswith("_bytes") else render(value)
    return f"{name.removesuffix('_bytes')} {shown}" + (f" ({v['via']})" if v.get("via") else "")


def usage_lines(usage: Any) -> list[str]:
    """`status` of a live run: memory and tasks now (CPU is on its own line)."""
    if not isinstance(usage, dict):
        return []
    if usage.get("unreadable"):
        return [f"    usage      unknown: {cut(str(usage['unreadable']), 120)}"]
    out = []
    for label, key, fmt in (("memory", "memory_bytes", size), ("tasks", "tasks", str)):
        t = _metric(usage.get(key), fmt)
        if t is not None:
            out.append(f"    {label:<10} {t}")
    return out


def cancel_did_not_hold(run_id: str, ack: dict[str, Any], *, wait: bool, timeout: float | None) -> str | None:
    """Why `contain cancel` exits 1, as one line for stderr, or None when
    the operation held: no answer; a stop that did not hold (UNCONFIRMED,
    BREACHED), whatever the effect (a retry of a run that ended on its own
    reads not_live); with --wait, a stop issued and not over. An EXITED end
    (degraded mode) is the stop done, with what it could not prove in the
    record: the operation held, as far as anything can tell."""
    effect, state, op = ack.get("effect"), ack.get("state"), ack.get("op_id")
    if effect == "unknown":
        return f"run {run_id}: cancel {op}: no answer" + (f" ({ack['detail']})" if ack.get("detail") else "")
    if state == "UNCONFIRMED":
        # Not "run `contain cancel`": the user has just run it (issue 31).
        return (f"run {run_id}: the stop did not hold: UNCONFIRMED (the container was not observed empty); "
                f"`contain status {run_id}` shows what is left in it and why")
    if state == "BREACHED":
        return f"run {run_id}: BREACHED: a process left the container and is not proven gone"
    if wait and effect == "cancel_requested" and state != "EXITED":
        after = f" after {timeout} s" if timeout is not None else ""
        return f"run {run_id}: cancel {op}: the stop is not over{after} (state {state or '-'})"
    return None
