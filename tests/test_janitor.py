"""`contain janitor`: runs whose owner died are finished by adoption, as it
happens, without a cancel; live and ended runs are left alone; janitors and
`contain cancel` racing on one orphan make one record. Survival is the
test's own /proc scan (tests/_proc.py)."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time

from _proc import TOKEN_VAR, contain_cmd, holders, readline_within, run_contain, wait_gone, wait_holders
from conftest import needs_cgroup

pytestmark = needs_cgroup

TREE = "setsid sleep 300 & sleep 300 & wait"


def start(box, run_id: str, *extra: str, want: int = 3) -> subprocess.Popen:
    proc = subprocess.Popen(contain_cmd("run", "--id", run_id, "--grace", "1", *extra, "--", "sh", "-c", TREE),
                            env=box.env, stderr=subprocess.PIPE, text=True)
    assert len(wait_holders(box.token, want)) >= want, "workload did not start"
    return proc


def orphan(box, run_id: str) -> None:
    """A run whose owner was SIGKILLed, its tree still alive."""
    proc = start(box, run_id)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert len(holders(box.token)) >= 3, "the tree outlives its owner (no die-with-owner)"


def acks(box, run_id: str) -> dict[str, dict]:
    out = {}
    for p in glob.glob(os.path.join(box.state_dir, "runs", run_id, "cancellations", "*.json")):
        with open(p) as f:
            out[os.path.basename(p)[:-5]] = json.load(f)
    return out


def test_long_running_janitor_finishes_an_orphan_without_a_cancel(box):
    env = {k: v for k, v in box.env.items() if k != TOKEN_VAR}     # the janitor is not the run's: no token
    # Unbuffered: readline_within selects on the pipe, and lines already read
    # into a buffer would never make it readable again.
    jan = subprocess.Popen(contain_cmd("janitor", "--json"), env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, bufsize=0)
    try:
        time.sleep(0.5)                   # its first pass is over: what follows is the owner's death
        assert jan.poll() is None, jan.stderr.read()
        proc = start(box, "r")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        line = readline_within(jan.stdout, 20.0)
        assert line, "the janitor finished nothing"
        done = json.loads(line)
        assert done["id"] == "r" and done["state"] == "REAPED" and done["error"] is None, done
        assert wait_gone(box.token, 5.0) == [], "the orphan's tree was left running"
        rec = box.record("r")
        assert rec["state"] == "REAPED" and rec["evidence"]["container_empty"]["observed"] is True
        assert any("contain janitor" in n and "died" in n for n in rec["notes"]), rec["notes"]
        assert box.ack("r", done["op_id"])["state"] == "REAPED"
        assert box.leaves() == []
        jan.send_signal(signal.SIGTERM)
        assert jan.wait(10) == 0, jan.stderr.read()
    finally:
        if jan.poll() is None:
            jan.kill()
            jan.wait(10)


def test_two_janitors_and_a_cancel_racing_on_one_orphan_make_one_record(box):
    orphan(box, "r")
    racers = [subprocess.Popen(contain_cmd("janitor", "--once", "--json"), env=box.env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    racers.append(subprocess.Popen(contain_cmd("cancel", "r", "--op-id", "c", "--wait", "--json"), env=box.env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=60) for p in racers]
    for p, (out, err) in zip(racers, outs):
        assert p.returncode == 0 and "Traceback" not in err, (p.args, p.returncode, err)
    assert wait_gone(box.token, 5.0) == []
    rec = box.record("r")
    assert rec["state"] == "REAPED", rec["state"]
    cancel_ack = json.loads(outs[2][0])
    assert cancel_ack["state"] == "REAPED", cancel_ack
    every = acks(box, "r")
    assert "c" in every and every, every
    assert {a.get("state") for a in every.values()} == {"REAPED"}, every
    assert {a.get("run_uid") for a in every.values()} == {rec["run_uid"]}, every
    # What each janitor said it finished agrees with the record.
    said = [json.loads(line) for out, _ in outs[:2] for line in out.splitlines() if line.strip()]
    assert all(d["state"] == "REAPED" for d in said), said
    assert box.leaves() == []


def test_janitor_leaves_live_and_ended_runs_alone(box):
    assert run_contain(box.env, "run", "--id", "done", "--", "true").returncode == 0
    ended = box.record("done")
    live = start(box, "live")
    try:
        p = run_contain(box.env, "janitor", "--once", "--json")
        assert p.returncode == 0 and p.stdout.strip() == "" and "Traceback" not in p.stderr, (p.stdout, p.stderr)
        assert box.record("done") == ended
        assert live.poll() is None and len(holders(box.token)) >= 3, "the janitor touched a live run"
        assert not os.path.exists(os.path.join(box.state_dir, "runs", "live", "cancellations", "requests.ndjson"))
        assert acks(box, "done") == {}
    finally:
        run_contain(box.env, "cancel", "live", "--wait")
        live.wait(30)
    assert holders(box.token) == []


def test_janitor_finishes_an_orphan_of_the_old_owner_lock_layout_on_its_full_pass(box):
    """A run left by an older contain has `owner.lock` and no `owner` link;
    its orphan is found by the full pass (here: --once)."""
    orphan(box, "r")
    d = os.path.join(box.state_dir, "runs", "r")
    # Rewrite the owner link as the old layout: an unlocked owner.lock.
    os.unlink(os.path.join(d, "owner"))
    open(os.path.join(d, "owner.lock"), "w").close()
    p = run_contain(box.env, "janitor", "--once")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("r REAPED"), p.stdout
    assert wait_gone(box.token, 5.0) == []
    assert box.record("r")["state"] == "REAPED"


def test_janitor_keep_applies_retention_as_gc_does(box):
    for rid in ("a", "b", "c"):
        assert run_contain(box.env, "run", "--id", rid, "--", "true").returncode == 0
    p = run_contain(box.env, "janitor", "--once", "--keep", "1")
    assert p.returncode == 0 and p.stdout == "", (p.stdout, p.stderr)
    left = sorted(os.listdir(os.path.join(box.state_dir, "runs")))
    assert [n for n in left if not n.startswith(".")] == ["c"], left


def test_long_running_janitor_finishes_a_sigkilled_library_owners_die_with_owner_runs(box):
    """The Ray worker's case: a library process with several runs, killed by
    SIGKILL (the OOM killer's way); the kernel ends the trees, the janitor
    writes each record."""
    import sys
    import textwrap

    env = {k: v for k, v in box.env.items() if k != TOKEN_VAR}
    # Unbuffered: readline_within selects on the pipe, and lines already read
    # into a buffer would never make it readable again.
    jan = subprocess.Popen(contain_cmd("janitor", "--json"), env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, bufsize=0)
    code = textwrap.dedent(f"""
        import sys, launcher
        s = launcher.Supervisor(die_with_owner=True)
        ws = [s.spawn(["sh", "-c", {TREE!r}], id=f"lib{{i}}") for i in range(3)]
        print("up", flush=True)
        sys.stdin.readline()
    """)
    owner = subprocess.Popen([sys.executable, "-c", code], env=box.env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "up"
        assert len(wait_holders(box.token, 10)) >= 9, "workload did not start"
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert wait_gone(box.token, 5.0) == [], "the trees outlived their owner"
        seen = set()
        while len(seen) < 3:
            line = readline_within(jan.stdout, 20.0)
            assert line, f"the janitor finished only {sorted(seen)}"
            d = json.loads(line)
            assert d["state"] == "REAPED" and d["error"] is None, d
            seen.add(d["id"])
        assert seen == {"lib0", "lib1", "lib2"}
        for rid in seen:
            assert box.record(rid)["state"] == "REAPED"
        assert box.leaves() == []
        jan.send_signal(signal.SIGTERM)
        assert jan.wait(10) == 0
    finally:
        for p in (owner, jan):
            if p.poll() is None:
                p.kill()
                p.wait(10)
