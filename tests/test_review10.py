"""Review 10: the wall's init that is gone before it takes the go.

With a hold (SpawnRequest.on_init: every walled run), the owner describes
the init and then writes "G" to the pipe the init waits on. An init that
exited before that write (killed at birth by the cgroup.kill fork bug, or
failed at one of its own steps before the hold: the placement check, the
user-namespace maps, and since 1247de2 its /proc, signalfd and report pipe)
has closed the pipe's read end: the write raised BrokenPipeError, which
spawn_wall passed on as it was. So the init's own report (the stage and
errno it sent before exiting) was dropped, and an init killed at birth was
not DiedAtBirth, so Container._spawn never fell back to a fresh leaf: a
walled run whose clone hit the kernel bug failed instead of starting.

Real kernel throughout; survival by the test's own /proc scan; every init
is reaped and every cgroup removed; every wait is bounded.
"""
from __future__ import annotations

import os
import time

import pytest

from _proc import TOKEN_VAR, holders, new_token
from launcher._errors import SpawnFailed
from launcher._platform import posix

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
