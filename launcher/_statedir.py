"""Where the state directory is, and opening it only once it is ours.

Location (first that applies):
1. `CONTAIN_STATE_DIR`, unless the process runs with privilege its caller
   lacks (uid != euid, gid != egid, or AT_SECURE): a setuid or file-capability
   `contain` never lets its caller choose where it writes.
2. root: `/run/contain`.
3. `$XDG_RUNTIME_DIR/contain`, when XDG_RUNTIME_DIR is a directory owned by
   this user (not one inherited through `su` from another user).
4. `/run/user/<euid>/contain`, when logind made `/run/user/<euid>` for us.
5. `$XDG_STATE_HOME/contain`, else `~/.local/state/contain`, when that
   directory (or HOME) is owned by this user: `su -`, cron, a CI runner,
   a container's user with a home.
6. `/tmp/contain-<euid>` (a user with no home of its own: a container's
   numeric uid gets HOME=/), as tmux does: made 0700 by us, and verified as
   every state directory is, so one that another user made first is
   refused (exit 125, naming its owner), never used: that user can deny us
   the default, never read or forge our runs.

Verification, at every open (`StateDir.open`):
- every directory above the state directory is owned by root or by us, and
  is writable by others only with the sticky bit (as /tmp is), checked on
  the real path, one component at a time with O_NOFOLLOW, and a symlink
  that led there is followed only when it is root's or ours;
- the state directory and `runs/` are real directories (not symlinks), owned
  by the effective uid (readers also accept root's), not writable by group
  or others. What we create gets exactly 0700 (root's top and `runs/` 0755,
  so other users can list root's run ids, never read them: run directories
  are 0700), whatever the umask.
A directory that fails is refused with `StateDirError` (exit 125), naming the
directory and what is wrong; nothing in it is read or written.
"""
from __future__ import annotations

import errno
import os
import stat
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Callable

from . import _safefs as F
from ._policy import elevated as elevated, policy_env as policy_env
from ._safefs import UnsafePath
from ._safepath import open_ancestors

ENV = "CONTAIN_STATE_DIR"


class StateDirError(UnsafePath):
    """The state directory cannot be used: there is none, or it fails the
    ownership and mode checks. One line, naming the directory and why."""

    def __str__(self) -> str:
        return f"state directory {self.path}: {self.problem}"


