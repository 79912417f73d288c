"""`contain`: the entry point, exit codes and human output (the arguments
are parsed in _cliparse.py; the commands other than `run` are in
_commands.py).

Imports stay lean on the `run` path: the supervisor's own start-up is part of
every run's cost (benchmarks/bench_cli.py). A plain `contain run [OPTIONS]
-- CMD` is parsed without argparse (_cliparse.fast_run).
"""
from __future__ import annotations

import os
from . import _signals as signal
import sys
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    import argparse
    from types import SimpleNamespace
    from typing import Any, Sequence

from ._cliparse import EXIT_USAGE, fast_run, parser

EXIT_NOT_FOUND = 3
EXIT_CONTAIN_FAILED = 125

# The signal `contain` must die by once main() has returned (a run cancelled
# by SIGINT, SIGTERM or SIGHUP, or a Ctrl-C anywhere): console() raises it
# after the output is flushed; in-process callers of main() get 128 + N.
_die_by: list[int] = []


def main(argv: Sequence[str] | None = None) -> int:
    del _die_by[:]
    try:
        args = fast_run(sys.argv[1:] if argv is None else argv) or parser().parse_args(argv)
        if args.cmd is None:
            parser().print_help(sys.stderr)
            return EXIT_USAGE
        if args.cmd not in ("doctor",):
            from ._statedir import setting_problem

            problem = setting_problem()
            if problem is not None:
                _say(problem)
                return EXIT_USAGE
        from ._safefs import UnsafePath

        try:
            if args.cmd == "run":
                return _cmd_run(args)
            from . import _commands

            return int(getattr(_commands, f"cmd_{args.cmd}")(args))
        except UnsafePath as e:          # the state directory is not ours: one line, 125
            _say(str(e))
            return EXIT_CONTAIN_FAILED
    except KeyboardInterrupt:
        # Interrupted outside a run's stop (start-up, `wait`, `cancel --wait`):
        # die by SIGINT too, so the shell around us stops as well.
        _die_by[:] = [signal.SIGINT]
        return 128 + signal.SIGINT
    except BrokenPipeError:
        return 1
    except OSError as e:             # e.g. a run directory this user may not read
        _say(f"{getattr(args, 'cmd', 'contain')}: {e.filename + ': ' if e.filename else ''}{e.strerror or e}")
        return 1


def console() -> None:
    """The `contain` command (and `python -m launcher`): main(), then a fast
    exit. Everything that must outlive the process is already durable (the
    records are written with os.write and fsynced, the ledger is closed in
    the run's finalisation); interpreter teardown of every imported module
    only delays the caller, by 7 ms per `contain run` here
    (docs/performance.md). In-process callers use main(), which returns."""
    import os

    # Not one the caller ignored: Python's handler, or bin/contain's SIG_DFL
    # while it loaded the package (a process inherits no SIG_DFL for SIGINT
    # from Python: its start-up puts its own handler there).
    if callable(signal.getsignal(signal.SIGINT)) or signal.getsignal(signal.SIGINT) == signal.SIG_DFL:
        signal.signal(signal.SIGINT, _interrupt)
    out_closed = _hold_closed_stdio()
    from . import _statedir

    _statedir.warn_with = lambda msg: _say(f"warning: {msg}")
    for stream in (sys.stdout, sys.stderr):
        # A run's argv in an ASCII locale (PYTHONIOENCODING=ascii, LC_ALL=C
        # on an old Python): escaped, never a UnicodeEncodeError traceback.
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        try:
            rc = main()
        finally:
            _quiet.append(True)
    except KeyboardInterrupt:            # one that came as main() returned
        _quiet.append(True)
        _die_by[:] = [signal.SIGINT]
        rc = 128 + signal.SIGINT
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
    if _die_by:
        from ._sigproxy import die_by

        die_by(_die_by[0])
    if sys.platform == "win32" and rc > 0x7FFFFFFF:
        rc -= 1 << 32                    # an NTSTATUS exit code (0xC0000005): the same DWORD as an int
    os._exit(rc)


_quiet: list[bool] = []     # main() has returned: a Ctrl-C now changes nothing (_interrupt)


