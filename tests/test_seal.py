"""The seal against root workers that try to leave (and an unprivileged one).

Each test runs `contain run` as a subprocess with a workload that tries one
way out and then sleeps, reads from outside (its own /proc reads) where every
process of the workload is, cancels the run, and checks the record and that
nothing with the test's token is left alive. Named after the escape tried.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from _survivors import (IS_ROOT, ROOT, Contain, cgroup2_mount, cgroup_of, contain_base, kill_survivors,
                        new_token, survivors, wait_for)
from _users import python, share

pytestmark = pytest.mark.skipif(not IS_ROOT, reason="the seal is built by a root supervisor; "
                                "the escapes tried need a root worker")

HELPER = os.path.join(ROOT, "tests", "_clone3_into.py")
SEAL_METHOD = "user namespace mapped to an unprivileged host uid"
MOUNT = cgroup2_mount() or "/sys/fs/cgroup"
BASE = contain_base() or "/sys/fs/cgroup/contain"
PROCS = os.path.join(BASE, "cgroup.procs")

# Each attempt moves the shell itself ($$) or makes a process that execs
# `sleep 300`; the worker then execs `sleep 300` too. stderr of the attempt
# is kept in the run's output for diagnosis. {py} {helper} runs HELPER: for
# a worker that is not root on the host (--seal, --user), with an
# interpreter and a copy of it that its uid can read (tests/_users.py), as
# this tree may be where that uid cannot reach.
ATTEMPTS = {
    "write_parent_procs": f"echo $$ > {PROCS}",
    "nested_sh_write_parent_procs": f"sh -c 'echo $$ > {PROCS} && exec sleep 300' &",
    "clone3_into_parent": "{py} {helper} " + f"{BASE} sleep 300",
    "proc1_root_walk": f"echo $$ > /proc/1/root{PROCS}",
    "remount_rw": f"mount -o remount,rw {MOUNT} && echo $$ > {PROCS}",
    "fresh_cgroup2_mount": "mkdir -p {tmp}/cg && mount -t cgroup2 none {tmp}/cg && echo $$ > {tmp}/cg/contain/cgroup.procs",
    "nsenter_pid1": f"nsenter -t 1 -m -C sh -c 'echo $$ > {PROCS} && exec sleep 300' &",
    "userns_then_mount": "unshare -Urm sh -c 'mkdir -p {tmp}/cg2 && mount -t cgroup2 none {tmp}/cg2 && "
                         "echo $$ > {tmp}/cg2/contain/cgroup.procs && exec sleep 300' &",
    "userns_cgroupns_then_mount": "unshare -Urm --cgroup sh -c 'mkdir -p {tmp}/cg3 && mount -t cgroup2 none "
                                  "{tmp}/cg3 && echo $$ > {tmp}/cg3/cgroup.procs && exec sleep 300' &",
}
TOOLS = {"nsenter_pid1": "nsenter", "userns_then_mount": "unshare", "userns_cgroupns_then_mount": "unshare",
         "remount_rw": "mount", "fresh_cgroup2_mount": "mount"}


def _sleepers(token: str) -> list[int]:
    out = []
    for pid in survivors(token):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:2] == [b"sleep", b"300"]:
                    out.append(pid)
        except OSError:
            pass
    return out


def _inside(c: Contain, where: str | None) -> bool:
    base_cg = "/" + os.path.relpath(BASE, MOUNT) if os.path.relpath(BASE, MOUNT) != "." else ""
    return where is not None and where.startswith(f"{base_cg}/run-{c.run_id}-")


def _attempt(c: Contain, opts: list[str], attempt: str, tmp: str, extra_env: dict[str, str] | None = None,
             expect_sleepers: int = 1) -> dict[str, str | None]:
    """Start the workload, wait until it settled, and return where each of
    its processes is (pid -> v2 cgroup), read from outside."""
    fill = {"tmp": tmp, "py": sys.executable, "helper": HELPER}
    if "{py}" in attempt and ("--seal" in opts or "--user" in opts):
        fill.update(py=python(), helper=share(HELPER))
    script = attempt.format(**fill) + "\nsleep 0.3\nexec sleep 300"
    c.start(["--grace", "0.5", *opts], ["sh", "-c", script], extra_env)
    assert wait_for(lambda: len(_sleepers(c.token)) >= expect_sleepers, 15), \
        f"workload never settled: {survivors(c.token)}"
    time.sleep(0.3)
    # The supervisor carries the token too (the worker inherits its
    # environment); it is not part of the tree.
    sup = c.proc.pid if c.proc is not None else -1
    return {str(p): cgroup_of(p) for p in survivors(c.token) if p != sup}




def _helper_reported(c: Contain) -> bool:
    """HELPER said what its open or clone3 did: the way out was tried, not
    refused at exec (an interpreter the worker's uid cannot run makes every
    clone3 attempt pass without trying)."""
    return any(ln.startswith(("clone3 ", "open failed ")) for ln in c.stdout.splitlines())


def _finish(c: Contain) -> dict:
    c.cancel()
    rc = c.wait(60)
    rec = c.record()
    left = survivors(c.token)
    # The invariant of issue 4, by the test's own scan.
    if rec["state"] == "REAPED":
        assert left == [], f"REAPED while {left} of the tree live ({rec['evidence']['escapes']})"
    rec["_rc"] = rc
    rec["_left"] = left
    return rec


@pytest.mark.parametrize("name", sorted(ATTEMPTS))
def test_sealed_root_worker_cannot_leave(contain_runs, tmp_path, name):
    tool = TOOLS.get(name)
    if tool and shutil.which(tool) is None:
        pytest.skip(f"{tool} not installed")
    c = contain_runs()
    where = _attempt(c, ["--seal"], ATTEMPTS[name], str(tmp_path))
    outside = {p: w for p, w in where.items() if not _inside(c, w)}
    assert not outside, f"{name}: left the run under --seal: {outside}"
    rec = _finish(c)
    if "{py}" in ATTEMPTS[name]:
        assert _helper_reported(c), c.stdout + c.stderr
    assert rec["containment"]["sealed"] is True, rec["containment"]
    seal = rec["containment"]["seal"]
    assert seal["method"] == SEAL_METHOD and seal["host_uid"] != 0 and seal["no_new_privs"]
    assert rec["state"] == "REAPED", (rec["state"], c.stderr)
    assert rec["outcome"] == "cancelled"
    assert rec["_left"] == []
    # Sealed runs are not watched by the ledger, and say so instead of "none".
    esc = rec["evidence"]["escapes"]
    assert esc["observed"] is None and "not watched" in esc["detail"]


def test_sealed_root_worker_cannot_leave_through_capless_root_process(contain_runs, tmp_path):
    """A root process without capabilities outside the run can be walked
    through /proc/<pid>/root by a root worker whose capabilities are a
    superset of it; the seal's user namespace closes that."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv not installed")
    helper_token = new_token()
    env = dict(os.environ, SEALTEST_TOKEN=helper_token)
    helper = subprocess.Popen(["setpriv", "--bounding-set=-all", "--inh-caps=-all", "sleep", "300"], env=env)
    try:
        assert wait_for(lambda: survivors(helper_token), 5)
        c = contain_runs()
        attempt = (f"echo $$ > /proc/{helper.pid}/root{PROCS}; "
                   "{py} {helper} " + f"/proc/{helper.pid}/root{BASE} sleep 300")
        where = _attempt(c, ["--seal"], attempt, str(tmp_path))
        outside = {p: w for p, w in where.items() if not _inside(c, w)}
        assert not outside, f"left through /proc/{helper.pid}/root: {outside}"
        rec = _finish(c)
        assert _helper_reported(c), c.stdout + c.stderr
        assert rec["containment"]["sealed"] is True and rec["state"] == "REAPED"
    finally:
        helper.kill()
        helper.wait(10)
        kill_survivors(helper_token)


