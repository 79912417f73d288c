"""The library face of a run: `spawn`, `run` and `Worker`.

A Worker's owner loop runs in a thread of the caller's process. It does not
make the process a child subreaper (that is process-wide and would take
children from `subprocess` users): orphans of the tree are reaped by init,
and emptiness is still the kernel's `populated 0`.
"""
from __future__ import annotations

import io
import os
import selectors
import sys
import threading
import time
import weakref
from typing import IO, Any, Callable, Sequence

from . import _stdio
from ._args import check_optional_seconds, wait_event
from ._errors import LauncherError
from ._fdbudget import spawning
from ._layout import op_id_or_new
from ._record import CancelRecord, StopRecord, now_iso
from ._leadend import end_hook
from ._handle import RunHandle
from ._options import DEFAULT_GRACE, Options
from ._run import Run
from ._stdio import StdioSpec

SHARED_OWNER = sys.platform != "win32"
if SHARED_OWNER:
    from ._reactor import reactor


def wait_all(workers: Sequence[Worker]) -> None:
    """Until every one of `workers` has ended: one event, set by the last of
    them to end, so the waiting thread is woken once, not once per worker
    (each wake-up takes the GIL from the owner loop's thread while it is
    still ending the others)."""
    mu = threading.Lock()
    every = threading.Event()
    left = [1]                 # 1: held until every countdown is in place

    def one_ended() -> None:
        with mu:
            left[0] -= 1
            if left[0] == 0:
                every.set()

    for w in workers:
        with mu:
            left[0] += 1
        if not w._call_at_end(one_ended):
            one_ended()        # ended already
    one_ended()
    wait_event(every, None)


def wake_all(runs: list[Run]) -> None:
    """Make the owner loops of `runs` look at their inputs now: on Linux the
    process's one loop, woken once for all of them (a bulk cancel writes
    every intent first, then this)."""
    if not runs:
        return
    shared = [r for r in runs if SHARED_OWNER and r.wakeups is not None and r.wakeups.waker is not None]
    if shared:
        reactor().wake_all(shared)      # the loop that set their wakers (reactor.own)
    if len(shared) < len(runs):
        ids = {id(r) for r in shared}
        for r in runs:
            if id(r) not in ids:
                r.wake()


_owned_mu = threading.Lock()
_owned: "weakref.WeakSet[Run]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _owned_mu
    _owned_mu = threading.Lock()     # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def claim(run: Run) -> bool:
    """Become the one owner loop of `run` (a Worker's thread, or `abandon`).
    False if another has: an interrupt in `Thread.start()` comes once the
    thread exists, and both used to own the run at once."""
    with _owned_mu:
        if run in _owned:
            return False
        _owned.add(run)
        return True


def start_run(argv: Sequence[str], *, id: str | None, grace: float, timeout: float | None, backend: str,
              stdin: StdioSpec, stdout: StdioSpec, stderr: StdioSpec,
              options: dict[str, Any], track: Callable[[Run], None] | None = None,
              shared: bool = False, api: str = "launcher.spawn") -> tuple[Run, _stdio.Stdio]:
    """Claim, contain and spawn. The caller's copies of the child's stdio
    ends are closed before this returns, whatever happens. `track` sees the
    Run before it starts, so an owner interrupted mid-spawn can still stop it.
    `shared`: its owner will be the process's reactor (no wake-up pipe of its own)."""
    if "stdio" in options and (stdin, stdout, stderr) != (None, None, None):
        raise ValueError("give stdin/stdout/stderr or stdio, not both")
    with spawning():     # before anything starts: ResourceExhausted (EMFILE) at the descriptor limit
        return _start_run(argv, id=id, grace=grace, timeout=timeout, backend=backend, stdin=stdin, stdout=stdout,
                          stderr=stderr, options=options, track=track, shared=shared, api=api)


def _named(e: TypeError, api: str) -> TypeError:
    """A keyword the options do not take, said by the public function the
    caller called (not the private class that checks it)."""
    msg = str(e)
    if msg.startswith("Options.__init__() "):
        return TypeError(f"{api}() {msg[len('Options.__init__() '):]} (see help({api}))")
    return e


def _start_run(argv: Sequence[str], *, id: str | None, grace: float, timeout: float | None, backend: str,
               stdin: StdioSpec, stdout: StdioSpec, stderr: StdioSpec, options: dict[str, Any],
               track: Callable[[Run], None] | None, shared: bool, api: str) -> tuple[Run, _stdio.Stdio]:
    try:
        opts = Options(grace=grace, timeout=timeout, backend=backend, **options)
    except TypeError as e:
        raise _named(e, api) from None
    st = _stdio.resolve(stdin, stdout, stderr)
    run: Run | None = None
    try:
        if "stdio" not in options:
            opts.stdio = st.child
        run = Run(argv, id=id, options=opts)
        run.shared_wake = shared
        run.end_hooks.append(end_hook)
        if track is not None:
            track(run)
        run.start()
        st.spawned()
    except BaseException as e:
        if isinstance(e, LauncherError) and run is not None and run.finished():
            # Its final record (outcome spawn_failed) goes with the error.
            e.record, e.run_id = run.record(), run.id
        st.abort()
        if run is not None:
            abandon(run)    # an interrupt after the spawn: nothing owns the worker yet, so stop it here
        raise
    return run, st


