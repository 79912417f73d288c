"""The async face of a run, on anyio (asyncio and trio alike).

    async with launcher.open_worker(argv) as w:
        rec = await w.wait()

On Linux every run of the process, async or not, is owned by the one owner
loop of the process (_reactor.py: one thread, one epoll set, one inotify
instance, one wake-up pipe), so an async run costs its event loop no
descriptor, no task and no thread of its own. The loop's thread tells the
event loop what happened the way event loops take news from another
thread (asyncio's `call_soon_threadsafe`, trio's `run_sync_soon`): when a
run's state changes and when its last record is written. A run's stop goes
on while the event loop is busy or blocked, as a Worker's does.

On Windows an event loop cannot wait on a job's completion port: the run's
owner loop is a task of the caller's event loop whose waits block in a
thread (`host.wait_ready`).

Leaving the `async with` block in any way cancels the run if it is still
going and waits, shielded from cancellation, until its container is
observed empty (at most its grace plus the kill deadline).
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any, Sequence

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread

from ._errors import RunConflict
from ._fdbudget import reserve
from ._handle import RunHandle
from ._layout import op_id_or_new
from ._record import CancelRecord, StopRecord
from ._options import DEFAULT_GRACE
from ._run import Run
from ._state import Phase
from ._stdio import Stdio, StdioSpec
from ._worker import SHARED_OWNER, abandon, claim, start_run, wake_all

if TYPE_CHECKING:
    from ._completed import CompletedRun

if SHARED_OWNER:
    from ._reactor import reactor

__all__ = ["AsyncWorker", "AsyncSupervisor", "open_worker"]


# -- byte streams over pipe ends ---------------------------------------------

class FdReceiveStream(anyio.abc.ByteReceiveStream):
    """The reading end of a pipe, as an anyio byte stream (owns the fd)."""

    def __init__(self, fd: int) -> None:
        if sys.platform != "win32":       # Windows: event loops cannot wait for a pipe (read in a thread)
            os.set_blocking(fd, False)
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        await anyio.lowlevel.checkpoint_if_cancelled()
        if sys.platform == "win32":
            if self._fd < 0:
                raise anyio.ClosedResourceError
            data = await anyio.to_thread.run_sync(os.read, self._fd, max_bytes, abandon_on_cancel=True,
                                                  limiter=anyio.CapacityLimiter(1))
            if not data:
                raise anyio.EndOfStream
            return data
        while True:
            if self._fd < 0:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self._fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)
                continue
            if not data:
                raise anyio.EndOfStream
            return data

    async def aclose(self) -> None:
        _close_fd(self)
        await anyio.lowlevel.checkpoint()


class FdSendStream(anyio.abc.ByteSendStream):
    """The writing end of a pipe, as an anyio byte stream (owns the fd).
    Closing it is the worker's end of input."""

    def __init__(self, fd: int) -> None:
        if sys.platform != "win32":
            os.set_blocking(fd, False)
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    async def send(self, item: bytes) -> None:
        await anyio.lowlevel.checkpoint_if_cancelled()
        if sys.platform == "win32":
            try:
                await anyio.to_thread.run_sync(_write_all, self._fd, bytes(item), limiter=anyio.CapacityLimiter(1))
            except BrokenPipeError as e:
                raise anyio.BrokenResourceError from e
            return
        view = memoryview(item)
        while view:
            if self._fd < 0:
                raise anyio.ClosedResourceError
            try:
                n = os.write(self._fd, view)
            except BlockingIOError:
                await anyio.wait_writable(self._fd)
                continue
            except BrokenPipeError as e:
                raise anyio.BrokenResourceError from e
            view = view[n:]

    async def aclose(self) -> None:
        _close_fd(self)
        await anyio.lowlevel.checkpoint()


def _write_all(fd: int, data: bytes) -> None:
    if fd < 0:
        raise anyio.ClosedResourceError
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _close_fd(s: FdReceiveStream | FdSendStream) -> None:
    # Mark closed, wake any waiter, then close, with no checkpoint between
    # (anyio.notify_closing).
    fd, s._fd = s._fd, -1
    if fd >= 0:
        anyio.notify_closing(fd)
        os.close(fd)


