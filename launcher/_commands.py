"""The commands other than `run`: ls, status, cancel, wait, doctor."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from ._errors import LauncherError, RunConflict, RunNotFound
from ._layout import RunDir
from ._state import TERMINAL_STATES as TERMINAL

EXIT_OK, EXIT_DID_NOT_HOLD, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3


def _err(msg: str) -> None:
    sys.stderr.write(f"contain: {msg}\n")


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def _parse_iso(s: str | None) -> float | None:
    if not s:
        return None
    import calendar

    try:
        base, _, frac = s.rstrip("Z").partition(".")
        return calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S")) + (float("0." + frac) if frac else 0.0)
    except ValueError:
        return None


def _age(s: str | None) -> str:
    t = _parse_iso(s)
    if t is None:
        return "-"
    d = max(0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= n:
            return f"{int(d // n)}{unit}"
    return f"{int(d)}s"


def live_view(d: RunDir) -> dict[str, Any]:
    """What a reader can tell from the layout alone, plus the live cgroup."""
    info = d.read_run() or {}
    rec = d.read_record() or {}
    owner = d.owner_alive()
    state = rec.get("state", "RUNNING")
    view: dict[str, Any] = {
        "id": d.id, "run_uid": info.get("run_uid"), "state": state, "outcome": rec.get("outcome"),
        "orphaned": (not owner) and state not in TERMINAL,
        "owner_alive": owner,
        "pid": (rec.get("identity") or info.get("worker") or {}).get("pid"),
        "started_at": info.get("started_at"), "argv": info.get("argv"),
        "members": None, "cpu_usec": (rec.get("cpu") or {}).get("usage_usec"),
    }
    cg = info.get("cgroup_dir")
    if cg and state not in TERMINAL and os.path.isdir(cg):
        members = 0
        for sub, _dirs, _files in os.walk(cg):
            try:
                with open(os.path.join(sub, "cgroup.procs")) as f:
                    members += len(f.read().split())
            except OSError:
                pass
        view["members"] = members
        try:
            with open(os.path.join(cg, "cpu.stat")) as f:
                for line in f:
                    if line.startswith("usage_usec "):
                        view["cpu_usec"] = int(line.split()[1])
        except OSError:
            pass
    return view


def cmd_ls(args: argparse.Namespace) -> int:
    views = [live_view(d) for d in RunDir.all()]
    if args.json:
        _print_json(views)
        return EXIT_OK
    if not views:
        print("no runs")
        return EXIT_OK
    rows = [("ID", "STATE", "AGE", "PID", "MEMBERS", "CPU", "COMMAND")]
    for v in views:
        state = v["state"] + (" (orphaned)" if v["orphaned"] else "")
        cpu = "-" if v["cpu_usec"] is None else f"{v['cpu_usec'] / 1e6:.2f}s"
        members = "-" if v["members"] is None else str(v["members"])
        rows.append((v["id"], state, _age(v["started_at"]), str(v["pid"] or "-"), members, cpu,
                     " ".join(v["argv"] or [])[:60]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    try:
        d = RunDir.find(args.id)
    except RunNotFound as e:
        _err(str(e))
        return EXIT_NOT_FOUND
    except ValueError as e:               # a malformed ID is a usage error, as for cancel (README)
        _err(str(e))
        return EXIT_USAGE
    rec = d.read_record() or {}
    view = live_view(d)
    if args.json:
        _print_json({"record": rec, "live": view, "cancellations": d.acks()})
        return EXIT_OK
    print(f"run {d.id}  uid {view['run_uid']}")
    print(f"  state     {view['state']}{'  (orphaned: supervisor gone)' if view['orphaned'] else ''}")
    print(f"  outcome   {rec.get('outcome')}  exit_code {rec.get('exit_code')}  signal {rec.get('signal')}")
    c = rec.get("containment") or {}
    print(f"  container {c.get('backend')} {c.get('path') or ''}  sealed {c.get('sealed')}"
          + (f" ({c.get('sealed_reason')})" if c.get("sealed_reason") else ""))
    ident = rec.get("identity") or {}
    print(f"  worker    pid {ident.get('pid')} start {ident.get('start_time')}  members {view['members']}")
    print("  evidence")
    for layer, ev in (rec.get("evidence") or {}).items():
        obs = {True: "yes", False: "no", None: "unknown"}[ev.get("observed")]
        detail = ev.get("detail")
        detail_s = "" if detail is None else "  " + (json.dumps(detail) if not isinstance(detail, str) else detail)
        print(f"    {layer:<20} {obs:<8} {ev.get('at') or '':<28} {ev.get('via')}{detail_s[:160]}")
    for ack in d.acks():
        print(f"  cancel    {ack.get('op_id')}: {ack.get('effect')} (requested {ack.get('requested_at')})")
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    from ._cancel import cancel

    try:
        ack = cancel(args.id, op_id=args.op_id, grace=args.grace, run_uid=args.run_uid, wait=args.wait,
                     timeout=args.timeout)
    except RunNotFound as e:
        _err(str(e))
        return EXIT_NOT_FOUND
    except (RunConflict, ValueError) as e:
        _err(f"cancel: {e}")
        return EXIT_USAGE
    except LauncherError as e:
        _err(f"cancel: {e}")
        return EXIT_DID_NOT_HOLD
    d = ack.to_dict()
    if args.json:
        _print_json(d)
    else:
        extra = f" ({d['detail']})" if d.get("detail") else ""
        print(f"run {args.id}: {d.get('effect')}  state {d.get('state')}  op {d.get('op_id')}{extra}")
    effect = d.get("effect")
    if effect == "unknown":
        return EXIT_DID_NOT_HOLD
    if args.wait and effect == "cancel_requested":
        return EXIT_DID_NOT_HOLD          # the stop was issued but not proven (UNCONFIRMED)
    return EXIT_OK


def cmd_wait(args: argparse.Namespace) -> int:
    from ._cancel import Watcher

    try:
        d = RunDir.find(args.id)
    except RunNotFound as e:
        _err(str(e))
        return EXIT_NOT_FOUND
    except ValueError as e:               # a malformed ID is a usage error, as for cancel (README)
        _err(str(e))
        return EXIT_USAGE
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    watch = Watcher(d, (d.read_run() or {}).get("supervisor"))
    try:
        while True:
            rec = d.read_record() or {}
            state = rec.get("state", "RUNNING")
            if state in TERMINAL:
                break
            if not d.owner_alive():
                rec = d.read_record() or rec
                if rec.get("state") in TERMINAL:
                    break
                _err(f"run {d.id} is {rec.get('state', 'RUNNING')} and its owner is gone; "
                     f"`contain cancel {d.id}` adopts and stops it")
                break
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                _err(f"run {d.id} still {state} after {args.timeout} s")
                break
            watch.wait(0.5 if remaining is None else min(0.5, remaining))
    finally:
        watch.close()
    rec = d.read_record() or {}
    if args.json:
        _print_json(rec)
    else:
        print(f"run {d.id}: {rec.get('state')}  outcome {rec.get('outcome')}  exit_code {rec.get('exit_code')}"
              f"  signal {rec.get('signal')}")
    return EXIT_OK if rec.get("state") in ("REAPED", "EXITED") else EXIT_DID_NOT_HOLD


def cmd_doctor(args: argparse.Namespace) -> int:
    from ._doctor import capabilities, render

    caps = capabilities()
    if args.json:
        _print_json(caps)
    else:
        sys.stdout.write(render(caps))
    return EXIT_OK if caps.get("containment_possible") else EXIT_DID_NOT_HOLD