def test_unprivileged_worker_cannot_move(contain_runs, tmp_path):
    """--user nobody: nobody owns no cgroup.procs above the run, so the
    write is refused by the kernel; that is a seal without namespaces."""
    c = contain_runs()
    where = _attempt(c, ["--user", "nobody"], ATTEMPTS["write_parent_procs"], str(tmp_path))
    assert all(_inside(c, w) for w in where.values()), where
    rec = _finish(c)
    assert rec["containment"]["sealed"] is True
    assert rec["containment"]["seal"]["method"] == "unprivileged-uid"
    assert rec["state"] == "REAPED" and rec["_left"] == []


def test_unprivileged_worker_cannot_move_by_clone3(contain_runs, tmp_path):
    c = contain_runs()
    where = _attempt(c, ["--user", "nobody"], ATTEMPTS["clone3_into_parent"], str(tmp_path))
    assert all(_inside(c, w) for w in where.values()), where
    rec = _finish(c)
    assert _helper_reported(c), c.stdout + c.stderr
    assert rec["containment"]["sealed"] is True and rec["state"] == "REAPED" and rec["_left"] == []


def test_seal_with_user_nobody(contain_runs, tmp_path):
    c = contain_runs()
    where = _attempt(c, ["--seal", "--user", "nobody"], ATTEMPTS["write_parent_procs"], str(tmp_path))
    assert all(_inside(c, w) for w in where.values()), where
    rec = _finish(c)
    assert rec["containment"]["sealed"] is True and rec["containment"]["seal"]["method"] == SEAL_METHOD
    assert rec["containment"]["seal"]["host_uid"] == 65534    # --user's uid is the one mapped to 0
    assert rec["state"] == "REAPED" and rec["_left"] == []