# -- the worker ----------------------------------------------------------------

class AsyncWorker(RunHandle):
    """A run owned by the process's owner loop (Windows: a task of this
    event loop), awaited from this event loop. Get one from `open_worker`
    or `AsyncSupervisor.spawn`. With `subprocess.PIPE`, `stdin` is an anyio
    `ByteSendStream` and `stdout`/`stderr` are `ByteReceiveStream`s."""

    def __init__(self, run: Run, stdio: Stdio | None = None) -> None:
        self._run = run
        self._ended = anyio.Event()
        self._finished = threading.Event()       # the owner loop is done (set in its thread)
        self._changed: anyio.Event | None = None  # a cancel waiting for its acknowledgement
        self._on_ended: list[Any] = []            # called in the event loop when the run has ended (_all_ended)
        self._error: BaseException | None = None
        parent = stdio.parent if stdio is not None else [None, None, None]
        self.stdin: FdSendStream | None = FdSendStream(parent[0]) if parent[0] is not None else None
        self.stdout: FdReceiveStream | None = FdReceiveStream(parent[1]) if parent[1] is not None else None
        self.stderr: FdReceiveStream | None = FdReceiveStream(parent[2]) if parent[2] is not None else None
        self._soon = _threadsafe_soon()
        self._to_worker: list[int] = []          # send_signal()'s, sent by the owner loop's thread

    def _start_owner(self, tg: anyio.abc.TaskGroup) -> None:
        """Hand the run to its owner loop: the process's one loop on Linux
        (claimed first, as a Worker's: a claimed run is owned, or abandon()
        could not stop it), a task of `tg` on Windows."""
        self._run.on_change = self._on_turn
        if not SHARED_OWNER:
            tg.start_soon(self._own, name=f"contain-{self._run.id}")
            return
        loop = reactor()
        if claim(self._run):
            loop.own(self._run, self._owner_done)
        else:
            self._owner_done(None)        # abandon() owns it (the start was interrupted)

    def _owner_done(self, error: BaseException | None) -> None:
        """In the owner loop's thread: the run's last record is written."""
        self._error = error
        self._finished.set()
        self._soon(self._tell_ended)

    def _tell_ended(self) -> None:
        self._ended.set()
        self._tell_changed()
        calls, self._on_ended = self._on_ended, []
        for fn in calls:
            fn()

    def _on_turn(self) -> None:
        """In the owner loop's thread, after each turn of the run: the event
        loop is told only when a cancel() waits there for an answer (it
        sets `_changed` before it looks at the inbox, so an answer given
        before it was set is seen by that look). Also send_signal()'s queue."""
        self._send_queued()
        if self._changed is not None:
            self._soon(self._tell_changed)

    def _tell_changed(self) -> None:
        ev, self._changed = self._changed, None
        if ev is not None:
            ev.set()

    def done(self) -> bool:
        return self._ended.is_set() or self._finished.is_set()

    async def wait(self) -> StopRecord:
        """Until the owner loop has finished; the stop record."""
        await self._ended.wait()
        return self._result()

    def _result(self) -> StopRecord:
        if self._error is not None:
            raise self._error
        return self.record()

    async def cancel(self, *, op_id: str | None = None, grace: float | None = None) -> CancelRecord:
        """Request a stop; this operation's acknowledgement (effect
        `cancel_requested`, or `not_live` if the run had ended). `wait()` for
        the end; the settled acknowledgement is `cancel_record(op_id)`."""
        await anyio.lowlevel.checkpoint()
        op = op_id_or_new(op_id)
        if not SHARED_OWNER:
            return self._cancel_now(op, grace)
        known = self._known_ack(op)
        if known is not None:
            return known
        if self.done() or not self._run.owning():
            return self._answer_as_ended(op)
        self._request_stop(op, grace)
        run = self._run
        while op not in run.inbox.ops and not self._finished.is_set():
            changed = self._changed = anyio.Event()
            if op in run.inbox.ops or self._finished.is_set():     # said before the event was there
                break
            with anyio.CancelScope(shield=True):        # the intent is written: its answer is awaited
                with anyio.move_on_after(1.0):
                    await changed.wait()
        # The acknowledgement as first written (cancel_requested, not_live):
        # the owner loop may already have settled it (cancelled) by now.
        ack = run.inbox.first.get(op) or run.inbox.ops.get(op)
        if ack is not None:
            return CancelRecord(ack)
        return self._answer_as_ended(op)

    def _request_stop(self, op: str, grace: float | None, wake: bool = True) -> None:
        """A cancel's intent, written, and its owner woken (unless `wake` is
        False: the caller wakes it, with others); no wait for the
        acknowledgement (a supervisor asks every run before it waits)."""
        if not SHARED_OWNER:
            self._cancel_now(op, grace)
            return
        if self.done() or self._known_ack(op) is not None:
            return
        self._request(op, grace, {"task": "anyio"})
        if wake:
            self._run.wake()

    def _cancel_now(self, op: str, grace: float | None) -> CancelRecord:
        """Windows: the owner is a task of this event loop, so the request is
        acknowledged and acted on here and now."""
        run = self._run
        known = self._known_ack(op)
        if known is not None:
            return known
        if not run.owning() or run.finished():
            return self._answer_as_ended(op)
        self._request(op, grace, {"task": "anyio"})
        with reserve.released():
            run.turn()                 # we are the owner's thread: acknowledge and act now
        run.wake()                     # the owner task re-reads its deadlines
        ack = run.inbox.ops.get(op)
        if ack is None:
            raise RunConflict(f"run {self.id}: operation {op} was not acknowledged")
        return CancelRecord(ack)

    async def _own(self) -> None:
        """The owner loop as a task. Shielded: it ends when the run ends, and
        whoever leaves the worker's scope makes sure that happens."""
        run = self._run
        with anyio.CancelScope(shield=True):
            try:
                while run.owning():
                    # Near the descriptor limit, the wait's epoll and the
                    # turn's files come from the reserve (_fdbudget.py).
                    with reserve.released():
                        ready = await _wait_ready(run.sources(), run.next_deadline())
                        run.drain(ready)
                        run.turn()
            except Exception as e:           # surfaced by wait(), never lost
                self._error = e
            finally:
                try:
                    if run.snap.terminal or run.snap.phase == Phase.UNCONFIRMED:
                        with reserve.released():
                            run.finish()     # as Run.supervise() does
                finally:
                    self._ended.set()

    async def _stop(self, grace: float | None = None) -> None:
        """Cancel if still running, wait for the end, close the streams.
        Call shielded. A KeyboardInterrupt meanwhile is held until the
        container is empty."""
        interrupted: BaseException | None = None
        while not self._ended.is_set():        # (ended already: no checkpoint, see _all_ended)
            try:
                if not self.done() and self._run.owning():
                    self._request_stop(f"scope-exit-{self._run.uid}", grace)
                await self._ended.wait()
                break
            except KeyboardInterrupt as e:
                interrupted = e
        for s in (self.stdin, self.stdout, self.stderr):
            if s is not None:
                _close_fd(s)
        if interrupted is not None:
            raise interrupted



