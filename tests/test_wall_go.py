"""The wall's init between its clone and the go: an init that fails its own
placement check or is killed at birth is reported by stage or replaced by a
fresh leaf, and the go written to an init already gone never leaves the owner
a SIGPIPE (delivered, pending or blocked), whatever its SIGPIPE disposition."""
from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest

from launcher._errors import SpawnFailed
from launcher._platform import posix
from launcher._platform.wall import write_go

from _proc import TOKEN_VAR, holders, new_token


ROOT = os.geteuid() == 0


needs_root = pytest.mark.skipif(not ROOT, reason="needs root (a PID namespace without a user namespace, cgroups)")


def _slow_on_init(seen: list[tuple[int, int | None, int | None]]):
    def on_init(pid: int, start: int | None, ns: int | None) -> None:
        seen.append((pid, start, ns))
        # The owner describing the init durably (a run.json write and its
        # fsyncs) takes a while; long enough that an init which fails on its
        # own has exited before the go is written.
        time.sleep(0.2)
    return on_init


def _request(token: str, argv: list[str], **kw: object) -> posix.SpawnRequest:
    return posix.SpawnRequest(argv, env={"PATH": "/usr/bin:/bin", TOKEN_VAR: token}, pidns=True,
                              mount_proc=True, **kw)


def _gone(pid: int, timeout: float = 5.0) -> bool:
    """Whether `pid` is gone from /proc (reaped) within `timeout`."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.01)
    return not os.path.exists(f"/proc/{pid}")


@needs_root
def test_init_failing_its_placement_check_before_the_go_reports_its_stage() -> None:
    """The init fails its own step before the hold (here the placement
    check: it is not in the cgroup it was told to expect) and exits; the
    owner's go then finds no reader. The spawn must fail with the init's
    reason, not with the owner's BrokenPipeError."""
    err = _spawn_whose_init_fails_its_placement()
    assert not isinstance(err, BrokenPipeError)


def _spawn_whose_init_fails_its_placement() -> SpawnFailed:
    """A walled spawn whose init fails its placement check (it is not in the
    cgroup it was told to expect) and exits before the go; checked to fail
    with the init's own reason, its init reaped, nothing left running."""
    token = new_token()
    seen: list[tuple[int, int | None, int | None]] = []
    req = _request(token, ["/bin/sleep", "30"])
    req.on_init = _slow_on_init(seen)
    try:
        with pytest.raises(SpawnFailed) as ei:
            posix.spawn(req, expect_cgroup=["0::/contain-review10-no-such-cgroup"])
        assert seen, "on_init was never called"
        assert ei.value.stage is not None and "placement" in str(ei.value.stage), ei.value.stage
        assert _gone(seen[0][0]), "the init of the failed spawn was not reaped"
    finally:
        assert holders(token) == []
    return ei.value


@needs_root
def test_walled_run_whose_init_is_killed_at_birth_falls_back_to_a_fresh_leaf() -> None:
    """The cgroup.kill fork bug (KERNEL-NOTES.md) SIGKILLs the init cloned
    into a leaf that was once killed, before it runs our code. With a hold,
    that must still be DiedAtBirth, so that the container places the run in
    a fresh leaf (joined by the init itself) instead of failing it."""
    from launcher._platform import linux

    token = new_token()
    seen: list[tuple[int, int | None, int | None]] = []
    c = linux.Container.create("review10birth")
    sp = None
    try:
        with open(os.path.join(c.leaf, "cgroup.kill"), "w") as f:
            f.write("1")
        killed_leaf = c.leaf
        req = _request(token, ["/bin/sleep", "30"])
        req.on_init = _slow_on_init(seen)
        sp = c._spawn(req)
        assert sp.wall == "pidns"
        deadline = time.monotonic() + 10
        while not holders(token) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert holders(token), "the walled worker never ran"
        if len(seen) == 1:
            pytest.skip("this kernel has the fix for the cgroup.kill fork bug")
        # The first init died at birth; the second one is the run's.
        assert len(seen) == 2 and seen[1][0] == sp.init_pid
        assert c.leaf != killed_leaf
        assert c.placed(sp.init_pid) == c.hierarchy.cg_path(c.leaf)
    finally:
        if sp is not None:
            posix.discard(sp)
        c.kill()
        deadline = time.monotonic() + 10
        while c.populated() and time.monotonic() < deadline:
            time.sleep(0.01)
        c.remove()
        assert holders(token) == []


@needs_root
@pytest.mark.forked
def test_init_gone_before_the_go_does_not_sigpipe_an_owner_that_set_sigpipe_to_default() -> None:
    """Python ignores SIGPIPE, but a library caller may set it back to
    SIG_DFL (as many CLIs do for `| head`). The go written to an init that
    is already gone must then still come back as the init's own failure,
    not as a SIGPIPE that kills the owner. Forked: it changes this
    process's SIGPIPE disposition."""
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _spawn_whose_init_fails_its_placement()      # the owner is still here: no SIGPIPE killed it
    assert signal.SIGPIPE not in signal.sigpending(), "the owner was left with a pending SIGPIPE"
    assert signal.SIGPIPE not in signal.pthread_sigmask(signal.SIG_BLOCK, []), "SIGPIPE left blocked"


def _spawn_whose_init_is_gone_before_the_go(token: str) -> None:
    """A walled spawn whose init fails its placement check and exits before
    the owner writes the go (the set-up of the placement tests above)."""
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
