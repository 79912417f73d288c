"""One owner loop for every Worker of a process (Linux).

A `Worker` used to be a thread running its run's owner loop (`Run.supervise`):
a thread and a wake-up pipe per live run, so a process with a thousand runs
had a thousand threads. Here one daemon thread owns them all: it waits on
one epoll set for every run's inputs (`Run.sources()`: the worker's pidfd,
the wall's init, `cgroup.events`, the inbox's wake-up FIFO), and turns only
the runs that have something to read, a deadline due, or a wake-up from
another thread (a `cancel()`). The stop sequence, the state table, the
evidence and the record are the run's own, exactly as under `supervise()`:
only who waits, and on what, changes.

Some facts about epoll that the loop follows from:
- A descriptor is in the set by its open file description, listed by
  number. Closing the last reference removes it from the set by itself; a
  number closed and opened again is another file, which must be added
  again. So after each turn of a run its sources are compared with what is
  registered for it, and the difference applied at once, in this thread:
  every descriptor of a run is opened and closed by its owner's turns (or
  before the run is handed over), so no other run's registration can be
  taken for it in between.
- `poll()`'s POLLIN, POLLPRI and POLLERR are EPOLLIN, EPOLLPRI and EPOLLERR
  (the same bits, include/uapi/linux/eventpoll.h), so `sources()` serve as
  they are. `cgroup.events` signals a change with EPOLLPRI (POLLIN is
  always ready there, KERNEL-NOTES.md).
- Level-triggered: an input a turn did not consume wakes the loop again at
  once. The run's `drain()` consumes the wake-ups that need it (the FIFO,
  kernfs's POLLPRI), as under `supervise()`.
- Wake-ups from other threads (`cancel()`, `abandon()`) go through one
  pipe for the whole process, with the run marked pending under a lock:
  a run needs no pipe of its own.
- A run's cgroup.events is watched through the same inotify instance (a
  change of `populated` is IN_MODIFY, cgroup-v2.rst; systemd watches all
  its units' so): the container then closes its own descriptor of it and
  opens the file again, through the directory verified as the run's, only
  when it reads it (linux.Container.watch_events).
- A cancel from another process (`contain cancel`) is a line appended to
  the run's `cancellations/requests.ndjson`: one inotify instance watches
  every run's `cancellations/` (IN_MODIFY and friends), by the directory's
  inode (the watch is added through /proc/self/fd of the verified
  directory, so it is the directory the owner holds, not whatever the path
  names later). A watch is not a descriptor, and removing it before the
  instance is closed never waits for an SRCU grace period (cgroup.c). A
  worker that can write its run directory may replace `cancellations/`:
  the watch then reports its own move or removal (IN_MOVE_SELF,
  IN_DELETE_SELF, IN_IGNORED) and the new directory is watched; a guard
  deadline (Wakeups.guard_s, 60 s when watched) reads the inbox anyway.
  Deadlines are kept in a heap: a pass of the loop turns the runs that have
  something to read, were woken, or are due, never all of them.

A failure inside one run's turn is that run's (`_ending.abandon`: stopped
as a cancel of contain's own and recorded), never the loop's. After
`os.fork()` the child has no owner thread: the parent's runs are the
parent's, and the child starts its own reactor when it spawns.
"""
from __future__ import annotations

import heapq
import itertools
import os
import select
import struct
import threading
import time
from typing import Any, Callable

from . import _ending
from . import _state as S
from ._fdbudget import reserve

_MAX_WAIT_S = 3600.0


_IN_WATCH = 0x2 | 0x8 | 0x80 | 0x100     # IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
_IN_SELF = 0x400 | 0x800                 # IN_DELETE_SELF | IN_MOVE_SELF: cancellations/ itself went
_IN_IGNORED = 0x8000                     # the watch is gone (its inode was removed, or unwatched)
_IN_Q_OVERFLOW = 0x4000                  # events were dropped (wd -1): any run may have missed one