async def _wait_ready(fds: Sequence[tuple[int, int]], deadline: float) -> list[int]:
    """Windows: wait until one of `fds` is ready or `deadline` (monotonic)
    passes; the ready ones. The run's Waiter blocks in a thread of its own
    (an event loop cannot wait on a completion port); a cancel from the
    loop wakes it (Run.wake)."""
    from ._platform import host

    left = deadline - time.monotonic()
    if left <= 0:
        await anyio.lowlevel.checkpoint()
        return []
    return list(await anyio.to_thread.run_sync(host.wait_ready, fds, left, limiter=anyio.CapacityLimiter(1)))


def _threadsafe_soon() -> Any:
    """How another thread has a function called soon in the current event
    loop's thread, without waiting for it: asyncio's call_soon_threadsafe,
    trio's run_sync_soon. Once the loop is gone, nothing (the run's record
    is on disk all the same).

    Batched per event loop: what the owner loop's thread hands over while
    the event loop has not yet run the last batch joins it, so a pass that
    ends a thousand runs wakes the event loop once (each call of `soon`
    writes to its self-pipe, and the event loop takes the GIL each time),
    not a thousand times. The functions run in the order given."""
    soon: Any = None
    closed: tuple[type[BaseException], ...] = (RuntimeError,)
    key: Any = None
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            key = trio.lowlevel.current_trio_token()
            soon = key.run_sync_soon
            closed = (trio.RunFinishedError,)
        except RuntimeError:
            pass                     # trio is imported, but this is not its loop
    if soon is None:
        import asyncio

        key = asyncio.get_running_loop()
        soon = key.call_soon_threadsafe
    with _mailboxes_mu:
        box = _mailboxes.get(key)
        if box is None:
            box = _mailboxes[key] = _Mailbox(soon, closed)
    return box.call