class Worker(RunHandle):
    """A live run owned by this process. Thread-safe.

    With `subprocess.PIPE`, `stdin`, `stdout` and `stderr` are binary file
    objects (as `subprocess.Popen` gives), else None. Use the Worker as a
    context manager, or call `close()`, to close them; leaving the `with`
    block also cancels the run if it is still going and waits for its end."""

    def __init__(self, run: Run, stdio: _stdio.Stdio | None = None) -> None:
        self._run = run
        self._cond = threading.Condition()
        parent = stdio.parent if stdio is not None else [None, None, None]
        self.stdin: IO[bytes] | None = io.open(parent[0], "wb") if parent[0] is not None else None
        self.stdout: IO[bytes] | None = io.open(parent[1], "rb") if parent[1] is not None else None
        self.stderr: IO[bytes] | None = io.open(parent[2], "rb") if parent[2] is not None else None
        run.on_change = self._changed
        # Set when the owner thread is done. Not Thread.join/is_alive: in
        # CPython 3.11 a KeyboardInterrupt inside join() releases the running
        # thread's tstate lock and is_alive() then says False (the bpo-45274
        # handling in Thread._wait_for_tstate_lock).
        self._finished = threading.Event()
        self._on_end: list[Callable[[], None]] = []     # wait_all()'s countdowns, called once it has ended
        self._error: BaseException | None = None
        self._comm: tuple[dict[int, list[bytes]], memoryview] | None = None   # a communicate() under way
        self._to_worker: list[int] = []      # send_signal()'s, sent by the owner loop's thread
        try:
            if SHARED_OWNER:
                # One owner loop for every Worker of the process (_reactor.py),
                # started (its thread may take an interrupt) before the run is
                # claimed: a claimed run is owned, or abandon() could not stop it.
                loop = reactor()
                if claim(run):
                    loop.own(run, self._ended)
                else:
                    self._ended(None)     # abandon() owns it (the constructor was interrupted)
            else:
                # Windows: the owner waits on the job's completion port, a thread per run.
                threading.Thread(target=self._own, name=f"contain-{run.id}", daemon=True).start()
        except BaseException:
            self.close()
            raise

    def _ended(self, error: BaseException | None) -> None:
        self._error = error
        with self._cond:
            self._finished.set()
            calls, self._on_end = self._on_end, []
        self._changed()
        for fn in calls:
            fn()

    def _call_at_end(self, fn: Callable[[], None]) -> bool:
        """Have `fn` called (in the owner loop's thread) when the run has
        ended; False, and no call, if it already has."""
        with self._cond:
            if self._finished.is_set():
                return False
            self._on_end.append(fn)
            return True

    def _own(self) -> None:
        try:
            if not claim(self._run):
                return              # the constructor was interrupted and stopped the run itself
            self._run.supervise()
        except BaseException as e:      # surfaced by wait(), never lost
            self._error = e
        finally:
            self._ended(self._error)

    def _changed(self) -> None:
        # In the owner loop's thread (after each turn): send_signal's queue.
        self._send_queued()
        with self._cond:
            self._cond.notify_all()

    def done(self) -> bool:
        """Whether the owner loop has finished."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> StopRecord:
        """Block until the owner loop has finished; return the stop record.
        Raises TimeoutError if `timeout` passes first."""
        if not wait_event(self._finished, check_optional_seconds(timeout, "timeout")):
            raise TimeoutError(f"run {self.id} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.record()

    def cancel(self, *, op_id: str | None = None, grace: float | None = None) -> CancelRecord:
        """Request a stop; returns this operation's acknowledgement at once
        (effect `cancel_requested` or `not_live`). `wait()` for the end; the
        settled acknowledgement is `cancel_record(op_id)`."""
        grace = check_optional_seconds(grace, "grace")
        op = op_id_or_new(op_id)
        known = self._known_ack(op)
        if known is not None:
            return known
        if self.done():
            return self._answer_as_ended(op)
        self._request(op, grace, {"thread": threading.get_ident()})
        self._run.wake()
        with self._cond:
            while op not in self._run.inbox.ops and not self.done():
                self._cond.wait(1.0)
        # The acknowledgement as first written (cancel_requested, not_live):
        # the one owner loop may already have settled it (cancelled) by now.
        ack = self._run.inbox.first.get(op) or self._run.inbox.ops.get(op)
        if ack is not None:
            return CancelRecord(ack)
        # The run ended before its owner read this request: the request is in
        # the inbox of an ended run, answered as any late cancel.
        return self._answer_as_ended(op)

    def request_stop(self, op: str, grace: float | None, wake: bool = True) -> bool:
        """A cancel's intent, written, and the owner woken (unless `wake` is
        False: the caller wakes it, with others, wake_all); no wait for its
        acknowledgement (cancel_all asks every run before it waits).
        Whether a request was written."""
        if self.done() or self._known_ack(op) is not None:
            return False
        self._request(op, grace, {"thread": threading.get_ident()})
        if wake:
            self._run.wake()
        return True

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[bytes | None, bytes | None]:
        """As `Popen.communicate`: send `input` to stdin (then close it), read
        stdout and stderr to their ends, wait for the run. Returns the bytes
        read (None for a stream that is not a pipe). TimeoutError if `timeout`
        passes first; the run goes on and the call can be repeated."""
        timeout = check_optional_seconds(timeout, "timeout")
        deadline = None if timeout is None else time.monotonic() + timeout
        if sys.platform == "win32":       # no selecting on pipes there: a thread per pipe, as subprocess does
            return self._communicate_threads(input, deadline, timeout)
        if self._comm is None:
            # What was read so far and the input still to send: kept across
            # a TimeoutError, so a repeated call loses nothing (as Popen's).
            self._comm = ({}, memoryview(input or b""))
        elif input:
            raise ValueError("communicate(): cannot send input after a communicate() that timed out")
        chunks, view = self._comm
        sel = selectors.DefaultSelector()
        try:
            if self.stdin is not None and not self.stdin.closed:
                if view:
                    self.stdin.flush()
                    os.set_blocking(self.stdin.fileno(), False)
                    sel.register(self.stdin.fileno(), selectors.EVENT_WRITE, self.stdin)
                else:
                    self._close_stdin()
            fds = [-1, -1]
            for i, f in enumerate((self.stdout, self.stderr)):
                if f is not None and not f.closed:
                    fds[i] = f.fileno()
                    chunks.setdefault(fds[i], [])
                    sel.register(fds[i], selectors.EVENT_READ, f)
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"run {self.id}: communicate timed out after {timeout} s")
                for key, _ in sel.select(left):
                    if key.data is self.stdin:
                        try:
                            view = view[os.write(key.fd, view[:65536]):]
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:
                            view = view[len(view):]
                        if not view:
                            sel.unregister(key.fd)
                            os.set_blocking(key.fd, True)
                            self._close_stdin()
                    else:
                        data = os.read(key.fd, 65536)
                        if data:
                            chunks[key.fd].append(data)
                        else:
                            sel.unregister(key.fd)
        finally:
            sel.close()
            self._comm = (chunks, view)
        out, err = (b"".join(chunks[fd]) if fd >= 0 else None for fd in fds)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._comm = None
        return out, err

    def _communicate_threads(self, input: bytes | None, deadline: float | None,
                             timeout: float | None) -> tuple[bytes | None, bytes | None]:
        out: dict[int, bytes] = {}
        threads = []
        for i, f in ((1, self.stdout), (2, self.stderr)):
            if f is not None and not f.closed:
                t = threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, f.read()), daemon=True)
                t.start()
                threads.append(t)
        if self.stdin is not None and not self.stdin.closed:
            try:
                if input:
                    self.stdin.write(input)
            except BrokenPipeError:
                pass
            self._close_stdin()
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise TimeoutError(f"run {self.id}: communicate timed out after {timeout} s")
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return (out.get(1) if self.stdout is not None else None), (out.get(2) if self.stderr is not None else None)

    def _close_stdin(self) -> None:
        if self.stdin is not None:
            try:
                self.stdin.close()
            except BrokenPipeError:     # unflushed input the worker never read
                pass

    def close(self) -> None:
        """Close this side's pipe ends (the run itself is not touched)."""
        for f in (self.stdin, self.stdout, self.stderr):
            if f is not None and not f.closed:
                try:
                    f.close()
                except OSError:
                    pass

    def stop(self, *, op_id: str | None = None, grace: float | None = None) -> StopRecord:
        """Cancel if still running, wait for the end, close the pipes."""
        try:
            if not self.done():
                self.cancel(op_id=op_id_or_new(op_id, "stop"), grace=grace)
            return self.wait()
        finally:
            self.close()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()



