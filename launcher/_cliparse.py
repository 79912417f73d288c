"""`contain`'s arguments: every `contain run` option in one table, the
fast path that parses a plain `contain run` without argparse, and the
argparse parser for everything else (help and every error included).

Imports stay lean on the `run` path: the supervisor's own start-up is part
of every run's cost (benchmarks/bench_cli.py).
"""
from __future__ import annotations

from types import SimpleNamespace
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    import argparse
    from typing import Any, Sequence

EXIT_USAGE = 2


def _seconds_value(text: str, positive: bool = False) -> float:
    """Raises ValueError with the message argparse shows (launcher/_args.py
    holds the rules, so the library and the command line agree)."""
    from ._args import parse_seconds

    return parse_seconds(text, positive=positive)


def _seconds(text: str) -> float:
    import argparse

    try:
        return _seconds_value(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_seconds(text: str) -> float:
    """--timeout and --kill-timeout: 0 is refused, not read as "none" (it
    would either cancel the run before it ran, or never see it empty)."""
    import argparse

    try:
        return _seconds_value(text, positive=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _timeout(text: str) -> float | None:
    """--timeout: 0 means no timeout, as GNU `timeout 0` (CONTRACT.md)."""
    import argparse

    from ._args import parse_timeout

    try:
        return parse_timeout(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _argtype(parse: Any) -> Any:
    """An argparse `type=` from a parser that raises ValueError."""
    def convert(text: str) -> Any:
        import argparse

        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def _run_id(text: str) -> str:
    """An ID argument. One that no run could have (CONTRACT: letters,
    digits, '.', '_', '-'; at most 100) is a usage error, 2; a well-formed
    ID that names no run is "no such run", 3, from the command itself."""
    import argparse

    from ._layout import check_id

    try:
        return check_id(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _op_id(text: str) -> str:
    """--op-id: 1 to 200 printable characters, as the owner accepts them. An empty one
    is refused here, not read as "none given" (which mints a fresh id each
    time, so a script's unset "$OP" would lose idempotency without a word)."""
    import argparse

    from ._requests import op_filename

    try:
        op_filename(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


# What `contain` reads from its own environment (never the worker's), for
# --help. Keep in step with README.md.
_ENVIRONMENT = """environment:
  CONTAIN_STATE_DIR     the state directory, an absolute path (default
                        /run/contain for root; otherwise
                        $XDG_RUNTIME_DIR/contain, /run/user/UID/contain,
                        $XDG_STATE_HOME/contain, ~/.local/state/contain or
                        /tmp/contain-UID, the first that can be used; `contain
                        doctor` says which); it must be yours and private, or
                        contain refuses it (125); empty or relative: 2
  CONTAIN_KEEP_RUNS     how many run directories a run start keeps (default
                        1000; 0: no automatic removal; see `contain gc`)
  CONTAIN_CGROUP_BASE   the cgroup v2 directory runs are made under (default:
                        contain/ under the mount for root, your own delegated
                        cgroup otherwise)
  CONTAIN_BACKEND       the default of --backend (auto, cgroup2, pidns, subreaper, job-object, none)
  CONTAIN_LEDGER        off (or 0, no, false): no fork ledger; escapes are
                        then not watched
  CONTAIN_CGROUP_V1     off: no cgroup v1 hierarchies (hybrid hosts) for
                        limits and accounting
  CONTAIN_CGROUP_V1_BASE  the cgroup path runs' v1 cgroups go under in each
                        hierarchy (default /contain for root, your own
                        cgroup otherwise, where you may write it)
  (all of these are ignored when contain runs with privilege its caller
  lacks: setuid, setgid, file capabilities)
  CONTAIN_RUN_CGROUP, CONTAIN_RUN_DIR, CONTAIN_RUN_ID
                        set by contain in each worker's environment; a contain
                        started inside a run reads them to nest under it
  XDG_RUNTIME_DIR       where a non-root user's state directory goes

`contain doctor` says what this host gives and what to do next."""


# Every `contain run` option, once: both the argparse parser and the fast
# path below are built from this table, so they cannot drift apart.
# (flag, dest, kind, default, help); kind is "seconds" (>= 0), "positive"
# (seconds > 0), "timeout" (seconds, 0 for none), "text", "flag", or a tuple
# of choices. Seconds take a suffix too (s, m, h, d: _args.parse_seconds).
_RUN_OPTIONS: tuple[tuple[str, str, Any, Any, str], ...] = (
    ("--id", "id", "text", None, "run id (default: generated); a live run's id cannot be reused"),
    ("--grace", "grace", "seconds", 5.0, "seconds between SIGTERM and SIGKILL (default 5)"),
    ("--timeout", "timeout", "timeout", None,
     "cancel the run after this long (exit 124): seconds, or a number with s, m, h or d; 0: no timeout"),
    ("--kill-timeout", "kill_timeout", "positive", 10.0,
     "seconds to wait for the container to empty after SIGKILL (default 10); > 0"),
    ("--linger", "linger", "seconds", 0.0,
     "after the worker exits, let the rest of its tree finish on its own for up to this long, "
     "still contained, before the stop begins (default 0; e.g. for `git gc --auto`)"),
    ("--record", "record", "text", None, "also write the final stop record to FILE (`-`: stdout); only a "
     "regular file is ever replaced, a device or FIFO is written in place; exit 125 if it cannot be written"),
    ("--backend", "backend", ("auto", "cgroup2", "pidns", "subreaper", "job-object", "none"), None,
     "container kind (default auto, or CONTAIN_BACKEND)"),
    ("--seal", "seal", "flag", False,
     "make leaving the container impossible; needs a root supervisor (docs/sealing.md)"),
    ("--user", "user", "text", None, "run the worker as USER (name or uid)"),
    ("--workspace", "workspace", "text", None,
     "after the stop, check no process holds DIR and nothing writes under it"),
    ("--check-sockets", "check_sockets", "flag", False,
     "after the stop, check every socket the tree held at the stop is closed"),
    ("--quiet", "quiet", "flag", False, "say nothing on stderr about a weaker container or the stop"),
    ("--verbose", "verbose", "flag", False,
     "at the end, one line on stderr: how the run ended, what was stopped, the state, the record"),
    ("--memory-max", "memory_max", "text", None,
     "limit the whole tree's memory (bytes, or K/M/G/T); the run fails (125) if it cannot be applied"),
    ("--pids-max", "pids_max", "text", None, "limit the tree to N tasks (threads count; 125 if it cannot)"),
    ("--cpu-max", "cpu_max", "text", None,
     "limit the tree's CPU: a number of CPUs (0.5, 2, 150%%) or cgroup v2's \"QUOTA PERIOD\" in us"),
    ("--check-locks", "check_locks", "flag", False,
     "after the stop, check every file lock the tree held at the stop is released"),
    ("--stats-json", "stats_json", "text", None, "append one JSON line of the run's accounting to FILE (- for stdout)"),
    ("--accounting", "accounting", "flag", False,
     "record peak memory and peak tasks where that needs cgroups of the run's own besides its cgroup v2 "
     "directory (v1, on hybrid hosts: about 0.85 ms a run); implied by --stats-json and by a limit"),
    ("--die-with-owner", "die_with_owner", "flag", False,
     "when this contain process dies (SIGKILL, OOM), the kernel ends the tree: the PID-namespace wall's init "
     "exits with it (125 where there is no wall); `contain janitor` or `contain cancel` then writes the record"),
    ("--no-pidns", "no_pidns", "flag", False,
     "no PID-namespace wall (default: one wherever the kernel allows it; see docs/design.md)"),
)
_METAVARS = {"--record": "FILE", "--workspace": "DIR", "--user": "USER", "--memory-max": "BYTES",
             "--pids-max": "N", "--cpu-max": "SPEC", "--stats-json": "FILE"}
_SHORT = {"--quiet": "-q", "--verbose": "-v"}
_RUN_BY_FLAG = {o[0]: o for o in _RUN_OPTIONS}
_RUN_BY_FLAG.update({_SHORT[o[0]]: o for o in _RUN_OPTIONS if o[0] in _SHORT})
_RUN_DEFAULTS = {"cmd": "run", **{o[1]: o[3] for o in _RUN_OPTIONS}}


def fast_run(argv: Sequence[str]) -> SimpleNamespace | None:
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
        elif kind in ("seconds", "positive", "timeout"):
            try:
                v = _seconds_value(value, positive=kind == "positive")
            except ValueError:
                return None
            vals[dest] = None if kind == "timeout" and v == 0 else v
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


def _formatter() -> type[argparse.HelpFormatter]:
    import argparse

    class _Formatter(argparse.HelpFormatter):
        """Descriptions wrap as usual; a text laid out in lines (the
        environment table) is printed as written."""

        def _fill_text(self, text: str, width: int, indent: str) -> str:
            if "\n" in text:
                return "".join(indent + line for line in text.splitlines(keepends=True))
            return super()._fill_text(text, width, indent)

    return _Formatter


def parser() -> argparse.ArgumentParser:
    import argparse

    from . import __version__

    p = _make_parser_class()(prog="contain", description="Run a process tree inside a kernel container and "
                             "report exactly what was observed when it stopped.",
                             epilog=_ENVIRONMENT, formatter_class=_formatter())
    p.add_argument("--version", action="version", version=f"contain {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    r = sub.add_parser("run", help="run CMD in a fresh container; exits with its status",
                       description="Run CMD in a fresh cgroup v2 leaf entered at clone time, behind a PID-"
                       "namespace wall where the kernel allows it. stdin, stdout and stderr are inherited. "
                       "Exit status: the worker's own, 128+N for signal N, 124 on --timeout, 143 when "
                       "cancelled by `contain cancel`, 125 if contain failed (or the stop was not "
                       "confirmed), 126/127 if CMD cannot run, 2 for a usage error; a run cancelled by "
                       "SIGINT, SIGTERM, SIGHUP or SIGQUIT ends with contain dying by that signal (the stop "
                       "sends the tree that signal first; members that ignore SIGINT or SIGQUIT, such as a "
                       "shell's `&` jobs, get SIGTERM at once instead of waiting out the grace). "
                       "Other signals that would kill contain (SIGUSR1, SIGUSR2, SIGALRM, SIGRTMIN+n, ...) "
                       "are forwarded to the worker; one it dies of gives 128+N.",
                       epilog=_ENVIRONMENT, formatter_class=_formatter())
    for flag, dest, kind, default, help_text in _RUN_OPTIONS:
        if kind == "flag":
            names = [_SHORT[flag], flag] if flag in _SHORT else [flag]
            r.add_argument(*names, dest=dest, action="store_true", help=help_text)
        elif kind in ("seconds", "positive", "timeout"):
            r.add_argument(flag, dest=dest, type={"seconds": _seconds, "positive": _positive_seconds,
                                                  "timeout": _timeout}[kind],
                           default=default, metavar="DURATION" if kind == "timeout" else "SECONDS", help=help_text)
        elif isinstance(kind, tuple):
            r.add_argument(flag, dest=dest, choices=kind, default=default, help=help_text)
        else:
            r.add_argument(flag, dest=dest, default=default, metavar=_METAVARS.get(flag), help=help_text)
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD [ARG...]")

    from . import _commands

    _commands.add_parsers(sub, _argtype)

    st = sub.add_parser("status", help="show one run and every evidence layer")
    st.add_argument("id", type=_run_id)
    st.add_argument("--json", action="store_true")

    c = sub.add_parser("cancel", help="cancel a run (durably, idempotently by --op-id)")
    c.add_argument("id", type=_run_id)
    c.add_argument("--op-id", type=_op_id, help="operation id; repeating it returns the same record")
    c.add_argument("--run-uid", help="refuse unless the run (for a known --op-id, the run it was applied to) has this uid")
    c.add_argument("--grace", type=_seconds, help="seconds between SIGTERM and SIGKILL")
    c.add_argument("--wait", action="store_true", help="wait for the terminal acknowledgement")
    c.add_argument("--timeout", type=_timeout, default=None, metavar="DURATION",
                   help="with --wait: give up after this long (0: never)")
    c.add_argument("--json", action="store_true")

    w = sub.add_parser("wait", help="wait until a run has ended",
                       description="Wait until run ID has ended. Exit status: what `contain run` gave or "
                       "would give for it (the worker's code, 128+N, 124 on --timeout, 143 when cancelled, "
                       "128+N when signal N to contain run cancelled it, 125 when the stop did not hold); "
                       "1 when --timeout ran out first, 3 for no such run.")
    w.add_argument("id", type=_run_id)
    w.add_argument("--timeout", type=_timeout, default=None, metavar="DURATION",
                   help="give up after this long (exit 1); 0: never")
    w.add_argument("--json", action="store_true")
    w.add_argument("--redispatch", action="store_true",
                   help="exit 0 only if the next attempt may start in the same workspace (redispatch_eligible)")

    d = sub.add_parser("doctor", help="what this host can contain, and how strongly")
    d.add_argument("--json", action="store_true")
    return p