class _Mailbox:
    """One event loop's batch of calls from other threads (_threadsafe_soon)."""

    def __init__(self, soon: Any, closed: tuple[type[BaseException], ...]) -> None:
        # Weakly: the mailbox is the value of its event loop's key in
        # _mailboxes, and a strong reference to the loop would keep both.
        self._soon = weakref.WeakMethod(soon)
        self._closed = closed
        self._mu = threading.Lock()
        self._calls: list[Any] = []

    def call(self, fn: Any) -> None:
        with self._mu:
            self._calls.append(fn)
            if len(self._calls) > 1:
                return               # the event loop is due to run the batch: it takes this one too
        soon = self._soon()
        try:
            if soon is not None:
                soon(self._run)
                return
        except self._closed:
            pass
        except BaseException:
            with self._mu:               # not scheduled: the next call tries again
                self._calls.clear()
            raise
        with self._mu:                   # the event loop is gone: nobody is left to tell
            self._calls.clear()

    def _run(self) -> None:
        with self._mu:
            calls, self._calls = self._calls, []
        error: BaseException | None = None
        for fn in calls:
            try:
                fn()
            except BaseException as e:     # the others run all the same; the first is the loop's to see
                error = error or e
        if error is not None:
            raise error


_mailboxes: "weakref.WeakKeyDictionary[Any, _Mailbox]" = weakref.WeakKeyDictionary()
_mailboxes_mu = threading.Lock()


def _request_stops(workers: list[AsyncWorker], op: str | None, grace: float | None) -> None:
    """Every live worker's cancel intent written, then the owner loop woken
    once for all of them (one pass of it sends every signal before it waits
    for any container). `op` None: each worker's own supervisor-exit op.
    A KeyboardInterrupt meanwhile still wakes those already asked."""
    asked: list[Run] = []
    try:
        for w in workers:
            if not w.done() and w._run.owning():
                w._request_stop(op or f"supervisor-exit-{w._run.uid}", grace, wake=False)
                asked.append(w._run)
    finally:
        wake_all(asked)


async def _all_ended(workers: list[AsyncWorker]) -> None:
    """Until every one of `workers` has ended, waited for together: one
    event, set in the event loop by the last of them to end (not an await
    per worker, one after the other)."""
    left = [w for w in workers if not w._ended.is_set()]
    if not left:
        await anyio.lowlevel.checkpoint()
        return
    every = anyio.Event()
    count = [len(left)]

    def one_ended() -> None:
        count[0] -= 1
        if count[0] == 0:
            every.set()

    for w in left:
        w._on_ended.append(one_ended)
    await every.wait()


async def _exit_group(tg: anyio.abc.TaskGroup, et: type[BaseException] | None, e: BaseException | None,
                      tb: TracebackType | None) -> bool | None:
    """Leave a task group that holds only owner tasks (which never raise):
    the block's own exception comes out as itself, not wrapped in an
    ExceptionGroup (anyio's task groups on trio are strict)."""
    try:
        return await tg.__aexit__(et, e, tb)
    except BaseExceptionGroup as eg:
        if e is None or len(eg.exceptions) != 1 or eg.exceptions[0] is not e:
            raise
    raise e


