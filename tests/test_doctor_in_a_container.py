"""`contain doctor` inside a default container: it says what the container
withholds, from what the kernel shows, and what contain can still prove.

tests/_container.py makes the container (Docker's seccomp refusals, its
capabilities, read-only cgroup mounts in a cgroup namespace, a masked
/proc, a PID namespace); `python3 -m launcher doctor` runs inside it as a
CI step would, and the test checks its answers against what the harness
made. Before, the doctor listed the degraded mode as the only thing left
and said nothing of why: it printed the read-only cgroup mount as "rw" (the
superblock's options), never named seccomp, clone3, CAP_SYS_ADMIN or the
masked /proc, and advised "only the cgroup holds the tree" under a line
saying there was no cgroup.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from typing import Any

import pytest

import _container
import _seccomp
from conftest import ROOT
from _survivors import IS_ROOT, contain_base

needs_container = pytest.mark.skipif(_container.why_not() is not None, reason=_container.why_not() or "")

SUBREAPER = "subreaper (no cgroup, no namespace)"


def _doctor_in_container(*args: str, **kw: Any) -> tuple[int, str, str, list[str]]:
    """`python3 -m launcher doctor ARGS` run inside a default container (as
    a CI step: PID 1 is another program); its status, stdout, stderr, and
    which of Docker's masked /proc paths exist there."""
    def fn() -> tuple[int, str, str, list[str]]:
        r = subprocess.run([sys.executable, "-m", "launcher", "doctor", *args], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
        masked = [p for p in _container.MASKED + _container.READONLY if os.path.exists(p)]
        return r.returncode, r.stdout, r.stderr, masked

    return _container.run(fn, **kw)


def _caps_in_container(**kw: Any) -> tuple[dict[str, Any], list[str]]:
    rc, out, err, masked = _doctor_in_container("--json", **kw)
    assert "Traceback" not in err, err
    caps = json.loads(out)
    assert rc == (0 if caps["containment_possible"] else 1), (rc, err)
    return caps, masked


@needs_container
@pytest.mark.forked
def test_doctor_names_the_seccomp_filter_and_the_refused_clone3() -> None:
    caps, _ = _caps_in_container()
    sc = caps["container"]["seccomp"]
    assert (sc["mode"], sc["mode_name"]) == (2, "filter"), sc
    assert sc["refuses"] == {"clone3": "ENOSYS", "clone_namespaces": "EPERM", "unshare": "EPERM",
                             "mount": "EPERM"}, sc
    assert caps["clone3"]["usable"] is False and caps["clone3"]["refused_with"] == "ENOSYS", caps["clone3"]
    # The spawn works all the same, through the legacy clone, and says why.
    sp = caps["spawn"]
    assert sp["ok"] is True and sp["via"] == "clone", sp
    assert "clone3 refused with ENOSYS" in sp["clone3_refused"], sp
    assert "a seccomp filter" in caps["container"]["signs"]


@needs_container
@pytest.mark.forked
def test_doctor_shows_the_read_only_cgroup_mount_as_read_only() -> None:
    """The harness remounts each cgroup mount read-only as a bind
    (MS_REMOUNT|MS_BIND|MS_RDONLY), as Docker does: its superblock still
    says rw, which is what the doctor printed."""
    caps, _ = _caps_in_container()
    v2 = caps["cgroup2"]["mounts"]
    assert v2 and all(m["read_only"] is True for m in v2), v2
    assert all(m["read_only"] is True for m in caps["container"]["cgroup_mounts"]), caps["container"]["cgroup_mounts"]
    cg = caps["withheld"]["cgroup2"]
    assert cg["available"] is False and cg["container"] is True, cg
    assert any("read-only" in b for b in cg["by"]) and any("--cgroupns=private" in f for f in cg["fix"]), cg
    # No v1 controller is offered through a read-only mount either.
    for name, route in caps["controllers"]["routes"].items():
        assert route.get("via") is None, (name, route)
    ns = caps["container"]["cgroup_namespace"]
    assert ns["own"] is True and ns["cgroup"] == "/", ns


@needs_container
@pytest.mark.forked
def test_doctor_names_the_missing_capabilities_and_the_masked_proc() -> None:
    caps, masked = _caps_in_container()
    cap = caps["container"]["capabilities"]
    assert {"CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SYS_PTRACE"} <= set(cap["missing"]), cap
    assert "CAP_SYS_ADMIN" in cap["missing_bounding"], cap
    assert masked, "the harness masked nothing that exists here"
    shown = {m["path"] for m in caps["container"]["masked_proc"]}
    assert set(masked) <= shown, (masked, shown)
    assert "masked /proc" in caps["container"]["signs"]
    pid = caps["container"]["pid_namespace"]
    assert pid["own"] is True and pid["pid1"] is False, pid


@needs_container
@pytest.mark.forked
def test_doctor_says_why_there_is_no_pid_namespace_wall() -> None:
    caps, _ = _caps_in_container()
    assert caps["pidns_wall"]["ok"] is False
    wall = caps["withheld"]["pidns_wall"]
    assert wall["available"] is False and wall["container"] is True, wall
    assert any("seccomp filter" in b and "clone with namespace flags (EPERM)" in b for b in wall["by"]), wall
    assert any("CAP_SYS_ADMIN" in b for b in wall["by"]), wall
    assert any("--security-opt seccomp=" in f and "seccompProfile" in f for f in wall["fix"]), wall
    assert any("--cap-add SYS_ADMIN" in f for f in wall["fix"]), wall
    by = {m["mode"]: m for m in caps["modes"]}
    assert by["pidns (no cgroup)"]["available"] is False
    assert "seccomp filter" in by["pidns (no cgroup)"]["why_not"], by["pidns (no cgroup)"]


@needs_container
@pytest.mark.forked
def test_doctor_offers_the_subreaper_where_no_cgroup_and_no_wall_can_be_made() -> None:
    """Containment is possible there: the supervisor's own subtree proves
    REAPED (no capability, no namespace, no cgroup needed); the degraded
    mode is listed, never as the only thing left."""
    caps, _ = _caps_in_container()
    by = {m["mode"]: m for m in caps["modes"]}
    sub = by[SUBREAPER]
    assert sub["available"] is True and sub["strongest_state"] == "REAPED" and sub["backend"] == "subreaper", sub
    assert caps["subreaper"]["ok"] is True
    assert [m["mode"] for m in caps["modes"] if m["available"]] == [SUBREAPER, "none (degraded)"]
    assert caps["containment_possible"] is True and caps["strongest_mode"] == SUBREAPER


@needs_container
@pytest.mark.forked
def test_doctor_in_a_container_says_it_in_words() -> None:
    rc, text, err, masked = _doctor_in_container()
    assert rc == 0 and "Traceback" not in err, err
    lines = text.splitlines()

    def line(start: str) -> str:
        """The row named `start` (not a continuation line that happens to begin so)."""
        return next(x for x in lines if x.startswith(start) or x.startswith("  " + start))

    assert "filter" in line("seccomp") and "clone3 (ENOSYS)" in text, text
    assert "READ-ONLY" in line("mount ") and "READ-ONLY" in line("cgroup mounts"), text
    assert "CAP_SYS_ADMIN" in line("capabilities"), text
    assert "masked:" in line("masked /proc") and masked and all(p in text for p in masked), text
    assert "the legacy clone" in line("spawn of /bin/true") and "ENOSYS" in line("spawn of /bin/true"), text
    assert line(SUBREAPER).split()[-1] == "REAPED", text
    assert "containment: possible" in text and SUBREAPER in line("containment:"), text
    withheld = text.partition("what the container withholds")[2]
    assert "seccomp filter refuses" in withheld and "--cgroupns=private" in withheld, text
    assert "procMount: Unmasked" not in withheld, "a root supervisor's wall needs no new /proc in a user namespace"
    steps = text.partition("\nnext steps\n")[2]
    assert "only the cgroup holds the tree" not in steps, steps
    assert "--security-opt seccomp=" in steps and "--cap-add SYS_ADMIN" in steps, steps


@needs_container
@pytest.mark.forked
def test_doctor_as_the_containers_pid_1() -> None:
    """contain as the entrypoint: the library's capabilities() from PID 1
    of the container. Should it die, the kernel ends the namespace, so the
    subreaper's one gap (the supervisor's death) is closed there."""
    def fn() -> dict[str, Any]:
        import launcher

        return launcher.capabilities()

    caps = _container.run(fn, pid1=True)
    assert caps["container"]["pid_namespace"]["pid1"] is True
    sub = {m["mode"]: m for m in caps["modes"]}[SUBREAPER]
    assert sub["available"] is True and "PID 1" in sub["escapes"], sub
    assert "here contain is PID 1" in caps["withheld"]["subreaper"]["note"]


@needs_container
@pytest.mark.forked
def test_doctor_as_a_user_says_the_masked_proc_keeps_its_wall_from_a_proc_of_its_own() -> None:
    """A user's wall mounts a new /proc inside a user namespace, which the
    kernel refuses while a mount covers part of /proc (Docker's masked
    paths). With the seccomp filter lifted, the wall is kept without it (the
    worker sees the outer /proc), and the note names the pod's
    `procMount: Unmasked` for a /proc of its own."""
    import _users

    if _users.why_not():
        pytest.skip(_users.why_not() or "")
    uid = _users.spare_uids(1)[0]

    def fn() -> tuple[int, str, str]:
        r = _users.contain_as(uid, "doctor", "--json", env=_users.user_env(XDG_RUNTIME_DIR="/tmp"))
        return r.returncode, r.stdout, r.stderr

    rc, out, err = _container.run(fn, seccomp=False)
    assert "Traceback" not in err, err
    caps = json.loads(out)
    assert caps["euid"] == uid and caps["pidns_wall"]["ok"] is True, caps["pidns_wall"]
    wall = caps["withheld"]["pidns_wall"]
    assert wall["available"] is True and wall["by"] == [], wall
    assert "masked /proc" in wall["note"] and "the worker sees the outer /proc" in wall["note"], wall
    assert "procMount: Unmasked" in wall["note"] and "systempaths=unconfined" in wall["note"], wall
    assert caps["strongest_mode"] == "pidns (no cgroup)" and rc == 0


@pytest.mark.skipif(_seccomp.supported() is not None, reason=_seccomp.supported() or "")
@pytest.mark.forked
def test_doctor_where_nothing_can_be_spawned_offers_no_mode() -> None:
    """A filter that refuses every way to start a process: the degraded
    mode was listed as available (it needs a spawn like any other), and
    containment must say impossible, naming the spawn."""
    from launcher._doctor import capabilities
    from launcher._doctorreport import render

    before = _scratch_left()
    _seccomp.NR.update(clone=56, clone3=435, fork=57, vfork=58)
    _seccomp.install({"clone": errno.EPERM, "clone3": errno.EPERM, "fork": errno.EPERM, "vfork": errno.EPERM})
    caps = capabilities()
    assert caps["spawn"]["ok"] is False, caps["spawn"]
    assert not [m["mode"] for m in caps["modes"] if m["available"]], caps["modes"]
    assert "nothing can be spawned" in {m["mode"]: m for m in caps["modes"]}["none (degraded)"]["why_not"]
    assert caps["containment_possible"] is False and caps["strongest_mode"] is None
    assert "containment: IMPOSSIBLE here (nothing can be spawned)" in render(caps)
    assert _scratch_left() == before, "doctor left scratch cgroups"


def test_doctor_reads_each_mounts_own_read_only_flag() -> None:
    """Outside the harness too: the doctor's read-only flag of every cgroup
    mount is the kernel's per-mount one (statvfs's ST_RDONLY, the test's
    own reading), and its seccomp mode is this process's (inherited)."""
    r = subprocess.run([sys.executable, "-m", "launcher", "doctor", "--json"], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
    caps = json.loads(r.stdout)
    mounts = caps["container"]["cgroup_mounts"]
    for m in mounts:
        assert m["read_only"] is bool(os.statvfs(m["mount"]).f_flag & os.ST_RDONLY), m
    for m in caps["cgroup2"]["mounts"]:
        assert m["read_only"] is bool(os.statvfs(m["mount"]).f_flag & os.ST_RDONLY), m
    with open("/proc/self/status") as f:
        mode = next(int(x.split()[1]) for x in f if x.startswith("Seccomp:"))
    assert caps["container"]["seccomp"]["mode"] == mode
    assert caps["container"]["detected"] is bool(caps["container"]["signs"])


def _scratch_left() -> list[str]:
    base = contain_base() if IS_ROOT else None
    if not base or not os.path.isdir(base):
        return []
    return [n for n in os.listdir(base) if n.startswith("doctor-")]
