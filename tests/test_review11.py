"""Review 11: the go written to a held init with SIGPIPE blocked (d230f5c).

write_go decided from Python's table of handlers (`signal.getsignal`)
whether SIGPIPE could kill the owner. That table only knows what was set
through `signal`: a C library or an embedding application that puts
SIGPIPE back to SIG_DFL with sigaction(2) leaves it saying SIG_IGN, and the
go written to an init already gone then killed the owner's process. A
caller that blocks SIGPIPE itself was left with the SIGPIPE of our write
pending, which killed it when it unblocked SIGPIPE later. And the mask was
changed before the `try` that restores it: a signal handler that raises
(KeyboardInterrupt, from `pthread_sigmask`'s own check for handlers) left
SIGPIPE blocked in the caller's thread for good.

Real kernel throughout (pipes, signal masks, the wall's init); survival by
the test's own /proc scan; every init is reaped; every wait is bounded.
Forked: each changes this process's SIGPIPE disposition or mask.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest

from _proc import holders, new_token
from launcher._errors import SpawnFailed
from launcher._platform import posix
from launcher._platform.wall import write_go
from test_review10 import _gone, _request, _slow_on_init, needs_root


def _spawn_whose_init_is_gone_before_the_go(token: str) -> None:
    """A walled spawn whose init fails its placement check and exits before
    the owner writes the go (test_review10's set-up)."""
    seen: list[tuple[int, int | None, int | None]] = []
    req = _request(token, ["/bin/sleep", "30"])
    req.on_init = _slow_on_init(seen)
    with pytest.raises(SpawnFailed) as ei:
        posix.spawn(req, expect_cgroup=["0::/contain-review11-no-such-cgroup"])
    assert seen, "on_init was never called"
    assert "placement" in str(ei.value.stage), ei.value.stage
    assert _gone(seen[0][0]), "the init of the failed spawn was not reaped"


def _dead_pipe() -> int:
    r, w = os.pipe()
    os.close(r)
    return w


@needs_root
@pytest.mark.forked
def test_go_to_a_gone_init_does_not_sigpipe_an_owner_whose_c_code_set_sigpipe_to_default() -> None:
    """A C library (or the application embedding Python) sets SIGPIPE back
    to SIG_DFL with sigaction: Python's signal.getsignal still says SIG_IGN.
    The go to an init already gone must still come back as the init's own
    failure, not as a SIGPIPE that kills this process (pytest-forked sees
    the child die of signal 13)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(signal.SIGPIPE, None)           # SIG_DFL, behind Python's back
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN, "Python's table saw the change"
    token = new_token()
    try:
        _spawn_whose_init_is_gone_before_the_go(token)
        assert signal.SIGPIPE not in signal.sigpending(), "a SIGPIPE was left pending"
        assert signal.SIGPIPE not in signal.pthread_sigmask(signal.SIG_BLOCK, []), "SIGPIPE left blocked"
    finally:
        assert holders(token) == []


@needs_root
@pytest.mark.forked
def test_go_to_a_gone_init_leaves_no_sigpipe_for_an_owner_that_blocks_sigpipe_and_unblocks_it_later() -> None:
    """A caller with SIGPIPE at SIG_DFL that blocks it (a thread that leaves
    signals to a sigwait thread, say) must not find the SIGPIPE of our go
    pending: it kills the caller as soon as it unblocks SIGPIPE."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    token = new_token()
    try:
        _spawn_whose_init_is_gone_before_the_go(token)
        assert signal.SIGPIPE in signal.pthread_sigmask(signal.SIG_BLOCK, []), "the caller's block was undone"
        assert signal.SIGPIPE not in signal.sigpending(), "our go left the caller a SIGPIPE"
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGPIPE})     # would die here
    finally:
        assert holders(token) == []


@pytest.mark.forked
def test_go_keeps_a_sigpipe_the_blocking_caller_already_had_pending() -> None:
    """Nothing of the caller's own is eaten: a SIGPIPE pending for it while
    it blocks SIGPIPE is still pending after a go that hit EPIPE."""
    got: list[int] = []
    signal.signal(signal.SIGPIPE, lambda s, f: got.append(s))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    os.kill(os.getpid(), signal.SIGPIPE)
    assert signal.SIGPIPE in signal.sigpending()
    w = _dead_pipe()
    try:
        with pytest.raises(BrokenPipeError):
            write_go(w)
    finally:
        os.close(w)
    assert signal.SIGPIPE in signal.sigpending(), "the caller's own SIGPIPE was eaten"
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGPIPE})
    assert got, "the caller's handler never saw its SIGPIPE"


class _Tick(Exception):
    pass


@pytest.mark.forked
def test_keyboard_interrupt_at_the_go_never_leaves_sigpipe_blocked() -> None:
    """A handler that raises (SIGINT's KeyboardInterrupt; here a SIGALRM
    every 20 us that raises while a go is being written) may fire inside
    pthread_sigmask, after the mask changed and before the result is
    assigned. Whatever point it hits, the thread's mask must be the one
    the caller had. Bounded: 3 s or 5000 interruptions."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    armed = [False]

    def tick(s: int, f: object) -> None:
        if armed[0]:
            armed[0] = False
            raise _Tick()

    signal.signal(signal.SIGALRM, tick)
    ticks = 0
    deadline = time.monotonic() + 3
    signal.setitimer(signal.ITIMER_REAL, 0.00002, 0.00002)
    try:
        while time.monotonic() < deadline and ticks < 5000:
            w = _dead_pipe()
            try:
                armed[0] = True
                try:
                    write_go(w)
                finally:
                    armed[0] = False
            except BrokenPipeError:
                pass
            except _Tick:
                ticks += 1
            finally:
                os.close(w)
            assert signal.SIGPIPE not in signal.pthread_sigmask(signal.SIG_BLOCK, []), \
                f"SIGPIPE left blocked after {ticks} interruptions"
            assert signal.SIGPIPE not in signal.sigpending(), "a SIGPIPE of ours left pending"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
    assert ticks > 0, "no interruption ever landed in a go"
