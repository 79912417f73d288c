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

    SignalProxy(run).install()   before the run starts (the claim is
                                 already covered: early signals are queued)
    proxy.first                  the signal to die by, or None
    proxy.changed()              the owner loop's on_change: the one
                                 "stopping" line on a terminal
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


class SignalProxy:
    def __init__(self, run: Run, *, say: Callable[[str], None] | None = None) -> None:
        self.run = run
        self.first: int | None = None
        self.say = say                 # callable(str) for the terminal line, or None (--quiet)
        self._announced = False
        # Read before anything is installed: Python itself leaves a SIGINT
        # that was ignored at start-up ignored (no KeyboardInterrupt handler).
        self.ignored = frozenset(int(s) for s in CANCEL_SIGNALS if signal.getsignal(s) == signal.SIG_IGN)

    def install(self) -> None:
        for s in CANCEL_SIGNALS:
            if int(s) not in self.ignored:
                signal.signal(s, self._on_signal)
        if hasattr(signal, "SIGCHLD"):
            signal.signal(signal.SIGCHLD, self._on_child)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.first is None:
            self.first = signum
        self.run.deliver_signal(signum)

    def _on_child(self, _signum: int, _frame: FrameType | None) -> None:
        self.run.wake()

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