class _OpenWorker:
    """`async with open_worker(...) as w:` (see `open_worker`)."""

    def __init__(self, argv: Sequence[str], kw: dict[str, Any]) -> None:
        self._argv = argv
        self._kw = kw
        self._tg: anyio.abc.TaskGroup | None = None
        self._worker: AsyncWorker | None = None

    async def __aenter__(self) -> AsyncWorker:
        await anyio.lowlevel.checkpoint_if_cancelled()
        kw = dict(self._kw)
        started: list[Run] = []
        w: AsyncWorker | None = None
        try:
            run, st = start_run(self._argv, id=kw.pop("id"), grace=kw.pop("grace"), timeout=kw.pop("timeout"),
                                backend=kw.pop("backend"), stdin=kw.pop("stdin"), stdout=kw.pop("stdout"),
                                stderr=kw.pop("stderr"), options=kw, track=started.append,
                                shared=SHARED_OWNER, api="launcher.open_worker")
            w = AsyncWorker(run, st)
            tg = anyio.create_task_group()
            await tg.__aenter__()
        except BaseException:
            # Started, but no owner task yet (an interrupt; trio raises
            # KeyboardInterrupt wherever the code runs): stopped here.
            for r in started:
                abandon(r)
            for stream in (w.stdin, w.stdout, w.stderr) if w is not None else ():
                if stream is not None:
                    _close_fd(stream)
            raise
        w._start_owner(tg)
        self._tg, self._worker = tg, w
        return w

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        assert self._tg is not None and self._worker is not None
        try:
            with anyio.CancelScope(shield=True):
                await self._worker._stop()
        finally:
            suppress = await _exit_group(self._tg, et, e, tb)
        return suppress


def open_worker(argv: Sequence[str], *, id: str | None = None, grace: float = DEFAULT_GRACE,
                timeout: float | None = None, backend: str = "auto", stdin: StdioSpec = None,
                stdout: StdioSpec = None, stderr: StdioSpec = None, **options: Any) -> _OpenWorker:
    """Start `argv` in a fresh container, awaited from the current
    event loop (asyncio or trio, through anyio):

        async with launcher.open_worker(["make", "test"]) as w:
            rec = await w.wait()

    Options are those of `launcher.spawn`. Leaving the block cancels the run
    if it is still going and waits until it is reaped."""
    return _OpenWorker(argv, dict(id=id, grace=grace, timeout=timeout, backend=backend, stdin=stdin,
                                  stdout=stdout, stderr=stderr, **options))


async def run_process(argv: Sequence[str], *, input: bytes | None = None, stdout: StdioSpec = -1,
                      stderr: StdioSpec = -1, check: bool = True, id: str | None = None,
                      grace: float = DEFAULT_GRACE, timeout: float | None = None, backend: str = "auto",
                      **options: Any) -> CompletedRun:
    """`launcher.run` for the event loop, with `anyio.run_process`'s names
    and defaults (asyncio or trio):

        rec = await launcher.run_process(["make", "test"])
        rec.returncode, rec.stdout, rec.stderr, rec.state

    `input` (bytes) is written to the worker's stdin, then closed; stdout
    and stderr are captured (`subprocess.PIPE`, the default) or go where
    you say (None: inherited); `check=True` (the default, as anyio's)
    raises `RunFailed` / `RunTimedOut` carrying the record. The result is
    a `CompletedRun`. Cancelling the awaiting task stops the whole tree
    (with the grace) before the cancellation goes on."""
    import subprocess

    from ._completed import CompletedRun, check as raise_unless_ok

    if input is not None and "stdin" in options:
        raise ValueError("stdin and input arguments may not both be used")
    if input is not None and not isinstance(input, (bytes, bytearray, memoryview)):
        raise TypeError(f"input must be bytes, not {type(input).__name__}")
    stdin = subprocess.PIPE if input is not None else options.pop("stdin", None)
    out: list[bytes] = []
    err: list[bytes] = []

    async def drain(stream: Any, sink: list[bytes]) -> None:
        while True:
            try:
                sink.append(await stream.receive())
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return

    async with open_worker(argv, id=id, grace=grace, timeout=timeout, backend=backend, stdin=stdin,
                           stdout=subprocess.PIPE if stdout == -1 else stdout,
                           stderr=subprocess.PIPE if stderr == -1 else stderr, **options) as w:
        async with anyio.create_task_group() as tg:
            if w.stdout is not None:
                tg.start_soon(drain, w.stdout, out)
            if w.stderr is not None:
                tg.start_soon(drain, w.stderr, err)
            if w.stdin is not None:
                try:
                    if input:
                        await w.stdin.send(bytes(input))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass            # the worker closed its stdin: as subprocess, not an error
                finally:
                    await w.stdin.aclose()
            rec = await w.wait()
    result = CompletedRun(rec, list(argv), b"".join(out) if w.stdout is not None else None,
                          b"".join(err) if w.stderr is not None else None)
    if check:
        raise_unless_ok(result, timeout)
    return result


