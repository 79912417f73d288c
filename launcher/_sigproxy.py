"""What `contain run` does with the signals a shell sends it.

Anchored on GNU `timeout` and `docker run`'s signal proxy:

- SIGINT, SIGTERM, SIGHUP and SIGQUIT (a terminal's Ctrl-\\, which GNU
  `timeout` forwards too) cancel the run. The handler only queues the
  signal for the owner loop (`Run.deliver_signal`), which makes the intent
  durable and then sends the tree *that* signal first (then `cgroup.kill`
  after the grace). A second one during the stop ends the grace at once.
- A signal the caller ignored (SIG_IGN when `contain` started: `nohup`'s
  SIGHUP, the SIGINT of a background job in a script) stays ignored: no
  handler is installed over it, it cancels nothing, and the worker starts
  with it ignored too (_launch.caller_ignored).
- When the stop is over and the record is written, `contain` resets the
  disposition and raises the first such signal on itself, so it dies by it
  (a shell sees 130, 143 or 129, and `for ...; do contain run ...; done`
  stops on one Ctrl-C: bash's wait-and-cooperative-exit looks at *how* its
  child ended, not at the number).
- Every other signal whose default action ends a process (FORWARD_SIGNALS:
  SIGUSR1, SIGUSR2, SIGALRM, SIGVTALRM, SIGPROF, SIGXCPU, SIGXFSZ, SIGPWR,
  SIGSTKFLT, SIGIO, SIGRTMIN..SIGRTMAX) is passed on to the worker, as
  docker's sig-proxy and tini do, and never ends `contain`: sent to the
  worker alone (not its tree), by its pidfd (`Root.send_signal`: never a
  pid that may have been reused), from outside the PID namespace when
  there is one (so it reaches the worker, not our init). A worker that
  dies of it ends the run as any worker killed by a signal (the tree
  stopped, the record written, `contain` exits 128 + N). The order of
  arrival is kept: Python runs handlers by signal number and coalesces
  repeats, so the arrivals are read from `signal.set_wakeup_fd` (one byte
  per delivery, in order). One that comes before the worker exists (the
  claim, the container) waits for it; one that comes once it has ended is
  dropped. A caller's SIG_IGN stays, as above; SIGXFSZ's SIG_IGN is
  Python's own, not the caller's (it is forwarded, and the worker starts
  with it at SIG_DFL, _launch.caller_ignored).
- Left as they are: SIGPIPE (Python ignores it; a SIGPIPE of ours is our
  own write's, not the caller's), the signals whose default is to ignore
  (SIGWINCH, SIGURG, SIGCONT: nothing reaches the worker), job control
  (SIGTSTP, SIGTTIN, SIGTTOU stop `contain` alone, the worker runs on;
  SIGSTOP cannot be caught) and the synchronous faults (SEGV, BUS, FPE,
  ILL, TRAP, SYS). The library installs none of this: it is the CLI's.

    SignalProxy(run).install()   before the run starts (the claim is
                                 already covered: early signals are queued)
    proxy.first                  the signal to die by, or None
    proxy.after_turn()           the owner loop's on_change: forwards what
                                 came, and the one "stopping" line on a terminal
    proxy.sources()              what the owner loop waits on besides its own
    die_by(signum)               the last act of the process
"""
from __future__ import annotations

import os
from . import _signals as signal
import sys
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from types import FrameType
    from typing import Callable

    from ._run import Run

CANCEL_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n))
# Default action "terminate" or "core" (signal(7)), not handled above, not
# a fault; SIGPOLL is SIGIO. None of these exist on Windows.
FORWARD_SIGNALS = tuple(int(getattr(signal, n)) for n in (
    "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGXCPU", "SIGXFSZ", "SIGPWR", "SIGSTKFLT",
    "SIGIO") if hasattr(signal, n)) + (
    tuple(range(signal.SIGRTMIN, signal.SIGRTMAX + 1)) if hasattr(signal, "SIGRTMIN") else ())
_PYTHONS_OWN_IGN = frozenset(int(getattr(signal, n)) for n in ("SIGXFSZ",) if hasattr(signal, n))


