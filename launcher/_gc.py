"""Retention: ended runs' directories are removed, never a live one.

`contain gc [--older-than DURATION] [--keep N]` removes ended runs; the
automatic bound (a claim that finds more than KEEP_RUNS + PRUNE_SLACK run
directories, _layout._maybe_prune) removes the oldest ended ones until
KEEP_RUNS are left. Both count `runs/<id>/` and the `runs/.ended-*` that id
reuse moved aside.

Ended means: no process holds the owner lock, and the record is readable and
terminal (REAPED, EXITED, BREACHED), and, for REAPED or EXITED, nothing the
run's tag names is alive (_tags.still_alive: else a member that can write
its run directory wrote that record); for BREACHED, no escaper the record
names is alive by its identity (_identity.escapers_alive): the record is
the only one of a breach, and is kept while the breach lives on (counted
with the live runs). A run that is live, orphaned (record
RUNNING or UNCONFIRMED, nobody owning it: `contain cancel` adopts it), or
whose files cannot be read, is never removed: nothing proves it over. A
moved-aside `.ended-*` directory was not live when it was moved, and is
removed unless an owner holds it now; a `.claim-*` directory is a claim that
died before its run appeared, removed a minute after.

A run is made to disappear by a rename to `runs/.gc-<hex>` under the claim
lock, after its state is read again under that lock (so an id reused in the
meantime is never touched), and only then removed, file by file, without
following any link (_safefs.remove_tree). A `.gc-*` left by a crash is removed
by the next pass.
"""
from __future__ import annotations

import errno
import os
import sys
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from . import _safefs as F
from ._ofdlock import lock_held
from ._names import valid_id
from ._runfiles import MAX_RECORD, TERMINAL, iso_epoch, loads, parse_record
from ._safefs import UnsafePath
from ._statedir import PRUNE_SLACK, StateDir, claim_lock, claim_unlock, keep_runs

CLAIM_STALE_S = 60.0
# Entries re-checked and renamed per hold of the claim lock: a big gc never
# keeps `contain run` waiting for long.
BATCH = 256


class Entry:
    __slots__ = ("name", "kind", "mtime", "status", "ended_at", "stray_uid")

    def __init__(self, name: str, kind: str, mtime: float) -> None:
        self.name = name
        self.kind = kind          # run, ended (moved aside), claim, gc
        self.mtime = mtime
        self.status = ""          # ended, live, unreadable (after examine)
        self.ended_at = mtime
        self.stray_uid: str | None = None     # never described: its cgroups go too (_strays.remove_strays)

    def __repr__(self) -> str:
        return f"Entry({self.name!r}, {self.kind}, {self.status})"


class GcResult:
    """What a pass did: names removed, and how many runs it left and why."""

    __slots__ = ("removed", "kept", "live", "unreadable", "failed")

    def __init__(self) -> None:
        self.removed: list[str] = []
        self.kept = 0
        self.live = 0
        self.unreadable = 0
        self.failed: list[str] = []

    def to_dict(self) -> dict[str, Any]:
        return {"removed": self.removed, "kept": self.kept, "live": self.live, "unreadable": self.unreadable,
                "failed": self.failed}


def _kind(name: str) -> str | None:
    if name.startswith(".ended-"):
        return "ended"
    if name.startswith(".claim-"):
        return "claim"
    if name.startswith(".gc-"):
        return "gc"
    if valid_id(name):
        return "run"
    return None     # .claim.lock and anything else: not ours to remove


def entries(st: StateDir) -> list[Entry]:
    """Every directory in runs/ that retention may consider."""
    out = []
    with os.scandir(st.runs_fd) as it:
        for e in it:
            kind = _kind(e.name)
            if kind is None:
                continue
            try:
                if not e.is_dir(follow_symlinks=False):
                    continue
                mtime = e.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
            out.append(Entry(e.name, kind, mtime))
    return out


def examine(st: StateDir, e: Entry, now: float) -> str:
    """Set and return e.status: ended, live or unreadable."""
    e.status = _status(st, e, now)
    return e.status