def spawn(argv: Sequence[str], *, id: str | None = None, grace: float = DEFAULT_GRACE,
          timeout: float | None = None, backend: str = "auto", stdin: StdioSpec = None,
          stdout: StdioSpec = None, stderr: StdioSpec = None, **options: Any) -> Worker:
    """Start `argv` in a fresh container and return its Worker at once.
    Raises SpawnFailed, ContainmentUnavailable or RunConflict; on the first
    two a stop record with outcome `spawn_failed` is in the run directory."""
    started: list[Run] = []
    try:
        run, st = start_run(argv, id=id, grace=grace, timeout=timeout, backend=backend, stdin=stdin,
                            stdout=stdout, stderr=stderr, options=options, track=started.append,
                            shared=SHARED_OWNER)
        return Worker(run, st)
    except BaseException:
        for r in started:
            abandon(r)
        raise


def abandon(run: Run) -> StopRecord | None:
    """Stop a run that has no owner loop (its Worker could not be made, or
    its starter was interrupted): cancel with no grace and own it to the end
    in this thread. A run interrupted before its worker existed gives up its
    directory lock and its (killed, removed) container; None then."""
    if run.layout is None or run.finished() or not run.owning():
        return None
    if not claim(run):
        # Its Worker's thread owns it (the interrupt came once that thread
        # existed): that owner stops it, and this caller (Supervisor.close)
        # waits for that stop, bounded as the stop is: returning at once let
        # the process exit with the stop under way and the tree running.
        run.layout.append_request({"op_id": f"abandon-{run.uid}", "run_uid": run.uid,
                                   "requested_at": now_iso(), "grace": 0.0,
                                   "by": {"pid": os.getpid(), "reason": "its Worker could not be made"}})
        run.wake()
        deadline = time.monotonic() + run.opts.kill_timeout + 1.0
        while not run.finished() and time.monotonic() < deadline:
            time.sleep(0.005)          # (no Worker here to wait on: the owner thread sets finished)
        return None
    if run.pid <= 0:
        if run.container is not None:
            try:
                run.container.kill()
            except OSError:
                pass
            run.container.remove()
        run.close()
        return None
    run.layout.append_request({"op_id": f"abandon-{run.uid}", "run_uid": run.uid,
                               "requested_at": now_iso(), "grace": 0.0,
                               "by": {"pid": os.getpid(), "reason": "no owner loop"}})
    return run.supervise()


