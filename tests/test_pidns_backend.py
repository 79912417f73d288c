"""A caller without root and without a delegated cgroup still gets a
container that nothing can leave: the PID-namespace wall alone (`pidns`).

Each test runs `contain` as a spare uid (setpriv), decides survival by its
own /proc scan (the token in every workload's environment), and removes
what it made.
"""
from __future__ import annotations

import json
import os

import pytest

from _proc import holders, kill_holders, new_token
from _users import Shared, as_uid, python, spare_uids, user_env, why_not

WHY_NOT = why_not()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
TOKEN_VAR = "CONTAIN_TEST_TOKEN"


@pytest.fixture
def user():
    uid = spare_uids(1)[0]
    token = new_token()
    with Shared() as shared:
        home = shared.sub("home", uid=uid, mode=0o700)
        try:
            yield uid, token, home
        finally:
            kill_holders(token)


def _run(uid: int, token: str, home: str, *args: str) -> tuple[int, dict]:
    rec_path = os.path.join(home, "record.json")
    env = user_env(CONTAIN_STATE_DIR=os.path.join(home, "state"), **{TOKEN_VAR: token})
    p = as_uid(uid, [python(), "-m", "launcher", "run", "--record", rec_path, *args], env=env)
    assert "Traceback" not in p.stderr, p.stderr
    with open(rec_path) as f:
        return p.returncode, json.load(f)


def test_readme_example_is_reaped_for_a_user_without_delegation(user):
    """The README's `setsid` grandchild, run by a user who owns no cgroup:
    REAPED, proven by the wall, with nothing left (the test's own scan)."""
    uid, token, home = user
    rc, rec = _run(uid, token, home, "--", "sh", "-c", "setsid sleep 300 & echo started; exit 0")
    assert rc == 0
    assert holders(token) == [], "the setsid grandchild outlived the run"
    assert rec["state"] == "REAPED" and rec["containment"]["backend"] == "pidns"
    assert rec["evidence"]["descendants_exit"]["observed"] is True
    assert [w["kind"] for w in rec["containment"]["walls"]] == ["pidns"]
    assert rec["containment"]["walls"][0]["user_namespace"] == "self"


def test_tree_cpu_without_a_cgroup_is_unknown_with_the_inits_rusage_as_a_lower_bound(user):
    """No cgroup counts the tree's CPU here: the init's rusage (every member
    reaped by a wait, a setsid grandchild's burn included) is kept as
    `at_least`, never as the whole-tree number (see the auto-reaped burner)."""
    uid, token, home = user
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    script = f"setsid {python()} -c '{burn}' & wait; sleep 0.5"
    rc, rec = _run(uid, token, home, "--", "sh", "-c", script)
    assert rc == 0 and rec["state"] == "REAPED"
    cpu = rec["accounting"]["cpu_usec"]
    assert rec["cpu"] is None and cpu["value"] is None and "SIGCHLD" in cpu["reason"], cpu
    assert cpu["at_least"] >= 250_000, cpu


# The member ignores SIGCHLD, so the kernel reaps its child at exit
# (exit_notify's autoreap) and the child's CPU is added to no rusage.
AUTOREAP_BURNER = """\
import os, signal, time
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
p = os.fork()
if p == 0:
    t = time.process_time()
    while time.process_time() - t < 0.6:
        pass
    os._exit(0)
try:
    os.waitpid(p, 0)     # returns ECHILD once the child is gone: nobody reaped it by a wait
except ChildProcessError:
    pass
"""


def _complete_or_unknown(rec: dict, burned_usec: int) -> None:
    cpu = rec["accounting"]["cpu_usec"]
    if cpu["value"] is None:
        assert cpu.get("reason"), cpu
        assert rec["cpu"] is None, rec["cpu"]
    else:
        assert cpu["value"] >= burned_usec, f"whole-tree CPU {cpu} misses the auto-reaped child's {burned_usec} us"
        assert rec["cpu"] is None or rec["cpu"]["usage_usec"] >= burned_usec, rec["cpu"]


def test_cpu_of_a_child_reaped_by_the_kernel_is_never_left_out(user):
    """A member that ignores SIGCHLD: its child burned 0.6 s, and the record
    said 0.02 s (the init's RUSAGE_CHILDREN never saw it). Whole-tree CPU is
    complete or null with the reason, never a smaller number."""
    uid, token, home = user
    rc, rec = _run(uid, token, home, "--backend", "pidns", "--", python(), "-c", AUTOREAP_BURNER)
    assert rc == 0 and rec["state"] == "REAPED" and rec["containment"]["backend"] == "pidns", rec["state"]
    _complete_or_unknown(rec, 550_000)


