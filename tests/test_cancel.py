"""The cancel protocol through the CLI, against real processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from _proc import contain_cmd, holders, host_pid, run_contain, wait_holders
from conftest import needs_cgroup

pytestmark = needs_cgroup

TREE = "setsid sleep 300 & sleep 300 & wait"


def start(box, run_id: str, *extra: str, script: str = TREE, want: int = 3) -> subprocess.Popen:
    proc = subprocess.Popen(contain_cmd("run", "--id", run_id, *extra, "--", "sh", "-c", script),
                            env=box.env, stderr=subprocess.PIPE, text=True)
    assert len(wait_holders(box.token, want)) >= want, "workload did not start"
    return proc


def cancel(box, run_id: str, *args: str) -> tuple[int, dict]:
    p = run_contain(box.env, "cancel", run_id, "--json", *args)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, (json.loads(p.stdout) if p.stdout.strip() else {})


def test_cancel_twice_with_one_op_id_returns_identical_records(box):
    proc = start(box, "r")
    rc1, a1 = cancel(box, "r", "--op-id", "op-1", "--wait")
    rc2, a2 = cancel(box, "r", "--op-id", "op-1", "--wait")
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert rc1 == rc2 == 0
    assert a1 == a2 and a1["effect"] == "cancelled" and a1["state"] == "REAPED"
    rec = box.record("r")
    assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled"
    assert holders(box.token) == []
    reqs = open(os.path.join(box.state_dir, "runs", "r", "cancellations", "requests.ndjson")).read().splitlines()
    assert len(reqs) == 1, "a repeated operation id must not be applied (or even requested) twice"


@pytest.mark.parametrize("op", ["", "x" * 201])
def test_an_empty_op_id_is_a_usage_error_not_a_fresh_operation(box, op):
    """`--op-id ''` (a script's unset "$OP") used to mint a fresh id, so two
    such requests were two operations and idempotency was lost without a
    word. It is refused as a usage error, like an id that is too long, and
    nothing is requested: the run goes on."""
    proc = start(box, "r")
    try:
        p = run_contain(box.env, "cancel", "r", f"--op-id={op}")
        assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr and "operation id" in p.stderr, p.stderr
        assert proc.poll() is None and len(holders(box.token)) >= 3, "a refused request cancelled the run"
        assert not os.path.exists(os.path.join(box.state_dir, "runs", "r", "cancellations", "requests.ndjson"))
    finally:
        cancel(box, "r", "--wait")
        proc.wait(30)


def test_cancel_without_wait_acknowledges_cancel_requested(box):
    proc = start(box, "r", "--grace", "0.3", script="trap '' TERM; sleep 300")
    rc, ack = cancel(box, "r", "--op-id", "a")
    assert rc == 0 and ack["effect"] == "cancel_requested"
    # A run cancelled by another process exits 143 whatever its worker died
    # of (issue 12; this was 128 + SIGKILL, the worker's fate, still in the record).
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert box.record("r")["signal"] == signal.SIGKILL
    assert box.ack("r", "a")["effect"] == "cancelled"
    assert holders(box.token) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="a root worker with no wall and no ledger needs root")
def test_cancel_that_emptied_a_cgroup_a_member_could_have_left_is_cancelled(box):
    """CONTRACT.md: `cancelled` is "this operation's stop ended the run and
    the container was observed empty". A root worker with no wall and no
    ledger ends EXITED (a member could have left its cgroup unseen), but its
    cgroup was observed empty: the effect stayed `cancel_requested`, which
    reads as a stop still under way once it is over."""
    env = dict(box.env, CONTAIN_LEDGER="off")
    proc = subprocess.Popen(contain_cmd("run", "--id", "r", "--no-pidns", "--", "sh", "-c", TREE),
                            env=env, stderr=subprocess.PIPE, text=True)
    assert len(wait_holders(box.token, 3)) >= 3, "workload did not start"
    rc, ack = cancel(box, "r", "--op-id", "a", "--wait")
    assert proc.wait(30) == 128 + signal.SIGTERM
    rec = box.record("r")
    assert (rec["state"], rec["outcome"]) == ("EXITED", "cancelled"), rec["state"]
    assert rec["evidence"]["container_empty"]["observed"] is True
    assert rec["evidence"]["descendants_exit"]["observed"] is None
    assert ack["effect"] == "cancelled" and box.ack("r", "a")["effect"] == "cancelled", ack
    assert holders(box.token) == []


def test_cancel_after_the_end_is_not_live(box):
    assert run_contain(box.env, "run", "--id", "r", "--", "sh", "-c", "exit 3").returncode == 3
    before = box.record("r")
    rc, ack = cancel(box, "r", "--op-id", "late", "--wait")
    assert rc == 0 and ack["effect"] == "not_live" and ack["outcome"] == "exited"
    assert box.record("r") == before, "one result: a late cancel changes nothing"


def test_natural_exit_first_stands(box):
    # No wait for the workload to show up: it may be gone before a scan.
    proc = subprocess.Popen(contain_cmd("run", "--id", "r", "--", "sh", "-c", "sleep 0.3; exit 5"), env=box.env)
    assert proc.wait(30) == 5
    rc, ack = cancel(box, "r", "--op-id", "x")
    assert ack["effect"] == "not_live"
    assert box.record("r")["outcome"] == "exited"


def test_unknown_run_is_3(box):
    p = run_contain(box.env, "cancel", "nope")
    assert p.returncode == 3 and "Traceback" not in p.stderr
    assert run_contain(box.env, "status", "nope").returncode == 3
    assert run_contain(box.env, "wait", "nope").returncode == 3


def test_sigkilled_supervisor_is_adopted_by_cancel(box):
    proc = start(box, "r")
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert len(holders(box.token)) >= 3, "the tree outlives its supervisor"
    ls = json.loads(run_contain(box.env, "ls", "--json").stdout)
    assert [v["orphaned"] for v in ls if v["id"] == "r"] == [True]
    p = run_contain(box.env, "cancel", "r", "--json", "--op-id", "adopt", "--wait")
    ack = json.loads(p.stdout) if p.stdout.strip() else {}
    assert p.returncode == 0 and ack["effect"] == "cancelled" and ack["state"] == "REAPED", (p.returncode, p.stderr, ack)
    rec = box.record("r")
    assert rec["state"] == "REAPED" and rec["evidence"]["container_empty"]["observed"] is True
    assert rec["evidence"]["cancel_requested"]["observed"] is True
    assert holders(box.token) == []
    assert box.leaves() == []


def test_stale_run_uid_is_refused(box):
    assert run_contain(box.env, "run", "--id", "r", "--", "true").returncode == 0
    old_uid = box.record("r")["run_uid"]
    proc = start(box, "r")
    rc, ack = cancel(box, "r", "--op-id", "old", "--run-uid", old_uid)
    assert rc == 1 and ack["effect"] == "unknown" and "refused" in ack["detail"]
    time.sleep(0.3)
    assert proc.poll() is None, "an old request must never hit the next run"
    new_uid = box.record("r")["run_uid"]
    rc, ack = cancel(box, "r", "--op-id", "new", "--run-uid", new_uid, "--wait")
    assert rc == 0 and ack["effect"] == "cancelled"
    proc.wait(30)
    assert holders(box.token) == []
    # A known op id asked for with another run uid is the same contradiction:
    # refused, not answered with the other run's record.
    rc, ack = cancel(box, "r", "--op-id", "new", "--run-uid", old_uid)
    assert rc == 1 and ack["effect"] == "unknown" and "refused" in ack["detail"], (rc, ack)
    assert ack["run_uid"] == old_uid
    rc, ack = cancel(box, "r", "--op-id", "new", "--run-uid", new_uid)
    assert rc == 0 and ack["effect"] == "cancelled" and ack["run_uid"] == new_uid, (rc, ack)


def test_reconnecting_reader_gets_the_result_from_the_layout(box):
    proc = start(box, "r")
    cancel(box, "r", "--op-id", "k")
    proc.wait(30)
    # A fresh process, knowing only the state directory, the id and the op id.
    code = textwrap.dedent("""
        import json, launcher
        ack = launcher.cancel("r", op_id="k")
        print(json.dumps(ack.to_dict()))
    """)
    p = subprocess.run([sys.executable, "-c", code], env=box.env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    again = json.loads(p.stdout)
    assert again == box.ack("r", "k") and again["effect"] == "cancelled"
    st = json.loads(run_contain(box.env, "status", "r", "--json").stdout)
    assert st["record"]["state"] == "REAPED"
    assert [a["op_id"] for a in st["cancellations"]] == ["k"]


def test_concurrent_cancels_join_one_stop(box):
    proc = start(box, "r", "--grace", "0.5", script="trap '' TERM; sleep 300")
    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda i: cancel(box, "r", "--op-id", f"c{i}", "--wait"), range(6)))
    proc.wait(30)
    assert all(rc == 0 and a["effect"] == "cancelled" for rc, a in results), results
    journal = [json.loads(x) for x in open(os.path.join(box.state_dir, "runs", "r", "journal.ndjson"))]
    assert [e["event"] for e in journal].count("kill") == 1, "one stop, not six"
    assert holders(box.token) == []


def test_24_concurrent_runs_cancelled_at_once(box):
    procs = [subprocess.Popen(contain_cmd("run", "--id", f"r{i}", "--grace", "0.5", "--", "sh", "-c", TREE),
                              env=box.env, stderr=subprocess.DEVNULL) for i in range(24)]
    try:
        assert len(wait_holders(box.token, 24 * 3, timeout=60)) >= 72
        with ThreadPoolExecutor(24) as ex:
            results = list(ex.map(lambda i: cancel(box, f"r{i}", "--op-id", "all", "--wait"), range(24)))
    finally:
        for p in procs:
            p.wait(60)
    assert all(rc == 0 and a["effect"] == "cancelled" for rc, a in results), results
    assert all(box.record(f"r{i}")["state"] == "REAPED" for i in range(24))
    assert holders(box.token) == []
    assert box.leaves() == []


def _v1_freezer() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            r = right.split()
            if r[:1] == ["cgroup"] and "freezer" in r[2].split(","):
                return left.split()[4]
    return None


@pytest.mark.skipif(_v1_freezer() is None, reason="needs a cgroup v1 freezer (hybrid host) to hold a "
                    "process in D state through SIGKILL")
def test_unconfirmed_is_not_terminal_and_a_retry_keeps_the_first_requested_at(box, tmp_path):
    # A task frozen by the v1 freezer cannot finish dying until thawed, so the
    # v2 container really stays populated after cgroup.kill: the stop cannot
    # be confirmed, and must not be reported as anything stronger.
    pidfile = tmp_path / "pid"
    freezer = os.path.join(_v1_freezer(), f"contain-test-{os.getpid()}-{box.token}")
    proc = start(box, "r", "--grace", "0", "--kill-timeout", "0.3",
                 script=f"sleep 300 & echo $! > {pidfile}; wait", want=2)
    os.mkdir(freezer)
    try:
        # The sleep can be up (want=2) a moment before sh has written its pid.
        deadline = time.monotonic() + 10
        while not (pidfile.exists() and pidfile.read_text().endswith("\n")):
            assert time.monotonic() < deadline, "the workload did not write its pid"
            time.sleep(0.01)
        # $! is the sleep's pid in the run's PID namespace: find its host pid
        # among the processes carrying the test's token (never write a pid
        # we did not start into a cgroup.procs).
        sleeper = host_pid(box.token, int(pidfile.read_text().strip()))
        assert sleeper is not None, "the sleep of this test's workload was not found"
        with open(os.path.join(freezer, "cgroup.procs"), "w") as f:
            f.write(str(sleeper))          # a process this test started
        with open(os.path.join(freezer, "freezer.state"), "w") as f:
            f.write("FROZEN")
        rc, first = cancel(box, "r", "--op-id", "first", "--wait", "--timeout", "20")
        assert proc.wait(30) == 125
        rec = box.record("r")
        assert rec["state"] == "UNCONFIRMED" and rec["outcome"] == "cancelled"
        assert rc == 1 and first["effect"] == "cancel_requested"
        assert rec["evidence"]["container_empty"]["observed"] is not True
        assert holders(box.token), "the frozen process is still there"
        requested_at = rec["evidence"]["cancel_requested"]["at"]
        with open(os.path.join(freezer, "freezer.state"), "w") as f:
            f.write("THAWED")
        rc, second = cancel(box, "r", "--op-id", "retry", "--wait")
        assert rc == 0 and second["effect"] == "cancelled"
        rec = box.record("r")
        assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled"
        assert rec["evidence"]["cancel_requested"]["at"] == requested_at
        assert box.ack("r", "first")["effect"] == "cancelled"
        assert holders(box.token) == []
        assert box.leaves() == []
    finally:
        try:
            with open(os.path.join(freezer, "freezer.state"), "w") as f:
                f.write("THAWED")
        except OSError:
            pass
        proc.kill() if proc.poll() is None else None
        for _ in range(100):
            try:
                os.rmdir(freezer)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.05)


def test_distinct_unsafe_op_ids_never_share_a_file(box):
    proc = start(box, "r")
    rc1, a = cancel(box, "r", "--op-id", "a/b")
    rc2, b = cancel(box, "r", "--op-id", "a:b")
    rc3, c = cancel(box, "r", "--op-id", "a_b", "--wait")
    proc.wait(30)
    assert (a["op_id"], b["op_id"], c["op_id"]) == ("a/b", "a:b", "a_b")
    files = sorted(os.listdir(os.path.join(box.state_dir, "runs", "r", "cancellations")))
    assert len([f for f in files if f.endswith(".json")]) == 3


def test_colliding_ack_file_fails_loudly(box):
    assert run_contain(box.env, "run", "--id", "r", "--", "true").returncode == 0
    path = os.path.join(box.state_dir, "runs", "r", "cancellations", "x.json")
    with open(path, "w") as f:
        json.dump({"op_id": "something-else", "effect": "cancelled"}, f)
    p = run_contain(box.env, "cancel", "r", "--op-id", "x")
    assert p.returncode == 2 and "collides" in p.stderr


def test_wait_returns_when_the_run_ends(box):
    proc = start(box, "r", script="sleep 3", want=3)
    p = run_contain(box.env, "wait", "r", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)["state"] == "REAPED"
    proc.wait(10)


def test_ls_and_status_for_people(box):
    proc = start(box, "r")
    p = run_contain(box.env, "ls")
    assert p.returncode == 0 and "r " in p.stdout and "RUNNING" in p.stdout
    s = run_contain(box.env, "status", "r")
    assert s.returncode == 0 and "container_empty" in s.stdout
    cancel(box, "r", "--wait")
    proc.wait(30)


def test_the_wall_is_described_before_the_worker_runs(box, tmp_path):
    """An owner killed at any point after the spawn leaves a wall its adopter
    can re-attach: the worker's very first look at the run directory's tag
    (what an adopter acts on; its first command) already finds the wall's
    init there, and an owner SIGKILLed right then is adopted by `cancel`,
    which proves the tree gone (REAPED), not merely EXITED."""
    seen = tmp_path / "seen.json"
    read_tag = ("import os, sys; d = os.environ['CONTAIN_RUN_DIR']; "
                "sys.stdout.write(os.getxattr(d, ('trusted.' if os.geteuid() == 0 else 'user.') + 'contain.run')"
                ".decode() + chr(10))")
    script = f'{sys.executable} -c "{read_tag}" > {seen}; setsid sleep 300 & sleep 300'
    proc = start(box, "w", script=script, want=2)
    deadline = time.monotonic() + 10
    while not (seen.exists() and seen.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    wall = json.loads(seen.read_text()).get("wall")
    assert wall and wall["kind"] == "pidns" and wall["init"]["pid"] > 0 and wall["init"]["start_time"], wall
    p = run_contain(box.env, "cancel", "w", "--json", "--op-id", "adopt", "--wait")
    ack = json.loads(p.stdout) if p.stdout.strip() else {}
    assert p.returncode == 0 and ack.get("state") == "REAPED", (p.returncode, p.stderr, ack)
    assert holders(box.token) == []