def _status(st: StateDir, e: Entry, now: float) -> str:
    if e.kind == "gc":
        return "ended"
    path = os.path.join(st.path, "runs", e.name)
    try:
        fd = F.open_private_dir(st.runs_fd, e.name, path, owners=st.owners)
    except (OSError, UnsafePath):
        return "unreadable"
    try:
        try:
            lock = os.open("owner.lock", F.O_READ, dir_fd=fd)
        except FileNotFoundError:
            lock = -1
        except OSError:
            return "unreadable"
        if lock >= 0:
            try:
                if lock_held(lock):
                    return "live"
            except OSError:
                return "unreadable"
            finally:
                os.close(lock)
        if e.kind == "claim":
            return "ended" if now - e.mtime > CLAIM_STALE_S else "live"
        if e.kind == "ended":
            return "ended"
        try:
            data = F.read_file(fd, "record.json", os.path.join(path, "record.json"), MAX_RECORD)
        except FileNotFoundError:
            try:
                os.stat("run.json", dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                # Claimed, never described, owner gone: nothing ever ran,
                # but the cgroups it made before it was killed may be left.
                # A run appears with its owner lock held (RunDir.claim): a
                # free one means its supervisor is gone, not still starting.
                if lock < 0 and now - e.mtime <= CLAIM_STALE_S:
                    return "live"
                from . import _tags                     # rare: not loaded for every claim's prune
                from ._strays import claimed_uid

                if _tags.read(path, _tags.RUN_TAG).value is not None:
                    return "live"      # described once (its run.json removed): `contain cancel` adopts it from the tag

                e.stray_uid = claimed_uid(fd)
                return "ended"
            except OSError:
                return "unreadable"
            return "live"      # an orphan before its first record: `contain cancel` adopts it
        except (OSError, UnsafePath):
            return "unreadable"
        try:
            rec = parse_record(loads(data, "record.json"), e.name)
        except ValueError:
            return "unreadable"
        if rec["state"] not in TERMINAL:
            return "live"
        if rec["state"] == "BREACHED":
            from ._identity import escapers_alive

            if escapers_alive(rec):
                return "live"     # the breach lives on, and this record is the only one of it
        else:
            from ._tags import still_alive

            if still_alive(path) is not None:
                return "live"     # the record is not its owner's: a live orphan (_views.fill_view)
        ended = iso_epoch((rec.get("timings") or {}).get("ended_at"))
        if ended is not None:
            e.ended_at = ended
        return "ended"
    finally:
        os.close(fd)


def _drop_strays(e: Entry) -> bool:
    """Remove the cgroups of a run that was never described (its
    supervisor killed between the claim and its first run.json). False when
    one holds a process: then it did not "never run", and it is kept."""
    if e.kind != "run" or e.stray_uid is None or sys.platform == "win32":
        return True                     # (a Job Object dies with its last handle)
    from ._strays import remove_strays

    return remove_strays(e.name, e.stray_uid) is None


def _set_aside(st: StateDir, e: Entry) -> str | None:
    """Rename an ended run out of sight (`.gc-<hex>`, which no reader lists)
    before it is removed; the name it now has, or None if it could not be."""
    if e.kind == "gc":
        return e.name                     # set aside already (by a pass that crashed)
    tmp = f".gc-{os.urandom(6).hex()}"
    try:
        os.rename(e.name, tmp, src_dir_fd=st.runs_fd, dst_dir_fd=st.runs_fd)
    except OSError:
        return None
    return tmp


def _remove(st: StateDir, chosen: list[Entry], now: float, result: GcResult) -> None:
    """Re-check each chosen entry under the claim lock, rename the ones still
    ended out of sight, then remove them."""
    doomed: list[tuple[Entry, str]] = []
    for i in range(0, len(chosen), BATCH):
        guard = claim_lock(st)
        try:
            for e in chosen[i:i + BATCH]:
                if examine(st, e, now) != "ended" or not _drop_strays(e):
                    if e.status != "ended":
                        result.live += e.status == "live"
                        result.unreadable += e.status != "live"
                    else:
                        result.live += 1          # its cgroup holds a process: not over
                    continue
                tmp = _set_aside(st, e)
                if tmp is None:
                    result.failed.append(e.name)
                    continue
                doomed.append((e, tmp))
        finally:
            claim_unlock(guard)
    for e, tmp in doomed:
        try:
            F.remove_tree(st.runs_fd, tmp)
        except OSError as err:
            if err.errno != errno.ENOENT:
                result.failed.append(e.name)
                continue
        if e.kind in ("run", "ended"):
            result.removed.append(e.name)


def gc(st: StateDir, *, older_than: float | None = None, keep: int | None = None,
       now: float | None = None) -> GcResult:
    """`contain gc`: remove every ended run, except the newest `keep` of them
    and those that ended less than `older_than` seconds ago."""
    now = time.time() if now is None else now
    result = GcResult()
    ended: list[Entry] = []
    chosen: list[Entry] = []
    for e in entries(st):
        status = examine(st, e, now)
        if e.kind in ("claim", "gc"):
            if status == "ended":
                chosen.append(e)
            continue
        if status == "ended":
            ended.append(e)
        elif status == "live":
            result.live += 1
        else:
            result.unreadable += 1
    ended.sort(key=lambda x: x.ended_at, reverse=True)
    for i, e in enumerate(ended):
        if keep is not None and i < keep:
            result.kept += 1
        elif older_than is not None and now - e.ended_at < older_than:
            result.kept += 1
        else:
            chosen.append(e)
    _remove(st, chosen, now, result)
    return result


def auto_prune(st: StateDir, keep: int, count: int | None) -> GcResult:
    """The automatic bound (called by a claim, which holds the claim lock):
    remove the oldest ended runs until at most `keep` run directories are
    left. `count` is how many there are (from the link count), if known.
    Looks at the oldest first and stops once enough were removed, so a pass
    reads only the records it needs."""
    now = time.time()
    result = GcResult()
    all_entries = entries(st)
    excess = len(all_entries) - keep
    if excess <= 0:
        return result
    all_entries.sort(key=lambda x: x.mtime)
    doomed: list[tuple[Entry, str]] = []
    for e in all_entries:
        if len(doomed) >= excess:
            break
        if examine(st, e, now) != "ended" or not _drop_strays(e):
            continue
        tmp = _set_aside(st, e)
        if tmp is not None:
            doomed.append((e, tmp))
    for e, tmp in doomed:
        try:
            F.remove_tree(st.runs_fd, tmp)
            if e.kind in ("run", "ended"):
                result.removed.append(e.name)
        except OSError:
            result.failed.append(e.name)
    return result


def parse_count(text: str) -> int:
    """`--keep N`: an integer >= 0. Raises ValueError."""
    if not (text.isascii() and text.isdigit()) or len(text) > 9:
        raise ValueError(f"not a count (an integer >= 0): {text!r}")
    return int(text)


def parse_duration(text: str) -> float:
    """`90`, `90s`, `15m`, `2h`, `7d`, `2w` (or combined: `1d12h`) as seconds.
    Raises ValueError with the message the CLI shows."""
    import re

    t = text.strip().lower()
    if not t:
        raise ValueError("empty duration")
    try:
        v = float(t)
    except ValueError:
        v = None
    if v is None:
        parts = re.fullmatch(r"(?:(\d+(?:\.\d+)?)([smhdw]))+", t)
        if parts is None:
            raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 15m, 2h, 7d, 2w)")
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
        v = sum(float(n) * unit[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smhdw])", t))
    if v != v or v < 0 or v == float("inf"):
        raise ValueError(f"a duration must be finite and >= 0: {text!r}")
    return v


