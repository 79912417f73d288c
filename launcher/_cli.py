"""`contain`: argument parsing, exit codes, human output.

Imports stay lean on the `run` path: the supervisor's own start-up is part of
every run's cost (benchmarks/bench_cli.py). A plain `contain run [OPTIONS]
-- CMD` is parsed without argparse (see _fast_run); everything else, help
and every error included, goes through the argparse parser below.
"""
from __future__ import annotations

import os
import signal
import sys
from types import SimpleNamespace
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    import argparse
    from typing import Any, Sequence

EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_CONTAIN_FAILED = 125


# The largest number of seconds any option takes (_runfiles.MAX_SECONDS,
# about 31.7 years): any finite value up to it is honoured.
MAX_SECONDS = 1e9


def _seconds_value(text: str, positive: bool = False) -> float:
    """Raises ValueError with the message argparse shows."""
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"not a number of seconds: {text!r}") from None
    if v != v or v < 0 or v == float("inf"):
        raise ValueError(f"seconds must be a finite number >= 0: {text!r}")
    if v > MAX_SECONDS:
        raise ValueError(f"at most {MAX_SECONDS:.0f} seconds (about 31 years): {text!r}")
    if positive and v == 0:
        raise ValueError("must be more than 0 seconds (leave the option out for no limit)")
    return v


