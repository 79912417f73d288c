"""Bad input is refused before anything runs, with one clear line (issue
31, item 6), and `doctor` names the state directory (item 1). Each test
failed before: the input was accepted silently, or refused for the wrong
reason, or the state directory was not in the report.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest

from _proc import ROOT, contain_cmd, run_contain
from conftest import needs_cgroup


def _env(tmp_path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["CONTAIN_STATE_DIR"] = str(tmp_path / "state")
    env["PYTHONPATH"] = ROOT
    env.update(extra)
    return env


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_missing_workspace_is_a_usage_error_before_anything_runs(tmp_path):
    """Before: exit 0, and `wait --redispatch` failed long after."""
    marker = tmp_path / "ran"
    for ws, why in ((str(tmp_path / "nonexistent"), "No such file or directory"),
                    ("/etc/hostname", "not a directory")):
        p = run_contain(_env(tmp_path), "run", "--workspace", ws, "--", "sh", "-c", f"echo x > {marker}")
        assert p.returncode == 2, (p.returncode, p.stderr)
        assert why in _one_line(p.stderr) and "--workspace" in p.stderr
        assert not marker.exists()


@needs_cgroup
def test_stats_json_writes_a_device_and_a_fifo_in_place_as_record_does(tmp_path, cgroup_base):
    """Before: /dev/null, /dev/stderr and a FIFO were refused (125) where
    --record writes them in place; a FIFO's reader must get the line."""
    env = _env(tmp_path)
    for target in ("/dev/null", "/dev/stderr"):
        p = run_contain(env, "run", "--stats-json", target, "--", "true")
        assert p.returncode == 0, (target, p.stderr)
    assert '"schema":"contain.stats/1"' in p.stderr          # the /dev/stderr one
    fifo = str(tmp_path / "collector")
    os.mkfifo(fifo, 0o600)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    p = run_contain(env, "run", "--stats-json", fifo, "--", "true")
    reader.join(30)
    assert p.returncode == 0, p.stderr
    assert got and json.loads(got[0])["state"] == "REAPED", got
    # With nobody reading, the line could never be written: refused up front.
    p = run_contain(env, "run", "--stats-json", fifo, "--", "sh", "-c", f"echo ran > {tmp_path}/m")
    assert p.returncode == 125 and "no reader" in _one_line(p.stderr)
    assert not (tmp_path / "m").exists()


@needs_cgroup
def test_an_invalid_keep_runs_is_named_not_ignored(tmp_path, cgroup_base):
    p = run_contain(_env(tmp_path, CONTAIN_KEEP_RUNS="abc"), "run", "--", "true")
    assert p.returncode == 0, p.stderr
    assert "CONTAIN_KEEP_RUNS='abc' is not a count" in _one_line(p.stderr)


def _v1_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup"]:
                return left.split()[4]
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a cgroup base of its own)")
def test_a_cgroup_base_that_is_not_on_cgroup2_is_refused(tmp_path):
    """Before: a v1 hierarchy's path silently became a nested v2 cgroup of
    that name (and a run went into it)."""
    v1 = _v1_mount()
    cases = [(str(tmp_path), "not on a cgroup2 mount")]
    if v1 is not None:
        cases.append((os.path.join(v1, f"contain-test-{os.getpid()}"), "cgroup v1"))
    for base, why in cases:
        p = run_contain(_env(tmp_path, CONTAIN_CGROUP_BASE=base), "run", "--", "sh", "-c",
                        f"echo ran > {tmp_path}/m")
        assert p.returncode == 125, (base, p.returncode, p.stderr)
        assert why in _one_line(p.stderr)
        assert not os.path.exists(os.path.join(tmp_path, "m"))
        assert not os.path.exists(base) or base == str(tmp_path)


