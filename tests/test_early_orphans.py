"""Runs whose owner died early (before the spawn, before describing the worker,
before the clone, between the clone and its tag, after forking a helper):
`wait`, `ls`, `gc` and `cancel` never call them ended nor lose them, and a
cancel still stops them."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _proc import (
    contain_cmd, contain_killed_at, holders, kill_holders, needs_mount, ramfs_state_script, run_contain,
    run_in_ramfs_namespace,
)
from conftest import needs_cgroup
from test_strays import kill_after_claim, strays


_WAIT_WORKER = r"""
import os, sys, time
needle = ("CONTAIN_TEST_TOKEN=" + sys.argv[1]).encode()
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and open(f"/proc/{p}/comm").read().strip() == "sleep" \
                    and needle in open(f"/proc/{p}/environ", "rb").read().split(b"\0"):
                sys.exit(0)
        except OSError:
            pass
    time.sleep(0.02)
sys.exit(1)
"""


@needs_mount
@pytest.mark.timeout(120)
def test_degraded_run_on_ramfs_whose_supervisor_dies_before_describing_the_worker_is_not_reported_ended(box, tmp_path):
    """Degraded mode with a state directory that holds no tag: until run.json
    is rewritten after the spawn, nothing written names the worker. An
    adopter that knows no member found none alive and ended the run EXITED
    (root_exit null, nothing signalled), `cancel --wait` and `wait` exited
    0, and the worker ran on. Knowing no member is an observation that
    could not be made: UNCONFIRMED, never an ended run."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    # Killed where the driver is about to describe the spawned worker
    # (RunEvidence.tag_holds, right before run.json is rewritten where no tag
    # can be kept): the worker runs, and nothing written names it yet.
    wrapper = contain_killed_at(tmp_path / "killed_before_described.py", "launcher._evidence:RunEvidence.tag_holds",
                                after=False, when="lambda self, run: run.pid > 0")
    contain = " ".join(contain_cmd())
    script = ramfs_state_script(mnt) + f"""
{sys.executable} {wrapper} run --id nox --backend none --grace 0.2 -- sh -c 'sleep 300 & exec sleep 301' \
    < /dev/null > {out}/run.out 2>&1
echo $? > {out}/run.rc
{sys.executable} -c '{_WAIT_WORKER}' {box.token} || exit 97
{contain} cancel nox --wait --json --op-id adopt --timeout 30 > {out}/cancel.json
echo $? > {out}/cancel.rc
{contain} wait nox --timeout 5 > /dev/null 2>&1
echo $? > {out}/wait.rc
"""
    try:
        p = run_in_ramfs_namespace(script, box.env, timeout=100)
        assert p.returncode == 0, (p.returncode, p.stderr)
        assert (out / "run.rc").read_text().strip() == str(128 + 9), "the supervisor was not killed there"
        alive = holders(box.token)
        assert alive, "the worker should still run: nothing in this run stopped it"
        ack = json.loads((out / "cancel.json").read_text())
        # The adopter could not find the tree: no ended state, no success.
        assert ack["state"] not in ("REAPED", "EXITED"), (ack, alive)
        assert ack["effect"] != "cancelled", ack
        assert (out / "cancel.rc").read_text().strip() != "0", (ack, alive)
        assert (out / "wait.rc").read_text().strip() != "0", "contain wait said the run ended"
    finally:
        kill_holders(box.token)


