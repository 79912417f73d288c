"""How to run and stop one run: fixed before the spawn, validated here."""
from __future__ import annotations

DEFAULT_GRACE = 5.0
DEFAULT_KILL_TIMEOUT = 10.0
BACKENDS = ("auto", "cgroup2", "pidns", "job-object", "none")


class Options:
    """Everything about how to run and stop, fixed before spawn."""

    __slots__ = ("grace", "timeout", "kill_timeout", "backend", "seal", "user", "workspace",
                 "record_file", "env", "cwd", "stdio", "state_dir", "subreaper", "parent_cgroup",
                 "new_pgroup", "check_sockets", "pidns")

    def __init__(self, *, grace: float = DEFAULT_GRACE, timeout: float | None = None,
                 kill_timeout: float = DEFAULT_KILL_TIMEOUT, backend: str = "auto",
                 seal: bool | None = None, user: str | None = None, workspace: str | None = None,
                 record_file: str | None = None, env: dict[str, str] | None = None,
                 cwd: str | None = None, stdio: tuple[int, int, int] = (-1, -1, -1),
                 state_dir: str | None = None, subreaper: bool = False,
                 parent_cgroup: str | None = None, new_pgroup: bool = False,
                 check_sockets: bool = False, pidns: bool | None = None) -> None:
        if grace < 0 or (timeout is not None and timeout <= 0) or kill_timeout <= 0:
            raise ValueError("grace must be >= 0, timeout and kill_timeout > 0")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} (auto, cgroup2, pidns, job-object or none)")
        self.grace = grace
        self.timeout = timeout
        self.kill_timeout = kill_timeout
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
        # The PID-namespace wall: None where the kernel allows it, True
        # required (125 where it cannot be made), False off.
        self.pidns = pidns


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
