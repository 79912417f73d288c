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


# What `contain` reads from its own environment (never the worker's), for
# --help. Keep in step with README.md.
_ENVIRONMENT = """environment:
  CONTAIN_STATE_DIR     the state directory (default /run/contain for root,
                        $XDG_RUNTIME_DIR/contain or /run/user/UID/contain
                        otherwise; without either, set this); it must be
                        yours and private, or contain refuses it (125)
  CONTAIN_KEEP_RUNS     how many run directories a run start keeps (default
                        1000; 0: no automatic removal; see `contain gc`)
  CONTAIN_CGROUP_BASE   the cgroup v2 directory runs are made under (default:
                        contain/ under the mount for root, your own delegated
                        cgroup otherwise)
  CONTAIN_BACKEND       the default of --backend (auto, cgroup2, job-object, none)
  CONTAIN_LEDGER        off (or 0, no, false): no fork ledger; escapes are
                        then not watched
  CONTAIN_RUN_CGROUP, CONTAIN_RUN_DIR, CONTAIN_RUN_ID
                        set by contain in each worker's environment; a contain
                        started inside a run reads them to nest under it
  XDG_RUNTIME_DIR       where a non-root user's state directory goes

`contain doctor` says what this host gives and what to do next."""


# Every `contain run` option, once: both the argparse parser and the fast
# path below are built from this table, so they cannot drift apart.
# (flag, dest, kind, default, help); kind is "seconds" (>= 0), "positive"
# (seconds > 0), "text", "flag", or a tuple of choices.
_RUN_OPTIONS: tuple[tuple[str, str, Any, Any, str], ...] = (
    ("--id", "id", "text", None, "run id (default: generated); a live run's id cannot be reused"),
    ("--grace", "grace", "seconds", 5.0, "seconds between SIGTERM and SIGKILL (default 5)"),
    ("--timeout", "timeout", "positive", None, "cancel the run after this many seconds (exit 124); > 0"),
    ("--kill-timeout", "kill_timeout", "positive", 10.0,
     "seconds to wait for the container to empty after SIGKILL (default 10); > 0"),
    ("--record", "record", "text", None, "also write the final stop record to FILE (`-`: stdout); only a "
     "regular file is ever replaced, a device or FIFO is written in place; exit 125 if it cannot be written"),
    ("--backend", "backend", ("auto", "cgroup2", "job-object", "none"), None,
     "container kind (default auto, or CONTAIN_BACKEND)"),
    ("--seal", "seal", "flag", False,
     "make leaving the container impossible; needs a root supervisor (docs/sealing.md)"),
    ("--user", "user", "text", None, "run the worker as USER (name or uid)"),
    ("--workspace", "workspace", "text", None,
     "after the stop, check no process holds DIR and nothing writes under it"),
    ("--check-sockets", "check_sockets", "flag", False,
     "after the stop, check every socket the tree held at the stop is closed"),
    ("--quiet", "quiet", "flag", False, "say nothing on stderr when the container is weaker than this host allows"),
    ("--no-pidns", "no_pidns", "flag", False,
     "no PID-namespace wall (default: one wherever the kernel allows it; see docs/design.md)"),
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
        elif kind in ("seconds", "positive"):
            try:
                vals[dest] = _seconds_value(value, positive=kind == "positive")
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


def _parser() -> argparse.ArgumentParser:
    import argparse

    from . import __version__

    p = _make_parser_class()(prog="contain", description="Run a process tree inside a kernel container and "
                             "report exactly what was observed when it stopped.",
                             epilog=_ENVIRONMENT, formatter_class=_formatter())
    p.add_argument("--version", action="version", version=f"contain {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    r = sub.add_parser("run", help="run CMD in a fresh container; exits with its status",
                       description="Run CMD in a fresh cgroup v2 leaf entered at clone time. stdin, "
                       "stdout and stderr are inherited. Exit status: the worker's own, 128+N for "
                       "signal N, 124 on --timeout, 125 if contain failed, 126/127 if CMD cannot run, "
                       "2 for a usage error.", epilog=_ENVIRONMENT, formatter_class=_formatter())
    for flag, dest, kind, default, help_text in _RUN_OPTIONS:
        if kind == "flag":
            r.add_argument(flag, dest=dest, action="store_true", help=help_text)
        elif kind in ("seconds", "positive"):
            r.add_argument(flag, dest=dest, type=_seconds if kind == "seconds" else _positive_seconds,
                           default=default, metavar="SECONDS", help=help_text)
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
    c.add_argument("--op-id", help="operation id; repeating it returns the same record")
    c.add_argument("--run-uid", help="refuse unless the run's uid is this one")
    c.add_argument("--grace", type=_seconds, help="seconds between SIGTERM and SIGKILL")
    c.add_argument("--wait", action="store_true", help="wait for the terminal acknowledgement")
    c.add_argument("--timeout", type=_seconds, default=None, help="with --wait: give up after this long")
    c.add_argument("--json", action="store_true")

    w = sub.add_parser("wait", help="wait until a run has ended")
    w.add_argument("id", type=_run_id)
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

    out_closed = _hold_closed_stdio()
    try:
        rc = main()
    except SystemExit as e:              # argparse's --help and usage errors
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:                            # sys.exit("message"), as Python would print it
            sys.stderr.write(f"{e.code}\n")
            rc = 1
    rc = _close_stdout(rc, out_closed)
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    if sys.platform == "win32" and rc > 0x7FFFFFFF:
        rc -= 1 << 32                    # an NTSTATUS exit code (0xC0000005): the same DWORD as an int
    os._exit(rc)


def _hold_closed_stdio() -> bool:
    """Keep a descriptor 0-2 that the caller closed (`contain run ... 1>&-`)
    closed for the worker, and out of contain's own hands. Unheld, the first
    file contain opens becomes fd 1 (here, the run's cgroup.events) and
    anything written to "stdout" lands in it. Each closed one gets a
    placeholder on /dev/null opened the wrong way round (outputs read-only,
    stdin write-only), so a write to it fails with EBADF as on a closed
    descriptor, and close-on-exec, so the worker finds it closed again, as it
    would under `env` or a plain exec. Python leaves sys.stdout None then;
    what a command prints goes to memory, and _close_stdout reports it.
    Returns whether stdout was closed."""
    import io

    for fd in (0, 1, 2):
        try:
            os.get_inheritable(fd)       # fcntl(F_GETFD): EBADF when closed
            continue
        except OSError:
            pass
        held = os.open(os.devnull, (os.O_WRONLY if fd == 0 else os.O_RDONLY) | os.O_CLOEXEC)
        if held != fd:                   # cannot differ (lower ones are open or held by now): defensive
            os.dup2(held, fd, inheritable=False)
            os.close(held)
    closed = sys.stdout is None
    if sys.stdout is None:
        sys.stdout = io.StringIO()
    if sys.stderr is None:               # messages have nowhere to go, as with `2>&-` anywhere
        sys.stderr = io.StringIO()
    return closed


def _close_stdout(rc: int, out_closed: bool) -> int:
    """gnulib's close_stdout: output that could not be written is an error
    of the command (one line, status 1 unless it already failed), so
    `contain ls >&-` does not pass for a listing; a closed stdout that
    nothing was written to is no error (`contain run -- true 1>&-` is the
    worker's 0). A broken pipe (`contain ls | head -1`) is quietly 1."""
    import errno
    import io

    if out_closed:
        if isinstance(sys.stdout, io.StringIO) and sys.stdout.getvalue():
            _say(f"write error: stdout: {os.strerror(errno.EBADF)}")
            return rc or 1
        return rc
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return rc or 1
    except OSError as e:
        _say(f"write error: stdout: {e.strerror or e}")
        return rc or 1
    except ValueError:                   # closed by someone: nothing more can be said
        return rc or 1
    return rc


def _say(msg: str) -> None:
    try:
        sys.stderr.write(f"contain: {msg}\n")
        sys.stderr.flush()
    except OSError:
        pass


def _cmd_run(args: argparse.Namespace | SimpleNamespace) -> int:
    from ._errors import ContainmentUnavailable, RunConflict, SpawnFailed
    from ._adopt import finish_nested
    from ._options import Options
    from ._run import Run

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
    # The parser has checked the numbers (launcher/_args.py): --timeout and
    # --kill-timeout are > 0, so 0 never turns into "none" or the default.
    kw: dict[str, Any] = dict(grace=args.grace, timeout=args.timeout, kill_timeout=args.kill_timeout,
                              backend=backend, seal=args.seal or None, user=args.user, workspace=args.workspace,
                              subreaper=True, check_sockets=args.check_sockets,
                              pidns=False if getattr(args, "no_pidns", False) else None)
    if "quiet" in Options.__slots__:     # the driver's "weaker container" line reads it (issue 12)
        kw["quiet"] = args.quiet
    try:
        opts = Options(**kw)
        run = Run(cmd, id=args.id, options=opts)
        run.end_hooks.append(finish_nested)
    except ValueError as e:
        _say(f"run: {e}")
        return EXIT_USAGE
    # --record is checked before anything runs and written once the run has
    # ended (_recordfile): 125 and one line if it cannot take the record.
    from ._recordfile import finish, prepare

    try:
        target = None if args.record is None else prepare(args.record)
    except OSError as e:
        _say(f"run: --record {e}")
        return EXIT_CONTAIN_FAILED

    # Signals cancel the run; they are turned into wake-ups of the owner
    # loop, which records the intent durably before anything is signalled.
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGBREAK"):    # (SIGHUP: not Windows; SIGBREAK: Windows)
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), lambda n, _f: run.deliver_signal(n))
    if sys.platform != "win32":          # Windows: no SIGCHLD, no subreaper (the job holds the tree)
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
        return finish(run, target, e.exit_code)
    except ContainmentUnavailable as e:
        _say(f"no container: {e}")
        return finish(run, target, EXIT_CONTAIN_FAILED)
    except OSError as e:
        _say(f"run: {e}")
        return finish(run, target, EXIT_CONTAIN_FAILED)
    rec = run.supervise()
    if rec.state == "UNCONFIRMED":
        _say(f"run {run.id}: stop not confirmed: the container did not empty; "
             f"`contain cancel {run.id}` repeats the kill")
    elif rec.state == "BREACHED":
        _say(f"run {run.id}: BREACHED: a process left the container and is not proven gone")
    return finish(run, target, run.exit_status())


if __name__ == "__main__":
    sys.exit(main())
