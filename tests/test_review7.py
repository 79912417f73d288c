"""Adversarial review 7: races and timing. Supervisors killed at random
points, signals at every step of the start-up and the end, cancellers,
waiters and adopters racing each other and the run's own end.

Each test is named after the attack and failed on the code it was written
against. Survival is decided by the test's own /proc scan (a token in the
workload's environment), never by asking contain.
"""
from __future__ import annotations

import os

import pytest

from _proc import run_contain
from conftest import needs_cgroup
from test_strays import kill_after_claim, strays

pytestmark = [needs_cgroup, pytest.mark.skipif(os.geteuid() != 0, reason="root's cgroup base and v1 cgroups")]


@pytest.mark.timeout(60)
def test_wait_on_a_run_whose_supervisor_was_killed_before_the_spawn_does_not_call_it_running(box):
    # A supervisor SIGKILLed between its claim and its first run.json:
    # ls and status say it never started, cancel says it never started,
    # and wait said "run k is RUNNING and its owner is gone; `contain
    # cancel k` adopts and stops it" (and printed RUNNING): nothing ever
    # ran, and cancel adopts nothing.
    kill_after_claim(box, "k")
    p = run_contain(box.env, "wait", "k")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "never started" in p.stderr, p.stderr
    assert "RUNNING" not in p.stdout + p.stderr and "adopts" not in p.stderr, (p.stdout, p.stderr)


@pytest.mark.timeout(60)
def test_gc_removes_at_once_the_run_that_cancel_says_gc_removes(box):
    # cancel of a run whose supervisor was SIGKILLed before the spawn says
    # "never started ... `contain gc` removes it"; gc then kept it (and its
    # cgroups, without the cancel) for 60 s, as a claim that may still be
    # starting, although the run's owner lock was free: a claim is made with
    # that lock held, so a free one means its supervisor is gone.
    uid = kill_after_claim(box, "k")
    assert strays(box, "k", uid)
    p = run_contain(box.env, "cancel", "k", "--wait")
    assert "`contain gc` removes it" in p.stderr, p.stderr
    uid2 = kill_after_claim(box, "k2")
    p = run_contain(box.env, "gc")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(box.state_dir, "runs", "k")), p.stdout
    assert not os.path.exists(os.path.join(box.state_dir, "runs", "k2")), p.stdout
    assert strays(box, "k2", uid2) == []


FORKS_A_HELPER_THEN_DIES = """
import os, sys, time
import launcher
w = launcher.spawn(["sleep", "300"], id="f")
helper = os.fork()
if helper == 0:
    time.sleep(60)                  # multiprocessing's fork, a daemonising helper: outlives its parent
    os._exit(0)
print(helper, w.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(60)
def test_a_library_owner_killed_after_forking_a_helper_leaves_an_adoptable_run(box):
    # The owner lock is an OFD lock, and fork() shares the open file
    # description: a helper the library's process forked went on holding it
    # after that process was SIGKILLed. ls showed the run RUNNING, not
    # orphaned, and `contain cancel --wait` waited for an owner that no
    # longer existed (until the helper ended), the worker running meanwhile.
    import signal
    import subprocess
    import sys

    from _proc import holders

    p = subprocess.Popen([sys.executable, "-c", FORKS_A_HELPER_THEN_DIES], env=box.env,
                         stdout=subprocess.PIPE, text=True)
    helper = -1
    try:
        helper = int(p.stdout.readline().split()[0])
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        ls = run_contain(box.env, "ls")
        assert "orphaned" in ls.stdout, ls.stdout
        c = run_contain(box.env, "cancel", "f", "--wait", timeout=20)
        assert c.returncode == 0, c.stderr
        assert box.record("f")["state"] == "REAPED"
        assert [h for h in holders(box.token) if h != helper] == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        if helper > 0:
            try:
                os.kill(helper, signal.SIGKILL)
            except ProcessLookupError:
                pass