def _interrupt(_signum: int, _frame: object) -> None:
    """SIGINT until a run installs its own handler (_sigproxy): Python's
    KeyboardInterrupt, except while one is being handled or once main() has
    returned. Python's own raised on every Ctrl-C: a second one (a key held
    down) landing in main()'s KeyboardInterrupt handler, or in the flush
    and import before die_by, escaped as a traceback with status 1."""
    if _quiet:
        return
    e = sys.exc_info()[1]
    for _ in range(50):       # what is being handled, and what that interrupted
        if e is None:
            raise KeyboardInterrupt
        if isinstance(e, KeyboardInterrupt):
            return
        e = e.__context__


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
        from . import _recordfile

        _recordfile.CLOSED_STDIO.add(fd)     # `--record /dev/stdin` is refused, not written to /dev/null
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
    from ._leadend import end_hook
    from ._errors import ContainmentUnavailable, RunConflict, SpawnFailed
    from ._launch import caller_ignored
    from ._options import Options
    from ._run import Run
    from ._policy import policy_env
    from ._sigproxy import SignalProxy

    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        _say("run: nothing to run (usage: contain run [OPTIONS] -- CMD [ARG...])")
        return EXIT_USAGE
    from ._pid1 import split

    split()          # as PID 1 (a container's entrypoint): an init of our own above the supervisor
    backend = args.backend or policy_env("CONTAIN_BACKEND") or "auto"
    if backend not in ("auto", "cgroup2", "pidns", "subreaper", "job-object", "none"):
        _say(f"run: CONTAIN_BACKEND={backend!r} is not auto, cgroup2, pidns, subreaper, job-object or none")
        return EXIT_USAGE
    quiet = bool(getattr(args, "quiet", False))
    # What the caller handed us without close-on-exec goes on to the worker
    # (`<(...)`, `3<file`, make's jobserver), as `env` and `timeout` do: read
    # before contain opens anything of its own (all close-on-exec, PEP 446).
    passed = _inherited_fds()
    # Its own soft descriptor limit up to the hard one, as systemd does: a
    # stop and its final record never meet the caller's low limit. The
    # worker starts with the caller's limits all the same.
    if sys.platform != "win32":
        from ._platform.spawnreq import raise_own_limit

        raise_own_limit()
    try:
        # What the caller ignored, read before any handler of ours exists:
        # it stays ignored here and in the worker (nohup, `trap '' INT`).
        ignored = caller_ignored()
        # The parser has checked the numbers (launcher/_args.py): --timeout
        # and --kill-timeout are > 0, so 0 never turns into "none".
        opts = Options(grace=args.grace, timeout=args.timeout, kill_timeout=args.kill_timeout,
                       backend=backend, seal=args.seal or None, user=args.user, workspace=args.workspace,
                       subreaper=True, check_sockets=args.check_sockets,
                       pidns=False if getattr(args, "no_pidns", False) else None,
                       linger=getattr(args, "linger", 0.0), keep_ignored=ignored, pass_fds=passed,
                       memory_max=args.memory_max, pids_max=args.pids_max, cpu_max=args.cpu_max,
                       check_locks=args.check_locks, stats_json=args.stats_json,
                       accounting=bool(getattr(args, "accounting", False)),
                       die_with_owner=bool(getattr(args, "die_with_owner", False)),
                       notify=None if quiet else _say_weaker)
        opts.backend_chosen = True          # --backend, else CONTAIN_BACKEND, resolved above
        opts.sole = True                    # this process starts no child but the worker
        run = Run(cmd, id=args.id, options=opts)
        run.end_hooks.append(end_hook)
    except ValueError as e:
        _say(f"run: {e}")
        return EXIT_USAGE
    # --record is checked before anything runs and written once the run has
    # ended (_recordfile): 125 and one line if it cannot take the record.
    from ._recordfile import finish, prepare, resume_terminals

    try:
        target = None if args.record is None else prepare(args.record)
    except OSError as e:
        _say(f"run: --record {e}")
        return EXIT_CONTAIN_FAILED
    if target is not None and target.kind in ("file", "winfile"):
        run.record_path = os.path.abspath(args.record)     # in run.json: an adopter writes it too
    if args.stats_json:
        # Checked as --record is: a run whose stats line could not be kept
        # is refused before anything runs (and then appended at the end).
        from ._stats import check_stats

        try:
            check_stats(args.stats_json)
        except OSError as e:
            _say(f"run: --stats-json {args.stats_json}: {e.strerror or e}")
            return EXIT_CONTAIN_FAILED

    # Signals cancel the run, or are forwarded to the worker; they are
    # turned into wake-ups of the owner loop, which records the intent
    # durably before anything is signalled (_sigproxy.py). Installed before
    # the claim: a cancel that arrives during the start-up is acted on
    # before the spawn, a signal to forward waits for the worker.
    proxy = SignalProxy(run, say=None if quiet else _say)
    proxy.install()
    run.on_change = proxy.after_turn      # also forwards the other signals to the worker
    if sys.platform != "win32":          # Windows: no subreaper (the job holds the tree)
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
        return _ended(proxy, finish(run, target, e.exit_code))
    except ContainmentUnavailable as e:
        _say(f"no container: {e}")
        return _ended(proxy, finish(run, target, EXIT_CONTAIN_FAILED))
    except OSError as e:
        _say(f"run: {e}")
        return _ended(proxy, finish(run, target, EXIT_CONTAIN_FAILED))
    try:
        rec = run.supervise(extra_fds=proxy.sources())
    except Exception:                   # a bug, not bad input: never the worker's exit status
        import traceback

        resume_terminals(1, 2)

        traceback.print_exc()
        _say(f"run {run.id}: internal error while supervising; its owner lock goes with this process: "
             f"`contain cancel {run.id}` adopts and finishes the run")
        return _ended(proxy, EXIT_CONTAIN_FAILED)
    resume_terminals(1, 2, target.fileno() if target is not None else -1)   # after the stop, before our writes
    if rec.state == "UNCONFIRMED":
        _say(f"run {run.id}: stop not confirmed: the container did not empty; "
             f"`contain cancel {run.id}` repeats the kill")
    elif rec.state == "BREACHED":
        _say(f"run {run.id}: BREACHED: a process left the container and is not proven gone")
    status = finish(run, target, run.exit_status())
    if run.stats_error is not None:
        _say(run.stats_error)
        status = EXIT_CONTAIN_FAILED
    if run.facts.unsaved:
        # The stop happened; what it found could not all be kept.
        _say(f"run {run.id}: not saved in the state directory: {'; '.join(run.facts.unsaved)}"
             + ("" if args.record else " (--record FILE keeps a copy elsewhere)"))
        status = EXIT_CONTAIN_FAILED
    if not quiet:
        _summarise(run, rec.to_dict(), args.record, verbose=bool(getattr(args, "verbose", False)))
    return _ended(proxy, status)