_IN_MODIFY = 0x2                         # cgroup.events: `populated` (or `frozen`) changed


class _Entry:
    __slots__ = ("run", "fds", "done", "due", "wd", "events_wd")

    def __init__(self, run: Any, done: Callable[[BaseException | None], None]) -> None:
        self.run = run
        self.fds: dict[int, int] = {}      # fd -> epoll events registered for this run
        self.done = done
        self.due = 0.0
        self.wd = -1                       # the inotify watch on its cancellations/
        self.events_wd = -1                # the inotify watch on its cgroup.events


class Reactor:
    def __init__(self) -> None:
        from ._native import lib

        self._lib = lib
        self._ep = select.epoll()
        self._r, self._w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._ep.register(self._r, select.EPOLLIN)
        self._in = lib.ct_inotify_open()           # -errno: every inbox is then read on its guard deadline
        if self._in >= 0:
            self._ep.register(self._in, select.EPOLLIN)
        self._by_wd: dict[int, _Entry] = {}
        self._mu = threading.Lock()
        self._entries: dict[int, _Entry] = {}      # id(run) -> entry, every run this loop owns
        self._by_fd: dict[int, _Entry] = {}
        self._incoming: list[_Entry] = []          # handed over, not yet seen by the loop
        self._pending: set[int] = set()            # id(run) woken by another thread
        # (due, n, entry) for every run's deadline: a loop pass looks at the
        # runs that are due, not at all of them (a thousand runs made every
        # wake-up, and so every spawn, cost a pass over all). Entries whose
        # due changed since stay in the heap, and are skipped when popped.
        self._deadlines: list[tuple[float, int, _Entry]] = []
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="contain-reactor", daemon=True)
        self._thread.start()

    # -- other threads -------------------------------------------------------

    def own(self, run: Any, done: Callable[[BaseException | None], None]) -> None:
        """Take over the owner loop of a started run. `done(error)` is called
        from the loop's thread once the run's last record is written (or its
        owner loop failed: then with the error)."""
        if run.wakeups is not None:
            run.wakeups.waker = lambda: self.wake(run)
        with self._mu:
            self._incoming.append(_Entry(run, done))
        self._poke()

    def wake(self, run: Any) -> None:
        """Make the loop turn `run` now (thread-safe; signal-safe enough:
        a set insert and one write)."""
        with self._mu:
            self._pending.add(id(run))
        self._poke()

    def wake_all(self, runs: list[Any]) -> None:
        """`wake()` for many runs at once: one wake-up of the loop, whose
        next pass turns them all (a bulk cancel's intents are all written
        first; then every signal goes out before any container is waited
        for)."""
        with self._mu:
            self._pending.update(id(r) for r in runs)
        self._poke()

    def _poke(self) -> None:
        try:
            os.write(self._w, b"!")
        except BlockingIOError:
            pass         # full: the loop is due to wake anyway

    # -- the loop --------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._mu:
                incoming, self._incoming = self._incoming, []
            for e in incoming:
                self._entries[id(e.run)] = e
                self._watch_inbox(e)
                self._watch_events(e)
                self._turn(e, [])            # the first turn: before any wait (as supervise())
            timeout = self._timeout()
            try:
                events = self._ep.poll(timeout)
            except InterruptedError:
                continue
            ready: dict[int, list[int]] = {}
            moved: list[_Entry] = []            # runs whose cancellations/ was moved or removed
            for fd, _ev in events:
                if fd == self._r:
                    try:
                        while os.read(self._r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                if fd == self._in:
                    for wd, mask in self._inbox_events():
                        if wd == -1 or mask & _IN_Q_OVERFLOW:
                            # The queue overflowed (a worker can flood its own
                            # cancellations/): every run looks at its inbox and
                            # its cgroup again, as inotify(7) advises.
                            for key in self._entries:
                                ready.setdefault(key, [])
                            continue
                        owner = self._by_wd.get(wd)
                        if owner is not None:
                            ready.setdefault(id(owner.run), [])
                            if wd == owner.wd and mask & (_IN_SELF | _IN_IGNORED):
                                moved.append(owner)
                    continue
                owner = self._by_fd.get(fd)
                if owner is not None:
                    ready.setdefault(id(owner.run), []).append(fd)
            for e in moved:
                self._rewatch_inbox(e)        # the new one, which requesters write to now
            with self._mu:
                woken, self._pending = self._pending, set()
            now = time.monotonic()
            due: dict[int, _Entry] = {}
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                t, _n, e = heapq.heappop(heap)
                if t == e.due and self._entries.get(id(e.run)) is e:
                    e.due = -1.0              # popped: the turn's deadline goes in anew, even the same
                    due[id(e.run)] = e
            for key in set(ready) | woken | set(due):
                owner = due.get(key) or self._entries.get(key)
                if owner is not None:
                    self._turn(owner, ready.get(key, []))

    def _compact(self) -> None:
        """One entry per run again: a busy run moves its deadline on every
        turn, and the entries it left behind would wait for their time."""
        self._deadlines = [(e.due, next(self._seq), e) for e in self._entries.values() if e.due >= 0]
        heapq.heapify(self._deadlines)

    def _timeout(self) -> float:
        heap = self._deadlines
        while heap and (heap[0][0] != heap[0][2].due or self._entries.get(id(heap[0][2].run)) is not heap[0][2]):
            heapq.heappop(heap)            # stale: the run's deadline moved, or it is gone
        if not heap:
            return -1
        return min(max(0.0, heap[0][0] - time.monotonic()), _MAX_WAIT_S)

    def _turn(self, e: _Entry, ready: list[int]) -> None:
        with reserve.released():         # near the descriptor limit: the stop's room (_fdbudget.py)
            self._turn_now(e, ready)

    def _turn_now(self, e: _Entry, ready: list[int]) -> None:
        # What one turn writes (an acknowledgement, the record, a final
        # record with its settled acknowledgements) wakes the run's waiters
        # once, at its end (RunDir.hold_pokes): in a final turn that is
        # after the owner lock is released, which is when they believe it,
        # and before the run is said done (the poke's descriptors closed).
        run = e.run
        layout = run.layout
        if layout is not None:
            layout.hold_pokes()
        try:
            going, error = self._work(e, ready)
        finally:
            if layout is not None:
                layout.release_pokes()
        if going:
            return
        self._drop(e)
        try:
            e.done(error)
        except BaseException:
            pass

    def _work(self, e: _Entry, ready: list[int]) -> tuple[bool, BaseException | None]:
        """One turn of the run: (whether it is still owned, the error that ended its ownership)."""
        run = e.run
        try:
            run.drain(ready)
            run.turn()
            if run.owning():
                due = run.next_deadline()
                if due != e.due:
                    e.due = due
                    heapq.heappush(self._deadlines, (due, next(self._seq), e))
                    if len(self._deadlines) > 2 * len(self._entries) + 64:
                        self._compact()
                self._sync(e)
                return True, None
            if run.snap.terminal or run.snap.phase == S.Phase.UNCONFIRMED:
                run.finish()
            return False, None
        except BaseException as err:        # that run's failure, never the loop's
            try:
                _ending.abandon(run, err)
            except BaseException:
                pass
            return False, err

    def _sync(self, e: _Entry) -> None:
        """Register what the run waits on now, unregister what it no longer does."""
        want = {fd: ev for fd, ev in e.run.sources() if fd >= 0}
        for fd in [fd for fd in e.fds if fd not in want or want[fd] != e.fds[fd]]:
            self._unregister(e, fd)
        for fd, ev in want.items():
            if fd in e.fds:
                continue
            try:
                self._ep.register(fd, ev)
            except FileExistsError:
                self._ep.modify(fd, ev)
            except OSError:
                continue         # closed meanwhile: its deadline still brings the run back
            e.fds[fd] = ev
            self._by_fd[fd] = e

    def _unregister(self, e: _Entry, fd: int) -> None:
        del e.fds[fd]
        if self._by_fd.get(fd) is e:
            del self._by_fd[fd]
            try:
                self._ep.unregister(fd)
            except OSError:
                pass             # closed already: the kernel dropped it from the set

    def _watch_inbox(self, e: _Entry) -> None:
        wakeups = e.run.wakeups
        if self._in < 0 or e.run.layout is None or wakeups is None or wakeups.inbox_fd >= 0:
            return
        try:
            cfd = e.run.layout.cancellations_fd(write=True, create=True)
        except OSError:
            return                     # read on the guard deadline instead
        try:
            wd = self._lib.ct_inotify_watch(self._in, f"/proc/self/fd/{cfd}".encode(), _IN_WATCH | _IN_SELF)
        finally:
            os.close(cfd)
        if wd >= 0:
            e.wd = wd
            self._by_wd[wd] = e
            wakeups.watched = True

    def _rewatch_inbox(self, e: _Entry) -> None:
        if e.wd < 0 or self._entries.get(id(e.run)) is not e:
            return
        self._by_wd.pop(e.wd, None)
        self._lib.ct_inotify_unwatch(self._in, e.wd)     # EINVAL when the kernel dropped it: fine
        e.wd = -1
        if e.run.wakeups is not None:
            e.run.wakeups.watched = False       # the guard timer's short period until watched again
        self._watch_inbox(e)

    def _watch_events(self, e: _Entry) -> None:
        """The run's cgroup.events through the one inotify instance, in place
        of a descriptor of its own (the container closes it)."""
        watch = getattr(e.run.container, "watch_events", None)
        if self._in < 0 or watch is None:
            return
        try:
            wd = watch(lambda path: self._lib.ct_inotify_watch(self._in, path.encode(), _IN_MODIFY))
        except OSError:
            return                         # it keeps its descriptor
        if wd >= 0:
            e.events_wd = wd
            self._by_wd[wd] = e

    def _inbox_events(self) -> list[tuple[int, int]]:
        """(watch descriptor, mask) of what the inotify instance has queued
        (struct inotify_event: wd, mask, cookie, len, then len bytes of name)."""
        wds = []
        try:
            while True:
                buf = os.read(self._in, 65536)
                i = 0
                while i + 16 <= len(buf):
                    wd, mask, _cookie, n = struct.unpack_from("iIII", buf, i)
                    wds.append((wd, mask))
                    i += 16 + n
        except BlockingIOError:
            pass
        return wds

    def _drop(self, e: _Entry) -> None:
        if e.events_wd >= 0:
            self._by_wd.pop(e.events_wd, None)
            self._lib.ct_inotify_unwatch(self._in, e.events_wd)     # EINVAL once the cgroup is gone
            e.events_wd = -1
        if e.wd >= 0:
            self._by_wd.pop(e.wd, None)
            self._lib.ct_inotify_unwatch(self._in, e.wd)     # EINVAL once the directory is gone: fine
            e.wd = -1
            if e.run.wakeups is not None:
                e.run.wakeups.watched = False
        for fd in list(e.fds):
            self._unregister(e, fd)
        self._entries.pop(id(e.run), None)
        with self._mu:
            self._pending.discard(id(e.run))


_reactor: Reactor | None = None
_reactor_mu = threading.Lock()


def reactor() -> Reactor:
    """This process's owner loop, started on first use."""
    global _reactor
    with _reactor_mu:
        if _reactor is None:
            _reactor = Reactor()
        return _reactor


def _forget_in_child() -> None:
    global _reactor, _reactor_mu
    _reactor = None                  # its thread is the parent's
    _reactor_mu = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
