"""Accounting, limits, locks and redispatch through `contain run`, as a user
drives them (issue 14). The modules are tested on their own in
test_accounting.py, test_controllers.py, test_locks.py; here the run applies
the limits before the worker's first instruction, records what it cost, and
says whether the next attempt may start. Survival is the test's own scan."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _proc import holders, run_contain
from conftest import needs_cgroup

pytestmark = needs_cgroup
PY = sys.executable


def _v1(controller: str) -> bool:
    from launcher import _controllers as C

    return any(controller in h.controllers for h in C.v1_hierarchies())


def test_a_clean_run_records_its_cost_and_may_be_redispatched(box, tmp_path):
    stats = tmp_path / "stats.ndjson"
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\n"
    p = run_contain(box.env, "run", "--id", "a", "--stats-json", str(stats), "--",
                    "sh", "-c", f"setsid {PY} -c '{burn}' & wait")
    assert p.returncode == 0, p.stderr
    rec = box.record("a")
    acct = rec["accounting"]
    assert acct["cpu_usec"]["value"] >= 150_000 and "cpu.stat" in acct["cpu_usec"]["source"]
    assert acct["wall_s"]["value"] > 0
    for k, m in acct.items():
        if isinstance(m, dict) and "value" in m:
            assert m["value"] is not None or m.get("reason"), (k, m)     # never a bare null
    assert rec["evidence"]["redispatch_eligible"]["observed"] is True
    line = json.loads(stats.read_text().splitlines()[-1])
    assert line["run_id"] == "a" and line["state"] == "REAPED"
    w = run_contain(box.env, "wait", "a", "--redispatch")
    assert w.returncode == 0 and "redispatch_eligible true" in w.stdout
    assert holders(box.token) == []


def test_a_stats_json_another_user_could_choose_is_refused_before_the_worker_runs(box, tmp_path):
    """--stats-json was checked only when the run ended: pointed at a link
    in a directory anyone may write (another user's, standing in here), the
    worker ran to the end and only then did contain exit 125. It is
    refused up front now, as --record is: nothing runs."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "stats.ndjson").symlink_to("/etc/passwd")
    marker = tmp_path / "ran"
    p = run_contain(box.env, "run", "--id", "sj", "--stats-json", str(shared / "stats.ndjson"), "--",
                    "touch", str(marker))
    assert p.returncode == 125 and "--stats-json" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not marker.exists(), "the worker ran"
    assert not os.path.exists(os.path.join(box.state_dir, "runs", "sj")), "a run was claimed"
    assert holders(box.token) == []


@pytest.mark.skipif(not _v1("pids"), reason="no pids controller on this host (neither v2 delegated nor v1)")
def test_a_fork_bomb_is_stopped_by_pids_max(box):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    p = run_contain(box.env, "run", "--id", "b", "--pids-max", "24", "--timeout", "3", "--grace", "0",
                    "--", PY, "-c", bomb, timeout=60)
    assert p.returncode == 124, p.stderr
    rec = box.record("b")
    assert rec["limits"]["applied"]["pids_max"]["value"] >= 24
    assert rec["accounting"]["tasks_peak"]["value"] <= 24      # the tree alone: the wall's init is not in it
    assert rec["limits"]["hit"]["pids_max"]["observed"] is True
    assert rec["state"] == "REAPED" and holders(box.token) == []


@pytest.mark.skipif(not _v1("memory"), reason="no memory controller on this host (neither v2 delegated nor v1)")
def test_a_memory_hog_is_oom_killed_and_the_record_says_so(box):
    p = run_contain(box.env, "run", "--id", "m", "--memory-max", "48M", "--",
                    PY, "-c", "x = bytearray(256 << 20)", timeout=60)
    assert p.returncode == 128 + 9, p.stderr
    rec = box.record("m")
    assert rec["outcome"] == "signaled" and rec["signal"] == 9
    assert rec["signal_cause"]["cause"] == "oom_kill", rec.get("signal_cause")
    assert rec["accounting"]["oom_kills"]["value"] >= 1
    assert rec["limits"]["hit"]["oom_kill"]["observed"] is True
    assert rec["state"] == "REAPED" and holders(box.token) == []


def test_a_limit_no_controller_can_give_is_refused_with_125(box):
    env = dict(box.env, CONTAIN_CGROUP_V1="off")     # this host's v2 has no controllers
    p = run_contain(env, "run", "--id", "r", "--memory-max", "64M", "--", "sh", "-c", "echo ran")
    assert p.returncode == 125 and "ran" not in p.stdout, (p.returncode, p.stdout, p.stderr)
    assert "memory" in p.stderr and "Traceback" not in p.stderr
    assert box.leaves() == [] and holders(box.token) == []


def test_a_lock_handed_to_an_outside_process_fails_the_locks_layer_and_redispatch(box, tmp_path):
    """The worker flocks a file and hands the open file to a process outside
    the run (over a unix socket): the locks layer is false and names it."""
    sock = str(tmp_path / "s")
    lock = str(tmp_path / "workspace.lock")
    holder = subprocess.Popen([PY, "-c", f"""
import array, fcntl, os, socket, time
s = socket.socket(socket.AF_UNIX); s.bind({sock!r}); s.listen(1); s.settimeout(30)
c, _ = s.accept()
msg, anc, flags, addr = c.recvmsg(16, socket.CMSG_SPACE(4))
fd = array.array("i", anc[0][2])[0]
print("held", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        worker = f"""
import array, fcntl, os, socket, time
f = open({lock!r}, "w"); fcntl.flock(f, fcntl.LOCK_EX)
for _ in range(100):
    try:
        s = socket.socket(socket.AF_UNIX); s.connect({sock!r}); break
    except OSError:
        time.sleep(0.05)
s.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [f.fileno()]))])
time.sleep(0.5)
"""
        p = run_contain(box.env, "run", "--id", "l", "--check-locks", "--", PY, "-c", worker, timeout=60)
        assert p.returncode == 0, p.stderr
        assert holder.stdout.readline().strip() == "held"
        rec = box.record("l")
        locks = rec["evidence"]["locks_released"]
        assert locks["observed"] is False, locks
        assert any(h.get("pid") == holder.pid for h in json.dumps(locks["detail"]) and
                   locks["detail"].get("held_by", [])) or str(holder.pid) in json.dumps(locks["detail"])
        red = rec["evidence"]["redispatch_eligible"]
        assert red["observed"] is False and "locks_released" in json.dumps(red["detail"])
        assert run_contain(box.env, "wait", "l", "--redispatch").returncode == 1
    finally:
        holder.kill()
        holder.wait(10)


def test_redispatch_is_unknown_when_a_measured_postcondition_could_not_be_observed(box, tmp_path):
    """A workspace gone by the end of the run cannot be checked: the layer is
    null, so redispatch_eligible is null too (never true). (One missing from
    the start is refused before anything runs.)"""
    ws = tmp_path / "ws"
    ws.mkdir()
    p = run_contain(box.env, "run", "--id", "u", "--workspace", str(ws), "--", "rmdir", str(ws))
    assert p.returncode == 0, p.stderr
    rec = box.record("u")
    assert rec["evidence"]["workspace_quiescent"]["observed"] is None
    assert rec["evidence"]["redispatch_eligible"]["observed"] is None
    assert run_contain(box.env, "wait", "u", "--redispatch").returncode == 1


def test_a_bad_limit_is_a_usage_error(box):
    p = run_contain(box.env, "run", "--memory-max", "lots", "--", "true")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert os.path.isdir(box.state_dir) is False or box.leaves() == []


@pytest.mark.skipif(os.geteuid() != 0 or not _v1("memory"), reason="a root worker and the v1 memory hierarchy")
def test_a_root_worker_that_left_its_memory_cgroup_is_not_counted_as_if_it_had_stayed(box):
    """A root worker moved itself into another v1 memory cgroup (one this
    test made) and used 120 MB there under --memory-max 50M. The record said
    peak 256 KiB, limit applied, not hit, and nothing else: the figures read
    as the tree's, and the limit as binding. They cover what stayed in the
    run's cgroups, and the record now says so (a `--user` run cannot move)."""
    from launcher import _controllers as C

    h = next(h for h in C.v1_hierarchies() if "memory" in h.controllers)
    elsewhere = os.path.join(h.mount, box.v1_base.lstrip("/"), "elsewhere")
    os.makedirs(elsewhere)
    try:
        hog = f"echo $$ > {elsewhere}/tasks && exec {PY} -c 'b = bytearray(120 << 20); b[::4096] = b\"x\" * len(b[::4096])'"
        p = run_contain(box.env, "run", "--id", "m", "--memory-max", "50M", "--", "sh", "-c", hog)
        assert p.returncode == 0, p.stderr
        rec = box.record("m")
        assert rec["accounting"]["memory_peak_bytes"]["value"] < 50 << 20, "the scaffold did not move out"
        for where in (rec["accounting"], rec["limits"]):
            assert any("could write its pid" in n and "stayed in them" in n for n in where.get("notes", [])), where
        p = run_contain(box.env, "run", "--id", "u", "--user", "nobody", "--memory-max", "50M", "--", "true")
        assert p.returncode == 0, p.stderr
        assert "notes" not in box.record("u")["accounting"]
    finally:
        os.rmdir(elsewhere)