class AsyncSupervisor:
    """Many async workers, one scope: leaving it (normally, on an exception,
    on cancellation) cancels every run still going and waits until all are
    reaped.

        async with launcher.AsyncSupervisor() as sup:
            a = await sup.spawn(["worker", "1"])
            b = await sup.spawn(["worker", "2"])
            await a.wait()

    `defaults` are spawn options applied to every worker (per-spawn options
    win). `grace` overrides the workers' grace when the scope stops them."""

    def __init__(self, *, grace: float | None = None, **defaults: Any) -> None:
        self.grace = grace
        self._defaults = defaults
        self._workers: list[AsyncWorker] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False

    @property
    def workers(self) -> list[AsyncWorker]:
        return list(self._workers)

    async def spawn(self, argv: Sequence[str], **kw: Any) -> AsyncWorker:
        if self._tg is None or self._closed:
            raise RuntimeError("AsyncSupervisor.spawn outside its `async with` block")
        await anyio.lowlevel.checkpoint_if_cancelled()
        o = {"id": None, "grace": DEFAULT_GRACE, "timeout": None, "backend": "auto",
             "stdin": None, "stdout": None, "stderr": None, **self._defaults, **kw}
        started: list[Run] = []
        try:
            run, st = start_run(argv, id=o.pop("id"), grace=o.pop("grace"), timeout=o.pop("timeout"),
                                backend=o.pop("backend"), stdin=o.pop("stdin"), stdout=o.pop("stdout"),
                                stderr=o.pop("stderr"), options=o, track=started.append,
                                shared=SHARED_OWNER, api="launcher.AsyncSupervisor.spawn")
            w = AsyncWorker(run, st)
        except BaseException:
            for r in started:       # started, but neither listed nor owned yet: stopped here
                abandon(r)
            raise
        self._workers.append(w)
        w._start_owner(self._tg)
        return w

    async def wait(self) -> list[StopRecord]:
        """Until every worker spawned so far has ended; their records."""
        workers = list(self._workers)
        await _all_ended(workers)
        return [w._result() for w in workers]

    async def cancel_all(self, *, grace: float | None = None) -> list[StopRecord]:
        """Cancel every worker still going in one pass (every stop asked for
        before any is waited for: their graces run together), then wait for
        all. The scope stays open. Every worker's final record."""
        await anyio.lowlevel.checkpoint()
        grace = self.grace if grace is None else grace
        op = f"cancel-all-{id(self)}-{time.monotonic_ns()}"
        workers = list(self._workers)
        _request_stops(workers, op, grace)
        await _all_ended(workers)
        return [w._result() for w in workers]

    async def __aenter__(self) -> "AsyncSupervisor":
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        assert self._tg is not None
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                interrupted: BaseException | None = None
                try:                             # every stop requested first: graces run together
                    _request_stops(self._workers, None, self.grace)
                except KeyboardInterrupt as ki:
                    interrupted = ki
                try:
                    await _all_ended(self._workers)     # together; then each only closes its streams
                except KeyboardInterrupt as ki:
                    interrupted = ki
                for w in self._workers:
                    try:
                        await w._stop(self.grace)
                    except KeyboardInterrupt as ki:
                        interrupted = ki
                if interrupted is not None:
                    raise interrupted
        finally:
            suppress = await _exit_group(self._tg, et, e, tb)
        return suppress
