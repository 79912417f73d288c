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
from .._names import valid_id
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

    def resume_owner(self) -> int | None:
        """(_cancel.Watcher resumes a stopped owner: Windows has no job-control stop.)"""
        return None

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
    if not valid_id(run_id):
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


def collect(st: StateDir, make: Any, *, older_than: float | None = None, keep: int | None = None,
            prune_to: int | None = None) -> Any:
    """`contain gc` on Windows (and, with `prune_to`, the retention bound a
    claim applies): remove ended runs (a terminal record and no owner, or a
    directory moved aside) except the newest `keep` and those that ended
    less than `older_than` seconds ago; with `prune_to`, only the oldest
    until at most that many run directories are left. `make(path)` is the
    RunDir class. Each is renamed to `.gc-*` under the claim guard, then
    removed. Live, orphaned and unreadable runs are never removed."""
    from .._gc import CLAIM_STALE_S, GcResult
    from .._runfiles import TERMINAL, iso_epoch

    now = time.time()
    res = GcResult()
    ended: list[tuple[float, str]] = []
    names = [e.name for e in os.scandir(st.runs) if e.name != ".claim.lock"]
    for n in names:
        path = os.path.join(st.runs, n)
        try:
            mtime = os.lstat(path).st_mtime
        except OSError:
            continue
        if n.startswith((".ended-", ".gc-")) or (n.startswith(".claim-") and now - mtime > CLAIM_STALE_S):
            if not winfs.lock_held(os.path.join(path, "owner.lock")):
                ended.append((0.0, n))     # the oldest of all: nothing runs in them
            continue
        if not valid_id(n):
            continue
        d = make(path)
        if d.owner_alive():
            res.live += 1
            continue
        rec = d.load_record()
        if isinstance(rec, dict) and rec.get("state") in TERMINAL:
            ended.append((iso_epoch((rec.get("timings") or {}).get("ended_at")) or mtime, n))
        elif rec is None and d.load_run() is None and now - mtime > CLAIM_STALE_S:
            ended.append((mtime, n))        # claimed, never described, owner gone: nothing ever ran
        elif isinstance(rec, dict) or rec is None:
            res.live += 1                   # RUNNING or UNCONFIRMED with no owner: orphaned, never removed
        else:
            res.unreadable += 1
    ended.sort(reverse=True)
    if prune_to is not None:
        runs = sum(1 for n in names if valid_id(n))
        chosen = [n for _t, n in ended if n.startswith(".")]
        chosen += [n for _t, n in reversed(ended) if not n.startswith(".")][:max(0, runs - prune_to)]
    else:
        chosen = []
        for i, (t, n) in enumerate(x for x in ended if not x[1].startswith(".")):
            if (keep is not None and i < keep) or (older_than is not None and now - t < older_than):
                res.kept += 1
            else:
                chosen.append(n)
        chosen += [n for _t, n in ended if n.startswith(".")]
    guard = claim_guard(st) if prune_to is None else None   # a claim holds it already
    try:
        for n in chosen:
            src = os.path.join(st.runs, n)
            dst = src if n.startswith(".gc-") else os.path.join(st.runs, f".gc-{n.lstrip('.')}-{os.urandom(3).hex()}")
            try:
                if dst != src:
                    winfs.replace(src, dst)
            except OSError:
                res.failed.append(n)
                continue
            remove_tree(dst)
            if os.path.lexists(dst):
                res.failed.append(n)
            elif not n.startswith("."):
                res.removed.append(n)
    finally:
        if guard is not None:
            guard.release()
    return res
