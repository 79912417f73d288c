"""Adversarial review 5: contract conformance of the commands' answers
(exit statuses, --json output) when a root worker makes the stop fail or
damages what it can reach.

Each test is named after the attack and failed on the code it was written
against. Survival is decided by the test's own /proc scan (a token in the
workload's environment), never by asking contain.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from _proc import contain_cmd, holders, host_pid, run_contain, wait_holders
from conftest import needs_cgroup
from test_cancel import _v1_freezer
from test_review2 import _remove_v1_of
from test_signals import wait_for_file

pytestmark = needs_cgroup


def _freeze_the_sleep(freezer: str, pidfile: str, token: str) -> None:
    """Put the workload's `sleep` (its pid written to `pidfile`; a process
    this test started) into the v1 freezer cgroup `freezer`, frozen."""
    sleeper = host_pid(token, int(wait_for_file(pidfile).strip()))
    assert sleeper is not None, "the sleep of this test's workload was not found"
    with open(os.path.join(freezer, "cgroup.procs"), "w") as f:
        f.write(str(sleeper))
    with open(os.path.join(freezer, "freezer.state"), "w") as f:
        f.write("FROZEN")


def _thaw_and_remove(freezer: str) -> None:
    try:
        with open(os.path.join(freezer, "freezer.state"), "w") as f:
            f.write("THAWED")
    except OSError:
        pass
    for _ in range(200):
        try:
            os.rmdir(freezer)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)


@pytest.mark.timeout(120)
@pytest.mark.skipif(_v1_freezer() is None, reason="needs a cgroup v1 freezer (hybrid host) to hold a "
                    "process through SIGKILL")
def test_worker_leaving_a_frozen_child_makes_cancel_wait_exit_1_and_no_wall_claim_empty(box, tmp_path):
    # The worker exits on its own and leaves a child the v1 freezer holds:
    # the stop after its exit cannot be confirmed (UNCONFIRMED, exit 125).
    # A retry with `cancel --wait` while the child is still frozen is not
    # confirmed either; "1: the operation did not hold (e.g. UNCONFIRMED)".
    # It exited 0 (effect not_live, state UNCONFIRMED) as if it had held.
    pidfile = tmp_path / "pid"
    freezer = os.path.join(_v1_freezer(), f"contain-review5-{os.getpid()}-{box.token}")
    os.mkdir(freezer)
    proc = subprocess.Popen(contain_cmd("run", "--id", "fz", "--grace", "0", "--kill-timeout", "0.5", "--",
                                        "sh", "-c", f"sleep 300 & echo $! > {pidfile}; read x; exit 0"),
                            env=box.env, stdin=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert len(wait_holders(box.token, 2)) >= 2, "workload did not start"
        _freeze_the_sleep(freezer, str(pidfile), box.token)
        # (not communicate(): the frozen sleep holds the stderr pipe open)
        proc.stdin.write("go\n")
        proc.stdin.flush()                     # the worker exits 0 on its own
        proc.wait(60)
        assert proc.returncode == 125
        rec = box.record("fz")
        assert rec["state"] == "UNCONFIRMED"
        assert holders(box.token), "the frozen process is still there"
        # "walls: each container ... and how it was observed empty": the
        # cgroup's entry said "via cgroup.events populated 0" while it held
        # the frozen member (container_empty false).
        cg = [w for w in rec["containment"]["walls"] if w["kind"] == "cgroup"]
        assert cg and cg[0]["observed_empty"] is not True and "populated 0" not in cg[0]["via"], cg

        p = run_contain(box.env, "cancel", "fz", "--op-id", "retry", "--wait", "--json", timeout=60)
        assert "Traceback" not in p.stderr, p.stderr
        ack = json.loads(p.stdout)
        assert holders(box.token), "the frozen process is still there"
        assert ack["state"] not in ("REAPED", "EXITED"), ack
        assert p.returncode == 1, (p.returncode, ack)

        _thaw_and_remove(freezer)
        p = run_contain(box.env, "cancel", "fz", "--op-id", "last", "--wait", "--json", timeout=60)
        assert json.loads(p.stdout)["state"] == "REAPED" and p.returncode == 0, (p.returncode, p.stdout)
        assert holders(box.token) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _thaw_and_remove(freezer)
        _remove_v1_of("fz")


def test_script_reading_the_effect_of_a_cancel_of_no_such_run_gets_unknown(box):
    # "unknown (no such run, ...)": `contain cancel nope --json | jq .effect`
    # read an empty stdout (only a line on stderr), exit 3.
    for extra in ((), ("--op-id", "op1"), ("--wait",)):
        p = run_contain(box.env, "cancel", "nope", "--json", *extra)
        assert p.returncode == 3 and "Traceback" not in p.stderr, p.stderr
        ack = json.loads(p.stdout)
        assert ack["effect"] == "unknown" and ack["run_id"] == "nope" and ack["state"] is None, ack
        assert ack["op_id"] == (extra[1] if extra[:1] == ("--op-id",) else None), ack
    assert not os.path.exists(os.path.join(box.state_dir, "runs", "nope"))
    p = run_contain(box.env, "cancel", "nope")
    assert p.returncode == 3 and p.stdout == "", p.stdout


@pytest.mark.timeout(60)
def test_root_worker_killing_its_supervisor_and_removing_the_record_leaves_no_reasonless_seal(box):
    # The owner dies before (or its first record is removed after) the
    # record says why the run is not sealed; the adopter's record said
    # `sealed: false, sealed_reason: null` ("else false with sealed_reason").
    script = ('kill -9 $PPID; rm -f "$CONTAIN_RUN_DIR/record.json"; exec sleep 300')
    p = subprocess.Popen(contain_cmd("run", "--id", "ks", "--no-pidns", "--grace", "0", "--", "sh", "-c", script),
                         env=box.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert p.wait(30) == -9
        assert wait_holders(box.token, 1), "the worker is not there"
        # `contain wait` of that orphan said "UNREADABLE": there is no record
        # yet, and nothing unreadable; it is a RUNNING run without an owner.
        w = run_contain(box.env, "wait", "ks", timeout=30)
        assert w.returncode == 1 and "RUNNING" in w.stdout and "UNREADABLE" not in w.stdout, (w.stdout, w.stderr)
        c = run_contain(box.env, "cancel", "ks", "--wait", "--json", timeout=30)
        assert "Traceback" not in c.stderr, c.stderr
        assert holders(box.token) == []
        rec = box.record("ks")
        assert rec["containment"]["sealed"] is False
        assert isinstance(rec["containment"]["sealed_reason"], str) and rec["containment"]["sealed_reason"], rec[
            "containment"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        _remove_v1_of("ks")


@pytest.mark.timeout(90)
def test_root_worker_scrambling_run_json_then_orphaned_is_still_stopped_by_cancel(box, tmp_path):
    # An unsealed root worker rewrites what it can reach (run.json and
    # record.json) and its supervisor dies: `contain cancel` answered "run.json
    # unreadable" (exit 1) for ever and the tree lived on. The adopter acts on
    # the owner's tag, never on run.json, so the tag is enough to stop it.
    done = tmp_path / "scrambled"
    script = ('sleep 0.5; cd "$CONTAIN_RUN_DIR" && echo junk > run.json && echo junk > record.json; '
              f'setsid sleep 300 & echo ok > {done}; exec sleep 300')
    p = subprocess.Popen(contain_cmd("run", "--id", "sc", "--", "sh", "-c", script),
                         env=box.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_file(str(done))
        assert len(wait_holders(box.token, 2)) >= 2, "workload did not start"
        p.kill()                                  # the supervisor dies (SIGKILL)
        p.wait(10)
        assert len(holders(box.token)) >= 2, "the tree went with its supervisor"
        # "ls shows it as orphaned" (it said UNREADABLE only)
        ls = run_contain(box.env, "ls", "--json")
        assert [v["orphaned"] for v in json.loads(ls.stdout) if v["id"] == "sc"] == [True], ls.stdout
        c = run_contain(box.env, "cancel", "sc", "--grace", "0", "--wait", "--json", timeout=60)
        assert "Traceback" not in c.stderr, c.stderr
        assert holders(box.token) == [], (c.returncode, c.stderr)
        assert c.returncode == 0, (c.returncode, c.stdout, c.stderr)
        assert json.loads(c.stdout)["effect"] == "cancelled"
        rec = box.record("sc")
        assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled", rec["state"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        _remove_v1_of("sc")


_FORGE_ACCOUNTING = r"""
import json, os, time
d = os.environ["CONTAIN_RUN_DIR"]
for _ in range(500):
    try:
        rec = json.load(open(os.path.join(d, "record.json")))
        break
    except (OSError, ValueError):
        time.sleep(0.02)