def test_unsealed_root_worker_is_not_called_sealed(contain_runs, tmp_path):
    c = contain_runs()
    rc = c.run([], ["true"])
    assert rc == 0
    rec = c.record()
    assert rec["containment"]["sealed"] is False
    assert "root" in rec["containment"]["sealed_reason"]
    assert rec["containment"]["seal"] is None


def test_sealed_root_worker_is_root_only_inside(contain_runs, tmp_path):
    """A user namespace that maps 0 to host 0 is not a seal: the sealed
    worker is uid 0 in its namespace and an unprivileged uid outside, so it
    cannot read root's files, change what the supervisor imports, write the
    state directory or /etc, open core_pattern, move its cgroup, or signal
    a root process outside (the test's own checks from outside decide)."""
    c = contain_runs()
    import pathlib
    import tempfile

    # Outside tmp_path (0700 root, which the sealed uid cannot traverse): a
    # directory of the test's own that the worker may write its report into.
    report = pathlib.Path(tempfile.mkdtemp(prefix="contain-seal-report-", dir="/tmp"))
    os.chmod(report, 0o777)
    out = report / "seen"
    out.touch()
    os.chmod(out, 0o666)
    victim_file = report / "root-owned"           # reachable, but root's and 0644
    victim_file.write_text("untouched\n")
    os.chmod(victim_file, 0o644)
    module = os.path.join(ROOT, "launcher", "_stats.py")      # imported lazily by a supervisor
    before = open(module, "rb").read()
    outsider = subprocess.Popen(["sleep", "300"])             # a root process outside the run
    state = os.path.join(c.tmp, "state")
    try:
        script = "; ".join([
            f"id -u > {out}",
            f"(cat /etc/shadow >/dev/null 2>&1 && echo shadow-read || echo shadow-denied) >> {out}",
            f"(echo '#' >> {module} 2>/dev/null && echo module-written || echo module-denied) >> {out}",
            f"(echo x >> {victim_file} 2>/dev/null && echo file-written || echo file-denied) >> {out}",
            f"(touch /etc/contain-seal-test 2>/dev/null && echo etc-written || echo etc-denied) >> {out}",
            f"(touch {state}/forged 2>/dev/null && echo state-written || echo state-denied) >> {out}",
            "(: > /proc/sys/kernel/core_pattern) 2>/dev/null && echo core-opened >> " + str(out)
            + " || echo core-denied >> " + str(out),
            f"(echo $$ > {PROCS} 2>/dev/null && echo moved || echo move-denied) >> {out}",
            f"(kill -STOP {outsider.pid} 2>/dev/null && echo signalled || echo signal-denied) >> {out}",
        ])
        assert c.run(["--seal"], ["sh", "-c", script]) == 0, c.stderr
        seen = out.read_text().split()
        assert seen[0] == "0", seen                       # root inside its namespace
        assert "shadow-denied" in seen and "module-denied" in seen and "file-denied" in seen, seen
        assert "etc-denied" in seen and "state-denied" in seen and "core-denied" in seen, seen
        assert "move-denied" in seen and "signal-denied" in seen, seen
        assert open(module, "rb").read() == before
        assert victim_file.read_text() == "untouched\n"
        assert not os.path.exists("/etc/contain-seal-test")
        assert not os.path.exists(os.path.join(state, "forged"))
        with open(f"/proc/{outsider.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] != "T", "the outside root process was stopped"
        rec = c.record()
        assert rec["state"] == "REAPED" and rec["containment"]["sealed"] is True
        assert rec["containment"]["seal"]["host_uid"] != 0
    finally:
        outsider.kill()
        outsider.wait(10)
        shutil.rmtree(report, ignore_errors=True)


def test_identity_mapped_namespace_is_not_called_sealed(contain_runs, tmp_path):
    """The old "seal" (a user namespace mapping 0 to 0) is not one: without
    --seal a root worker is root on the host, and the record says so."""
    c = contain_runs()
    assert c.run([], ["true"]) == 0
    rec = c.record()
    assert rec["containment"]["sealed"] is False and "root" in rec["containment"]["sealed_reason"]


def test_host_cgroup_mount_is_still_read_write():
    """The seal only ever changes mounts inside the worker's namespace."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                assert left.split()[5].split(",")[0] == "rw", line
                assert right.split()[2].split(",")[0] == "rw", line


@pytest.mark.forked
def test_seal_whose_user_namespace_fails_at_the_spawn_fails_the_run_never_runs_unsealed(contain_runs, tmp_path):
    """The seal is a user namespace that the wall's init enters (root
    inside, an unprivileged uid outside). When the init cannot become that
    root (here setresgid fails in it: a seccomp filter on the supervisor,
    which its children inherit), `--backend auto` used to fall back to the
    cgroup alone, dropping the user namespace with the wall: the worker ran
    as host root, read /etc/shadow, and the run exited 0 with a note. A seal
    that cannot be made fails the run (125), with nothing run."""
    import errno

    import _seccomp

    why = _seccomp.supported()
    if why:
        pytest.skip(why)
    c = contain_runs()
    seen = tmp_path / "seen"
    _seccomp.install({"setresgid": errno.EPERM})
    rc = c.run(["--seal"], ["sh", "-c", f"id -u > {seen}; head -c 1 /etc/shadow > /dev/null && echo read >> {seen}"])
    assert not seen.exists(), f"the worker ran: {seen.read_text()!r} (rc {rc}, {c.stderr})"
    assert rc == 125, (rc, c.stderr)
    assert "Traceback" not in c.stderr
    rec = c.record()
    assert rec["outcome"] == "spawn_failed", rec


@pytest.mark.forked
@pytest.mark.skipif(not IS_ROOT, reason="dynamic uids are claimed by a root supervisor (--seal)")
def test_two_state_directories_never_claim_the_same_dynamic_uid(tmp_path):
    """Dynamic seal uids were claimed per state directory: two root
    supervisors with different state directories could hand the same host
    uid to two sealed runs (each sealed worker could then signal, trace or
    write the other's). With the range narrowed to one free uid (this forked
    process only), the second state directory's claim is refused."""
    import errno

    from launcher._platform import sealing

    free = next(u for u in range(sealing.DYNAMIC_FIRST, sealing.DYNAMIC_LAST + 1)
                if u not in sealing._uids_in_use() and not sealing._is_account(u)
                and not os.path.exists(os.path.join(sealing.CLAIMS_HOST, str(u))))
    sealing.DYNAMIC_FIRST = sealing.DYNAMIC_LAST = free
    existed = os.path.isdir(sealing.CLAIMS_HOST)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(mode=0o700)
    b.mkdir(mode=0o700)
    uid, path = sealing.claim_dynamic_uid(str(a), "r1")
    try:
        assert uid == free
        with pytest.raises(OSError) as err:
            _uid2, path2 = sealing.claim_dynamic_uid(str(b), "r2")
            sealing.release_claim(path2)
        assert err.value.errno == errno.EUSERS, err.value
    finally:
        sealing.release_claim(path)
        if not existed:
            try:
                os.rmdir(sealing.CLAIMS_HOST)     # made by this test's claim; kept if another's is in it
            except OSError:
                pass