@pytest.mark.timeout(90)
def test_ls_since_shows_an_orphan_whose_supervisor_died_before_its_first_record(box, tmp_path):
    """run.json is written once, before the spawn, so it has no start time;
    the record that has one was due 5 ms later. A supervisor killed in
    between leaves a live orphan that `ls` shows, but `ls --since 1h`
    filtered it out as if it had started before then (no start time
    compared as older), for as long as nobody adopted it."""
    # Killed right after the start-up: the worker spawned and its tag
    # written; the first record was due 5 ms later.
    wrapper = contain_killed_at(tmp_path / "killed_before_first_record.py", "launcher._launch:_start", after=True)
    try:
        p = subprocess.run([sys.executable, str(wrapper), "run", "--id", "early", "--grace", "0.2", "--",
                            "sh", "-c", "sleep 300 & exec sleep 301"], env=box.env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        assert p.returncode == -9, "the supervisor was not killed there"
        assert holders(box.token), "the worker should run on: nothing stopped it"
        assert not os.path.exists(os.path.join(box.state_dir, "runs", "early", "record.json"))
        plain = subprocess.run(contain_cmd("ls", "--json"), env=box.env, capture_output=True, text=True, timeout=30)
        since = subprocess.run(contain_cmd("ls", "--json", "--since", "1h"), env=box.env, capture_output=True,
                               text=True, timeout=30)
        assert plain.returncode == 0 and since.returncode == 0, (plain.stderr, since.stderr)
        [v] = [v for v in json.loads(plain.stdout) if v["id"] == "early"]
        assert v["state"] == "RUNNING" and v["orphaned"] is True, v
        assert [v["id"] for v in json.loads(since.stdout)] == ["early"], since.stdout
        stop = subprocess.run(contain_cmd("cancel", "early", "--wait", "--json", "--timeout", "30"), env=box.env,
                              capture_output=True, text=True, timeout=60)
        assert json.loads(stop.stdout)["state"] == "REAPED", stop.stdout
        assert holders(box.token) == []
    finally:
        kill_holders(box.token)


@pytest.mark.timeout(90)
def test_degraded_run_whose_supervisor_died_before_the_clone_still_ends_when_cancelled(box, tmp_path):
    """The other side of knowing no member: a degraded run whose owner was
    killed before it cloned anything (its journal has no `spawning` line)
    started nothing, and its cancel ends it (EXITED, exit 0), rather than
    leaving it UNCONFIRMED for every cancel after."""
    # Killed just before the fork ledger starts, the last step before the
    # clone: nothing was ever started.
    wrapper = contain_killed_at(tmp_path / "killed_before_the_clone.py", "launcher._launch:EscapeWatch.before_spawn",
                                after=False)
    try:
        p = subprocess.run([sys.executable, str(wrapper), "run", "--id", "unborn", "--backend", "none", "--",
                            "sleep", "300"], env=box.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60)
        assert p.returncode == -9, "the supervisor was not killed there"
        assert holders(box.token) == []
        stop = subprocess.run(contain_cmd("cancel", "unborn", "--wait", "--json", "--timeout", "30"), env=box.env,
                              capture_output=True, text=True, timeout=60)
        ack = json.loads(stop.stdout)
        assert ack["state"] == "EXITED" and stop.returncode == 0, (ack, stop.stderr)
        assert holders(box.token) == []
    finally:
        kill_holders(box.token)


@pytest.mark.timeout(90)
def test_degraded_run_whose_supervisor_dies_between_the_clone_and_its_tag_is_not_reported_ended(box, tmp_path):
    """The same on a state directory that keeps tags: between the clone and
    the tag that names the worker (none.Container.spawn), a supervisor
    killed left an adopter that knew no member, found none, and said EXITED
    with the worker running."""
    # Killed as soon as the clone returns, before degraded mode's container
    # writes the worker into the run's tag.
    wrapper = contain_killed_at(tmp_path / "killed_after_the_clone.py", "launcher._platform.posix:spawn", after=True)
    try:
        p = subprocess.run([sys.executable, str(wrapper), "run", "--id", "undescribed", "--backend", "none", "--",
                            "sh", "-c", "sleep 300 & exec sleep 301"], env=box.env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        assert p.returncode == -9, "the supervisor was not killed there"
        subprocess.run([sys.executable, "-c", _WAIT_WORKER, box.token], timeout=30, check=True)
        stop = subprocess.run(contain_cmd("cancel", "undescribed", "--wait", "--json", "--timeout", "30"),
                              env=box.env, capture_output=True, text=True, timeout=60)
        ack = json.loads(stop.stdout)
        alive = holders(box.token)
        assert alive, "the worker should run on: the adopter could not find it"
        assert ack["state"] not in ("REAPED", "EXITED") and stop.returncode != 0, (ack, alive)
        w = subprocess.run(contain_cmd("wait", "undescribed", "--timeout", "5"), env=box.env,
                           capture_output=True, text=True, timeout=30)
        assert w.returncode != 0, w.stdout
    finally:
        kill_holders(box.token)


@needs_cgroup
@pytest.mark.skipif(os.geteuid() != 0, reason="root's cgroup base and v1 cgroups")
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


@needs_cgroup
@pytest.mark.skipif(os.geteuid() != 0, reason="root's cgroup base and v1 cgroups")
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


@needs_cgroup
@pytest.mark.skipif(os.geteuid() != 0, reason="root's cgroup base and v1 cgroups")
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
