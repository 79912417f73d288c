"""One run, from spawn to stop record: the driver of the state table.

The driver only waits, reads inputs, feeds events to the table
(`_state.step`) and acts; the decisions live in rooms of their own:

    _containers.py   which container, and what the worker is started with
    _stop.py         the stop sequence (terminate, kill, retry, observe empty)
    _inbox.py        cancel requests in, acknowledgements out
    _evidence.py     what was observed, and the one place a record is made
    _adopt.py        taking over a run whose owner died; nested runs' ends

The owner of a run (the `contain run` process, a library thread, an asyncio
or trio task, or an adopter) loops on kernel readiness, never on a sleep:
the worker's pidfd (root exit), the run cgroup's `cgroup.events` (POLLPRI on
`populated` changes), the cancel inbox's wake-up FIFO (poked by every
process that appends a request, see _layout.RunDir.poke_owner), and a
wake-up pipe for in-process callers and signals. `sources()` names them,
`next_deadline()` says how long to sleep, the per-platform waiting is
`host.wait_ready` (an event loop does its own, _aio.py), and `turn()` looks
at every input once.

`populated 0` can be seen a moment before the worker's status can be taken:
do_exit() leaves the task's cgroup (cgroup_exit) before exit_notify() makes
it waitable. When the container is observed empty while the worker's pidfd
is still open, the driver waits for that pidfd (briefly: an emptied
container means the worker is exiting, or left it) so the record has the
worker's status instead of "worker running".
"""
from __future__ import annotations

from . import _signals as signal
import _thread     # its RLock: `threading` (0.5 ms to import here) stays off the CLI's run path
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable, Sequence

    from ._recordfile import RecordTarget

from . import _ending, _launch, _nested
from . import _state as S
from ._args import check_argv
from ._evidence import RunEvidence
from ._inbox import Inbox, grace_of
from ._layout import RunDir, new_id, new_uid
from ._rundir import check_id
from ._escapes import EscapeWatch
from ._options import Options
from ._platform import host
from ._record import StopRecord, now_iso
from ._stop import StopSequence
from ._usage import RunUsage

UNCONFIRMED_RETRIES = 2
_INBOX_FALLBACK_S = 0.5        # without a wake-up FIFO the inbox is still read this often
_ROOT_STATUS_WAIT_S = 0.25     # at most, for the status of a worker whose container emptied (it blocks the loop)


