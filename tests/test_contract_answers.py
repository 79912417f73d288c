"""What the commands and the library answer, checked against CONTRACT.md as a
script reads it: the state at the top of `status --json`, `unknown` for no
such run, the limits asked, an empty id refused, a timed-out `cancel --wait`
saying so, a record read mid-cancel, 125 for a bug of contain's own."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _proc import contain_in, holders, run_contain
from _v1 import remove_v1_of
from conftest import TOKEN_VAR, needs_cgroup


@needs_cgroup
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


@needs_cgroup
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
    remove_v1_of("pe")


@needs_cgroup
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


PY = sys.executable


def _contain_bytes(box, *args: str, env: dict[str, str] | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    e = dict(box.env)
    e.update(env or {})
    return subprocess.run([PY, "-m", "launcher", *args], env=e, capture_output=True, timeout=timeout)


def _survivors(box) -> list[int]:
    return sorted(holders(box.token, TOKEN_VAR))


@needs_cgroup
def test_a_limit_that_could_not_be_applied_is_still_in_the_records_asked_limits(box):
    """A scheduler reads `limits.asked` to see what a failed run wanted: a
    run refused because its --pids-max could not be applied (no cgroup of
    any kind: degraded mode with cgroup v1 turned off) must say the limit
    was asked and that none was applied, not `asked: {}` as if the caller
    had asked for nothing."""
    p = _contain_bytes(box, "run", "--backend", "none", "--pids-max", "10", "--record", "-", "--", "true",
                 env={"CONTAIN_CGROUP_V1": "off"})
    assert p.returncode == 125, p.stderr
    assert b"Traceback" not in p.stderr
    rec = json.loads(p.stdout)
    assert rec["outcome"] == "spawn_failed"
    assert rec["limits"]["asked"] == {"pids_max": 10}, rec["limits"]
    assert rec["limits"]["applied"] == {}, rec["limits"]
    assert any("--pids-max" in n for n in rec["limits"].get("notes", [])), rec["limits"]
    assert _survivors(box) == []


@needs_cgroup
def test_cancel_wait_that_times_out_says_so_on_stderr(box):
    """`contain cancel ID --wait --timeout T` whose stop is not over by T
    exits 1 ("the operation did not hold"); like `contain wait --timeout`,
    it must say why in one line on stderr, not leave a script's log with a
    bare status 1 (stdout, which a script may parse or discard, is not
    where an error goes)."""
    import time

    rid = "rev18-cw"
    run = subprocess.Popen([PY, "-m", "launcher", "run", "--id", rid, "--grace", "60", "--", "sh", "-c",
                            "trap '' TERM; sleep 600"], env=box.env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(box.state_dir, "runs", rid, "run.json")):
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read() if run.stderr else ""
            time.sleep(0.05)
        time.sleep(0.3)
        p = _contain_bytes(box, "cancel", rid, "--op-id", "op1", "--wait", "--timeout", "0.5")
        assert p.returncode == 1, (p.stdout, p.stderr)
        assert b"Traceback" not in p.stderr
        lines = [ln for ln in p.stderr.decode().splitlines() if ln.strip()]
        assert len(lines) == 1 and rid in lines[0] and "0.5" in lines[0], p.stderr
        # The stop is then finished by a second operation without the grace.
        p = _contain_bytes(box, "cancel", rid, "--op-id", "op2", "--grace", "0", "--wait", "--timeout", "20")
        assert p.returncode == 0, (p.stdout, p.stderr)
        assert p.stderr == b"", p.stderr
        assert run.wait(timeout=30) == 143
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=30)
        if run.stderr:
            run.stderr.close()
    assert _survivors(box) == []


@needs_cgroup
@pytest.mark.parametrize("spelling", [["--id", ""], ["--id="]])
def test_run_with_an_empty_id_is_a_usage_error_not_a_generated_id(box, tmp_path, spelling):
    """`contain run --id "$JOB" -- CMD` with $JOB unset must not start CMD
    under a made-up id: the script's later `contain wait "$JOB"` and
    `contain cancel "$JOB"` are usage errors ('' is no run id), so the run
    it started could be neither waited for nor cancelled by name. As
    `--op-id ''` is, an empty --id is refused (2, one line) and nothing runs."""
    marker = tmp_path / "ran"
    p = _contain_bytes(box, "run", *spelling, "--", "sh", "-c", f"touch {marker}")
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = p.stderr.decode().splitlines()
    assert lines and "id" in lines[0] and b"Traceback" not in p.stderr, p.stderr
    assert not marker.exists()
    runs = os.path.join(box.state_dir, "runs")
    assert not os.path.isdir(runs) or os.listdir(runs) == []


def test_library_run_with_an_empty_id_raises_and_runs_nothing(box, tmp_path):
    """The same for `launcher.run(argv, id=job)` with an empty `job`: a
    ValueError, as for any invalid id, never a run under a generated id."""
    import launcher

    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match="invalid run id"):
        launcher.run(["sh", "-c", f"touch {marker}"], id="", state_dir=box.state_dir)
    assert not marker.exists()
    runs = os.path.join(box.state_dir, "runs")
    assert not os.path.isdir(runs) or os.listdir(runs) == []


@needs_cgroup
@pytest.mark.timeout(60)
def test_a_record_read_while_a_cancel_is_under_way_is_running_with_no_outcome_yet(box):
    """CONTRACT.md: `outcome` is null while the run is RUNNING. A record
    read during a cancel's grace said RUNNING with outcome `cancelled`, a
    result the run did not have yet (its worker could still exit on its
    own, and its stop could still end UNCONFIRMED). The stop under way is
    `stopping`; the outcome arrives with the end."""
    import time

    p = subprocess.Popen([PY, "-m", "launcher", "run", "-q", "--id", "g", "--grace", "3", "--", "sh", "-c",
                          "trap '' TERM; echo up; sleep 60"], env=box.env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline() == b"up\n"
        c = _contain_bytes(box, "cancel", "g")
        assert c.returncode == 0, c.stderr
        seen = None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            rec = box.record("g")
            if rec["state"] == "RUNNING" and rec.get("stopping"):
                seen = rec
                break
            time.sleep(0.02)
        assert seen is not None, "no record of the stop under way"
        assert seen["outcome"] is None and seen["stopping"] == "cancelled", seen
        p.wait(30)
        final = box.record("g")
        assert (final["state"], final["outcome"]) == ("REAPED", "cancelled") and "stopping" not in final, final
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert _survivors(box) == []


@needs_cgroup
def test_keep_runs_in_a_non_ascii_digit_is_ignored_not_a_failed_run(box, tmp_path):
    """CONTAIN_KEEP_RUNS that is not a count is ignored (the default
    applies), as `CONTAIN_KEEP_RUNS=lots` is: `²` (isdigit(), but not for
    int()) failed every run with exit 2 and int()'s own message, naming no
    variable, before anything ran."""
    marker = tmp_path / "ran"
    p = contain_in(box, "run", "-q", "--", "touch", str(marker), env={"CONTAIN_KEEP_RUNS": "\u00b2"})
    assert p.returncode == 0 and marker.exists(), (p.returncode, p.stderr)
    g = contain_in(box, "gc", "--keep", "\u00b2")
    assert g.returncode == 2 and "not a count" in g.stderr, (g.returncode, g.stderr)


@needs_cgroup
def test_worker_cancel_after_its_run_ended_and_was_collected_is_not_live(box, tmp_path):
    """A runner's clean-up cancels every Worker it started, ended or not
    ("w.cancel(...) -> effect cancel_requested | not_live"). Once `contain
    gc` had removed an ended run's directory, `w.cancel()` raised
    RunNotFound, even with the op id it had answered `not_live` before;
    and once another run had the id, it answered `unknown` ("refused").
    The Worker saw its run end: the answer is `not_live`, and the other
    run of the id is left alone."""
    import launcher

    w = launcher.spawn(["true"], id="gone")
    assert w.wait(30).state == "REAPED"
    assert w.cancel(op_id="first").effect == "not_live"
    g = contain_in(box, "gc", "--keep", "0", "--json")
    assert "gone" in json.loads(g.stdout)["removed"], g.stdout
    for op in ("first", "later"):
        ack = w.cancel(op_id=op)
        assert ack.effect == "not_live" and ack.state == "REAPED" and ack.op_id == op, ack.to_dict()
    other = launcher.spawn(["sleep", "60"], id="gone")
    try:
        ack = w.cancel(op_id="third")
        assert ack.effect == "not_live" and ack.run_uid == w.run_uid, ack.to_dict()
        assert other.record().state == "RUNNING" and not other.done()
    finally:
        other.cancel(grace=0)
        other.wait(30)
    assert _survivors(box) == []


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a cgroup base of the test's own)")


_BROKEN_CONTAIN = """
import sys
import launcher._postconditions as p

def broken(*a, **k):
    raise RuntimeError("injected fault in the stop's postconditions")

p.measure = broken
from launcher._cli import console
sys.argv = ["contain", *sys.argv[1:]]
console()
"""


@needs_root
def test_a_bug_raised_while_supervising_exits_125_not_an_exit_status_the_worker_could_have(contained, tmp_path):
    """Each RecursionError above came out of `contain run` as a traceback
    and exit status 1: to a script, the worker's own `exit 1`. Whatever
    escapes the supervision is contain's failure: 125 (CONTRACT.md), with
    the way out (`contain cancel` adopts the orphaned run)."""
    import sys

    env = contained["env"]
    p = subprocess.run([sys.executable, "-c", _BROKEN_CONTAIN, "run", "--id", "bug", "--workspace", str(tmp_path),
                        "--", "true"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 125, p.stderr[-1500:]
    assert "contain cancel bug" in p.stderr
    c = run_contain(env, "cancel", "bug", "--wait", "--timeout", "30")
    assert "Traceback" not in c.stderr, c.stderr
    assert c.returncode == 0, c.stdout + c.stderr
    assert holders(contained["token"]) == []
