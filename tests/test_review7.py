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
