"""How to run and stop one run: fixed before the spawn, validated here."""
from __future__ import annotations

import os
import stat

from ._args import check_env, check_path, check_run_numbers, check_seconds

DEFAULT_GRACE = 5.0
DEFAULT_KILL_TIMEOUT = 10.0
BACKENDS = ("auto", "cgroup2", "pidns", "subreaper", "job-object", "none")


class Options:
    """Everything about how to run and stop, fixed before spawn."""

    __slots__ = ("grace", "timeout", "kill_timeout", "backend", "seal", "user", "workspace",
                 "record_file", "env", "cwd", "stdio", "state_dir", "subreaper", "parent_cgroup",
                 "new_pgroup", "check_sockets", "pidns", "linger", "keep_ignored", "notify", "pass_fds",
                 "limits", "check_locks", "stats_json", "backend_chosen", "sole", "accounting",
                 "die_with_owner")

    def __init__(self, *, grace: float = DEFAULT_GRACE, timeout: float | None = None,
                 kill_timeout: float = DEFAULT_KILL_TIMEOUT, backend: str = "auto",
                 seal: bool | None = None, user: str | None = None, workspace: str | None = None,
                 record_file: str | None = None, env: dict[str, str] | None = None,
                 cwd: str | None = None, stdio: tuple[int, int, int] = (-1, -1, -1),
                 state_dir: str | None = None, subreaper: bool = False,
                 parent_cgroup: str | None = None, new_pgroup: bool = False,
                 check_sockets: bool = False, pidns: bool | None = None, linger: float = 0.0,
                 keep_ignored: frozenset[int] | None = None, notify: object = None,
                 pass_fds: tuple[int, ...] | list[int] = (), memory_max: int | str | None = None,
                 pids_max: int | str | None = None, cpu_max: float | str | None = None,
                 check_locks: bool = False, stats_json: str | None = None, accounting: bool = False,
                 die_with_owner: bool = False) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} (auto, cgroup2, pidns, subreaper, job-object or none)")
        # The library's numbers are checked as the CLI checks them (_args.py):
        # finite, grace >= 0, timeout and kill_timeout > 0.
        self.grace, self.timeout, kt = check_run_numbers(grace=grace, timeout=timeout, kill_timeout=kill_timeout)
        self.kill_timeout = DEFAULT_KILL_TIMEOUT if kt is None else kt
        # After the worker exits, how long the rest of the tree may go on on
        # its own before the stop begins (`git gc --auto` backgrounds itself).
        self.linger = check_seconds(linger, "linger")
        # Signals the worker starts with ignored: None means "what this
        # process ignores at the spawn" (_launch.caller_ignored).
        self.keep_ignored = keep_ignored
        # Called with one line for a person (the CLI prints it on stderr):
        # today only "the container is weaker than this host allows".
        self.notify = notify
        # Descriptors the worker gets besides stdio, as subprocess's pass_fds
        # (the CLI passes what its own caller handed it: `<(...)`, `3<file`,
        # make's jobserver). Every other descriptor is closed at exec.
        if isinstance(pass_fds, (str, bytes, int)) or any(isinstance(fd, bool) or not isinstance(fd, int) or fd < 0
                                                      for fd in pass_fds):
            raise TypeError(f"pass_fds must be a sequence of descriptor numbers, not {pass_fds!r}")
        self.pass_fds = tuple(sorted(set(pass_fds)))
        # Limits, applied before the worker's first instruction or refused
        # (125): bytes ("256M" or an int), tasks, CPUs ("0.5", "150%") or
        # cgroup v2's "QUOTA PERIOD" (_limits.py).
        self.limits = None
        if memory_max is not None or pids_max is not None or cpu_max is not None:
            from ._limits import Limits, parse_bytes, parse_cpu_max, parse_pids   # lazy: only runs with limits

            self.limits = Limits(memory_max=None if memory_max is None else parse_bytes(str(memory_max)),
                                 pids_max=None if pids_max is None else parse_pids(str(pids_max)),
                                 cpu_max=None if cpu_max is None else parse_cpu_max(str(cpu_max)))
        # Paths as subprocess takes them (str, bytes, os.PathLike, no NUL):
        # record_file=pathlib.Path(...) failed with AttributeError at the spawn.
        record_file, stats_json, workspace, state_dir, parent_cgroup = (
            None if v is None else check_path(v, name) for v, name in (
                (record_file, "record_file"), (stats_json, "stats_json"), (workspace, "workspace"),
                (state_dir, "state_dir"), (parent_cgroup, "parent_cgroup")))
        # An empty path is not "option not given": it would drop the stats
        # or the workspace layer without a word.
        for flag, path in (("--stats-json", stats_json), ("--workspace", workspace)):
            if path is not None and not str(path):
                raise ValueError(f"{flag} is an empty path")
        if workspace is not None:
            # Said now: a missing workspace was accepted and failed only at
            # `wait --redispatch`, long after the run (issue 31).
            try:
                is_dir = stat.S_ISDIR(os.stat(workspace).st_mode)
            except OSError as e:
                raise ValueError(f"--workspace {os.fsdecode(workspace)}: {e.strerror or e}") from None
            if not is_dir:
                raise ValueError(f"--workspace {os.fsdecode(workspace)}: not a directory")
        self.check_locks = check_locks
        self.stats_json = stats_json
        # Peak memory and tasks where they need cgroups of the run's own
        # besides its v2 directory (v1, on hybrid hosts): made only when
        # asked, here or by stats_json or a limit (_controllers.plan).
        if not isinstance(accounting, bool):
            raise TypeError(f"accounting must be True or False, not {accounting!r}")
        self.accounting = accounting
        # When this process dies (not one of its threads), the kernel ends
        # the tree: the wall's init exits on this process's pidfd (init.c).
        # Refused where there is no wall; on Windows the job's kill-on-close
        # does it anyway. The final record is then written by whoever
        # finishes the run (`contain janitor`, `contain cancel`).
        if not isinstance(die_with_owner, bool):
            raise TypeError(f"die_with_owner must be True or False, not {die_with_owner!r}")
        self.die_with_owner = die_with_owner
        self.backend = backend
        # `contain run --backend auto` chose auto: CONTAIN_BACKEND, only a
        # default, does not override it (the library's "auto" is its default).
        self.backend_chosen = False
        self.seal = seal
        if isinstance(user, int) and not isinstance(user, bool):
            user = str(user)            # a uid, as --user takes it
        elif user is not None and not isinstance(user, str):
            raise TypeError(f"user must be a name or a uid, not {type(user).__name__} {user!r}")
        self.user = user
        self.workspace = workspace
        self.record_file = record_file
        self.env = None if env is None else check_env(env)
        self.cwd = None if cwd is None else check_path(cwd, "cwd")
        self.stdio = stdio
        self.state_dir = state_dir
        if not isinstance(subreaper, bool):
            raise TypeError(f"subreaper must be True or False, not {subreaper!r}")
        # The process becomes a child subreaper (process-wide, for good) when
        # a run needs the subreaper wall (_platform/subreaper.py).
        self.subreaper = subreaper
        # This process starts no child but its runs' (`contain run`): every
        # orphan that reaches it is its run's, and it reaps every child.
        self.sole = False
        self.parent_cgroup = parent_cgroup
        self.new_pgroup = new_pgroup
        self.check_sockets = check_sockets
        # The PID-namespace wall: None where the kernel allows it, True
        # required (125 where it cannot be made), False off.
        self.pidns = pidns


