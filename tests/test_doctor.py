"""`contain doctor`: it names what this host lacks, checked against the
test's own reading of the host (mountinfo, and its own clone3 probe of the
cgroup.kill bug), and it leaves no scratch cgroup behind."""
from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys

import pytest

from _proc import cgroup2_mount, remove_cgroup_tree
from _survivors import IS_ROOT, ROOT, cgroup2_nsdelegate, contain_base
from _users import python, pythonpath

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
    assert modes["cgroup2 + wall (default)"]["strongest_state"] == "REAPED"
    assert modes["cgroup2 (--no-pidns)"]["strongest_state"] == "REAPED"
    assert modes["pidns (no cgroup)"]["strongest_state"] == "REAPED"
    assert caps["pidns_wall"]["ok"] is True
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


def test_doctor_without_a_cgroup_base_offers_the_wall_alone():
    """As an unprivileged user with no delegated cgroup, the PID-namespace
    wall is what is left (inside a user namespace of its own): containment
    is still possible (REAPED through the pidns backend), the cgroup modes
    say why not, exit 0."""
    r = subprocess.run(["su", "nobody", "-s", "/bin/sh", "-c", _launcher_for_nobody("doctor --json")],
                       capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr
    caps = json.loads(r.stdout)
    by = {m["mode"]: m for m in caps["modes"]}
    assert by["cgroup2 (--no-pidns)"]["available"] is False and by["cgroup2 (--no-pidns)"]["why_not"]
    if caps["pidns_wall"]["ok"]:
        assert r.returncode == 0 and caps["containment_possible"] is True
        assert by["pidns (no cgroup)"]["strongest_state"] == "REAPED"
    else:
        # Without the wall, the supervisor's own subtree is what is left.
        sub = by["subreaper (no cgroup, no namespace)"]
        assert caps["containment_possible"] is sub["available"]
        assert r.returncode == (0 if sub["available"] else 1)


# -- what to do next -------------------------------------------------------------

def _next_steps(report: str) -> str:
    """The human report's last section."""
    head, sep, steps = report.partition("\nnext steps\n")
    assert sep, report[-500:]
    return steps


def _launcher_for_nobody(args: str, env: str = "") -> str:
    """A shell command for nobody that runs `python -m launcher ARGS` with
    what another uid can read (tests/_users.py stages it), not this tree,
    which may sit where nobody cannot reach it (a clone in root's home)."""
    if not IS_ROOT or shutil.which("su") is None:
        pytest.skip("needs root and su to switch to nobody")
    py, path = shlex.quote(python()), shlex.quote(pythonpath())
    chk = subprocess.run(["su", "nobody", "-s", "/bin/sh", "-c",
                          f"cd / && PYTHONPATH={path} {py} -c 'import launcher._native'"],
                         capture_output=True, text=True, timeout=60)
    if chk.returncode != 0:
        pytest.skip(f"nobody cannot import launcher with {py}: {chk.stderr.strip()[-200:]}")
    return f"cd / && {env} PYTHONPATH={path} {py} -m launcher {args}"


def _as_nobody(args: str, *, cgroup: str | None = None, env: str = "") -> subprocess.CompletedProcess:
    """`python -m launcher ARGS` as nobody; inside `cgroup` (one this test
    made) when given: the shell moves its own pid there before it becomes
    nobody."""
    inner = _launcher_for_nobody(args, env)
    move = f"echo $$ > {cgroup}/cgroup.procs && " if cgroup else ""
    return subprocess.run(["sh", "-c", f"{move}exec su nobody -s /bin/sh -c {shlex.quote(inner)}"],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not IS_ROOT, reason="the probes need a writable cgroup base (root here)")
def test_doctor_ends_with_what_root_can_do_next(seal_doctor_json):
    caps = json.loads(seal_doctor_json.stdout)
    steps = caps["next_steps"]
    assert steps and all(isinstance(s, str) and s for s in steps)
    human = _doctor()
    assert human.returncode == 0
    section = _next_steps(human.stdout)
    if caps["seal"]["ok"]:
        # This host lets a root worker leave (no nsdelegate): the way out is --seal or --user.
        assert "contain run --seal -- CMD" in section and "--user USER" in section, section


def test_doctor_tells_a_user_without_a_delegated_cgroup_how_to_get_one():
    import pwd

    r = _as_nobody("doctor")
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stdout + r.stderr
    section = _next_steps(r.stdout)
    uid = pwd.getpwnam("nobody").pw_uid
    assert "CONTAIN_CGROUP_BASE" in section and f"uid {uid}" in section and "as root" in section, section
    assert "--seal" not in section, "advised --seal to a user for whom it is refused"


def test_doctor_for_a_user_with_a_delegated_cgroup_does_not_advise_seal(tmp_path):
    """nobody inside a cgroup delegated to it (as systemd's Delegate=yes
    would make): containment works, and what is left (a worker of the same
    uid can move within its own subtree) needs root, which is what it says."""
    import pwd

    if not IS_ROOT or cgroup2_mount() is None:
        pytest.skip("needs root to delegate a cgroup of its own")
    nobody = pwd.getpwnam("nobody").pw_uid
    deleg = os.path.join(cgroup2_mount(), f"contain-doctor-deleg-{secrets.token_hex(3)}")
    os.mkdir(deleg)
    try:
        for f in ("", "cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):
            os.chown(os.path.join(deleg, f), nobody, -1)
        r = _as_nobody("doctor", cgroup=deleg)
        assert r.returncode == 0, r.stdout + r.stderr
        section = _next_steps(r.stdout)
        assert "root supervisor" in section, section
        assert "--seal" not in section, "advised --seal to a user for whom it is refused"
        assert [d for d in os.listdir(deleg) if d.startswith("doctor-")] == []
    finally:
        remove_cgroup_tree(deleg)


@pytest.mark.skipif(not IS_ROOT, reason="the probes need a writable cgroup base (root here)")
def test_doctor_names_an_unusable_cgroup_base(tmp_path):
    mnt = cgroup2_mount()
    bad = os.path.join(mnt, "cgroup.procs", "x")       # under a file: can never be a directory
    r = subprocess.run([sys.executable, "-m", "launcher", "doctor"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT, CONTAIN_CGROUP_BASE=bad), timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    section = _next_steps(r.stdout)
    assert f"CONTAIN_CGROUP_BASE={bad} cannot be used" in section and "unset it" in section, section


def test_next_steps_offer_a_systemd_scope_where_the_user_has_a_manager(tmp_path, monkeypatch):
    """Pure: the advice for a user with no delegated cgroup, on a host
    where systemd's user manager could delegate one (its private socket
    and systemd-run exist; faked here, nothing is started)."""
    from launcher import _advice

    (tmp_path / "systemd").mkdir()
    (tmp_path / "systemd" / "private").touch()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "systemd-run").write_text("#!/bin/sh\nexit 1\n")
    (bindir / "systemd-run").chmod(0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.delenv("CONTAIN_CGROUP_BASE", raising=False)
    caps = {"euid": 1000, "process_connector": {"ok": True},
            "cgroup2": {"mounts": [{"mount": "/sys/fs/cgroup"}], "nsdelegate": True,
                        "error": "own cgroup /user.slice/user-1000.slice/session-2.scope is not delegated to uid 1000"},
            "clone3_into_cgroup": {"ok": None, "error": "no writable cgroup v2 base"},
            "seal": {"ok": False, "error": "the namespace seal needs a root supervisor"}}
    caps["pidns_wall"] = {"ok": True}
    caps["modes"] = _advice.modes(caps)
    steps = _advice.next_steps(caps)
    assert steps[0].endswith("run contain inside a cgroup delegated to you by systemd: "
                             "`systemd-run --user --scope -p Delegate=yes contain run -- CMD`")
    assert steps[0].startswith("runs get the PID-namespace wall alone"), steps[0]
    assert any("CONTAIN_CGROUP_BASE" in s for s in steps) and any("as root" in s for s in steps)
    assert not any("--seal" in s for s in steps)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert not any("systemd-run" in s for s in _advice.next_steps(caps))


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