def test_stats_json_dash_is_stdout_not_a_file_named_dash(box, tmp_path):
    """`--stats-json -` made a file named `-` in the working directory,
    while `--record -` means stdout. It is stdout; with stdout closed the
    run is refused before the worker runs (125), as an unwritable file is."""
    p = subprocess.run([PY, "-m", "launcher", "run", "--id", "s", "--stats-json", "-", "--", "true"],
                       env=box.env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    line = json.loads(p.stdout.strip().splitlines()[-1])
    assert line["run_id"] == "s" and line["state"] == "REAPED"
    assert not os.path.exists(tmp_path / "-")
    marker = tmp_path / "ran"
    p = subprocess.run(f"{PY} -m launcher run --id c --stats-json - -- touch {marker} >&-", shell=True,
                       env=box.env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 125 and "--stats-json -" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not marker.exists(), "the worker ran although its stats line could not be kept"


# A library loop in a child process: one interpreter for every run (a
# `contain run` per iteration costs 250 ms here, a library run 10-25 ms), and
# a child so that a hang is bounded by subprocess's timeout.
_MANY_SHORT_RUNS = r"""
import json, sys
import launcher
from launcher._errors import LauncherError

side, n, limit, value = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
outcomes, failed, notes = {}, [], []
for i in range(n):
    try:
        rec = launcher.run(["sh", "-c", f"echo {i} >> {side}"], id=f"r{i}", **{limit: value}).to_dict()
    except LauncherError as e:
        failed.append([i, str(e)])
        outcomes["raised"] = outcomes.get("raised", 0) + 1
        continue
    key = f"{rec['outcome']}/{rec['exit_code']}/{rec['state']}"
    outcomes[key] = outcomes.get(key, 0) + 1
    placement = (rec["containment"].get("cgroup_v1") or {}).get("placement") or {}
    if placement.get("observed") is not True:
        notes.append([i, placement, rec.get("notes")])
    if rec["outcome"] == "spawn_failed":
        failed.append([i, rec["evidence"]["root_exit"]])
print(json.dumps({"outcomes": outcomes, "failed": failed, "notes": notes}))
"""


@pytest.mark.parametrize("limit,value,controller", [("memory_max", "64M", "memory"), ("cpu_max", "1", "cpu"),
                                                     ("pids_max", "16", "pids")])
def test_a_fast_worker_that_ran_is_never_recorded_as_a_failed_start(box, tmp_path, limit, value, controller):
    """With any limit, about 1 fast worker in 100-150 ended exit 125,
    outcome spawn_failed, root_exit "spawn", with a Python dict for a
    message: the placement check read /proc/<pid>/cgroup of a worker that
    was already exiting, for which the kernel prints "/" on every v1
    hierarchy. The command had run (the side-effect file says so), and a
    runtime that retries a spawn_failed would run it twice. Every run here
    ran, so every record says it ran; a placement that could not be
    verified is a note, in words."""
    if not _v1(controller):
        pytest.skip(f"no v1 {controller} hierarchy on this host")
    n = 600
    side = tmp_path / "sidefx"
    p = subprocess.run([PY, "-c", _MANY_SHORT_RUNS, str(side), str(n), limit, value], env=box.env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    ran = side.read_text().split()
    assert ran == [str(i) for i in range(n)], "a command did not run, or ran twice"
    assert got["failed"] == [] and got["outcomes"] == {"exited/0/REAPED": n}, got
    for i, placement, notes in got["notes"]:
        assert placement.get("observed") is None, (i, placement)
        note = placement["detail"]["note"]
        assert "not verified" in note and "{" not in note and note in (notes or []), (i, placement, notes)
    assert holders(box.token) == []


@pytest.mark.skipif(not _v1("pids"), reason="no v1 pids hierarchy on this host")
def test_pids_max_counts_the_tree_and_not_contains_own_init(box, tmp_path):
    """--pids-max counted contain's own init (pid 1 of the run's PID
    namespace): `--pids-max 1 -- true` failed with "fork in the pid
    namespace failed", and `--pids-max 2 -- sh -c ...` said "sh: Cannot
    fork" when sh forked its one child. The worker joins the pids cgroup
    itself now: N lets the tree have N tasks, and N means N."""
    p = run_contain(box.env, "run", "--id", "one", "--pids-max", "1", "--", "true")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    rec = box.record("one")
    assert rec["outcome"] == "exited" and rec["state"] == "REAPED", rec["evidence"]["root_exit"]
    assert rec["accounting"]["tasks_peak"]["value"] == 1
    side = tmp_path / "side"
    two = f"ls / > /dev/null && echo ran > {side}"
    p = run_contain(box.env, "run", "--id", "two", "--pids-max", "2", "--", "sh", "-c", two)
    assert p.returncode == 0, p.stderr
    assert side.read_text() == "ran\n"
    assert box.record("two")["accounting"]["tasks_peak"]["value"] == 2
    # And the limit still binds the tree: one task, and sh cannot fork ls.
    side.unlink()
    p = run_contain(box.env, "run", "--id", "tight", "--pids-max", "1", "--", "sh", "-c", two)
    assert p.returncode != 0 and not side.exists(), (p.returncode, p.stderr)
    rec = box.record("tight")
    assert rec["outcome"] == "exited" and rec["limits"]["hit"]["pids_max"]["observed"] is True, rec["limits"]
    assert holders(box.token) == []


@pytest.mark.skipif(not _v1("memory"), reason="no v1 memory hierarchy on this host")
def test_memory_max_says_it_counts_contains_own_init(box):
    """--memory-max 1 said only "the pid namespace init died killed by
    signal 9". The init stays in the run's memory cgroup (a vfork child
    that joins one at its limit faults for ever, _runcgroups.py), so the
    error says what happened and how the init is counted, and a limited
    run's record says it in limits.notes."""
    p = run_contain(box.env, "run", "--id", "tiny", "--memory-max", "1", "--", "true", timeout=60)
    assert p.returncode == 125, (p.returncode, p.stderr)
    assert "contain's init" in p.stderr and "--memory-max counts the init's own pages" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "{" not in p.stderr, p.stderr
    rec = box.record("tiny")
    assert rec["outcome"] == "spawn_failed" and rec["evidence"]["root_exit"]["detail"]["stage"] == "pid namespace init"
    assert rec["limits"]["hit"]["oom_kill"]["observed"] is True
    p = run_contain(box.env, "run", "--id", "ok", "--memory-max", "64M", "--", "true")
    assert p.returncode == 0, p.stderr
    notes = box.record("ok")["limits"]["notes"]
    assert any("contain's init" in n and "memory_max" in n for n in notes), notes
    # Without the wall there is no init to count.
    p = run_contain(box.env, "run", "--id", "bare", "--no-pidns", "--memory-max", "64M", "--", "true")
    assert p.returncode == 0, p.stderr
    assert not any("contain's init" in n for n in box.record("bare")["limits"]["notes"])
    assert holders(box.token) == []