def test_a_world_writable_module_file_in_the_package_is_not_called_sealed(contain_runs, tmp_path):
    """The seal's "nothing the supervisor runs or reads is writable" looked
    at directories only: with one world-writable module file in the
    installed package the record said sealed: true, and the sealed worker
    could append to a module the root supervisor imports lazily (after the
    stop) and so run code as root outside every namespace. Every file of the
    package is checked now. Here a copy of the package, as installed, with
    one module made 0666."""
    c = contain_runs()
    pkg = tmp_path / "pkg"
    shutil.copytree(os.path.join(ROOT, "launcher"), pkg / "launcher",
                    ignore=shutil.ignore_patterns("__pycache__"))
    os.chmod(pkg, 0o755)
    module = pkg / "launcher" / "_stats.py"

    def sealed_run(run_id: str) -> dict:
        record = tmp_path / f"{run_id}.json"
        env = c.env({"PYTHONPATH": str(pkg)})
        p = subprocess.run([sys.executable, "-m", "launcher", "run", "--id", run_id, "--record", str(record),
                            "--seal", "--", "true"], cwd=pkg, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert "Traceback" not in p.stderr, p.stderr
        with open(record) as f:
            rec = json.load(f)
        assert rec["containment"]["seal"] is not None, rec["containment"]
        return rec

    os.chmod(module, 0o644)
    rec = sealed_run("ok")
    assert rec["containment"]["sealed"] is True, rec["containment"]       # the copy itself seals
    assert "launcher package" in rec["containment"]["seal"]["checked_not_writable"]
    os.chmod(module, 0o666)
    rec = sealed_run("writable")
    cont = rec["containment"]
    assert cont["sealed"] is False, cont
    assert str(module) in cont["sealed_reason"] and "supervisor runs or reads" in cont["sealed_reason"], cont
    assert str(module) in cont["seal"]["writable"], cont["seal"]
    assert rec["state"] == "REAPED"