@pytest.mark.parametrize("value", ["", "relative/state"])
def test_an_empty_or_relative_state_dir_is_a_usage_error(tmp_path, value):
    """Before: empty fell back to the shared default, relative resolved
    against the current directory and was made 0755 there."""
    env = _env(tmp_path)
    env["CONTAIN_STATE_DIR"] = value
    for args in (("run", "--", "true"), ("ls",)):
        p = subprocess.run(contain_cmd(*args), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, (args, p.returncode, p.stderr)
        assert "CONTAIN_STATE_DIR" in _one_line(p.stderr)
    assert not (tmp_path / "relative").exists()


def test_doctor_names_the_state_directory_and_what_to_do(tmp_path):
    """Before: doctor said "containment: possible" with no word of a state
    directory every run refused."""
    os.chmod(tmp_path, 0o777)
    p = run_contain(_env(tmp_path, CONTAIN_STATE_DIR=str(tmp_path)), "doctor", "--json", timeout=120)
    caps = json.loads(p.stdout)
    assert caps["state_dir"]["usable"] is False and caps["state_dir"]["path"] == str(tmp_path)
    assert caps["containment_possible"] is False
    assert any("CONTAIN_STATE_DIR" in s for s in caps["next_steps"])
    os.chmod(tmp_path, 0o700)
    p = run_contain(_env(tmp_path), "doctor", timeout=120)
    assert "state directory" in p.stdout and str(tmp_path / "state") in p.stdout


# -- what contain run says (issue 31, item 5) ------------------------------------

def _run_with_tty_stderr(env: dict[str, str], *argv: str) -> tuple[int, str]:
    import pty

    master, slave = pty.openpty()
    try:
        p = subprocess.run(contain_cmd("run", *argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=slave, timeout=60)
        os.close(slave)
        slave = -1
        out = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        return p.returncode, out.decode(errors="replace")
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)


@needs_cgroup
def test_the_stop_line_comes_only_when_something_was_stopped(tmp_path, cgroup_base):
    """Before: on a terminal most trivial runs said "stopped 0 leftover
    processes with SIGTERM" (the stop signalled the wall's init alone)."""
    env = _env(tmp_path)
    for _ in range(8):
        rc, err = _run_with_tty_stderr(env, "--", "true")
        assert rc == 0 and err.strip() == "", err
    rc, err = _run_with_tty_stderr(env, "--grace", "0.5", "--", "sh", "-c", "sleep 30 & exit 0")
    assert rc == 0 and "stopped 1 leftover process (sleep)" in err, err


@needs_cgroup
def test_an_oom_kill_is_named_on_stderr_without_verbose(tmp_path, cgroup_base):
    p = run_contain(_env(tmp_path), "run", "--memory-max", "32M", "--", "python3", "-c",
                    "x = bytearray(256 * 1024 * 1024)")
    if p.returncode == 125:
        pytest.skip(f"no memory limit on this host: {p.stderr.strip()}")
    assert p.returncode == 128 + 9, p.stderr
    assert "OOM killer killed" in p.stderr and "the worker was one of them" in p.stderr, p.stderr


def test_cancel_wait_of_an_unconfirmed_run_does_not_advise_the_command_just_run():
    from launcher._views import cancel_did_not_hold

    why = cancel_did_not_hold("r1", {"effect": "cancel_requested", "state": "UNCONFIRMED", "op_id": "o"},
                              wait=True, timeout=None)
    assert why is not None and "UNCONFIRMED" in why and "contain cancel" not in why and "contain status r1" in why


@needs_cgroup
def test_ls_shows_the_peak_memory_of_ended_runs_where_measured(tmp_path, cgroup_base):
    env = _env(tmp_path)
    p = run_contain(env, "run", "--id", "measured", "--accounting", "--", "python3", "-c",
                    "x = bytearray(40 * 1024 * 1024)")
    assert p.returncode == 0, p.stderr
    views = json.loads(run_contain(env, "ls", "--json").stdout)
    v = next(x for x in views if x["id"] == "measured")
    if v["memory_peak_bytes"] is None:
        pytest.skip("this host measures no peak memory for a run")
    assert v["memory_peak_bytes"] >= 40 * 1024 * 1024
    table = run_contain(env, "ls", "--all").stdout
    row = next(line for line in table.splitlines() if line.startswith("measured"))
    assert "MiB" in row, table