def run(argv: Sequence[str], *, id: str | None = None, grace: float = DEFAULT_GRACE,
        timeout: float | None = None, backend: str = "auto", stdin: StdioSpec = None,
        stdout: StdioSpec = None, stderr: StdioSpec = None, input: Any = None, capture_output: bool = False,
        check: bool = False, text: bool | None = None, encoding: str | None = None, errors: str | None = None,
        **options: Any) -> StopRecord:
    """Run `argv` to the end in a fresh container; return its stop record,
    a `CompletedRun`: the record with `args`, `returncode` (negative for a
    signal), `stdout` and `stderr` as `subprocess.run` gives them.
    `capture_output`, `input`, `text`/`encoding`/`errors` and PIPE mean
    what they mean to `subprocess.run`; `check=True` raises `RunFailed`
    (a `subprocess.CalledProcessError`) or, on `timeout`, `RunTimedOut` (a
    `subprocess.TimeoutExpired`), each carrying the record."""
    from ._completed import CompletedRun

    if capture_output:
        if stdout is not None or stderr is not None:
            raise ValueError("stdout and stderr arguments may not be used with capture_output")
        stdout = stderr = _stdio.PIPE
    if input is not None:
        if stdin is not None:
            raise ValueError("stdin and input arguments may not both be used")
        stdin = _stdio.PIPE
    text_mode = bool(text or encoding or errors)
    piped = any(s is _stdio.PIPE or (type(s) is int and s == _stdio.PIPE) for s in (stdin, stdout, stderr))
    out: Any = None
    err: Any = None
    if piped:
        from ._completed import encode

        data = encode(input, text_mode, encoding, errors)
        with spawn(argv, id=id, grace=grace, timeout=timeout, backend=backend, stdin=stdin, stdout=stdout,
                   stderr=stderr, **options) as w:
            # The run's `timeout` is the owner loop's: the tree is stopped
            # then, and the pipes close with it.
            out, err = w.communicate(data)
            rec = w.wait()
    else:
        started: list[Run] = []
        try:
            r, _ = start_run(argv, id=id, grace=grace, timeout=timeout, backend=backend, stdin=stdin,
                             stdout=stdout, stderr=stderr, options=options, track=started.append,
                             api="launcher.run")
            rec = r.supervise()
        except BaseException:
            for s in started:       # interrupted before its owner loop began: no worker runs on unowned
                abandon(s)
            raise
    if text_mode:
        from ._completed import decode

        out, err = decode(out, encoding, errors), decode(err, encoding, errors)
    result = CompletedRun(rec, list(argv), out, err)
    if check:
        from ._completed import check as raise_unless_ok

        raise_unless_ok(result, timeout)
    return result
