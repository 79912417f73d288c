"""How to run and stop one run: fixed before the spawn, validated here."""
from __future__ import annotations

import math

DEFAULT_GRACE = 5.0
DEFAULT_KILL_TIMEOUT = 10.0
BACKENDS = ("auto", "cgroup2", "job-object", "none")


def _finite(name: str, value: float, *, positive: bool) -> float:
    """Every time bound is a finite number of seconds: the owner loop can
    honour any of them (its waits are clamped and looped), and nan or inf
    would make every deadline comparison false or never true."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be a finite number of seconds {'> 0' if positive else '>= 0'}, "
                         f"not {value!r}")
    return v


class Options:
    """Everything about how to run and stop, fixed before spawn."""

    __slots__ = ("grace", "timeout", "kill_timeout", "backend", "seal", "user", "workspace",
                 "record_file", "env", "cwd", "stdio", "state_dir", "subreaper", "parent_cgroup",
                 "new_pgroup", "check_sockets", "linger", "keep_ignored", "notify")

    def __init__(self, *, grace: float = DEFAULT_GRACE, timeout: float | None = None,
                 kill_timeout: float = DEFAULT_KILL_TIMEOUT, backend: str = "auto",
                 seal: bool | None = None, user: str | None = None, workspace: str | None = None,
                 record_file: str | None = None, env: dict[str, str] | None = None,
                 cwd: str | None = None, stdio: tuple[int, int, int] = (-1, -1, -1),
                 state_dir: str | None = None, subreaper: bool = False,
                 parent_cgroup: str | None = None, new_pgroup: bool = False,
                 check_sockets: bool = False, linger: float = 0.0,
                 keep_ignored: frozenset[int] | None = None, notify: object = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} (auto, cgroup2, job-object or none)")
        self.grace = _finite("grace", grace, positive=False)
        self.timeout = None if timeout is None else _finite("timeout", timeout, positive=True)
        self.kill_timeout = _finite("kill_timeout", kill_timeout, positive=True)
        # After the worker exits, how long the rest of the tree may go on on
        # its own before the stop begins (`git gc --auto` backgrounds itself).
        self.linger = _finite("linger", linger, positive=False)
        # Signals the worker starts with ignored: None means "what this
        # process ignores at the spawn" (_launch.caller_ignored).
        self.keep_ignored = keep_ignored
        # Called with one line for a person (the CLI prints it on stderr):
        # today only "the container is weaker than this host allows".
        self.notify = notify
        self.backend = backend
        self.seal = seal
        self.user = user
        self.workspace = workspace
        self.record_file = record_file
        self.env = env
        self.cwd = cwd
        self.stdio = stdio
        self.state_dir = state_dir
        self.subreaper = subreaper
        self.parent_cgroup = parent_cgroup
        self.new_pgroup = new_pgroup
        self.check_sockets = check_sockets


def resolve_user(user: str) -> tuple[int, int, list[int]]:
    """(uid, gid, supplementary groups) for --user NAME|UID."""
    import grp
    import pwd

    try:
        pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, ValueError):
        if user.isdigit():
            return int(user), int(user), []
        raise ValueError(f"no such user {user!r}") from None
    groups = [g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem]
    return pw.pw_uid, pw.pw_gid, sorted({pw.pw_gid, *groups})