rec["accounting"] = {"cpu_usec": {"value": "lots", "source": "me"}, "wall_s": {"value": "long", "source": "me"},
                     "memory_peak_bytes": {"value": [1], "source": "me"}}
tmp = os.path.join(d, ".forged.tmp")
with open(tmp, "w") as f:
    f.write(json.dumps(rec))
os.rename(tmp, os.path.join(d, "record.json"))
print("forged", flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(60)
def test_root_worker_rewriting_its_record_accounting_cannot_make_status_print_a_traceback(box):
    # "No command prints a Python traceback for bad input": a string where
    # the record has a number made `contain status` die in its cost line.
    import sys

    p = subprocess.Popen(contain_cmd("run", "--id", "fa", "--", sys.executable, "-c", _FORGE_ACCOUNTING),
                         env=box.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        from _proc import readline_within

        assert readline_within(p.stdout, 30) == b"forged\n"
        s = run_contain(box.env, "status", "fa", timeout=30)
        assert "Traceback" not in s.stderr, s.stderr
        assert s.returncode == 0 and "lots" in s.stdout, (s.returncode, s.stdout)
    finally:
        run_contain(box.env, "cancel", "fa", "--grace", "0", "--wait", timeout=30)
        if p.poll() is None:
            p.kill()
        p.wait(10)
        _remove_v1_of("fa")
    assert holders(box.token) == []


@pytest.mark.timeout(90)
def test_root_worker_removing_its_cancellations_cannot_make_itself_uncancellable(box, tmp_path):
    # One `rm -rf "$CONTAIN_RUN_DIR/cancellations"` by an unsealed root worker:
    # `contain cancel` and `contain status` said "no run" (exit 3) while `ls`
    # listed it RUNNING, and the owner kept reading a directory nobody could
    # reach any more. Both while its owner lives and once it is gone.
    done = tmp_path / "removed"
    for run_id, orphan in (("rc", False), ("ro", True)):
        script = f'rm -rf "$CONTAIN_RUN_DIR/cancellations" && echo ok > {done}-{run_id}; exec sleep 300'
        p = subprocess.Popen(contain_cmd("run", "--id", run_id, "--", "sh", "-c", script),
                             env=box.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_file(f"{done}-{run_id}")
            assert wait_holders(box.token, 1), "workload did not start"
            if orphan:
                p.kill()
                p.wait(10)
            s = run_contain(box.env, "status", run_id, timeout=30)
            assert s.returncode == 0 and "Traceback" not in s.stderr, (s.returncode, s.stderr)
            c = run_contain(box.env, "cancel", run_id, "--grace", "0", "--wait", "--json", timeout=60)
            assert "Traceback" not in c.stderr, c.stderr
            assert c.returncode == 0, (run_id, c.returncode, c.stdout, c.stderr)
            assert json.loads(c.stdout)["effect"] == "cancelled"
            if not orphan:
                assert p.wait(30) == 143, p.returncode    # (the supervisor carries the token too)
            assert holders(box.token) == []
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            _remove_v1_of(run_id)


@pytest.mark.timeout(60)
def test_caller_shell_standing_in_the_workspace_does_not_hold_it_for_ever(box, tmp_path):
    # `cd ws && contain run --workspace . -- make`: the caller's own shell has
    # its cwd there, so workspace_quiescent (and redispatch_eligible) was
    # false for every run started that way. An open file of the caller's
    # still counts: it can write.
    ws = tmp_path / "ws"
    ws.mkdir()
    cmd = " ".join(contain_cmd("run", "--id", "{id}", "--workspace", ".", "--", "true"))
    sh = f'cd {ws} && {cmd.format(id="w1")} && exec 3>{ws}/log && {cmd.format(id="w2")}'
    p = subprocess.run(["sh", "-c", sh], env=box.env, capture_output=True, text=True, timeout=50, cwd="/")
    assert p.returncode == 0, p.stderr
    quiet = box.record("w1")["evidence"]["workspace_quiescent"]
    assert quiet["observed"] is True, quiet
    assert box.record("w1")["evidence"]["redispatch_eligible"]["observed"] is True
    held = box.record("w2")["evidence"]["workspace_quiescent"]
    assert held["observed"] is False and [h["how"] for h in held["detail"]["held_by"]] == ["fd 3"], held
    _remove_v1_of("w1")
    _remove_v1_of("w2")


@pytest.mark.timeout(60)
def test_environment_naming_a_plain_directory_as_the_lead_cgroup_is_no_traceback(box, tmp_path):
    # CONTAIN_RUN_CGROUP is what a run hands its worker for nested runs; the
    # worker's own environment is input. A plain writable directory there
    # made `contain run` die with a StopIteration traceback.
    fake = tmp_path / "not-a-cgroup"
    fake.mkdir()
    env = dict(box.env, CONTAIN_RUN_CGROUP=str(fake))
    p = run_contain(env, "run", "--id", "pe", "--record", "-", "--", "true", timeout=30)
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert rec["state"] == "REAPED" and not rec["containment"]["path"].startswith(str(fake)), rec["containment"]
    assert os.listdir(fake) == []
    _remove_v1_of("pe")


def test_script_reading_status_json_finds_the_state_at_the_top(box):
    """`status --json` wrapped everything ({"record": ..., "live": ...}): a
    script reading `state` as every other command's JSON has it found none.
    The run's state, outcome, exit status and whether it is final now sit at
    the top, beside the record as written."""
    assert run_contain(box.env, "run", "-q", "--id", "top", "--", "sh", "-c", "exit 3").returncode == 3
    st = json.loads(run_contain(box.env, "status", "top", "--json").stdout)
    assert (st["run_id"], st["state"], st["outcome"], st["exit_code"], st["signal"], st["final"]) == \
        ("top", "REAPED", "exited", 3, None, True), st
    assert st["record"]["state"] == "REAPED" and st["live"]["state"] == "REAPED"


def test_library_caller_of_a_missing_program_gets_the_spawn_failed_record_with_the_error(box):
    """launcher.run(["/nonexistent"]) raises SpawnFailed (as subprocess
    raises FileNotFoundError), and the run's final record, outcome
    spawn_failed, was only in the run directory: the caller had no id to
    find it by. The error now carries it."""
    import launcher

    with pytest.raises(launcher.SpawnFailed) as ei:
        launcher.run(["/nonexistent/program"], state_dir=box.state_dir)
    e = ei.value
    assert e.exit_code == 127 and e.run_id and e.record is not None, (e.run_id, e.record)
    assert e.record.outcome == "spawn_failed" and e.record.run_id == e.run_id
    assert box.record(e.run_id)["outcome"] == "spawn_failed"
    assert holders(box.token) == []


def test_library_caller_sees_the_record_of_a_retry_that_ended_its_unconfirmed_run(box, tmp_path):
    """A library run whose stop could not be confirmed (a child the v1
    freezer holds) ends its owner loop UNCONFIRMED and lets go of the run.
    A later `w.cancel()`, once the child can die, adopts it and ends it
    REAPED (record.json says so), but `w.record()` and `w.wait()` kept
    returning the old UNCONFIRMED record for ever."""
    import launcher

    pidfile = tmp_path / "pid"
    freezer = os.path.join(_v1_freezer(), f"contain-review5-lib-{os.getpid()}-{box.token}")
    os.mkdir(freezer)
    try:
        w = launcher.spawn(["sh", "-c", f"sleep 300 & echo $! > {pidfile}; exec sleep 300"], id="lf",
                           grace=0, kill_timeout=0.5, state_dir=box.state_dir)
        _freeze_the_sleep(freezer, str(pidfile), box.token)
        w.cancel(op_id="first")
        rec = w.wait(timeout=60)
        assert rec.state == "UNCONFIRMED", rec.state
        _thaw_and_remove(freezer)
        ack = w.cancel(op_id="retry")
        assert ack.to_dict().get("state") == "REAPED" or box.record("lf")["state"] == "REAPED", ack.to_dict()
        assert holders(box.token) == []
        assert w.record().state == "REAPED" and w.wait(timeout=5).state == "REAPED", w.record().state
    finally:
        _thaw_and_remove(freezer)
        _remove_v1_of("lf")


def test_supervisor_killed_before_writing_its_record_file_still_gets_it_written_by_the_adopter(box, tmp_path):
    """`contain run --record FILE` whose supervisor is SIGKILLed (an OOM
    kill, a lost session): `contain cancel` adopted and stopped the run and
    record.json said REAPED, but FILE never appeared ("also to --record FILE
    when given"). The adopter now writes it, under --record's rules."""
    from test_adoption import _start_orphan

    out = tmp_path / "out.json"
    _start_orphan(box, "rf", "--record", str(out), script="setsid sleep 300 & sleep 300")
    assert not out.exists(), "the test is void: the supervisor wrote it"
    c = run_contain(box.env, "cancel", "rf", "--grace", "0", "--wait", timeout=60)
    assert c.returncode == 0, (c.stdout, c.stderr)
    assert holders(box.token) == []
    rec = json.loads(out.read_text())
    assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled" and rec["run_id"] == "rf", rec["state"]
    assert rec == box.record("rf")