def test_worker_behind_the_wall_has_no_capabilities(user):
    """Root of its user namespace is not what the worker gets: its own uid,
    no capability, no_new_privs."""
    uid, token, home = user
    out = os.path.join(home, "status")
    rc, rec = _run(uid, token, home, "--", "sh", "-c", f"grep -E '^(Uid|Cap(Eff|Bnd|Amb)|NoNewPrivs)' "
                   f"/proc/self/status > {out}")
    assert rc == 0, rec
    status = dict(line.split(":", 1) for line in open(out).read().splitlines())
    assert status["Uid"].split()[0] == str(uid)
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0 and int(status["CapAmb"], 16) == 0
    assert status["NoNewPrivs"].strip() == "1"


def test_no_cgroup_and_no_wall_is_the_subreaper_wall_and_none_stays_degraded(user):
    """With the wall turned off, a user without a cgroup gets the subreaper
    wall (contain run's own subtree: REAPED once no child of the tree's is
    left); asked for by name, degraded mode stays the honest one: never
    REAPED."""
    uid, token, home = user
    rc, rec = _run(uid, token, home, "--no-pidns", "--", "sh", "-c", "setsid sleep 300 & exit 0")
    assert rc == 0 and rec["state"] == "REAPED" and rec["containment"]["backend"] == "subreaper", rec["containment"]
    rc, rec = _run(uid, token, home, "--backend", "none", "--", "sh", "-c", "exit 0")
    assert rc == 0 and rec["state"] == "EXITED" and rec["containment"]["backend"] == "none"


def test_explicit_pidns_backend_refuses_a_seal(user):
    uid, token, home = user
    env = user_env(CONTAIN_STATE_DIR=os.path.join(home, "state"), **{TOKEN_VAR: token})
    p = as_uid(uid, [python(), "-m", "launcher", "run", "--backend", "pidns", "--seal", "--", "true"], env=env)
    assert p.returncode == 125 and "Traceback" not in p.stderr and "--seal" in p.stderr, p.stderr


def test_a_worker_that_can_write_the_state_directory_is_not_called_sealed(user):
    """The worker runs as the caller's uid, which owns the state directory
    and everything else of the caller's (it writes the caller's home, here).
    The state directory itself is out of its reach (an empty tmpfs over it
    in the run's mount namespace: what it writes there goes nowhere), but a
    uid that may write it is no seal: the record must say sealed false,
    naming why, whichever way the state directory was chosen
    (CONTAIN_STATE_DIR, not an option)."""
    uid, token, home = user
    state = os.path.join(home, "state")
    rc, rec = _run(uid, token, home, "--", "sh", "-c",
                   f'touch "{home}/written-by-the-worker" && touch "{state}/written-by-the-worker"')
    assert rc == 0
    assert os.path.exists(os.path.join(home, "written-by-the-worker")), "the test is void: nothing was written"
    assert not os.path.exists(os.path.join(state, "written-by-the-worker")), "the worker reached the state directory"
    c = rec["containment"]
    assert c["sealed"] is False, c
    assert c["sealed_reason"], c


def test_orphaned_run_is_stopped_by_cancel_not_left_running(user):
    """`contain run` SIGKILLed (by the pid this test started): the run is
    orphaned, and `contain cancel` must adopt it and stop it (CONTRACT:
    "a run whose supervisor died is never lost"). Its wall's init, as the
    run's tag records it, is what the adopter kills and watches: REAPED,
    and nothing of the tree left (the test's own scan)."""
    import signal
    import subprocess
    import time

    uid, token, home = user
    env = user_env(CONTAIN_STATE_DIR=os.path.join(home, "state"), **{TOKEN_VAR: token})
    rec_path = os.path.join(home, "state", "runs", "o", "record.json")
    sup = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                            python(), "-m", "launcher", "run", "-q", "--id", "o", "--grace", "0.3", "--",
                            "sh", "-c", "setsid sleep 300 & sleep 300 & wait"],
                           env=env, stderr=subprocess.DEVNULL, cwd="/")
    try:
        deadline = time.monotonic() + 20
        while True:                   # supervisor, init, sh, two sleeps; the record names the worker
            try:
                with open(rec_path) as f:
                    started = json.load(f).get("identity") is not None
            except (OSError, ValueError):
                started = False
            if started and len(holders(token)) >= 5:
                break
            assert time.monotonic() < deadline, "the run did not start"
            time.sleep(0.02)
    finally:
        sup.send_signal(signal.SIGKILL)
        sup.wait(10)
    assert len(holders(token)) >= 3, "the tree outlives its supervisor"
    p = as_uid(uid, [python(), "-m", "launcher", "cancel", "o", "--wait", "--timeout", "20", "--json"], env=env)
    assert "Traceback" not in p.stderr, p.stderr
    ack = json.loads(p.stdout)
    assert holders(token) == [], "cancel left the orphaned tree running"
    with open(rec_path) as f:
        rec = json.load(f)
    assert p.returncode == 0 and ack["effect"] == "cancelled" and ack["state"] == "REAPED", (ack, p.stderr)
    assert rec["state"] == "REAPED" and rec["containment"]["backend"] == "pidns", rec["containment"]
    assert [w["kind"] for w in rec["containment"]["walls"]] == ["pidns"]
    assert rec["evidence"]["signal_sent"]["observed"] is True


