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


def _seconds_value(text: str, positive: bool = False) -> float:
    """Raises ValueError with the message argparse shows. Any finite number
    is honoured (the owner loop clamps and loops its waits); nan, inf and
    negatives are refused, and so is 0 where it could not mean what it says
    (`--timeout 0` would cancel at once, `--kill-timeout 0` would give the
    kernel no time to empty the container)."""
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"not a number of seconds: {text!r}") from None
    if v != v or v < 0 or v == float("inf"):
        raise ValueError(f"seconds must be a finite number >= 0: {text!r}")
    if positive and v == 0:
        raise ValueError(f"seconds must be > 0 here: {text!r} (leave the option out for the default)")
    return v


def _seconds(text: str) -> float:
    import argparse

    try:
        return _seconds_value(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _duration(text: str) -> float:
    import argparse

    try:
        return _seconds_value(text, positive=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Every `contain run` option, once: both the argparse parser and the fast
# path below are built from this table, so they cannot drift apart.
# (flag, dest, kind, default, help); kind is "seconds" (>= 0), "duration"
# (> 0), "text", "flag", or a tuple of choices.
_RUN_OPTIONS: tuple[tuple[str, str, Any, Any, str], ...] = (
    ("--id", "id", "text", None, "run id (default: generated); a live run's id cannot be reused"),
    ("--grace", "grace", "seconds", 5.0, "seconds between SIGTERM and SIGKILL (default 5)"),
    ("--timeout", "timeout", "duration", None, "cancel the run after this many seconds (exit 124)"),
    ("--kill-timeout", "kill_timeout", "duration", 10.0,
     "seconds to wait for the container to empty after SIGKILL (default 10)"),
    ("--linger", "linger", "seconds", 0.0,
     "after the worker exits, let the rest of its tree finish on its own for up to this long, "
     "still contained, before the stop begins (default 0; e.g. for `git gc --auto`)"),
    ("--quiet", "quiet", "flag", False, "say nothing on stderr about a weaker container or the stop"),
    ("--verbose", "verbose", "flag", False,
     "at the end, one line on stderr: how the run ended, what was stopped, the state, the record"),
    ("--record", "record", "text", None, "also write the stop record to FILE"),
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
_SHORT = {"--quiet": "-q", "--verbose": "-v"}
_RUN_BY_FLAG = {o[0]: o for o in _RUN_OPTIONS}
_RUN_BY_FLAG.update({_SHORT[o[0]]: o for o in _RUN_OPTIONS if o[0] in _SHORT})
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
        if not value or value.startswith("-"):
            return None
        if isinstance(kind, tuple):
            if value not in kind:
                return None
            vals[dest] = value
        elif kind in ("seconds", "duration"):
            try:
                vals[dest] = _seconds_value(value, positive=kind == "duration")
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
            names = [_SHORT[flag], flag] if flag in _SHORT else [flag]
            r.add_argument(*names, dest=dest, action="store_true", help=help_text)
        elif kind in ("seconds", "duration"):
            r.add_argument(flag, dest=dest, type=_seconds if kind == "seconds" else _duration, default=default,
                           metavar="SECONDS", help=help_text)
        elif isinstance(kind, tuple):
            r.add_argument(flag, dest=dest, choices=kind, default=default, help=help_text)
        else:
            r.add_argument(flag, dest=dest, default=default, metavar=_METAVARS.get(flag), help=help_text)
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")

    ls = sub.add_parser("ls", help="list runs")
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

    w = sub.add_parser("wait", help="wait until a run has ended")
    w.add_argument("id")
    w.add_argument("--timeout", type=_seconds, default=None)
    w.add_argument("--json", action="store_true")

    d = sub.add_parser("doctor", help="what this host can contain, and how strongly")
    d.add_argument("--json", action="store_true")
    return p


# The signal `contain` must die by once main() has returned (a run cancelled
# by SIGINT, SIGTERM or SIGHUP, or a Ctrl-C anywhere): console() raises it
# after the output is flushed; in-process callers of main() get 128 + N.
_die_by: list[int] = []


def main(argv: Sequence[str] | None = None) -> int:
    del _die_by[:]
    try:
        args = _fast_run(sys.argv[1:] if argv is None else argv) or _parser().parse_args(argv)
        if args.cmd is None:
            _parser().print_help(sys.stderr)
            return EXIT_USAGE
        if args.cmd == "run":
            return _cmd_run(args)
        from . import _commands

        return int(getattr(_commands, f"cmd_{args.cmd}")(args))
    except KeyboardInterrupt:
        # Interrupted outside a run's stop (start-up, `wait`, `cancel --wait`):
        # die by SIGINT too, so the shell around us stops as well.
        _die_by[:] = [signal.SIGINT]
        return 128 + signal.SIGINT
    except BrokenPipeError:
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
    if _die_by:
        from ._sigproxy import die_by

        die_by(_die_by[0])
    os._exit(rc)


def _say(msg: str) -> None:
    try:
        sys.stderr.write(f"contain: {msg}\n")
        sys.stderr.flush()
    except OSError:
        pass


def _cmd_run(args: argparse.Namespace | SimpleNamespace) -> int:
    from ._errors import ContainmentUnavailable, RunConflict, SpawnFailed
    from ._adopt import finish_nested
    from ._launch import caller_ignored
    from ._options import Options
    from ._run import Run
    from ._sigproxy import SignalProxy

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
    quiet = bool(getattr(args, "quiet", False))
    try:
        # What the caller ignored, read before any handler of ours exists:
        # it stays ignored here and in the worker (nohup, `trap '' INT`).
        ignored = caller_ignored()
        opts = Options(grace=args.grace, timeout=args.timeout, kill_timeout=args.kill_timeout,
                       backend=backend, seal=args.seal or None, user=args.user, workspace=args.workspace,
                       record_file=args.record, subreaper=True, check_sockets=args.check_sockets,
                       linger=getattr(args, "linger", 0.0), keep_ignored=ignored,
                       notify=None if quiet else _say_weaker)
        run = Run(cmd, id=args.id, options=opts)
        run.end_hooks.append(finish_nested)
    except ValueError as e:
        _say(f"run: {e}")
        return EXIT_USAGE

    # Signals cancel the run; they are turned into wake-ups of the owner
    # loop, which records the intent durably before anything is signalled
    # (_sigproxy.py). Installed before the claim: one that arrives during
    # the start-up is queued and acted on before the spawn.
    proxy = SignalProxy(run, say=None if quiet else _say)
    proxy.install()
    run.on_change = proxy.changed
    from ._native import lib

    lib.ct_set_child_subreaper(1)
    try:
        run.start()
    except RunConflict as e:
        _say(f"run: {e}")
        return _ended(proxy, EXIT_USAGE)
    except ValueError as e:       # e.g. --user names nobody
        _say(f"run: {e}")
        return _ended(proxy, EXIT_USAGE)
    except SpawnFailed as e:
        _say(str(e))
        return _ended(proxy, e.exit_code)
    except ContainmentUnavailable as e:
        _say(f"no container: {e}")
        return _ended(proxy, EXIT_CONTAIN_FAILED)
    except OSError as e:
        _say(f"run: {e}")
        return _ended(proxy, EXIT_CONTAIN_FAILED)
    rec = run.supervise()
    if rec.state == "UNCONFIRMED":
        _say(f"run {run.id}: stop not confirmed: the container did not empty; "
             f"`contain cancel {run.id}` repeats the kill")
    elif rec.state == "BREACHED":
        _say(f"run {run.id}: BREACHED: a process left the container and is not proven gone")
    if not quiet:
        _summarise(run, rec.to_dict(), verbose=bool(getattr(args, "verbose", False)))
    return _ended(proxy, run.exit_status())


def _ended(proxy: Any, status: int) -> int:
    """The exit status, unless a signal cancelled the run: then `contain`
    dies by that signal (console() raises it once the record is written and
    the output flushed), whatever the worker's own status was."""
    if proxy.first is not None:
        _die_by[:] = [proxy.first]
        return 128 + proxy.first
    return status


def _say_weaker(reason: str) -> None:
    from ._summary import weaker_line

    _say(weaker_line(reason))


def _summarise(run: Any, rec: dict[str, Any], *, verbose: bool) -> None:
    """`-v`: one line on how the run ended. Without it, the same line on a
    terminal when leftovers of the tree had to be stopped (the worker's own
    output never says that)."""
    from ._summary import stopped_leftovers, summary

    if not verbose and not (stopped_leftovers(rec) and _stderr_is_tty()):
        return
    paths = [os.path.join(run.layout.path, "record.json")] if run.layout is not None else []
    if run.opts.record_file:
        paths.append(run.opts.record_file)
    _say(summary(rec, paths))


def _stderr_is_tty() -> bool:
    try:
        return os.isatty(2)
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
