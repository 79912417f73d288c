"""die_with_owner: when the owner process dies, the kernel ends the tree
(the wall's init exits on the owner's pidfd, init.c), and whoever finishes
the run (`contain janitor`, `contain cancel`) writes the record, saying the
owner died. Survival is the test's own /proc scan (tests/_proc.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import sys
import textwrap

import pytest

from _proc import ROOT, contain_cmd, holders, run_contain, wait_gone, wait_holders
from conftest import needs_cgroup

pytestmark = needs_cgroup

TREE = "setsid sleep 300 & sleep 300 & wait"


def test_sigkilled_contain_run_with_die_with_owner_leaves_nothing_alive(box):
    proc = subprocess.Popen(contain_cmd("run", "--id", "r", "--die-with-owner", "--", "sh", "-c", TREE),
                            env=box.env, stderr=subprocess.PIPE, text=True)
    try:
        assert len(wait_holders(box.token, 3)) >= 3, "workload did not start"
        assert json.load(open(os.path.join(box.state_dir, "runs", "r", "run.json"))).get("die_with_owner") is True
        # Its first live record is written a moment after the spawn: the
        # kill comes after it (under load the workload started first).
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(box.state_dir, "runs", "r", "record.json")):
            assert time.monotonic() < deadline, "no first record"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # No janitor, no cancel: the kernel ended the tree.
        assert wait_gone(box.token, 5.0) == [], "the tree outlived its owner"
        rec = json.load(open(os.path.join(box.state_dir, "runs", "r", "record.json")))
        assert rec["state"] == "RUNNING", rec["state"]
        p = run_contain(box.env, "janitor", "--once", "--json")
        assert p.returncode == 0 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
        done = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
        assert [d["id"] for d in done] == ["r"], done
        rec = box.record("r")
        assert rec["state"] == "REAPED", rec
        assert rec["evidence"]["container_empty"]["observed"] is True
        assert any("owner" in n and "died" in n for n in rec["notes"]), rec["notes"]
        assert box.leaves() == []
        # A second pass finds nothing left to do.
        p = run_contain(box.env, "janitor", "--once", "--json")
        assert p.returncode == 0 and p.stdout.strip() == "", p.stdout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


SPAWNS = {
    # launcher.spawn, the init exec'd from its image (the default where it can be)
    "spawn": 'w = launcher.spawn(["sh", "-c", %r], id="lib", die_with_owner=True)',
    # a Supervisor's default, the init forked from this process (wall.c's other path)
    "supervisor-forked-init": ('from launcher._platform import wall; wall.EXEC_INIT = False\n'
                               's = launcher.Supervisor(die_with_owner=True)\n'
                               'w = s.spawn(["sh", "-c", %r], id="lib")'),
}


@pytest.mark.parametrize("how", sorted(SPAWNS))
def test_library_process_exiting_without_wait_leaves_nothing_alive(box, how):
    code = "import os, sys, launcher\n" + SPAWNS[how] % TREE + textwrap.dedent("""
        print("up", flush=True)
        sys.stdin.readline()
        os._exit(0)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env=box.env, cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up", proc.stderr.read() if proc.poll() is not None else ""
        assert len(wait_holders(box.token, 3)) >= 3, "workload did not start"
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(10) == 0
        assert wait_gone(box.token, 5.0) == [], "the tree outlived the library process"
        p = run_contain(box.env, "janitor", "--once")
        assert p.returncode == 0, p.stderr
        assert box.record("lib")["state"] == "REAPED"
        assert box.leaves() == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_thread_that_spawned_and_ended_does_not_end_the_tree(box):
    """The pidfd is the process's (its thread-group leader's): a spawning
    thread that ends is not the owner's death (PR_SET_PDEATHSIG would be)."""
    import launcher
    import threading

    got: list = []
    t = threading.Thread(target=lambda: got.append(launcher.spawn(["sh", "-c", TREE], id="th",
                                                                  die_with_owner=True)))
    t.start()
    t.join(30)
    w = got[0]
    try:
        assert len(wait_holders(box.token, 3)) >= 3, "workload did not start"
        import time
        time.sleep(0.5)
        assert len(holders(box.token)) >= 3, "the tree died with a thread, not with its owner"
    finally:
        rec = w.stop(grace=0.5)
    assert rec.state == "REAPED"
    assert holders(box.token) == []


def test_die_with_owner_without_the_wall_is_refused(box):
    p = run_contain(box.env, "run", "--id", "n", "--no-pidns", "--die-with-owner", "--", "true")
    assert p.returncode == 125 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    assert "die-with-owner" in p.stderr, p.stderr
