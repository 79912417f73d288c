"""`contain doctor`: it names what this host lacks, checked against the
test's own reading of the host (mountinfo, and its own clone3 probe of the
cgroup.kill bug), and it leaves no scratch cgroup behind."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys

import pytest

from _survivors import IS_ROOT, ROOT, cgroup2_nsdelegate, contain_base

HELPER = os.path.join(ROOT, "tests", "_clone3_into.py")


def _doctor(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launcher", "doctor", *args]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                          timeout=60)


def _scratch_left() -> list[str]:
    base = contain_base()
    if not base or not os.path.isdir(base):
        return []
    return [n for n in os.listdir(base) if n.startswith("doctor-")]


def _own_kill_bug_probe() -> bool:
    """Write cgroup.kill on an empty leaf of our own, clone3 a child into
    it, and see whether the child was SIGKILLed before it could exit 0."""
    leaf = os.path.join(contain_base(), f"seal-test-killbug-{secrets.token_hex(3)}")
    os.mkdir(leaf)
    try:
        with open(os.path.join(leaf, "cgroup.kill"), "w") as f:
            f.write("1")
        out = subprocess.run([sys.executable, HELPER, leaf], capture_output=True, text=True, timeout=30).stdout
        word = out.split()
        assert word[:2] == ["clone3", "ok"], out
        status = int(word[3])
        return os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9
    finally:
        for _ in range(100):
            try:
                os.rmdir(leaf)
                break
            except FileNotFoundError:
                break
            except OSError:
                import time

                time.sleep(0.01)


@pytest.fixture(scope="module")
def seal_doctor_json():
    before = set(_scratch_left())
    r = _doctor("--json")
    assert set(_scratch_left()) == before, "doctor left scratch cgroups"
    return r


@pytest.mark.skipif(not IS_ROOT, reason="the probes need a writable cgroup base (root here)")
def test_doctor_json_exit_and_modes(seal_doctor_json):
    r = seal_doctor_json
    assert r.returncode == 0, r.stderr
    caps = json.loads(r.stdout)
    assert caps["containment_possible"] is True
    modes = {m["mode"]: m for m in caps["modes"]}
    assert modes["none (degraded)"]["strongest_state"] == "EXITED"
    assert modes["cgroup2"]["strongest_state"] == "REAPED"
    assert caps["clone3_into_cgroup"]["ok"] is True
    assert caps["pidfd"]["ok"] is True


@pytest.mark.skipif(not IS_ROOT, reason="the probes need a writable cgroup base (root here)")
def test_doctor_names_missing_nsdelegate(seal_doctor_json):
    caps = json.loads(seal_doctor_json.stdout)
    assert caps["cgroup2"]["nsdelegate"] is cgroup2_nsdelegate()
    if cgroup2_nsdelegate() is False:
        human = _doctor().stdout
        line = next(x for x in human.splitlines() if x.strip().startswith("nsdelegate"))
        assert "no" in line, line


@pytest.mark.skipif(not IS_ROOT, reason="the probe needs a cgroup leaf of our own")
def test_doctor_names_the_kill_bug(seal_doctor_json):
    caps = json.loads(seal_doctor_json.stdout)
    ours = _own_kill_bug_probe()
    assert caps["cgroup_kill_bug"]["present"] is ours
    human = _doctor().stdout
    line = next(x for x in human.splitlines() if "cgroup.kill fork bug" in x)
    assert ("PRESENT" in line) is ours, line


def test_doctor_without_a_cgroup_base_exits_1():
    """As an unprivileged user with no delegated cgroup, only degraded mode
    is left: containment is impossible, exit 1, and the report says why."""
    py = "/usr/bin/python3"
    if not IS_ROOT or shutil.which("su") is None or not os.path.exists(py):
        pytest.skip("needs root to switch to nobody, and a system python for nobody")
    chk = subprocess.run(["su", "nobody", "-s", "/bin/sh", "-c", f"cd {ROOT} && {py} -c 'import launcher._native'"],
                         capture_output=True, text=True)
    if chk.returncode != 0:
        pytest.skip(f"nobody cannot import launcher with {py}: {chk.stderr.strip()[-200:]}")
    r = subprocess.run(["su", "nobody", "-s", "/bin/sh", "-c", f"cd {ROOT} && {py} -m launcher doctor"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "IMPOSSIBLE" in r.stdout and "EXITED" in r.stdout
    assert "Traceback" not in r.stderr
