"""The commands other than `run`: ls, status, cancel, wait, gc, doctor.

Readers never trust the run directory: every file comes through the typed
parsers (_runfiles, via RunDir.load_*), a file that does not parse makes the
run UNREADABLE with the reason, and a directory this user may not read is
UNREADABLE too ("permission denied"), never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from typing import Any

from ._errors import LauncherError, RunConflict, RunNotFound
from ._layout import RunDir
from ._record import LAYERS
from ._runfiles import TERMINAL, RunInfo, Unreadable, iso_epoch
from ._safefs import UnsafePath

EXIT_OK, EXIT_DID_NOT_HOLD, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_CONTAIN_FAILED = 0, 1, 2, 3, 125
UNREADABLE = "UNREADABLE"
ID_WIDTH = 24               # `ls` truncates longer ids (`--no-trunc` shows them whole)
MAX_MEMBER_DIRS = 1000      # a live view walks at most this many cgroups of one run
_LEAF_RE = re.compile(r"^(run|sub)-[A-Za-z0-9._-]+-[0-9a-f]{8}$")


def _err(msg: str) -> None:
    sys.stderr.write(f"contain: {msg}\n")


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


_parse_iso = iso_epoch


def _age(s: Any, now: float | None = None) -> str:
    t = _parse_iso(s)
    if t is None:
        return "-"
    d = max(0.0, (time.time() if now is None else now) - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= n:
            return f"{int(d // n)}{unit}"
    return f"{int(d)}s"


def _signame(n: Any) -> str:
    try:
        return signal.Signals(n).name
    except (ValueError, TypeError):
        return f"signal {n}"


# -- one run as a reader sees it --------------------------------------------------

def _members(cgroup_dir: str | None) -> tuple[int | None, int | None]:
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


def live_view(d: RunDir, *, live: bool = True, summary: bool = False) -> dict[str, Any]:
    """What a reader can tell from the layout alone, plus (with `live`) the
    run's cgroup as it is now. `state` is the record's, or UNREADABLE with
    `unreadable` saying why; `owner_alive` is True, False or None (cannot
    tell)."""
    view = _empty_view(d)
    try:
        with d.opened():
            return _fill_view(d, view, live, summary)
    except (OSError, UnsafePath) as e:
        view["unreadable"] = _why(e)
        return view


def _why(e: BaseException) -> str:
    if isinstance(e, UnsafePath):
        return e.problem
    if isinstance(e, OSError) and e.errno:
        return os.strerror(e.errno).lower() if e.errno == 13 else os.strerror(e.errno)
    return str(e)


def _fill_view(d: RunDir, view: dict[str, Any], live: bool, summary: bool = False) -> dict[str, Any]:
    rec = d.load_record(summary=summary)
    if isinstance(rec, dict):
        view.update(run_uid=rec.get("run_uid"), state=rec["state"], outcome=rec.get("outcome"),
                    exit_code=rec.get("exit_code"), signal=rec.get("signal"), argv=rec.get("argv"),
                    pid=(rec.get("identity") or {}).get("pid"))
        timings = rec.get("timings") or {}
        view["started_at"] = timings.get("spawned_at")
        view["ended_at"] = timings.get("ended_at")
        view["cpu_usec"] = (rec.get("cpu") or {}).get("usage_usec") if isinstance(rec.get("cpu"), dict) else None
        if rec["state"] in TERMINAL:
            view["owner_alive"] = d.owner()
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
            view["state"], view["unreadable"] = UNREADABLE, ("no run.json and no record: it never started"
                                                              if owner is False else "cannot be read")
        else:
            view["state"] = "RUNNING"       # being born, or an orphan before its first record
    if view["state"] in ("RUNNING", "UNCONFIRMED"):
        view["orphaned"] = owner is False
        if live and isinstance(info, RunInfo) and info.backend == "cgroup2":
            members, cpu = _members(info.cgroup_dir)
            view["members"] = members
            view["cpu_usec"] = cpu if cpu is not None else view["cpu_usec"]
    return view


def _ended(v: dict[str, Any]) -> bool:
    return v["state"] in TERMINAL


# -- ls ---------------------------------------------------------------------------

def _since(text: str) -> float:
    """`--since`: a duration back from now (15m, 2h, 7d) or an ISO time."""
    from ._gc import parse_duration

    t = _parse_iso(text if text.endswith("Z") else text + "Z") if "T" in text else None
    if t is not None:
        return t
    return time.time() - parse_duration(text)


def _exit_text(v: dict[str, Any]) -> str:
    if v.get("signal") is not None:
        return _signame(v["signal"])
    if v.get("exit_code") is not None:
        return str(v["exit_code"])
    return "-"


def _cut(s: str, width: int) -> str:
    return s if len(s) <= width else s[:width - 1] + "…"


def cmd_ls(args: argparse.Namespace) -> int:
    states = None
    if getattr(args, "state", None):
        states = {s.strip().upper() for arg in args.state for s in arg.split(",") if s.strip()}
        known = {"RUNNING", "REAPED", "EXITED", "UNCONFIRMED", "BREACHED", UNREADABLE, "ORPHANED"}
        bad = states - known
        if bad:
            _err(f"ls: unknown state {', '.join(sorted(bad))} (one of {', '.join(sorted(known))})")
            return EXIT_USAGE
    since = None
    if getattr(args, "since", None):
        try:
            since = _since(args.since)
        except ValueError as e:
            _err(f"ls: --since: {e}")
            return EXIT_USAGE
    show_all = bool(getattr(args, "all", False)) or states is not None or since is not None
    views, hidden = [], 0
    for d in RunDir.all():
        v = live_view(d, summary=True)
        if states is not None and v["state"] not in states and not ("ORPHANED" in states and v["orphaned"]):
            continue
        if since is not None:
            t = _parse_iso(v["started_at"])
            if t is None or t < since:
                continue
        if not show_all and _ended(v):
            hidden += 1
            continue
        views.append(v)
    if args.json:
        # One view per line: the C encoder (indent= is pure Python), and
        # still valid JSON for any parser.
        sys.stdout.write("[\n" + ",\n".join(json.dumps(v) for v in views) + ("\n]\n" if views else "]\n"))
        return EXIT_OK
    if not views:
        print(f"no live runs ({hidden} ended: `contain ls --all` lists them)" if hidden else "no runs")
        return EXIT_OK
    now = time.time()
    width = None if getattr(args, "no_trunc", False) else ID_WIDTH
    rows = [("ID", "STATE", "OUTCOME", "EXIT", "AGE", "MEMBERS", "COMMAND")]
    for v in views:
        state = v["state"] + (" (orphaned)" if v["orphaned"] else "")
        members = "-" if v["members"] is None else str(v["members"])
        what = (f"({v['unreadable']})" if v["unreadable"] else " ".join(v["argv"] or []))
        rows.append((v["id"] if width is None else _cut(v["id"], width), state, v["outcome"] or "-",
                     _exit_text(v), _age(v["started_at"], now), members, _cut(what, 80)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    if hidden:
        out.append(f"({hidden} ended run{'s' if hidden != 1 else ''} not shown: `contain ls --all`)")
    sys.stdout.write("\n".join(out) + "\n")
    return EXIT_OK


# -- status -----------------------------------------------------------------------

def _text(v: Any, budget: int = 240) -> str:
    """A value from the record as text for people: strings whole, numbers
    and booleans as words, objects as `key: value` lists, long lists
    summarised by their count. Never a Python repr, never cut mid-word."""
    s = _render(v)
    if len(s) <= budget:
        return s
    if isinstance(v, dict):
        keys = ", ".join(str(k) for k in list(v)[:8])
        return f"{len(v)} fields ({keys}{', ...' if len(v) > 8 else ''}): `contain status ID --json` shows them"
    if isinstance(v, list):
        return f"{len(v)} entries: `contain status ID --json` shows them"
    return s


def _render(v: Any) -> str:
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
        return ", ".join(f"{k}: {_render(x)}" for k, x in v.items())
    if isinstance(v, list):
        if all(isinstance(x, (str, int, float)) for x in v):
            return ", ".join(_render(x) for x in v) or "none"
        return "; ".join(f"({_render(x)})" for x in v) or "none"
    return json.dumps(v)


def _observed(v: Any) -> str:
    return {True: "yes", False: "no"}.get(v, "unknown") if v is not None else "unknown"


def _layers(evidence: dict[str, Any]) -> list[str]:
    """Layers in the one fixed order (_record.LAYERS), then any others."""
    return [x for x in LAYERS if x in evidence] + sorted(x for x in evidence if x not in LAYERS)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        d = RunDir.find(args.id)
    except (RunNotFound, ValueError) as e:
        _err(str(e))
        return EXIT_NOT_FOUND
    with d.opened():
        rec = d.load_record()
        view = _fill_view(d, _empty_view(d), live=True)
        acks = d.acks()
        info = d.load_run()
    record = rec if isinstance(rec, dict) else None
    if args.json:
        _print_json({"record": record, "live": view, "cancellations": acks,
                     "unreadable": rec.reason if isinstance(rec, Unreadable) else None})
        return EXIT_OK
    out: list[str] = []
    add = out.append
    add(f"run {d.id}" + (f"  (uid {view['run_uid']})" if view["run_uid"] else ""))
    state = view["state"]
    if state == UNREADABLE:
        add(f"  state      UNREADABLE: {view['unreadable']}")
    elif view["orphaned"]:
        add(f"  state      {state}, orphaned: its supervisor is gone; `contain cancel {d.id}` adopts and stops it")
    else:
        add(f"  state      {state}")
    if record is not None:
        how = record.get("outcome") or "-"
        if record.get("signal") is not None:
            how += f", the worker died of {_signame(record['signal'])}"
        elif record.get("exit_code") is not None:
            how += f", exit code {record['exit_code']}"
        add(f"  outcome    {how}")
    argv = view["argv"]
    if argv:
        add(f"  command    {' '.join(argv)}")
    t = (record or {}).get("timings") or {}
    if t.get("spawned_at") or view["started_at"]:
        started = t.get("spawned_at") or view["started_at"]
        add(f"  started    {started} ({_age(started)} ago)"
            + (f", ended {t['ended_at']}" if t.get("ended_at") else ""))
    if record is not None:
        c = record.get("containment") or {}
        sealed = "yes" if c.get("sealed") else "no" + (f" ({c['sealed_reason']})" if c.get("sealed_reason") else "")
        add(f"  container  {c.get('backend') or '-'} {c.get('path') or ''}".rstrip() + f"; sealed: {sealed}")
        ident = record.get("identity") or {}
        if ident:
            add(f"  worker     pid {ident.get('pid')}, start time {ident.get('start_time')} (clock ticks after boot)")
        ev = record.get("evidence") or {}
        add(f"  evidence   as recorded at {record.get('record_written_at') or '-'}")
        for layer in _layers(ev):
            lay = ev[layer]
            add(f"    {layer:<20} {_observed(lay.get('observed')):<8} "
                f"{('at ' + lay['at']) if lay.get('at') else '-':<31} via {lay.get('via') or '-'}")
            if lay.get("detail") is not None:
                add(f"    {'':<20} {_text(lay['detail'])}")
        for note in record.get("notes") or []:
            add(f"  note       {_text(note)}")
    elif isinstance(info, RunInfo):
        add(f"  container  {info.backend or '-'} {info.cgroup or ''}".rstrip())
    add("  now")
    owner = {True: "alive", False: "gone", None: "cannot tell"}[view["owner_alive"]]
    add(f"    owner      {owner}")
    if state in ("RUNNING", "UNCONFIRMED"):
        add(f"    members    {'-' if view['members'] is None else view['members']} (processes in its cgroup now)")
        if view["cpu_usec"] is not None:
            add(f"    cpu        {view['cpu_usec'] / 1e6:.2f} s")
    for ack in acks:
        add(f"  cancel     {ack.get('op_id')}: {ack.get('effect')}"
            + (f" (requested {ack['requested_at']})" if ack.get("requested_at") else "")
            + (f": {ack['detail']}" if ack.get("detail") else ""))
    sys.stdout.write("\n".join(out) + "\n")
    return EXIT_OK


def _empty_view(d: RunDir) -> dict[str, Any]:
    return {"id": d.id, "run_uid": None, "state": UNREADABLE, "outcome": None, "exit_code": None, "signal": None,
            "orphaned": False, "owner_alive": None, "pid": None, "started_at": None, "ended_at": None,
            "argv": None, "members": None, "cpu_usec": None, "unreadable": None}


# -- cancel, wait -----------------------------------------------------------------

def cmd_cancel(args: argparse.Namespace) -> int:
    from ._cancel import cancel
    from ._statedir import StateDir

    # A cancel writes (the intent, perhaps the whole stop): only into a
    # state directory of this user's own. Another user's is refused here,
    # with the reason, before anything is read from it.
    try:
        StateDir.open(None, write=True).close()
    except FileNotFoundError:
        _err(f"no run {args.id!r}: there is no state directory yet")
        return EXIT_NOT_FOUND
    except UnsafePath as e:
        _err(f"cancel: {e}")
        return EXIT_CONTAIN_FAILED
    try:
        ack = cancel(args.id, op_id=args.op_id, grace=args.grace, run_uid=args.run_uid, wait=args.wait,
                     timeout=args.timeout)
    except RunNotFound as e:
        _err(str(e))
        return EXIT_NOT_FOUND
    except (RunConflict, ValueError) as e:
        _err(f"cancel: {e}")
        return EXIT_USAGE
    except UnsafePath as e:
        _err(f"cancel: {e}")
        return EXIT_CONTAIN_FAILED
    except LauncherError as e:
        _err(f"cancel: {e}")
        return EXIT_DID_NOT_HOLD
    d = ack.to_dict()
    if args.json:
        _print_json(d)
    else:
        extra = f" ({d['detail']})" if d.get("detail") else ""
        print(f"run {args.id}: {d.get('effect')}  state {d.get('state') or '-'}  op {d.get('op_id')}{extra}")
    effect = d.get("effect")
    if effect == "unknown":
        return EXIT_DID_NOT_HOLD
    if args.wait and effect == "cancel_requested":
        return EXIT_DID_NOT_HOLD          # the stop was issued but not proven (UNCONFIRMED)
    return EXIT_OK


def cmd_wait(args: argparse.Namespace) -> int:
    from ._cancel import _Watch

    try:
        d = RunDir.find(args.id)
    except (RunNotFound, ValueError) as e:
        _err(str(e))
        return EXIT_NOT_FOUND
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    info = d.load_run()
    watch = _Watch(d, info.supervisor if isinstance(info, RunInfo) else None)
    rec: dict[str, Any] | Unreadable | None = None
    try:
        while True:
            rec = d.load_record()
            state = rec["state"] if isinstance(rec, dict) else "RUNNING"
            if state in TERMINAL:
                break
            if not d.owner_alive():
                rec = d.load_record()
                if isinstance(rec, dict) and rec["state"] in TERMINAL:
                    break
                if isinstance(rec, Unreadable):
                    _err(f"run {d.id}: its record is unreadable ({rec.reason}) and its owner is gone")
                else:
                    _err(f"run {d.id} is {state} and its owner is gone; "
                         f"`contain cancel {d.id}` adopts and stops it")
                break
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                _err(f"run {d.id} still {state} after {args.timeout} s")
                break
            watch.wait(0.5 if remaining is None else min(0.5, remaining))
    finally:
        watch.close()
    record = rec if isinstance(rec, dict) else {}
    if args.json:
        _print_json(record)
    else:
        print(f"run {d.id}: {record.get('state') or UNREADABLE}  outcome {record.get('outcome') or '-'}  "
              f"exit {_exit_text(record)}")
    return EXIT_OK if record.get("state") in ("REAPED", "EXITED") else EXIT_DID_NOT_HOLD


# -- gc -----------------------------------------------------------------------------

def cmd_gc(args: argparse.Namespace) -> int:
    from ._gc import gc
    from ._statedir import StateDir

    try:
        st = StateDir.open(None, write=True)
    except FileNotFoundError:
        if args.json:
            _print_json({"removed": [], "kept": 0, "live": 0, "unreadable": 0, "failed": []})
        else:
            print("no runs")
        return EXIT_OK
    with st:
        res = gc(st, older_than=args.older_than, keep=args.keep)
    if args.json:
        _print_json(res.to_dict())
    else:
        n = len(res.removed)
        print(f"removed {n} ended run{'s' if n != 1 else ''}; left {res.kept} ended, "
              f"{res.live} live or orphaned, {res.unreadable} unreadable")
    if res.failed:
        _err(f"gc: could not remove {', '.join(res.failed[:10])}{' ...' if len(res.failed) > 10 else ''}")
        return EXIT_DID_NOT_HOLD
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from ._doctor import capabilities, render

    caps = capabilities()
    if args.json:
        _print_json(caps)
    else:
        sys.stdout.write(render(caps))
    return EXIT_OK if caps.get("containment_possible") else EXIT_DID_NOT_HOLD
