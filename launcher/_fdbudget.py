"""Descriptors a process's runs can count on, at any RLIMIT_NOFILE.

Every run a process started must reach a final record, whatever limit the
process hits: so what a stop needs is reserved before a spawn is accepted.

- A reserve of `RESERVE` descriptors (duplicates of one /dev/null) is held
  for the process. While the process is near its limit, every owner turn,
  cancel request and final record runs with the reserve released
  (`released()`), so the descriptors it opens for a moment (the inbox, an
  acknowledgement, a record's temporary file, a cgroup file, a /proc read,
  a module imported on first use) are there; then it is taken back.
- A spawn is refused before anything starts (`check_spawn`: a
  `ResourceExhausted`, a LauncherError with errno EMFILE) when the
  descriptors in use, what a spawn opens for a moment (`SPAWN_PEAK`) and
  the reserve do not fit under the soft limit. The library never raises a
  caller's limit (select() breaks above 1024); `contain run`, which owns
  its process, may.

How many runs a limit allows: about (limit - 64) / the descriptors a live
run holds (1 for a run behind the wall, docs/api.md).
"""
from __future__ import annotations

import errno
import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

from ._errors import LauncherError, ResourceExhausted

RESERVE = 24        # a stop and its final record at once, with room for an import and a /proc scan
SPAWN_PEAK = 24     # a walled spawn's transient descriptors (pipes, socketpair, memfds, cgroup and /proc files)


class _Reserve:
    def __init__(self) -> None:
        self._mu = threading.RLock()
        self._held: list[int] = []
        self.near = False           # the process came near its limit: turns run with the reserve released
        self._depth = 0

    def fill(self) -> None:
        with self._mu:
            if self._depth:
                return
            try:
                while len(self._held) < RESERVE:
                    self._held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                self.near = True    # could not take it back: someone took the room

    def _full(self) -> bool:
        """Whether the process has room for one more descriptor (a probe)."""
        try:
            os.close(os.dup(2) if not self._held else os.dup(self._held[0]))
        except OSError as e:
            return e.errno != errno.EMFILE
        return True

    def missing(self) -> int:
        return RESERVE - len(self._held)

    @contextmanager
    def released(self) -> Iterator[None]:
        """Give the reserve back to the process for the block (only while
        the process is near its limit: elsewhere it is a no-op)."""
        if not self.near and not self._full():
            self.near = True
        if not self.near:
            yield
            return
        with self._mu:
            self._depth += 1
            held, self._held = self._held, []
            for fd in held:
                os.close(fd)
        try:
            yield
        finally:
            with self._mu:
                self._depth -= 1
            self.fill()


reserve = _Reserve()


def in_use() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1          # less the listing's own
    except OSError:
        return -1


_inflight = 0                   # spawns under way in other threads: each may still open SPAWN_PEAK
_inflight_mu = threading.Lock()


@contextmanager
def spawning() -> Iterator[None]:
    """Around one spawn (claim, container, clone, first records): refused
    before anything starts when this process cannot afford it, counting the
    spawns under way in other threads (each may still open its peak), and
    any descriptor exhaustion inside it said as ResourceExhausted, never a
    bare OSError."""
    global _inflight
    preload()
    with _inflight_mu:
        check_spawn(_inflight)
        _inflight += 1
    try:
        yield
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE) and not isinstance(e, LauncherError):
            raise ResourceExhausted(f"descriptors ran out during the spawn: {e}", e.errno) from e
        raise
    finally:
        with _inflight_mu:
            _inflight -= 1


# The last count of /proc/self/fd: (soft limit, room left then, spawns since).
# Listing /proc/self/fd costs time in proportion to the descriptors open
# (about 2 ms at 1,200), so a process with thousands of runs would pay it
# for each spawn: the count is taken again only once the spawns since could
# have used up the room it found, at an allowance of _PER_SPAWN each (what a
# spawn leaves open, with a margin for the caller's own files). A caller
# that opens more than that between spawns still meets no lie: the spawn
# that runs out says ResourceExhausted and undoes itself (`spawning()`).
_PER_SPAWN = 64
_last: list[int] = [-1, 0, 0]


def check_spawn(others: int = 0) -> None:
    """Refuse a spawn that would leave this process's runs without what
    their stops need (`others`: spawns under way besides this one). Raises
    ResourceExhausted."""
    if sys.platform == "win32":
        return
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return
    last_soft, last_room, since = _last
    if last_soft == soft and not reserve.near and \
            last_room - (since + others + 1) * _PER_SPAWN >= 4 * SPAWN_PEAK:
        _last[2] = since + 1
        return
    reserve.fill()
    used = in_use()
    if used < 0:
        return                       # no /proc to count with: the spawn finds out for itself
    free = soft - used - reserve.missing() - others * SPAWN_PEAK
    _last[:] = [soft, free, 1]
    if free < 4 * SPAWN_PEAK:
        reserve.near = True
    if free < SPAWN_PEAK:
        raise ResourceExhausted(f"this process has {used} of its {soft} descriptors open (RLIMIT_NOFILE) and "
                                f"{others} other spawn(s) under way: a spawn needs {SPAWN_PEAK} more for a moment, "
                                f"and {RESERVE} stay reserved so that every run it started can still be stopped "
                                "and recorded")


_preloaded = False


def preload() -> None:
    """Import now what a stop and a final record import on first use: at
    the descriptor limit, an import opens files too (its .py and .pyc), and
    a caller's thread may have taken the room the reserve gave back."""
    global _preloaded
    if _preloaded or sys.platform == "win32":
        return
    from . import _accounting, _locks, _stats, _summary  # noqa: F401
    from ._platform import none, subreaper  # noqa: F401
    _preloaded = True
