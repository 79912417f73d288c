"""The state directory on Windows, the claim's helpers, and waiting clients
(winlayout.py is the run directory itself).

- `StateDir`: CONTAIN_STATE_DIR, else %LOCALAPPDATA%\\contain, and its
  runs\\, each checked to be a real directory of this user (winfs).
- The claim guard `runs\\.claim.lock` (LockFileEx, a bounded retry), and
  moving an ended run's directory aside (a bounded retry of the rename:
  Windows refuses it while a file inside is open).
- `Watcher`: what `contain cancel --wait` and `contain wait` block on.
"""
from __future__ import annotations

import errno
import os
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Mapping

from .._errors import RunConflict
from .._runfiles import ID_RE
from .._safefs import PersistError, UnsafePath
from .._statedir import CLAIM_WAIT_S, StateDirError
from . import winfs, winsync


def location(env: Mapping[str, str] = os.environ) -> str:
    """The state directory: CONTAIN_STATE_DIR, else %LOCALAPPDATA%\\contain."""
    try:
        return os.path.normpath(os.path.abspath(winfs.state_dir(env)))
    except OSError as e:
        raise StateDirError("(none)", f"{e.strerror}: set CONTAIN_STATE_DIR", errno.ENOENT) from None


def check_dir(path: str, *, create: bool) -> None:
    """winfs.ensure_private_dir, its refusals as UnsafePath (FileNotFoundError passes)."""
    try:
        winfs.ensure_private_dir(path, create=create)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise UnsafePath(path, e.strerror or str(e), e.errno or errno.EPERM) from None


def persist_error(e: OSError, what: str, path: str) -> PersistError:
    return e if isinstance(e, PersistError) else PersistError(e.errno or errno.EIO, what, path, e.strerror)


class StateDir:
    """The state directory and its runs\\, checked (created with `create`)."""

    def __init__(self, path: str, write: bool) -> None:
        self.path = path
        self.runs = os.path.join(path, "runs")
        self.write = write

    @classmethod
    def open(cls, path: str | None = None, *, write: bool, create: bool = False) -> "StateDir":
        path = os.path.normpath(os.path.abspath(path or location()))
        try:
            if create:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            check_dir(path, create=create)
            check_dir(os.path.join(path, "runs"), create=create)
        except UnsafePath as e:
            raise StateDirError(e.path, e.problem, e.errno or errno.EPERM) from None
        return cls(path, write)

    def close(self) -> None:
        pass

    def __enter__(self) -> "StateDir":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Watcher:
    """What `contain cancel --wait` and `contain wait` wait on (as
    _cancel.Watcher on Linux): an event of our own, which the owner sets
    after every record or acknowledgement, and the owner's process handle
    (signalled when it dies)."""

    def __init__(self, layout: Any, owner: dict[str, Any] | None) -> None:
        from . import winproc

        self.waiter = winsync.Waiter()
        self.path = ""
        self.owner = 0
        try:
            token = layout.add_waiter()
            self.waiter.listen(winsync.waiter_event_name(token))
            path = os.path.join(layout.waiters, token)
            with open(path, "xb"):
                pass
            self.path = path
        except (OSError, ValueError, UnsafePath):
            self.path = ""
        if owner and isinstance(owner.get("pid"), int) and isinstance(owner.get("start_time"), int):
            try:
                h = winproc.open_identity(owner["pid"], owner["start_time"])
            except OSError:
                h = None
            if h is not None:
                self.owner = h
                self.waiter.watch_process(h)

    def wait(self, timeout: float) -> None:
        # Without an event of our own the bounded timeout is the only wake-up.
        self.waiter.wait(timeout if self.path else min(timeout, 0.05))

    def close(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = ""
        self.waiter.close()
        if self.owner:
            from . import winproc

            winproc.close_handle(self.owner)
            self.owner = 0


def check_id(run_id: str) -> None:
    if not isinstance(run_id, str) or not ID_RE.match(run_id):
        raise ValueError(f"invalid run id {run_id!r}: use letters, digits, '.', '_' or '-' (at most 100)")


def claim_guard(st: StateDir) -> winfs.OwnerLock:
    """runs\\.claim.lock, held while claiming; waits at most CLAIM_WAIT_S."""
    path = os.path.join(st.runs, ".claim.lock")
    deadline = time.monotonic() + CLAIM_WAIT_S
    pause = 0.001
    while True:
        try:
            lock = winfs.OwnerLock.acquire(path)
        except OSError as e:
            raise StateDirError(path, e.strerror or str(e), e.errno or errno.EIO) from None
        if lock is not None:
            return lock
        if time.monotonic() > deadline:
            raise StateDirError(path, f"another claim held it for {CLAIM_WAIT_S:.0f} s", errno.EAGAIN)
        # A bounded retry: LockFileEx that waits could wedge every later
        # run behind a stopped process holding it.
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def move_aside(st: StateDir, run_id: str, run_uid: str | None) -> None:
    dst = os.path.join(st.runs, f".ended-{run_id}-{run_uid or os.urandom(4).hex()}")
    if os.path.lexists(dst):
        dst += f"-{os.urandom(4).hex()}"
    try:
        winfs.replace(os.path.join(st.runs, run_id), dst)
    except OSError as e:
        raise RunConflict(f"run id {run_id!r}: its ended run's directory could not be moved aside: {e}") from None


def remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