def _inherited_fds() -> list[int]:
    if sys.platform == "win32":
        return []
    from ._platform.spawnreq import inherited_fds

    return inherited_fds()


def _ended(proxy: Any, status: int) -> int:
    """The exit status, unless a signal cancelled the run: then `contain`
    dies by that signal (console() raises it once the record is written and
    the output flushed), whatever the worker's own status was."""
    if proxy.first is not None and status != EXIT_CONTAIN_FAILED:
        # contain's own failure (no container, a record not written, a stop
        # not confirmed) is never hidden behind "it died of the signal you sent".
        _die_by[:] = [proxy.first]
        return 128 + proxy.first
    return status


def _say_weaker(reason: str, backend: str = "none") -> None:
    from ._summary import weaker_line

    _say(weaker_line(reason, backend))


def _summarise(run: Any, rec: dict[str, Any], record_path: str | None, *, verbose: bool) -> None:
    """`-v`: one line on how the run ended. Without it, the same line on a
    terminal when leftovers of the tree had to be stopped (the worker's own
    output never says that)."""
    from ._summary import oom_line, stopped_leftovers, summary

    oom = oom_line(rec)
    if oom is not None:
        _say(oom)
    if not verbose and not (stopped_leftovers(rec) and _stderr_is_tty()):
        return
    paths = [os.path.join(run.layout.path, "record.json")] if run.layout is not None else []
    if record_path and record_path != "-":
        paths.append(record_path)
    _say(summary(rec, paths))


def _stderr_is_tty() -> bool:
    try:
        return os.isatty(2)
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