def _seconds(text: str) -> float:
    import argparse

    try:
        return _seconds_value(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_seconds(text: str) -> float:
    import argparse

    try:
        return _seconds_value(text, positive=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _duration(text: str) -> float:
    import argparse

    from ._gc import parse_duration

    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _count(text: str) -> int:
    import argparse

    if not text.isdigit() or len(text) > 9:
        raise argparse.ArgumentTypeError(f"not a count (an integer >= 0): {text!r}")
    return int(text)


# Every `contain run` option, once: both the argparse parser and the fast
# path below are built from this table, so they cannot drift apart.
# (flag, dest, kind, default, help); kind is "seconds", "seconds>0", "text",
# "flag", or a tuple of choices.
_RUN_OPTIONS: tuple[tuple[str, str, Any, Any, str], ...] = (
    ("--id", "id", "text", None, "run id (default: generated); a live run's id cannot be reused"),
    ("--grace", "grace", "seconds", 5.0, "seconds between SIGTERM and SIGKILL (default 5)"),
    ("--timeout", "timeout", "seconds>0", None, "cancel the run after this many seconds (exit 124)"),
    ("--kill-timeout", "kill_timeout", "seconds>0", 10.0,
     "seconds to wait for the container to empty after SIGKILL (default 10)"),
    ("--record", "record", "text", None, "also write the final stop record to FILE (`-`: stdout); only a "
     "regular file is ever replaced, a device or FIFO is written in place; exit 125 if it cannot be written"),
    ("--backend", "backend", ("auto", "cgroup2", "job-object", "none"), None,
     "container kind (default auto, or CONTAIN_BACKEND)"),
    ("--seal", "seal", "flag", False, "make leaving the container impossible (see docs/sealing.md)"),
    ("--user", "user", "text", None, "run the worker as USER (name or uid)"),
    ("--workspace", "workspace", "text", None,
     "after the stop, check no process holds DIR and nothing writes under it"),
    ("--check-sockets", "check_sockets", "flag", False,
     "after the stop, check every socket the tree held at the stop is closed"),
)
_METAVARS = {"--record": "FILE", "--workspace": "DIR", "--user": "USER"}
_RUN_BY_FLAG = {o[0]: o for o in _RUN_OPTIONS}
_RUN_DEFAULTS = {"cmd": "run", **{o[1]: o[3] for o in _RUN_OPTIONS}}


def _fast_run(argv: Sequence[str]) -> SimpleNamespace | None:
    """The arguments of a plain `contain run`, as argparse would give them,
    without importing and building argparse (3 ms import + 3 ms parser here,
    per run: docs/performance.md). Returns None whenever anything is not
    plain (help, abbreviations, a value that looks like an option, a value
    argparse would reject): the full parser then decides, with its own
    messages. tests/test_cli_parse.py holds the two to the same answers."""
    if not argv or argv[0] != "run":
        return None
    vals: dict[str, Any] = dict(_RUN_DEFAULTS)
    i = 1
    while i < len(argv):
        a = argv[i]
        if a == "--" or not a.startswith("-"):
            break                             # REMAINDER: argparse keeps a leading "--"
        name, eq, value = a.partition("=")
        opt = _RUN_BY_FLAG.get(name)
        if opt is None:
            return None
        _flag, dest, kind, _default, _help = opt
        if kind == "flag":
            if eq:
                return None
            vals[dest] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                return None
            value = argv[i + 1]
            i += 1
        if not value or (value.startswith("-") and value != "-"):
            return None
        if isinstance(kind, tuple):
            if value not in kind:
                return None
            vals[dest] = value
        elif kind in ("seconds", "seconds>0"):
            try:
                vals[dest] = _seconds_value(value, positive=kind == "seconds>0")
            except ValueError:
                return None
        else:
            vals[dest] = value
        i += 1
    vals["command"] = list(argv[i:])
    return SimpleNamespace(**vals)


def _make_parser_class() -> type[argparse.ArgumentParser]:
    import argparse

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:   # one clear line, exit 2, no traceback
            self.exit(EXIT_USAGE, f"contain: {message}\n(see `contain --help`)\n")

    return _Parser


def _parser() -> argparse.ArgumentParser:
    import argparse

    p = _make_parser_class()(prog="contain", description="Run a process tree inside a kernel container and "
                "report exactly what was observed when it stopped.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    r = sub.add_parser("run", help="run CMD in a fresh container; exits with its status",
                       description="Run CMD in a fresh cgroup v2 leaf entered at clone time. stdin, "
                       "stdout and stderr are inherited. Exit status: the worker's own, 128+N for "
                       "signal N, 124 on --timeout, 125 if contain failed, 126/127 if CMD cannot run.")
    for flag, dest, kind, default, help_text in _RUN_OPTIONS:
        if kind == "flag":
            r.add_argument(flag, dest=dest, action="store_true", help=help_text)
        elif kind in ("seconds", "seconds>0"):
            r.add_argument(flag, dest=dest, type=_seconds if kind == "seconds" else _positive_seconds,
                           default=default, metavar="SECONDS", help=help_text)
        elif isinstance(kind, tuple):
            r.add_argument(flag, dest=dest, choices=kind, default=default, help=help_text)
        else:
            r.add_argument(flag, dest=dest, default=default, metavar=_METAVARS.get(flag), help=help_text)
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")

    ls = sub.add_parser("ls", help="list live runs (--all: every run)",
                        description="List runs: by default those not ended (running, unconfirmed, orphaned, "
                        "unreadable); --all, --state or --since select from every run.")
    ls.add_argument("-a", "--all", action="store_true", help="ended runs too")
    ls.add_argument("--state", action="append", metavar="STATE",
                    help="only runs in STATE (RUNNING, REAPED, EXITED, UNCONFIRMED, BREACHED, UNREADABLE, "
                    "ORPHANED; repeat or separate with commas)")
    ls.add_argument("--since", metavar="WHEN", help="only runs started since WHEN: a duration ago (15m, 2h, "
                    "7d) or an ISO-8601 UTC time")
    ls.add_argument("--no-trunc", action="store_true", help="do not shorten long run ids")
    ls.add_argument("--json", action="store_true")

    st = sub.add_parser("status", help="show one run and every evidence layer")
    st.add_argument("id")
    st.add_argument("--json", action="store_true")

    c = sub.add_parser("cancel", help="cancel a run (durably, idempotently by --op-id)")
    c.add_argument("id")
    c.add_argument("--op-id", help="operation id; repeating it returns the same record")
    c.add_argument("--run-uid", help="refuse unless the run's uid is this one")
    c.add_argument("--grace", type=_seconds, help="seconds between SIGTERM and SIGKILL")
    c.add_argument("--wait", action="store_true", help="wait for the terminal acknowledgement")
    c.add_argument("--timeout", type=_seconds, default=None, help="with --wait: give up after this long")
    c.add_argument("--json", action="store_true")

    g = sub.add_parser("gc", help="remove ended runs' directories",
                       description="Remove the directories of ended runs (a terminal record and no owner). "
                       "Live, orphaned and unreadable runs are never removed. Without options every ended "
                       "run goes. Automatically, a run start keeps at most CONTAIN_KEEP_RUNS (default 1000) "
                       "run directories.")
    g.add_argument("--older-than", type=_duration, metavar="DURATION",
                   help="only runs that ended more than DURATION ago (90s, 15m, 2h, 7d, 2w)")
    g.add_argument("--keep", type=_count, metavar="N", help="keep the N most recently ended runs")
    g.add_argument("--json", action="store_true")

    w = sub.add_parser("wait", help="wait until a run has ended")
    w.add_argument("id")
    w.add_argument("--timeout", type=_seconds, default=None)
    w.add_argument("--json", action="store_true")

    d = sub.add_parser("doctor", help="what this host can contain, and how strongly")
    d.add_argument("--json", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _fast_run(sys.argv[1:] if argv is None else argv) or _parser().parse_args(argv)
    if args.cmd is None:
        _parser().print_help(sys.stderr)
        return EXIT_USAGE
    from ._safefs import UnsafePath

    try:
        if args.cmd == "run":
            return _cmd_run(args)
        from . import _commands

        return int(getattr(_commands, f"cmd_{args.cmd}")(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 1
    except UnsafePath as e:          # the state directory is not ours: one line, 125
        _say(str(e))
        return EXIT_CONTAIN_FAILED
    except OSError as e:             # e.g. a run directory this user may not read
        _say(f"{args.cmd}: {e.filename + ': ' if e.filename else ''}{e.strerror or e}")
        return 1


def console() -> None:
    """The `contain` command (and `python -m launcher`): main(), then a fast
    exit. Everything that must outlive the process is already durable (the
    records are written with os.write and fsynced, the ledger is closed in
    the run's finalisation); interpreter teardown of every imported module
    only delays the caller, by 7 ms per `contain run` here
    (docs/performance.md). In-process callers use main(), which returns."""
    import os

    try:
        rc = main()
    except SystemExit as e:              # argparse's --help and usage errors
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:                            # sys.exit("message"), as Python would print it
            sys.stderr.write(f"{e.code}\n")
            rc = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            if rc == 0:
                rc = 1
    os._exit(rc)


def _say(msg: str) -> None:
    try:
        sys.stderr.write(f"contain: {msg}\n")
        sys.stderr.flush()
    except OSError:
        pass


def _cmd_run(args: argparse.Namespace | SimpleNamespace) -> int:
    from ._errors import ContainmentUnavailable, RunConflict, SpawnFailed
    from ._run import Options, Run

    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        _say("run: nothing to run (usage: contain run [OPTIONS] -- CMD [ARG...])")
        return EXIT_USAGE
    backend = args.backend or os.environ.get("CONTAIN_BACKEND", "auto")
    if backend not in ("auto", "cgroup2", "job-object", "none"):
        _say(f"run: CONTAIN_BACKEND={backend!r} is not auto, cgroup2, job-object or none")
        return EXIT_USAGE
    try:
        opts = Options(grace=args.grace, timeout=args.timeout or None, kill_timeout=args.kill_timeout or 10.0,
                       backend=backend, seal=args.seal or None, user=args.user, workspace=args.workspace,
                       subreaper=True, check_sockets=args.check_sockets)
        run = Run(cmd, id=args.id, options=opts)
    except ValueError as e:
        _say(f"run: {e}")
        return EXIT_USAGE
    # --record is checked before anything runs, and written by this process
    # once the run has ended (_recordfile): a destination that cannot take
    # the record is exit 125 before the spawn, a write that fails is 125
    # after it, with one line each.
    target = None
    if args.record is not None:
        from ._recordfile import prepare

        try:
            target = prepare(args.record)
        except OSError as e:
            _say(f"run: --record {e}")
            return EXIT_CONTAIN_FAILED

    # Signals cancel the run; they are turned into wake-ups of the owner
    # loop, which records the intent durably before anything is signalled.
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda n, _f: run.deliver_signal(n))
    signal.signal(signal.SIGCHLD, lambda n, _f: run.wake())
    from ._native import lib

    lib.ct_set_child_subreaper(1)
    try:
        run.start()
    except RunConflict as e:
        _say(f"run: {e}")
        return EXIT_USAGE
    except ValueError as e:       # e.g. --user names nobody
        _say(f"run: {e}")
        return EXIT_USAGE
    except SpawnFailed as e:
        _say(str(e))
        return _write_record_file(run, target, e.exit_code)
    except ContainmentUnavailable as e:
        _say(f"no container: {e}")
        return _write_record_file(run, target, EXIT_CONTAIN_FAILED)
    except OSError as e:
        _say(f"run: {e}")
        return _write_record_file(run, target, EXIT_CONTAIN_FAILED)
    rec = run.supervise()
    if rec.state == "UNCONFIRMED":
        _say(f"run {run.id}: stop not confirmed: the container did not empty; "
             f"`contain cancel {run.id}` repeats the kill")
    elif rec.state == "BREACHED":
        _say(f"run {run.id}: BREACHED: a process left the container and is not proven gone")
    return _write_record_file(run, target, run.exit_status())


def _write_record_file(run: Any, target: Any, status: int) -> int:
    """The final record to --record's target (if any): `status`, or 125
    with one line when it cannot be written (CONTRACT.md)."""
    if target is None or run.layout is None:
        if target is not None:
            target.close()
        return status
    from ._layout import encode

    try:
        target.final(encode(run.record().to_dict(), pretty=True))
    except OSError as e:
        _say(f"run {run.id}: the record could not be written to --record {e}; it is in "
             f"{os.path.join(run.layout.path, 'record.json')}")
        return EXIT_CONTAIN_FAILED
    finally:
        target.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