class SignalProxy:
    def __init__(self, run: Run, *, say: Callable[[str], None] | None = None) -> None:
        self.run = run
        self.first: int | None = None
        self.say = say                 # callable(str) for the terminal line, or None (--quiet)
        self._announced = False
        # Read before anything is installed: Python itself leaves a SIGINT
        # that was ignored at start-up ignored (no KeyboardInterrupt handler).
        self.ignored = frozenset(int(s) for s in CANCEL_SIGNALS + FORWARD_SIGNALS
                                 if signal.getsignal(s) == signal.SIG_IGN and int(s) not in _PYTHONS_OWN_IGN)
        self.forwarding = frozenset(FORWARD_SIGNALS) - self.ignored
        self.queued: list[int] = []     # arrived, not yet sent: no worker yet
        self._arrivals = (-1, -1)       # the wake-up fd's pipe (read, write), or none

    def install(self) -> None:
        for s in CANCEL_SIGNALS:
            if int(s) not in self.ignored:
                signal.signal(s, self._on_signal)
        if hasattr(signal, "SIGCHLD"):
            signal.signal(signal.SIGCHLD, self._on_child)
        if self.forwarding:
            self._log_arrivals()
            for s in sorted(self.forwarding):
                signal.signal(s, self._on_forward)

    def _log_arrivals(self) -> None:
        """Python's C handler writes each signal's number to the wake-up
        fd as it is delivered: the one record of their order. Not where
        another wake-up fd is set (an in-process caller's event loop), or
        off the main thread: then the handlers queue (by number)."""
        r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:          # not the main thread
            old = None
        if old == -1:
            self._arrivals = (r, w)
            return
        if old is not None:
            signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)

    def _on_forward(self, signum: int, _frame: FrameType | None) -> None:
        if self._arrivals[0] < 0:
            self.queued.append(signum)
        self.run.wake()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.first is None:
            self.first = signum
        self.run.deliver_signal(signum)

    def _on_child(self, _signum: int, _frame: FrameType | None) -> None:
        self.run.wake()

    def sources(self) -> list[int]:
        """What the owner loop waits on for the forwarded signals."""
        return [self._arrivals[0]] if self._arrivals[0] >= 0 else []

    def after_turn(self) -> None:
        """The owner loop's on_change: forward what came, then say what
        must be said on a terminal."""
        self.forward()
        self.changed()

    def forward(self) -> None:
        """Send the worker, in order, the signals that came for it. Kept
        while there is no worker yet; dropped once it has ended (or the run
        has, with none: nothing to send them to)."""
        r = self._arrivals[0]
        while r >= 0:
            try:
                got = os.read(r, 512)
            except (BlockingIOError, InterruptedError):
                break
            if not got:
                break
            self.queued += [n for n in got if n in self.forwarding]
        root = self.run.root
        if root is None and not self.run.snap.terminal:
            return
        while self.queued:
            signum = self.queued.pop(0)
            if root is not None:
                root.send_signal(signum)    # False: the worker has ended, the signal goes nowhere

    def changed(self) -> None:
        """After each turn: once a signal started a stop that waits out a
        grace, say so on a terminal, with the way out."""
        if self._announced or self.first is None or self.say is None:
            return
        stop = self.run.stop
        if stop.stage != "term" or not _is_tty(2):
            return
        self._announced = True
        left = max(0.0, stop.grace)
        name = signal.name_of(stop.signum) or str(stop.signum)
        self.say(f"stopping run {self.run.id}: {name} sent, SIGKILL in {left:g} s (Ctrl-C again kills now)")


def _is_tty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def die_by(signum: int) -> None:
    """Die by `signum` as if it had never been caught: default disposition,
    unblocked, raised on ourselves. Returns only if that did not end the
    process (then the caller exits with 128 + signum)."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    if sys.platform == "win32":
        return                # no dying by a signal on Windows: the caller exits 128 + signum
    if signum == getattr(signal, "SIGQUIT", None):
        # Its default action dumps core: a core of the supervisor, after a
        # stop that went as asked, is litter in the caller's directory.
        import resource

        try:
            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        except (OSError, ValueError):
            pass
    signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
