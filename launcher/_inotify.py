"""A small per-process pool of inotify instances for run owners.

Closing an inotify instance that held a watch waits in
`fsnotify_destroy_group()` for the mark reaper and an SRCU grace period
(fs/notify/mark.c): 4-16 ms a close measured here, more than the rest of a
short run. Each run needs one instance for its cancel inbox, so the owner
gives it back here instead: its watch is removed (the mark is then freed
asynchronously) and its queue drained, and the next run adds its own watch.

The pool is bounded (`MAX_IDLE` instances); beyond that an instance is closed.
A forked child never uses its parent's instances (they share the kernel
object): they are dropped in the child at fork.
"""
from __future__ import annotations

import os
import threading

MAX_IDLE = 4

_lock = threading.Lock()
_idle: list[int] = []


def take() -> int:
    """An inotify fd with no watches (pooled or new), or -errno."""
    with _lock:
        if _idle:
            return _idle.pop()
    from ._native import lib

    return int(lib.ct_inotify_open())


def give(fd: int, wd: int) -> None:
    """Return `fd` after removing its watch `wd` (-1: none was added)."""
    from ._native import lib

    if wd >= 0 and lib.ct_inotify_unwatch(fd, wd) < 0:
        os.close(fd)        # an unknown watch state: do not hand it on
        return
    _drain(fd)
    with _lock:
        if len(_idle) < MAX_IDLE:
            _idle.append(fd)
            return
    os.close(fd)


def _drain(fd: int) -> None:
    # Old events (and the IN_IGNORED of the removed watch) would only cause
    # one spurious wake-up of the next owner; drop them anyway.
    try:
        while os.read(fd, 65536):
            pass
    except (BlockingIOError, InterruptedError):
        pass


def idle() -> int:
    """How many instances the pool holds (for leak accounting)."""
    return len(_idle)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    for fd in _idle:
        try:
            os.close(fd)    # the parent still holds the instance: a cheap close
        except OSError:
            pass
    _idle.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