def move_aside(st: StateDir, run_id: str, uid: str | None) -> None:
    """Rename an ended run's directory (or whatever is in its place) out of
    the way of a new claim of its id, keeping it for `gc`: `.ended-<id>-<uid>`.
    Raises RunConflict when no free name is found, OSError."""
    from ._errors import RunConflict

    uid = uid or os.urandom(4).hex()
    for _ in range(4):
        try:
            os.rename(run_id, f".ended-{run_id}-{uid}", src_dir_fd=st.runs_fd, dst_dir_fd=st.runs_fd)
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                raise
            uid = f"{uid}-{os.urandom(2).hex()}"
    raise RunConflict(f"run id {run_id!r}: its ended directory cannot be moved aside")


# After a pass that could not get down to the bound (what is left is live):
# (st_dev, st_ino of runs/, its link count then, monotonic time before which
# no claim looks again unless PRUNE_SLACK more directories appeared).
_fruitless: tuple[int, int, int, float] | None = None
PRUNE_BACKOFF_S = 1.0        # at least; and at least 20 times as long as that pass took


def maybe_prune(st: StateDir) -> None:
    """The automatic retention bound, checked at every claim (which holds
    the claim lock) for the cost of one fstat: a directory's link count is
    2 + its subdirectories on tmpfs, ext4 and xfs (btrfs says 1: there, one
    claim in 64 looks). Retention never fails a run.

    A pass examines the oldest directories until it has found enough ended
    ones: with more than the bound of live runs (a process holding
    thousands), it examines every one of them and removes nothing, and
    each claim did that again (quadratic in the runs). After such a pass
    the claims of this process look again only once PRUNE_SLACK more
    directories appeared or PRUNE_BACKOFF_S (at least twenty times that
    pass's own time) went by."""
    global _fruitless
    keep = keep_runs()
    if keep <= 0:
        return
    try:
        sb = os.fstat(st.runs_fd)
    except OSError:
        return
    nlink = sb.st_nlink
    if nlink >= 2:
        if nlink - 2 <= keep + PRUNE_SLACK:
            return
        f = _fruitless
        if (f is not None and (f[0], f[1]) == (sb.st_dev, sb.st_ino) and nlink < f[2] + PRUNE_SLACK
                and time.monotonic() < f[3]):
            return
    elif os.urandom(1)[0] >= 4:
        return
    t0 = time.monotonic()
    try:
        auto_prune(st, keep, nlink - 2 if nlink >= 2 else None)
    except (OSError, ValueError):
        pass
    if nlink < 2:
        return
    try:
        left = os.fstat(st.runs_fd).st_nlink - 2
    except OSError:
        return
    t1 = time.monotonic()
    _fruitless = ((sb.st_dev, sb.st_ino, left + 2, t1 + max(PRUNE_BACKOFF_S, 20 * (t1 - t0)))
                  if left > keep + PRUNE_SLACK else None)