def location(env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The state directory's path (see the module docstring). Raises
    StateDirError when this user has none, ValueError when CONTAIN_STATE_DIR
    is set but empty or relative (setting_problem)."""
    problem = setting_problem(env)
    if problem is not None:
        raise ValueError(problem)
    explicit = policy_env(ENV, env)
    if explicit:
        return os.path.abspath(explicit)
    euid = os.geteuid()
    if euid == 0:
        return "/run/contain"
    xdg = None if elevated() else env.get("XDG_RUNTIME_DIR")
    if xdg and _owned_dir(xdg, euid) is None:
        return os.path.join(os.path.abspath(xdg), "contain")
    run_user = f"/run/user/{euid}"
    if _owned_dir(run_user, euid) is None:
        return os.path.join(run_user, "contain")
    if not elevated():
        state = env.get("XDG_STATE_HOME")
        if state and os.path.isabs(state) and _owned_dir(state, euid) is None:
            return os.path.join(state, "contain")
        home = env.get("HOME")
        if home and os.path.isabs(home) and _owned_dir(home, euid) is None:
            return os.path.join(home, ".local", "state", "contain")
    return f"/tmp/contain-{euid}"


def setting_problem(env: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Why CONTAIN_STATE_DIR cannot be used as set, or None. An empty one
    fell back to the shared default (root's /run/contain) and a relative
    one resolved against whatever directory the command ran in, made 0755
    there (issue 31): both are a mistake to say, not to guess around."""
    if elevated() or ENV not in env:
        return None
    v = env[ENV]
    if not v:
        return f"{ENV} is set but empty: set it to an absolute path, or unset it for the default"
    if not os.path.isabs(v):
        return f"{ENV}={v!r} is a relative path: set it to an absolute path"
    return None


def _owned_dir(path: str, euid: int) -> str | None:
    """None if `path` is a directory owned by `euid`; else what it is."""
    try:
        st = os.stat(path)
    except OSError as e:
        return "does not exist" if e.errno == errno.ENOENT else f"cannot be read ({os.strerror(e.errno or 0)})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != euid:
        return f"belongs to uid {st.st_uid}"
    return None


def top_mode() -> int:
    return 0o755 if os.geteuid() == 0 else 0o700


RUN_DIR_MODE = 0o700
FILE_MODE = 0o600

# Retention (docs/protocol.md, "Retention"): at most KEEP_RUNS run
# directories are kept; a claim that finds more than KEEP_RUNS + PRUNE_SLACK
# removes the oldest ended ones. CONTAIN_KEEP_RUNS=N sets N, 0 turns it off.
KEEP_RUNS = 1000
PRUNE_SLACK = 100
# How long a claim waits for another claim of the same state directory.
CLAIM_WAIT_S = 10.0


def keep_runs(env: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """CONTAIN_KEEP_RUNS (a count >= 0; 0: no automatic bound), else KEEP_RUNS."""
    v = policy_env("CONTAIN_KEEP_RUNS", env)
    if v is None:
        return KEEP_RUNS
    if v.isascii() and v.isdigit() and len(v) <= 9:
        return int(v)
    if v not in _warned:
        # Said once, not ignored without a word (issue 31): a typo here
        # would keep every run for ever or none at all.
        _warned.add(v)
        msg = f"CONTAIN_KEEP_RUNS={v!r} is not a count (an integer >= 0): ignored, at most {KEEP_RUNS} runs are kept"
        if warn_with is not None:
            warn_with(msg)
        else:
            import warnings

            warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return KEEP_RUNS


_warned: set[str] = set()
# The `contain` command says warnings as its other lines ("contain: ..."),
# not as Python's warnings module would (file and line of the library).
warn_with: Callable[[str], None] | None = None


class StateDir:
    """An open, verified state directory: `fd` (the top) and `runs_fd`
    (`runs/`), both O_RDONLY|O_DIRECTORY. `write` says whether it was opened
    to write (only the euid's own then) or to read (root's accepted too).
    Close it (or use it as a context manager); nothing is cached between
    opens, so every open is verified afresh."""

    __slots__ = ("path", "fd", "runs_fd", "write", "owners")

    def __init__(self, path: str, fd: int, runs_fd: int, write: bool, owners: tuple[int, ...]) -> None:
        self.path = path
        self.fd = fd
        self.runs_fd = runs_fd
        self.write = write
        self.owners = owners

    @classmethod
    def open(cls, path: str | None = None, *, write: bool, create: bool = False) -> "StateDir":
        """Open and verify. `create` makes what is missing (with the modes
        above). Raises StateDirError, or FileNotFoundError when the directory
        (or its runs/) does not exist and `create` is false."""
        default = path is None
        path = os.path.normpath(os.path.abspath(path or location()))
        try:
            return cls._open(path, write=write, create=create)
        except StateDirError as e:
            if default and path == f"/tmp/contain-{os.geteuid()}":
                # The last default: say what was looked for first, and the way out.
                e.problem = (f"{e.problem} (the default where neither XDG_RUNTIME_DIR, /run/user/"
                             f"{os.geteuid()} nor a home of this user's exists): set {ENV} to a directory of "
                             "your own")
            raise

    @classmethod
    def _open(cls, path: str, *, write: bool, create: bool) -> "StateDir":
        parent, name = os.path.split(path)
        if not name:
            raise StateDirError(path, "is the root directory")
        euid = os.geteuid()
        owners = (euid,) if write or euid == 0 else (euid, 0)
        mode = top_mode()
        try:
            try:
                anc = open_ancestors(parent)
            except FileNotFoundError:
                if not create:
                    raise
                _make_parents(parent)
                anc = open_ancestors(parent)
            try:
                fd = F.open_private_dir(anc, name, path, owners=owners, create_mode=mode if create else None)
            finally:
                os.close(anc)
            try:
                runs = F.open_private_dir(fd, "runs", os.path.join(path, "runs"), owners=owners,
                                          create_mode=mode if create else None)
            except BaseException:
                os.close(fd)
                raise
        except StateDirError:
            raise
        except UnsafePath as e:
            raise StateDirError(e.path, e.problem, e.errno or errno.EPERM) from None
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StateDirError(path, os.strerror(e.errno or errno.EIO), e.errno or errno.EIO) from None
        return cls(path, fd, runs, write, owners)

    def close(self) -> None:
        for fd in (self.runs_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.runs_fd = -1

    def __enter__(self) -> "StateDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _make_parents(parent: str) -> None:
    """Create the missing directories above the state directory, 0700 (as
    `mkdir -p -m 0700` would, but the mode is exact): an explicit
    CONTAIN_STATE_DIR may name a path that does not exist yet. Only the
    missing levels are made, each by mkdirat in its parent as verified by
    open_ancestors: by path, another user's symlink put where a level was
    missing a moment before (in /tmp) was followed, and root made the
    next level wherever it pointed."""
    missing = []
    p = parent
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        up, name = os.path.split(d)
        try:
            anc = open_ancestors(up)
        except FileNotFoundError:
            raise StateDirError(up, "was removed while the directories below it were made", errno.ENOENT) from None
        try:
            try:
                os.mkdir(name, 0o700, dir_fd=anc)
            except FileExistsError:
                continue          # someone else's: verified as an ancestor at the next level
            fd = os.open(name, F.O_DIR, dir_fd=anc)
            try:
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
        finally:
            os.close(anc)


def claim_unlock(fd: int) -> None:
    """Give up the claim lock and close its fd. Unlocked first: a fork() of
    this process (another thread's, during the claim) shares the flock's
    open file description, and closing our copy alone would leave it held."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def claim_lock(st: StateDir) -> int:
    """`runs/.claim.lock`, held (flock LOCK_EX) by the caller until it gives
    the returned fd to claim_unlock: claims, and the renames of retention,
    are serialised by it. Waits at most CLAIM_WAIT_S for another holder (a stopped process
    holding it must not wedge every later run). Raises StateDirError."""
    import fcntl     # (imported here: this module is loaded on Windows too, for its errors and bounds)

    path = os.path.join(st.path, "runs", ".claim.lock")
    try:
        fd = os.open(".claim.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     FILE_MODE, dir_fd=st.runs_fd)
    except OSError as e:
        raise StateDirError(path, "is a symlink (not followed)" if e.errno == errno.ELOOP
                            else os.strerror(e.errno or errno.EIO), e.errno or errno.EIO) from None
    try:
        s = os.fstat(fd)
        if not stat.S_ISREG(s.st_mode) or s.st_uid != os.geteuid():
            raise StateDirError(path, "is not a regular file of this user")
        if stat.S_IMODE(s.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
        deadline = time.monotonic() + CLAIM_WAIT_S
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StateDirError(path, f"another claim held it for {CLAIM_WAIT_S:.0f} s",
                                        errno.EAGAIN) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
    except BaseException:
        os.close(fd)
        raise