# The run's own uid rewrites the run's tag so that its wall's init names a
# process of the same user outside the wall. (The worker did this itself; it
# can no longer reach its run directory, so a process of the same user
# outside the run does it here.)
TAG_FORGER = """\
import json, os, time
rd = os.environ["CONTAIN_RUN_DIR"]
deadline = time.monotonic() + 20
while True:
    try:
        tag = json.loads(os.getxattr(rd, "user.contain.run"))
        if tag.get("worker") and tag.get("wall"):
            break
    except OSError:
        pass
    assert time.monotonic() < deadline, "no tag"
    time.sleep(0.01)
tag["wall"]["init"] = json.loads(os.environ["VICTIM"])
os.setxattr(rd, "user.contain.run", json.dumps(tag).encode())
open(os.environ["FORGED"], "w").close()
"""


def test_worker_forging_its_wall_init_cannot_make_cancel_kill_a_process_outside(user):
    """The run's uid can write its run directory's `user.` tag. Naming one
    of the user's other processes as the wall's init must not turn
    `contain cancel` into the weapon: the adopter acts only on a process
    that is pid 1 of the recorded PID namespace; anything else is
    UNCONFIRMED, never signalled."""
    import signal
    import subprocess
    import time

    uid, token, home = user
    victim = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                               "sleep", "300"], env=user_env(**{TOKEN_VAR: token}), cwd="/")
    forged = os.path.join(home, "forged")
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with open(f"/proc/{victim.pid}/stat", "rb") as f:
                    data = f.read()
                if b"(sleep)" in data:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the victim did not start"
            time.sleep(0.01)
        start = int(data[data.rfind(b")") + 2:].split()[19])
        env = user_env(CONTAIN_STATE_DIR=os.path.join(home, "state"), FORGED=forged,
                       VICTIM=json.dumps({"pid": victim.pid, "start_time": start}), **{TOKEN_VAR: token})
        sup = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                                python(), "-m", "launcher", "run", "-q", "--id", "f", "--grace", "0.3", "--",
                                "sleep", "300"], env=env, stderr=subprocess.DEVNULL, cwd="/")
        try:
            forger = as_uid(uid, [python(), "-c", TAG_FORGER],
                            env=dict(env, CONTAIN_RUN_DIR=os.path.join(home, "state", "runs", "f")))
            assert forger.returncode == 0 and os.path.exists(forged), forger.stderr
        finally:
            sup.send_signal(signal.SIGKILL)
            sup.wait(10)
        p = as_uid(uid, [python(), "-m", "launcher", "cancel", "f", "--wait", "--timeout", "10", "--json"],
                   env=env)
        assert "Traceback" not in p.stderr, p.stderr
        assert victim.poll() is None, "cancel killed a process outside the run, named by a forged tag"
        with open(os.path.join(home, "state", "runs", "f", "record.json")) as f:
            rec = json.load(f)
        assert rec["state"] == "UNCONFIRMED" and p.returncode != 0, (rec["state"], p.returncode)
        assert rec["evidence"]["container_empty"]["observed"] is None
    finally:
        victim.kill()
        victim.wait(10)