def user_account(user: str) -> tuple[int, int, list[int], dict[str, str | None]]:
    """--user NAME|UID: (uid, gid, supplementary groups, and the HOME, USER
    and LOGNAME the worker gets, as su(1) sets them; None: unset). A number
    with no passwd entry is that uid with gid the same, no groups, HOME=/
    and no USER or LOGNAME (never the caller's names). Raises ValueError
    for a name nobody has."""
    import pwd

    # A uid is ASCII digits, as for chown(1) and su(1): str.isdigit() and
    # int() also take '٣' (uid 3, sys) and '²'.
    numeric = user.isascii() and user.isdigit()
    try:
        pw = pwd.getpwuid(int(user)) if numeric else pwd.getpwnam(user)
    except (KeyError, ValueError, OverflowError):
        if numeric and int(user) < 2**32 - 1:
            return int(user), int(user), [], {"HOME": "/", "USER": None, "LOGNAME": None}
        raise ValueError(f"no such user {user!r}") from None
    try:
        groups = os.getgrouplist(pw.pw_name, pw.pw_gid)     # NSS, as initgroups(3) sees them
    except OSError:
        groups = [pw.pw_gid]
    env: dict[str, str | None] = {"HOME": pw.pw_dir or "/", "USER": pw.pw_name, "LOGNAME": pw.pw_name}
    return pw.pw_uid, pw.pw_gid, sorted({pw.pw_gid, *groups}), env
