"""The commands other than `run`: ls, status, cancel, wait, gc, janitor, doctor.

Readers never trust the run directory: every file comes through the typed
parsers (_runfiles, via RunDir.load_*), a file that does not parse makes the
run UNREADABLE with the reason, and a directory this user may not read is
UNREADABLE too ("permission denied"), never a traceback.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

from ._errors import LauncherError, RunConflict, RunNotFound
from ._layout import RunDir
from ._ofdlock import write_locked
from ._runfiles import TERMINAL, RunInfo, Unreadable
from ._safefs import UnsafePath
from ._views import (ID_WIDTH, UNREADABLE, age, cancel_did_not_hold, command, cost_lines, cut, empty_view, exit_text,
                     fill_view, layers, live_view, observed, parse_iso, printable, signame, size, text, usage_lines)

EXIT_OK, EXIT_DID_NOT_HOLD, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_CONTAIN_FAILED = 0, 1, 2, 3, 125


def add_parsers(sub: Any, argtype: Any) -> None:
    """The ls and gc subcommands, for _cli's parser (`argtype` makes an
    argparse type from a function that raises ValueError)."""
    from ._gc import parse_count, parse_duration

    ls = sub.add_parser("ls", help="list live runs (--all, --json: every run)",
                        description="List runs: the table shows those not ended (running, unconfirmed, orphaned, "
                        "unreadable); --all, --state or --since select from every run. --json lists every run, "
                        "ended ones too (a script filters by `state`), unless --state or --since select.")
    ls.add_argument("-a", "--all", action="store_true", help="ended runs too")
    ls.add_argument("--state", action="append", metavar="STATE",
                    help="only runs in STATE (RUNNING, REAPED, EXITED, UNCONFIRMED, BREACHED, UNREADABLE, "
                    "ORPHANED; repeat or separate with commas)")
    ls.add_argument("--since", metavar="WHEN", help="only runs started since WHEN: a duration ago (15m, 2h, "
                    "7d) or an ISO-8601 UTC time")
    ls.add_argument("--no-trunc", action="store_true", help="do not shorten long run ids")
    ls.add_argument("--json", action="store_true", help="one JSON array of every run (ended ones too)")
    g = sub.add_parser("gc", help="remove ended runs' directories",
                       description="Remove the directories of ended runs (a terminal record and no owner). "
                       "Live, orphaned and unreadable runs are never removed, nor a BREACHED run whose escaper "
                       "is alive. Without options every ended "
                       "run goes. Automatically, a run start that finds more than CONTAIN_KEEP_RUNS (default 1000) "
                       "plus 100 run directories removes the oldest ended ones down to CONTAIN_KEEP_RUNS.")
    g.add_argument("--older-than", type=argtype(parse_duration), metavar="DURATION",
                   help="only runs that ended more than DURATION ago (90s, 15m, 2h, 7d, 2w)")
    g.add_argument("--keep", type=argtype(parse_count), metavar="N", help="keep the N most recently ended runs")
    g.add_argument("--json", action="store_true")
    j = sub.add_parser("janitor", help="finish every run whose owner died, as it happens (--once: one pass)",
                       description="Finish every run of the state directory whose owner process died (SIGKILL, "
                       "OOM, a program that exited without waiting): the stop where anything is left and the "
                       "final record, by adoption, within about a second of the owner's death (it waits on the "
                       "owners' pidfds). Safe beside other janitors and `contain cancel`: the owner lock decides "
                       "who acts. Prints one line per run finished. Runs until SIGTERM or SIGINT, finishing the "
                       "run at hand first (exit 0). Exit 1 if a run could not be adopted.")
    j.add_argument("--once", action="store_true", help="one pass over every run, then exit")
    j.add_argument("--keep", type=argtype(parse_count), metavar="N",
                   help="after each pass keep only the N most recently ended runs (as gc --keep); default: "
                   "the automatic bound (CONTAIN_KEEP_RUNS)")
    j.add_argument("--json", action="store_true", help="one JSON object per run finished, one a line")


def _err(msg: str) -> None:
    sys.stderr.write(f"contain: {msg}\n")


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def _ended(v: dict[str, Any]) -> bool:
    return v["state"] in TERMINAL and not v.get("not_final")


# -- ls ---------------------------------------------------------------------------

def _since(text: str) -> float:
    """`--since`: a duration back from now (15m, 2h, 7d) or an ISO time."""
    from ._gc import parse_duration

    t = parse_iso(text if text.endswith("Z") else text + "Z") if "T" in text else None
    if t is not None:
        return t
    return time.time() - parse_duration(text)


def _gather(show_all: bool, states: set[str] | None, since: float | None,
            owner_of_ended: bool) -> tuple[list[dict[str, Any]], int]:
    """The views `ls` shows, and how many ended runs it hides.
    `owner_of_ended`: open each ended run's owner lock (Windows, where no
    one read says which locks are held; only --json shows it)."""
    views, hidden = [], 0
    # Every owner lock held now, in one read: a final record whose owner
    # still holds its lock is not final, and is shown (live_view).
    locked = None if owner_of_ended or sys.platform == "win32" else write_locked()
    # Parsed records are acyclic and die at once; without this the cycle
    # collector would rescan every view kept so far each time they pile
    # up (a fifth of `ls`'s time with 10,000 ended runs).
    gc.disable()
    try:
        for d in RunDir.all():
            v = live_view(d, summary=True, owner_of_ended=owner_of_ended, locked=locked)
            if states is not None and v["state"] not in states and not ("ORPHANED" in states and v["orphaned"]):
                continue
            if since is not None:
                t = parse_iso(v["started_at"])
                # A live run before its first record has no start time yet
                # (run.json is written before the spawn): nothing shows it
                # started before `since`, and a live orphan is never lost.
                if (t is None and v["state"] != "RUNNING") or (t is not None and t < since):
                    continue
            if not show_all and _ended(v):
                hidden += 1
                continue
            views.append(v)
    finally:
        gc.enable()
    return views, hidden


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
    # The machine form is the whole listing: a script reading `ls --json`
    # for a run that has ended must find it, with its state.
    show_all = bool(getattr(args, "all", False) or args.json) or states is not None or since is not None
    # --json shows an ended run's owner_alive too: from the one read of the
    # locks held (write_locked) where there is one, not a lock opened per run.
    views, hidden = _gather(show_all, states, since,
                            owner_of_ended=show_all and bool(args.json) and sys.platform == "win32")
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
    rows = [("ID", "STATE", "OUTCOME", "EXIT", "AGE", "MEMBERS", "CPU", "MEM", "COMMAND")]
    for v in views:
        state = v["state"] + (" (not final)" if v.get("not_final") else " (orphaned)" if v["orphaned"] else "")
        members = "-" if v["members"] is None else str(v["members"])
        cpu = "-" if not isinstance(v["cpu_usec"], int) else f"{v['cpu_usec'] / 1e6:.2f}s"
        # Live: memory now; ended: its peak, where the run measured it.
        mem = ((v.get("usage") or {}).get("memory_bytes") or {}).get("value") or v.get("memory_peak_bytes")
        what = (f"({printable(v['unreadable'])})" if v["unreadable"] else command(v["argv"]))
        rows.append((v["id"] if width is None else cut(v["id"], width), state, v["outcome"] or "-",
                     exit_text(v), age(v["started_at"], now), members, cpu, size(mem) if mem is not None else "-",
                     cut(what, 80)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    if hidden:
        out.append(f"({hidden} ended run{'s' if hidden != 1 else ''} not shown: `contain ls --all`)")
    sys.stdout.write("\n".join(printable(line) for line in out) + "\n")
    return EXIT_OK


# -- status -----------------------------------------------------------------------

def cmd_status(args: argparse.Namespace) -> int:
    try:
        d = RunDir.find(args.id)
    except RunNotFound as e:
        _err(str(e))
        return EXIT_NOT_FOUND
    except ValueError as e:               # a malformed ID is a usage error, as for cancel (README)
        _err(str(e))
        return EXIT_USAGE
    with d.opened():
        rec = d.load_record()
        view = fill_view(d, empty_view(d), live=True)
        acks = d.acks()
        info = d.load_run()
    record = rec if isinstance(rec, dict) else None
    if args.json:
        # The run's state at the top (what a script reads first), then the
        # record as written, what is seen now, and the operations.
        _print_json({"run_id": d.id, "state": view["state"], "outcome": view["outcome"],
                     "exit_code": view["exit_code"], "signal": view["signal"],
                     "final": view["state"] in TERMINAL and not view.get("not_final"),
                     "record": record, "live": view, "cancellations": acks,
                     "unreadable": rec.reason if isinstance(rec, Unreadable) else None})
        return EXIT_OK
    out: list[str] = []
    add = out.append
    add(f"run {d.id}" + (f"  (uid {view['run_uid']})" if view["run_uid"] else ""))
    state = view["state"]
    if state == UNREADABLE:
        add(f"  state      UNREADABLE: {view['unreadable']}")
        if view["orphaned"]:
            add(f"             orphaned: {view.get('not_final')} and its supervisor is gone; "
                f"`contain cancel {d.id}` adopts and stops it")
    elif view.get("not_final") and view["owner_alive"] is True:
        add(f"  state      {state}? not final: {view['not_final']} (a record is final once its owner "
            f"lets go; `contain wait {d.id}` waits for that)")
    elif view.get("not_final"):
        add(f"  state      {state}? not final: {view['not_final']} and its supervisor is gone; "
            f"`contain cancel {d.id}` adopts and stops it")
    elif view["orphaned"]:
        add(f"  state      {state}, orphaned: its supervisor is gone; `contain cancel {d.id}` adopts and stops it")
    else:
        add(f"  state      {state}")
    if record is not None:
        how = record.get("outcome") or "-"
        if record.get("signal") is not None:
            how += f", the worker died of {signame(record['signal'])}"
        elif record.get("exit_code") is not None:
            how += f", exit code {record['exit_code']}"
        add(f"  outcome    {how}")
    argv = view["argv"]
    if argv:
        add(f"  command    {command(argv)}")
    t = (record or {}).get("timings") or {}
    if t.get("spawned_at") or view["started_at"]:
        started = t.get("spawned_at") or view["started_at"]
        add(f"  started    {started} ({age(started)} ago)"
            + (f", ended {t['ended_at']}" if t.get("ended_at") else ""))
    if record is not None:
        c = record.get("containment") or {}
        sealed = "yes" if c.get("sealed") else "no" + (f" ({c['sealed_reason']})" if c.get("sealed_reason") else "")
        add(f"  container  {c.get('backend') or '-'} {c.get('path') or ''}".rstrip() + f"; sealed: {sealed}")
        ident = record.get("identity") or {}
        if ident:
            unit = ("FILETIME, 100 ns since 1601" if c.get("backend") == "job-object" else "clock ticks after boot")
            add(f"  worker     pid {ident.get('pid')}, start time {ident.get('start_time')} ({unit})")
        ev = record.get("evidence") or {}
        add(f"  evidence   as recorded at {record.get('record_written_at') or '-'}")
        for layer in layers(ev):
            lay = ev[layer]
            add(f"    {layer:<20} {observed(lay.get('observed')):<8} "
                f"{('at ' + lay['at']) if lay.get('at') else '-':<31} via {lay.get('via') or '-'}")
            if lay.get("detail") is not None:
                add(f"    {'':<20} {text(lay['detail'])}")
        for line in cost_lines(record):
            add(line)
        for note in record.get("notes") or []:
            add(f"  note       {text(note)}")
    elif isinstance(info, RunInfo):
        add(f"  container  {info.backend or '-'} {info.cgroup or ''}".rstrip())
    add("  now")
    owner = {True: "alive", False: "gone", None: "cannot tell"}[view["owner_alive"]]
    add(f"    owner      {owner}")
    if state in ("RUNNING", "UNCONFIRMED"):
        add(f"    members    {'-' if view['members'] is None else view['members']} (processes in its cgroup now)")
        if view["cpu_usec"] is not None:
            add(f"    cpu        {view['cpu_usec'] / 1e6:.2f} s")
        for line in usage_lines(view.get("usage")):
            add(line)
    for ack in acks:
        add(f"  cancel     {ack.get('op_id')}: {ack.get('effect')}"
            + (f" (requested {ack['requested_at']})" if ack.get("requested_at") else "")
            + (f": {ack['detail']}" if ack.get("detail") else ""))
    sys.stdout.write("\n".join(printable(line) for line in out) + "\n")
    return EXIT_OK


def _no_such_run(args: argparse.Namespace, why: str, status: int = EXIT_NOT_FOUND) -> int:
    """No such run: 3, and with --json still the operation's record, effect
    `unknown` (the contract's answer for "no such run"), so that a script
    reading the effect gets one rather than an empty stdout. The same, with
    1, for a run that nothing can answer for (it never started)."""
    _err(why)
    if args.json:
        _print_json({"op_id": args.op_id, "run_id": args.id, "effect": "unknown", "state": None,
                     "detail": why})
    return status


def cmd_cancel(args: argparse.Namespace) -> int:
    from ._cancel import cancel
    from ._layout import StateDir

    # A cancel writes (the intent, perhaps the whole stop): only into a
    # state directory of this user's own. Another user's is refused here,
    # with the reason, before anything is read from it.
    try:
        StateDir.open(None, write=True).close()
    except FileNotFoundError:
        return _no_such_run(args, f"no run {args.id!r}: there is no state directory yet")
    except UnsafePath as e:
        _err(f"cancel: {e}")
        return EXIT_CONTAIN_FAILED
    try:
        ack = cancel(args.id, op_id=args.op_id, grace=args.grace, run_uid=args.run_uid, wait=args.wait,
                     timeout=args.timeout)
    except RunNotFound as e:
        return _no_such_run(args, str(e))
    except (RunConflict, ValueError) as e:
        _err(f"cancel: {e}")
        return EXIT_USAGE
    except UnsafePath as e:
        _err(f"cancel: {e}")
        return EXIT_CONTAIN_FAILED
    except LauncherError as e:
        return _no_such_run(args, f"cancel: {e}", EXIT_DID_NOT_HOLD)
    d = ack.to_dict()
    if args.json:
        _print_json(d)
    else:
        extra = f" ({d['detail']})" if d.get("detail") else ""
        print(f"run {args.id}: {d.get('effect')}  state {d.get('state') or '-'}  op {d.get('op_id')}{extra}")
    # Status 1 says why on stderr too, as `contain wait` does: the line on
    # stdout is the operation's record, which a script may parse or drop.
    why = cancel_did_not_hold(args.id, d, wait=args.wait, timeout=args.timeout)
    if why is not None:
        _err(why)
        return EXIT_DID_NOT_HOLD
    return EXIT_OK


def _final_unless_alive(d: RunDir, state: str) -> bool:
    """A final record whose owner let go is final unless what the run's tag
    names is alive (_tags.still_alive): then a worker wrote it, and the
    owner died before it could write its own."""
    if state not in ("REAPED", "EXITED"):
        return True                  # BREACHED says itself that a member lives (an escaper)
    from ._tags import still_alive

    alive = still_alive(d.path)
    if alive is None:
        return True
    _err(f"run {d.id}: its record says {state} but {alive} and its owner is gone: not final; "
         f"`contain cancel {d.id}` adopts and stops it")
    return False


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
    info = d.load_run()
    watch = Watcher(d, info.supervisor if isinstance(info, RunInfo) else None)
    rec: dict[str, Any] | Unreadable | None = None
    final = False
    never = False
    try:
        while True:
            rec = d.load_record()
            state = rec["state"] if isinstance(rec, dict) else "RUNNING"
            # The owner writes its last record and then lets go of its lock:
            # a final state while the lock is still held is either those last
            # moments or a record forged by a worker that can write its run
            # directory. Only the kernel's lock says the owner is done.
            if state in TERMINAL and d.owner() is not True:
                final = _final_unless_alive(d, state)
                break
            if not d.owner_alive():
                rec = d.load_record()
                if isinstance(rec, dict) and rec["state"] in TERMINAL:
                    final = _final_unless_alive(d, rec["state"])
                    break
                if isinstance(rec, Unreadable):
                    _err(f"run {d.id}: its record is unreadable ({rec.reason}) and its owner is gone")
                elif rec is None and d.never_described():
                    never = True          # as ls, status and cancel say: nothing ran, nothing to adopt
                    _err(f"run {d.id} never started: its supervisor died before the spawn "
                         "(no run.json, no record); `contain gc` removes it")
                else:
                    _err(f"run {d.id} is {state} and its owner is gone; "
                         f"`contain cancel {d.id}` adopts and stops it")
                break
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                if state in TERMINAL:
                    _err(f"run {d.id}: its record says {state} but its owner still holds the run "
                         f"after {args.timeout} s: not final")
                else:
                    _err(f"run {d.id} still {state} after {args.timeout} s")
                break
            watch.wait(0.5 if remaining is None else min(0.5, remaining))
    finally:
        watch.close()
    record = rec if isinstance(rec, dict) else {}
    if args.json:
        _print_json(record)
    else:
        # No record.json at all is a run before its first record (or whose
        # owner died before writing it), not an unreadable one.
        shown = record.get("state") or (UNREADABLE if isinstance(rec, Unreadable) or never else "RUNNING")
        print(f"run {d.id}: {shown}  outcome {record.get('outcome') or '-'}  "
              f"exit {exit_text(record)}")
    if getattr(args, "redispatch", False):
        # What a scheduler asks before the next attempt in the same workspace:
        # 0 only when the record says redispatch_eligible true (REAPED, every
        # measured postcondition held); 1 when false or not observable.
        from ._redispatch import redispatch_eligible

        layer = redispatch_eligible(record)
        if not args.json:
            print(f"  redispatch_eligible {str(layer.get('observed')).lower() if layer.get('observed') is not None else 'unknown'}"
                  f"  ({layer.get('via')})")
        return EXIT_OK if final and layer.get("observed") is True else EXIT_DID_NOT_HOLD
    if final:
        # The status `contain run` gave or would give for the run (CONTRACT.md),
        # as bash's `wait` and `systemd-run --wait` return the job's.
        from ._state import record_exit_status

        return record_exit_status(record)
    if not never and (record.get("state") in ("UNCONFIRMED", "BREACHED") or
                      (isinstance(rec, Unreadable) and not d.owner_alive())):
        return EXIT_CONTAIN_FAILED        # what `contain run` would give: the stop did not hold, or it failed
    return EXIT_DID_NOT_HOLD              # still going when --timeout ran out; or it never started


# -- gc -----------------------------------------------------------------------------

def cmd_gc(args: argparse.Namespace) -> int:
    if sys.platform == "win32":
        from ._platform.winlayout import StateDir, gc
    else:
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


def cmd_janitor(args: argparse.Namespace) -> int:
    if sys.platform == "win32":
        _err("janitor: not on Windows: a run's Job Object ends its tree when the owner's last handle closes; "
             "`contain cancel ID` writes the record of a run whose owner died")
        return EXIT_DID_NOT_HOLD
    from ._janitor import serve

    failed: list[str] = []

    def say(res: Any) -> None:
        if res.error:
            failed.append(res.id)
            _err(f"janitor: {res.line()}")
            return
        sys.stdout.write((json.dumps(res.to_dict()) if args.json else res.line()) + "\n")
        sys.stdout.flush()

    try:
        serve(None, say, once=args.once, keep=args.keep)
    except LauncherError as e:            # the state directory is not usable (StateDirError, ...)
        _err(f"janitor: {e}")
        return EXIT_DID_NOT_HOLD
    return EXIT_DID_NOT_HOLD if failed else EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import _doctor, _doctorreport

    caps = _doctor.capabilities()
    if args.json:
        _print_json(caps)
    else:
        sys.stdout.write(_doctorreport.render(caps))
    return EXIT_OK if caps.get("containment_possible") else EXIT_DID_NOT_HOLD
