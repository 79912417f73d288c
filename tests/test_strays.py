"""A supervisor killed between its claim and its first run.json leaves no
cgroup behind for good: `gc` finds the run's cgroups by name (the run uid its
journal gives) and removes them while they are empty, and `cancel` says the
run never started instead of failing on an unreadable run.json."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _proc import run_contain
from conftest import needs_cgroup, v1_mounts

pytestmark = [needs_cgroup, pytest.mark.skipif(os.geteuid() != 0, reason="root's cgroup base and v1 cgroups")]

# A supervisor that dies by SIGKILL once its cgroups exist and before it has
# described the run (spawn_request is the next step after the claim, the
# container and the run's v1 cgroups, and before the first run.json).
KILLED_AFTER_THE_CLAIM = """
import os, signal, sys
import launcher, launcher._launch as L
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
L.spawn_request = die
launcher.run(["/bin/true"], id=sys.argv[1])
"""


def kill_after_claim(box, run_id: str) -> str:
    """Run a supervisor that is SIGKILLed after its claim; its run uid."""
    p = subprocess.run([sys.executable, "-c", KILLED_AFTER_THE_CLAIM, run_id], env=box.env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr)
    run_dir = os.path.join(box.state_dir, "runs", run_id)
    assert not os.path.exists(os.path.join(run_dir, "run.json"))
    with open(os.path.join(run_dir, "journal.ndjson")) as f:
        first = json.loads(f.readline())
    assert first["event"] == "claimed"
    return first["run_uid"]


def strays(box, run_id: str, uid: str) -> list[str]:
    name = f"run-{run_id}-{uid[:8]}"
    found = [os.path.join(box.base, name)] if box.base else []
    found += [os.path.join(m, box.v1_base.lstrip("/"), name) for m in v1_mounts()]
    return [d for d in found if os.path.isdir(d)]


def age(box, run_id: str, seconds: float = 120.0) -> None:
    """Make the claim look `seconds` old (gc leaves younger ones: their
    supervisor may still be starting)."""
    t = time.time() - seconds
    os.utime(os.path.join(box.state_dir, "runs", run_id), (t, t))


def test_supervisor_killed_before_describing_its_run_leaves_no_cgroup_after_cancel_and_gc(box):
    uid = kill_after_claim(box, "k")
    left = strays(box, "k", uid)
    assert left, "the scaffold did not die after making the run's cgroups"
    p = run_contain(box.env, "cancel", "k", "--wait")
    assert "Traceback" not in p.stderr and "never started" in p.stderr, p.stderr
    assert strays(box, "k", uid) == [], "cancel, the run's owner now, left the cgroups it found"
    age(box, "k")
    p = run_contain(box.env, "gc")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert strays(box, "k", uid) == [], "the killed supervisor's cgroups are still there"
    assert not os.path.exists(os.path.join(box.state_dir, "runs", "k"))


def test_a_stray_cgroup_that_holds_a_process_keeps_its_run(box):
    """A cgroup named like the run's that holds a process is not the leftover
    of a run that never started: gc removes neither it nor the run."""
    uid = kill_after_claim(box, "k")
    leaf = os.path.join(box.base, f"run-k-{uid[:8]}", "main")
    assert os.path.isdir(leaf)
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
            f.write(str(sleeper.pid))
        p = run_contain(box.env, "cancel", "k", "--wait")
        assert "Traceback" not in p.stderr and "holds processes" in p.stderr and "never started" not in p.stderr, p.stderr
        age(box, "k")
        p = run_contain(box.env, "gc")
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        assert os.path.isdir(leaf) and sleeper.poll() is None
        assert os.path.isdir(os.path.join(box.state_dir, "runs", "k")), "gc removed a run whose cgroup holds a process"
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_a_run_whose_run_json_was_removed_is_not_called_never_started(box):
    """Without run.json and record but with its tag, a run was described:
    its files were removed (by its user, or a worker that can reach them),
    and its worker may live. `wait` and `ls` said "never started" on the
    missing run.json alone; they say so only when the tag is missing too,
    and `cancel` adopts the run from its tag."""
    from _proc import contain_cmd, holders, wait_holders

    proc = subprocess.Popen(contain_cmd("run", "--id", "t", "--", "sleep", "300"), env=box.env,
                            stderr=subprocess.DEVNULL)
    try:
        run_dir = os.path.join(box.state_dir, "runs", "t")
        deadline = time.monotonic() + 20
        while not os.path.exists(os.path.join(run_dir, "record.json")) and time.monotonic() < deadline:
            time.sleep(0.02)                 # the RUNNING record: run.json and the tag are written by then
        assert len(wait_holders(box.token, 2)) >= 2, "workload did not start"
        for name in ("run.json", "record.json", "summary.json"):
            if os.path.exists(os.path.join(run_dir, name)):
                os.unlink(os.path.join(run_dir, name))
        proc.kill()
        proc.wait(10)
        p = run_contain(box.env, "wait", "t")
        assert "Traceback" not in p.stderr and "never started" not in p.stderr, p.stderr
        p = run_contain(box.env, "ls")
        assert "never started" not in p.stdout, p.stdout
        age(box, "t")
        p = run_contain(box.env, "gc")
        assert os.path.isdir(run_dir), "gc removed a described run whose worker lives"
        p = run_contain(box.env, "cancel", "t", "--wait")
        assert "Traceback" not in p.stderr and "never started" not in p.stderr, p.stderr
        assert holders(box.token) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