@pytest.mark.parametrize("cmd", [["/nonexistent-contain-cmd"], ["/etc/passwd"]], ids=["not-found", "not-executable"])
def test_a_start_that_failed_inside_the_wall_names_the_wall_it_was_reaped_by(user, cmd):
    """A worker whose exec failed behind the wall: the record says REAPED
    with the PID namespace's init reaped as its proof (container_empty), so
    `containment.walls` must list that wall, observed empty. It listed no
    wall at all (`walls: []`), a REAPED record naming no container."""
    uid, token, home = user
    rc, rec = _run(uid, token, home, "--backend", "pidns", "--", *cmd)
    assert rc in (126, 127)
    assert rec["outcome"] == "spawn_failed" and rec["state"] == "REAPED"
    walls = rec["containment"]["walls"]
    assert [w["kind"] for w in walls] == ["pidns"], walls
    assert walls[0]["observed_empty"] is True and isinstance(walls[0]["init_pid"], int), walls
    assert holders(token) == []


# The worker (the caller's uid) moves the state directory's parent aside
# and plants a state directory with a REAPED record for its own run, then
# lives on. `MOVED` says whether the rename went through.
FORGE = """\
cd "$HOME_DIR" || exit 1
if mv cache cache.old 2>"$HOME_DIR/mv.err"; then
    mkdir -p "cache/contain/runs/$RUN" && cp "$FORGED" "cache/contain/runs/$RUN/record.json"
    echo moved > "$HOME_DIR/outcome"
else
    echo refused > "$HOME_DIR/outcome"
fi
exec sleep 300
"""


def test_worker_renaming_a_parent_of_the_state_directory_cannot_forge_its_record(user):
    """`--backend pidns` with the state directory under a directory the
    user owns (`~/cache/contain`): the init hides the state directory, but
    the worker (same uid) renamed its parent, planted a fresh state directory
    with a forged REAPED record, and `status` believed it while the tree ran
    on. Every directory above the state directory is a mount point in the
    worker's namespace now: the rename is refused, and readers see the run."""
    import subprocess
    import time

    uid, token, home = user
    cache = os.path.join(home, "cache")
    os.mkdir(cache, 0o700)
    os.chown(cache, uid, uid)
    state = os.path.join(cache, "contain")
    forged = os.path.join(home, "forged.json")
    with open(forged, "w") as f:
        json.dump({"run_id": "victim", "run_uid": "0123456789abcdef", "state": "REAPED", "outcome": "exited",
                   "exit_code": 0, "argv": ["true"],
                   "timings": {"spawned_at": "2026-01-01T00:00:00.000000Z",
                               "ended_at": "2026-01-01T00:00:01.000000Z"}}, f)
    os.chown(forged, uid, uid)
    env = user_env(CONTAIN_STATE_DIR=state, HOME_DIR=home, RUN="victim", FORGED=forged, **{TOKEN_VAR: token})
    sup = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", python(), "-m",
                            "launcher", "run", "-q", "--id", "victim", "--backend", "pidns", "--grace", "0.2", "--",
                            "sh", "-c", FORGE], env=env, cwd="/", stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    outcome = os.path.join(home, "outcome")
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(outcome) and sup.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.path.exists(outcome), f"the worker never got to try (rc {sup.poll()})"
        time.sleep(0.1)
        assert holders(token), "the worker is gone (the test is void)"
        st = as_uid(uid, [python(), "-m", "launcher", "status", "victim", "--json"], env=env)
        view = json.loads(st.stdout) if st.stdout.strip() else {}
        what = open(outcome).read().strip()
        assert what == "refused", f"the worker renamed {cache}: status now says {st.stdout[:400]}"
        assert st.returncode == 0 and view.get("state") == "RUNNING", (st.returncode, st.stdout[:400], st.stderr)
    finally:
        as_uid(uid, [python(), "-m", "launcher", "cancel", "victim", "--grace", "0"], env=env)
        try:
            sup.wait(30)
        except subprocess.TimeoutExpired:
            sup.kill()
            sup.wait(10)
        kill_holders(token)
    assert holders(token) == []


def test_state_directory_reached_through_a_symlink_the_worker_could_replace_is_refused(user):
    """The pins hold directories, not a symlink on the way to them: one in a
    directory the user may write (the worker could replace it and point
    readers at another state directory) is refused before anything starts,
    naming the real path to use instead."""
    uid, token, home = user
    real = os.path.join(home, "real")
    os.mkdir(real, 0o700)
    os.chown(real, uid, uid)
    link = os.path.join(home, "link")
    os.symlink(real, link)
    os.lchown(link, uid, uid)
    env = user_env(CONTAIN_STATE_DIR=os.path.join(link, "contain"), **{TOKEN_VAR: token})
    p = as_uid(uid, [python(), "-m", "launcher", "run", "--backend", "pidns", "--", "true"], env=env)
    assert p.returncode == 125 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    assert "symlink" in p.stderr and f"CONTAIN_STATE_DIR={real}/contain" in p.stderr, p.stderr