class Run:
    """A run and its owner loop. Use `start()`, then `supervise()`."""

    def __init__(self, argv: Sequence[str], *, id: str | None = None, options: Options | None = None,
                 uid: str | None = None, facts: RunEvidence | None = None) -> None:
        self.argv = check_argv(argv)
        self.opts = options or Options()
        self.id = new_id() if id is None else check_id(id)     # "" is a bad id, not none given
        self.uid = uid or new_uid()
        self.layout: RunDir | None = None
        self.container: Any = None
        self.root: host.Root | None = None
        self.pid = -1
        self.snap = S.Snapshot()
        self.facts = facts or RunEvidence()
        self.inbox = Inbox(None, self.id, self.uid, self.facts)
        self.inbox.on_reject = lambda offset, reason: self.journal("rejected", offset=offset, reason=reason[:200])
        self.watch: EscapeWatch | None = None
        self.stop = StopSequence(None, self.facts, kill_timeout=self.opts.kill_timeout, journal=self.journal)
        self.usage = self.stop.usage = RunUsage.for_options(self.opts)
        self.on_change: Callable[[], None] | None = None
        self.end_hooks: list[Callable[[Run], None]] = []   # called once a run ended REAPED
        self._cancel_grace: float | None = None
        self._deadline_timeout = 0.0
        self.wakeups: host.Wakeups | None = None
        self.shared_wake = False      # owned by the process's reactor (_reactor.py): no wake-up pipe of its own
        self._signals: list[int] = []
        self._lock = _thread.RLock()
        self._done = False        # set once, by the owner; nobody waits on it (Worker.wait waits on the run)
        self._final: StopRecord | None = None
        self.stats_error: str | None = None       # why --stats-json could not be written
        self.record_target: RecordTarget | None = None   # record_file=, checked at the start
        self.record_path: str | None = None      # --record's file, in run.json: an adopter writes it too
        self.record_target_failed = False
        self.live_due = 0.0       # when the first record is due, if none was published yet (_launch)

    # -- start -------------------------------------------------------------

    def start(self) -> None:
        """Claim the id, make the container, spawn the worker inside it (_launch.py).
        Raises RunConflict, ContainmentUnavailable or SpawnFailed; in the last
        two cases a final record with outcome `spawn_failed` exists."""
        _launch.start(self)
        if self.opts.timeout is not None:
            self._deadline_timeout = self.stop.timeout_at = time.monotonic() + self.opts.timeout   # ends a linger too

    def attach(self, layout: RunDir) -> None:
        self.layout = self.inbox.layout = layout

    def set_container(self, container: Any) -> None:
        self.container = self.stop.container = container
        self.stop.check_sockets = self.opts.check_sockets

    def open_channels(self) -> None:
        self.wakeups = host.Wakeups(self.layout, container=self.container, run_uid=self.uid,
                                    pipe=not self.shared_wake)
        if self.wakeups.problem is not None:
            self.facts.notes.append(f"{self.wakeups.problem}: inbox read every {_INBOX_FALLBACK_S} s")

    # -- the owner loop ----------------------------------------------------

    def wake(self) -> None:
        """Make the owner loop look at its inputs now (thread- and signal-safe)."""
        if self.wakeups is not None:
            self.wakeups.wake()

    def deliver_signal(self, signum: int) -> None:
        """Signal-safe; one queued before the wake-up pipe is seen all the same."""
        self._signals.append(signum)
        self.wake()

    def supervise(self, *, extra_fds: Sequence[int] = ()) -> StopRecord:
        """Own the run until it ends (or until an unconfirmed stop has been
        retried `UNCONFIRMED_RETRIES` times). Returns the stop record."""
        try:
            self.turn()      # before the first wait: an EXIT the spawn read (before EXEC) wakes nothing
            while self.owning():
                sources = self.sources() + [(fd, host.POLLIN) for fd in extra_fds]
                self.drain(host.wait_ready(sources, self.next_deadline() - time.monotonic()))
                self.turn()
        except BaseException as e:
            _ending.abandon(self, e)
            raise
        if self.snap.terminal or self.snap.phase == S.Phase.UNCONFIRMED:
            self.finish()
        assert self._final is not None
        return self._final

    def owning(self) -> bool:
        """Whether the owner loop goes on: until the run has ended, or an
        unconfirmed stop has been retried `UNCONFIRMED_RETRIES` times."""
        if self.snap.terminal:
            return False
        return not (self.snap.phase == S.Phase.UNCONFIRMED and self.stop.kill_rounds > UNCONFIRMED_RETRIES)

    def finished(self) -> bool:
        """Whether the owner loop has written its last record."""
        return self._done

    def sources(self) -> list[Any]:
        """What the owner waits on (on Linux, (fd, poll events) pairs)."""
        src = self.root.source() if self.root is not None else None
        return (([src] if src is not None else []) + (self.container.sources() if self.container is not None else [])
                + (self.wakeups.sources() if self.wakeups else []))

    def drain(self, ready: Sequence[Any]) -> None:
        """Consume the wake-ups among `ready` (level-triggered inputs)."""
        if self.container is not None:
            self.container.drain(ready)
        if self.wakeups is not None:
            self.wakeups.drain(ready)

    def next_deadline(self) -> float:
        if self._signals or self.inbox.backlog:
            return time.monotonic()       # a signal delivered before the wake-up pipe existed; more to read
        t = self.stop.next_deadline()
        if self._deadline_timeout and self.snap.phase == S.Phase.RUNNING:
            t = min(t, self._deadline_timeout)
        if self.container is not None and self.container.backend in ("none", "subreaper") and self.snap.stopping:
            t = min(t, time.monotonic() + 0.02)   # degraded mode has no emptiness event
        t = min(t, self.live_due or t)
        if (due := getattr(self.root, "due", None)) is not None:
            t = min(t, due)               # a worker seen exited, its status not yet kept (WallRoot)
        if self.layout is not None:
            if not (self.wakeups is not None and self.wakeups.inbox_woken):
                t = min(t, time.monotonic() + _INBOX_FALLBACK_S)
            elif (guard := getattr(self.wakeups, "guard_s", None)) is not None:
                t = min(t, time.monotonic() + guard)
        return t

    def turn(self) -> None:
        """Look at every input once. Cheap enough to do on any wake-up."""
        with self._lock:
            now = time.monotonic()
            while self._signals:
                signum = self._signals.pop(0)
                if self.snap.stopping:
                    self.stop.on_signal(now, signum)   # a second signal: no more waiting
                if self.inbox.request_from_signal(signum):
                    self._read_inbox()
            self._read_inbox()
            self._check_root()
            self._root_ended(host.reap_tree_children(self))
            if self._deadline_timeout and self.snap.phase == S.Phase.RUNNING and now >= self._deadline_timeout:
                self.feed(S.Event.TIMEOUT)
                self.journal("timeout", after=self.opts.timeout)
                self._begin_stop(now)
            if self.snap.stopping:
                self._check_root()
                ev = self.stop.observe() if self.stop.stage is not None else None
                if ev is not None:
                    self._check_root(wait=ev != S.Event.OBSERVE_FAILED)
                    self.feed(ev)
                if not self.snap.terminal:
                    self._advance(now)
            if self.live_due and now >= self.live_due and not self.snap.terminal:
                self.publish()
        if self.on_change is not None:
            self.on_change()

    # -- inputs ------------------------------------------------------------

    def _check_root(self, wait: bool = False) -> None:
        if wait and self.root is not None and (src := self.root.source()) is not None:
            host.wait_ready([src], _ROOT_STATUS_WAIT_S)     # the container emptied: its status is due
        self._root_ended(self.root.poll() if self.root is not None else None)

    def _root_ended(self, ex: host.RootExit | None) -> None:
        if ex is None:
            return
        self.facts.root_exited(ex.exit_code, ex.signal, ex.layer)
        was_stopping = self.snap.stopping
        self.feed(S.Event.ROOT_EXITED, S.checked(S.Outcome, ex.how) if ex.how else None)
        self.journal("root_exited", exit_code=self.facts.exit_code, signal=self.facts.signal)
        if not was_stopping:
            self._begin_stop(time.monotonic(), linger=self.opts.linger)

    def _read_inbox(self) -> None:
        for req in self.inbox.pending():
            arrival = self.inbox.arrive(req, self.snap)
            if arrival is None:
                continue
            grace, signum = grace_of(req), self.inbox.signal_of(arrival.op)
            if arrival.effect == S.Effect.CANCEL_REQUESTED and not self.facts.observed("cancel_requested"):
                self.facts.cancel_requested(arrival.op, req)
                self._cancel_grace = grace
            before = self.snap
            self.feed(S.Event.CANCEL)
            self.inbox.acknowledge(arrival, self.snap)
            self.journal("cancel", op_id=arrival.op, effect=arrival.effect)
            if self.snap.stopping and not before.stopping:
                self._begin_stop(time.monotonic(), grace=self._cancel_grace, signum=signum)
            elif before.phase == S.Phase.UNCONFIRMED:
                self.stop.retry(time.monotonic())
            elif before.stopping:
                self.stop.shorten(time.monotonic(), grace, signum)   # ends a linger; a shorter grace
            if not before.terminal:
                self.publish()   # one result: a terminal record is never rewritten
        self.inbox.answer_rejections()

    # -- acting --------------------------------------------------------------

    def _begin_stop(self, now: float, grace: float | None = None, signum: int | None = None,
                    linger: float = 0.0) -> None:
        self.see_nested()
        self._check_root()     # an empty container's worker status is taken first
        if self.snap.terminal:
            return
        ev = self.stop.begin(now, self.opts.grace if grace is None else grace,
                             signum=signum or signal.SIGTERM, linger=linger)
        if ev is not None:
            self._check_root(wait=ev != S.Event.OBSERVE_FAILED)
            self.feed(ev)
        elif self.stop.stage == "linger":
            self.publish()          # readers see the worker's end and what lingers

    def _advance(self, now: float) -> None:
        if self.stop.stage is None:
            self._begin_stop(now)
            return
        ev = self.stop.advance(now)
        if ev == S.Event.DEADLINE:
            self.feed(ev)
            self.journal("deadline", after=self.opts.kill_timeout)
            self.publish()
            self.stop.retry(now)

    def feed(self, ev: str, how: str | None = None) -> None:
        self.snap = S.step(self.snap, ev, how)

    def journal(self, event: str, **fields: Any) -> None:
        if self.layout is not None:
            try:
                self.layout.journal(event, **fields)
            except OSError as e:
                self.facts.not_saved("the journal", e)

    def see_nested(self) -> None:
        """Remember the runs nested in this one while their containers exist:
        they end with this run (at the start of its stop, and before removal)."""
        if self.container is not None and self.container.backend == "cgroup2":
            self.facts.nested_seen = _nested.merge(self.facts.nested_seen, _nested.scan(self.container))

    # -- ending ------------------------------------------------------------

    def close(self) -> None:
        """Give up ownership without writing anything (used after acknowledging
        a cancel on a run that had already ended)."""
        if self.wakeups is not None:
            self.wakeups.close()
        if self.root is not None:
            self.root.close()
        if self.watch is not None:
            self.watch.close()        # the ledger's thread and socket
        if self.record_target is not None:
            self.record_target.close()
        if self.layout is not None:
            self.layout.release()
        self._done = True

    def finish(self) -> None:
        """The end of ownership: postconditions, accounting, removal of the
        container, the record, the settled acknowledgements, in that order."""
        if self._final is not None and self._final.terminal:
            return
        terminal = self.snap.terminal
        _ending.settle_tree(self, terminal)
        self.facts.times["ended_at"] = now_iso() if terminal else None
        # The record first: an acknowledgement may only claim what a written
        # record already says (an owner dying in between leaves acks to be
        # settled by the next adopter, never the reverse).
        rec = self.publish()
        if terminal and self.opts.stats_json:
            self.stats_error = self.usage.append_stats(self.opts.stats_json, rec.to_dict())
            if self.stats_error is not None:     # said in the record too (a library caller sees no stderr)
                self.facts.notes.append(self.stats_error)
                rec = self.publish()
        self.inbox.settle(self.snap, emptied=self.facts.observed("container_empty"))
        self.journal("ended" if terminal else "unconfirmed", state=self.snap.state)
        if self.layout is not None:
            # Readers believe a final record or settled ack only once the
            # lock is free (a worker may forge either): wake them again then.
            self.layout.release_and_poke()
        if self.wakeups is not None:
            self.wakeups.close()
        self._final = rec
        self._done = True

    def publish(self) -> StopRecord:
        """Write the current record to the run directory (and --record)."""
        return _ending.publish(self)

    def record(self) -> StopRecord:
        with self._lock:
            return self._final if self._final is not None else StopRecord(_ending.record_dict(self))

    def exit_status(self) -> int:
        """What `contain run` exits with (CONTRACT.md)."""
        return S.exit_status(self.snap, self.facts.exit_code, self.facts.signal)
