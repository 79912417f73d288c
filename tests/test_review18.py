"""Review 18: the acceptance checker's view, driving `contain` only through
its outside contract (CONTRACT.md) with adversarial inputs.

Real kernel throughout: every workload carries the box's token and is
killed by it at the end; survival is decided by the test's own /proc scan;
every wait is bounded.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _proc import holders
from conftest import TOKEN_VAR, needs_cgroup

PY = sys.executable


def _contain(box, *args: str, env: dict[str, str] | None = None,
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
    p = _contain(box, "run", "--backend", "none", "--pids-max", "10", "--record", "-", "--", "true",
                 env={"CONTAIN_CGROUP_V1": "off"})
    assert p.returncode == 125, p.stderr
    assert b"Traceback" not in p.stderr
    rec = json.loads(p.stdout)
    assert rec["outcome"] == "spawn_failed"
    assert rec["limits"]["asked"] == {"pids_max": 10}, rec["limits"]
    assert rec["limits"]["applied"] == {}, rec["limits"]
    assert any("--pids-max" in n for n in rec["limits"].get("notes", [])), rec["limits"]
    assert _survivors(box) == []


def test_doctor_as_a_user_names_no_v1_controller_that_user_cannot_get(tmp_path):
    """`contain run --memory-max` as a user without a writable v1 memory
    cgroup fails with "(`contain doctor` lists, per controller, where this
    host offers it)"; doctor must then not list `cgroup1 memory` for that
    user, or the user is sent in a circle. Every v1 route doctor reports for
    a spare uid must be one its runs really get: a limit on it is applied."""
    from _users import as_uid, python, spare_uids, user_env, why_not

    reason = why_not()
    if reason:
        pytest.skip(reason)
    uid = spare_uids(1)[0]
    home = tmp_path / "home"
    home.mkdir()
    os.chown(tmp_path, 0, 0)
    os.chmod(tmp_path, 0o755)
    os.chown(home, uid, uid)
    os.chmod(home, 0o700)
    env = user_env(XDG_RUNTIME_DIR=str(home))
    p = as_uid(uid, [python(), "-m", "launcher", "doctor", "--json"], env=env)
    assert p.returncode == 0, p.stderr
    routes = json.loads(p.stdout)["controllers"]["routes"]
    flag = {"memory": ("--memory-max", "64M"), "pids": ("--pids-max", "50"), "cpu": ("--cpu-max", "1")}
    for c, (opt, value) in flag.items():
        via = (routes.get(c) or {}).get("via")
        if via is None:
            continue
        r = as_uid(uid, [python(), "-m", "launcher", "run", "-q", opt, value, "--", "true"], env=env)
        assert r.returncode == 0, (f"doctor says {c} comes by {via!r} for uid {uid}, but {opt} fails: "
                                   f"{r.stderr.strip()}")


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
        p = _contain(box, "cancel", rid, "--op-id", "op1", "--wait", "--timeout", "0.5")
        assert p.returncode == 1, (p.stdout, p.stderr)
        assert b"Traceback" not in p.stderr
        lines = [ln for ln in p.stderr.decode().splitlines() if ln.strip()]
        assert len(lines) == 1 and rid in lines[0] and "0.5" in lines[0], p.stderr
        # The stop is then finished by a second operation without the grace.
        p = _contain(box, "cancel", rid, "--op-id", "op2", "--grace", "0", "--wait", "--timeout", "20")
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
@pytest.mark.parametrize("name", ["/dev/stdin", "/dev/fd/0", "/proc/self/fd/0"])
def test_record_to_stdin_however_named_never_replaces_the_callers_input_file(box, tmp_path, name):
    """`--record /dev/fd/0` with stdin redirected from a file is refused
    ("our descriptor 0, open only for reading"); `/dev/stdin` is the same
    descriptor by another name (a root-owned link to /proc/self/fd/0) and
    must get the same answer, not the atomic replace of a regular file:
    that deleted the caller's input (`contain run --record /dev/stdin --
    cat < data` left `data` holding the record)."""
    data = tmp_path / "input.txt"
    data.write_bytes(b"the caller's data\n")
    with open(data, "rb") as stdin:
        p = subprocess.run([PY, "-m", "launcher", "run", "--record", name, "--", "true"], env=box.env,
                           stdin=stdin, capture_output=True, timeout=60)
    assert data.read_bytes() == b"the caller's data\n"
    assert p.returncode == 125, (p.returncode, p.stderr)
    lines = p.stderr.decode().splitlines()
    assert len(lines) == 1 and "descriptor 0" in lines[0], p.stderr
    assert _survivors(box) == []


@needs_cgroup
def test_record_to_dev_tty_without_a_terminal_is_not_called_a_fifo(box):
    """`--record /dev/tty` from a process with no controlling terminal (cron,
    a CI job) fails to open with ENXIO, as a FIFO with no reader does; the
    one line must say what is wrong with a terminal device, not send the
    user looking for a FIFO reader."""
    p = subprocess.run([PY, "-m", "launcher", "run", "--record", "/dev/tty", "--", "true"], env=box.env,
                       capture_output=True, timeout=60, start_new_session=True)
    assert p.returncode == 125, p.stderr
    lines = p.stderr.decode().splitlines()
    assert len(lines) == 1 and "/dev/tty" in lines[0], p.stderr
    assert "FIFO" not in lines[0], lines[0]


@needs_cgroup
@pytest.mark.parametrize("spelling", [["--id", ""], ["--id="]])
def test_run_with_an_empty_id_is_a_usage_error_not_a_generated_id(box, tmp_path, spelling):
    """`contain run --id "$JOB" -- CMD` with $JOB unset must not start CMD
    under a made-up id: the script's later `contain wait "$JOB"` and
    `contain cancel "$JOB"` are usage errors ('' is no run id), so the run
    it started could be neither waited for nor cancelled by name. As
    `--op-id ''` is, an empty --id is refused (2, one line) and nothing runs."""
    marker = tmp_path / "ran"
    p = _contain(box, "run", *spelling, "--", "sh", "-c", f"touch {marker}")
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
        c = _contain(box, "cancel", "g")
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
