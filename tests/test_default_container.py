"""contain inside a default container: it starts there, proves what it can,
and says what the container withholds.

A default `docker run` or Kubernetes pod refuses clone3 (ENOSYS, from
Docker's seccomp profile), namespaces, mounts and CAP_SYS_ADMIN, and its
cgroup filesystem is read-only. tests/_container.py makes one around a
function of the test's; the test's own /proc scan (the token in every
workload's environment) decides what survived. Everything that installs a
filter or makes namespaces runs forked.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import pytest

import _container
import _seccomp
from _proc import wait_gone
from conftest import ROOT

pytestmark = pytest.mark.skipif(_container.why_not() is not None, reason=_container.why_not() or "")

SETSID_SLEEPER = "setsid sleep 300 & echo started; exit 0"


@pytest.fixture
def pod(box, monkeypatch):
    """The test's world (state directory, token) as a default container
    sees it: no cgroup base of the test's (its filesystem is read-only
    there, and a base named by CONTAIN_CGROUP_BASE is a choice, not a hint)."""
    monkeypatch.delenv("CONTAIN_CGROUP_BASE", raising=False)
    monkeypatch.delenv("CONTAIN_CGROUP_V1_BASE", raising=False)
    return box


# -- the spawn: clone where clone3 is refused -----------------------------------

@pytest.mark.forked
@pytest.mark.parametrize("refusal,pidns", [(errno.ENOSYS, None), (errno.ENOSYS, False), (errno.EPERM, None)],
                         ids=["ENOSYS-wall", "ENOSYS-no-pidns", "EPERM-wall"])
def test_a_refused_clone3_falls_back_to_clone_and_the_cgroup_still_holds_the_tree(box, refusal, pidns) -> None:
    """Docker's profile answers clone3 with ENOSYS, older ones with EPERM:
    before, every spawn failed ("clone failed: Function not implemented").
    Now the worker starts with the legacy clone, joins its leaf before exec
    (no CLONE_INTO_CGROUP without clone3), and the record says so. (Under
    an EPERM filter glibc itself cannot start a thread, since it falls back
    from clone3 only on ENOSYS: a run that needs the fork ledger's thread,
    --no-pidns, fails there whatever contain does.)"""
    import launcher
    from launcher._native import lib

    assert lib.ct_clone3_probe() == 0
    _seccomp.NR.setdefault("clone3", 435)
    _seccomp.install({"clone3": refusal})
    assert lib.ct_clone3_probe() == -refusal
    kw = {} if pidns is None else {"pidns": pidns}
    rec = launcher.run(["sh", "-c", SETSID_SLEEPER], stdio=(-1, -1, -1), **kw).to_dict()
    via = rec["containment"].get("spawn_via") or ""
    assert rec["state"] == "REAPED" and rec["exit_code"] == 0, rec
    assert f"clone3 refused with {errno.errorcode[refusal]}" in via and "clone(" in via, via
    assert "wrote 0 to cgroup.procs, verified /proc/self/cgroup" in via, via
    kinds = [w["kind"] for w in rec["containment"]["walls"]]
    assert kinds == (["cgroup", "pidns"] if pidns is None else ["cgroup"]), kinds
    assert wait_gone(box.token) == []


@pytest.mark.forked
def test_the_pidns_backend_starts_its_init_and_worker_without_clone3(box) -> None:
    """The wall alone (no cgroup): its init is cloned with the legacy clone
    and forks the worker the same way."""
    import launcher

    _seccomp.NR.setdefault("clone3", 435)
    _seccomp.install({"clone3": errno.ENOSYS})
    rec = launcher.run(["sh", "-c", SETSID_SLEEPER], backend="pidns", stdio=(-1, -1, -1)).to_dict()
    assert rec["state"] == "REAPED" and rec["exit_code"] == 0, rec
    via = rec["containment"].get("spawn_via") or ""
    assert "clone(" in via and "CLONE_NEWPID" in via and "clone3 refused" in via, via
    assert wait_gone(box.token) == []


@pytest.mark.forked
def test_a_clone3_refused_after_it_worked_is_found_at_the_next_spawn(box) -> None:
    """The refusal is probed when a clone3 fails, not once at import: a
    filter installed after a first spawn (a sandbox that locks itself down
    late) still gets the fallback."""
    import launcher

    assert launcher.run(["true"], pidns=False).to_dict()["state"] == "REAPED"
    _seccomp.NR.setdefault("clone3", 435)
    _seccomp.install({"clone3": errno.ENOSYS})
    rec = launcher.run(["true"], pidns=False).to_dict()
    assert rec["state"] == "REAPED", rec
    assert "clone3 refused with ENOSYS" in rec["containment"]["spawn_via"]


@pytest.mark.forked
def test_an_eperm_of_the_kernel_is_not_taken_for_a_refused_clone3(box) -> None:
    """EPERM from clone3 means a refused clone3 only when the probe agrees.
    Without CAP_SYS_ADMIN the kernel itself answers clone3(CLONE_NEWPID)
    with EPERM: the wall is unavailable (auto goes on with the cgroup
    alone), and the worker is still cloned into its cgroup by clone3. (The
    state is the cgroup's alone: EXITED for a root worker whose fork ledger
    could not subscribe without the capability.)"""
    import launcher
    from launcher._native import lib

    _container.drop_caps(set(range(64)) - {_container.CAP_SYS_ADMIN})
    rec = launcher.run(["true"]).to_dict()
    assert lib.ct_clone3_refused() == 0
    assert rec["exit_code"] == 0 and rec["evidence"]["container_empty"]["observed"] is True, rec["evidence"]
    assert [w["kind"] for w in rec["containment"]["walls"]] == ["cgroup"], rec["containment"]
    assert rec["containment"]["spawn_via"] == "clone3(CLONE_INTO_CGROUP|CLONE_PIDFD)", rec["containment"]


# -- the subreaper wall -----------------------------------------------------------

def _contain(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    """`contain` as a CI step in the container runs it (this checkout's)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "launcher", *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def _record(out: str) -> dict:
    return json.loads(out[out.index("{"):])


@pytest.mark.forked
def test_the_readme_example_is_reaped_by_the_subreaper_wall_in_a_default_container(pod) -> None:
    """The README's first command in a default container: before, nothing
    started (clone3 ENOSYS); then degraded mode said EXITED. contain run is a
    child subreaper from before the spawn, so no child of its left proves
    the tree gone: REAPED by the wall `subreaper`."""
    rc, out, err = _container.run(lambda: _contain("run", "--record", "-", "--", "sh", "-c", SETSID_SLEEPER))
    assert rc == 0, err
    assert out.startswith("started"), out
    rec = _record(out)
    assert rec["state"] == "REAPED" and rec["containment"]["backend"] == "subreaper", rec["containment"]
    wall = rec["containment"]["walls"][0]
    assert wall["kind"] == "subreaper" and wall["observed_empty"] is True, wall
    assert rec["evidence"]["descendants_exit"]["observed"] is True, rec["evidence"]["descendants_exit"]
    assert "using backend subreaper" in err and "never REAPED" not in err, err
    assert wait_gone(pod.token) == []


@pytest.mark.forked
def test_a_double_forked_term_ignoring_daemon_is_stopped_by_the_cli(pod) -> None:
    daemon = "(trap '' TERM; setsid sleep 300 & ); (trap '' TERM; exec sleep 301) & exit 0"
    rc, out, err = _container.run(lambda: _contain("run", "--grace", "0.3", "--record", "-", "--", "sh", "-c",
                                                   daemon))
    assert rc == 0, err
    rec = _record(out)
    assert rec["state"] == "REAPED", rec["containment"]
    kill = [s for s in rec["evidence"]["signal_sent"]["detail"]["steps"] if s.get("kind") == "kill"]
    assert kill, rec["evidence"]["signal_sent"]        # TERM was ignored: it took the kill
    assert wait_gone(pod.token) == []


def _library_daemon(token_file: str) -> dict:
    import launcher

    w = launcher.spawn(["sh", "-c", "(trap '' TERM; setsid sleep 300 & ); echo up > " + token_file + "; exec sleep 300"],
                       subreaper=True, grace=0.3)
    deadline = time.monotonic() + 10
    while not os.path.exists(token_file) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)                       # the daemon's parent has exited: it is the supervisor's orphan
    w.cancel()
    return w.wait(30).to_dict()


@pytest.mark.forked
@pytest.mark.parametrize("parent_read_proc", [False, True], ids=["fresh", "parent-read-proc"])
def test_the_library_with_subreaper_true_stops_a_double_forked_daemon(pod, tmp_path, parent_read_proc) -> None:
    """parent-read-proc: the process that made the container had read /proc
    through launcher before (as a test runner that ran other tests has): the
    container's first process inherited that /proc view, of the host's PID
    namespace, and its run took a host kernel thread for its worker
    (UNCONFIRMED after three kills, "pool_workqueue_release" alive)."""
    if parent_read_proc:
        from launcher import _procfs

        assert _procfs.read_stat(os.getpid()) is not None
    rec = _container.run(lambda: _library_daemon(str(tmp_path / "up")))
    assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled", json.dumps(
        {k: rec[k] for k in ("state", "outcome", "containment", "evidence", "notes")}, indent=1)
    assert rec["containment"]["backend"] == "subreaper"
    found = rec["evidence"]["descendants_exit"]
    assert found["observed"] is True, found
    assert wait_gone(pod.token) == []


@pytest.mark.forked
def test_the_library_without_subreaper_is_degraded_mode_in_a_default_container(pod, tmp_path) -> None:
    """subreaper=True is process-wide, so the library never turns it on by
    itself: without it a default container gives degraded mode (EXITED)."""
    import launcher

    rec = _container.run(lambda: launcher.run(["true"]).to_dict())
    assert rec["containment"]["backend"] == "none" and rec["state"] == "EXITED", rec["containment"]


# -- PID 1 and visitors ----------------------------------------------------------

VISITOR_VAR = "CONTAIN_TEST_VISITOR"


def _wait_file(path: str, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Visitor:
    """`kubectl exec` into the pod while its run is live: a shell entered
    from outside (nsenter into the pod's PID namespace) leaves an orphan,
    which the kernel reparents to the pod's PID 1. It carries a token of its
    own, so the test's scan tells it from the tree."""

    def __init__(self, tmp_path) -> None:
        import secrets
        import threading

        self.dir = str(tmp_path)
        self.token = secrets.token_hex(8)
        self.pod_pid_file = os.path.join(self.dir, "pod.pid")
        self.alive_after_record: list[int] | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._visit, daemon=True)

    def worker(self) -> str:
        """The worker's script: say it runs, wait for the visit, exit."""
        return f"touch {self.dir}/ready; while [ ! -e {self.dir}/visited ]; do sleep 0.02; done; exit 0"

    def _visit(self) -> None:
        try:
            if not (_wait_file(self.pod_pid_file) and _wait_file(f"{self.dir}/ready")):
                self.error = "the pod or its run never started"
                return
            with open(self.pod_pid_file) as f:
                pod = int(f.read())
            env = dict(os.environ, **{VISITOR_VAR: self.token})
            subprocess.run(["nsenter", "-t", str(pod), "-p", "--", "sh", "-c", "sleep 300 & exit 0"], env=env,
                           timeout=20, check=True)
            time.sleep(0.1)            # reparented to the pod's PID 1 by now
            open(f"{self.dir}/visited", "w").close()
            if not _wait_file(f"{self.dir}/record.json"):
                self.error = "no record"
                return
            time.sleep(0.2)
            from _proc import holders

            self.alive_after_record = holders(self.token, VISITOR_VAR)
        except Exception as e:     # reported by the test
            self.error = repr(e)
        finally:
            open(f"{self.dir}/checked", "w").close()

    def end(self) -> None:
        from _proc import holders

        for pid in holders(self.token, VISITOR_VAR):
            try:
                os.kill(pid, 9)       # the visitor's own sleep, found by its token
            except OSError:
                pass


@pytest.mark.forked
@pytest.mark.skipif(__import__("shutil").which("nsenter") is None, reason="nsenter (util-linux) is not installed")
def test_contain_as_pid_1_keeps_the_visitors_orphans_away_from_its_run(pod, tmp_path) -> None:
    """`contain run` as the pod's entrypoint forks its supervisor off and
    stays an init (as tini): the visitor's orphan is reparented to PID 1,
    the tree's to the supervisor, which proves its tree gone (REAPED) and
    never touches the visitor."""
    v = Visitor(tmp_path)
    record = os.path.join(v.dir, "record.json")

    def entrypoint() -> int:
        from launcher._cli import main

        rc = main(["run", "--record", record, "--", "sh", "-c", v.worker()])
        _wait_file(os.path.join(v.dir, "checked"))     # the test looks at the visitor before the pod ends
        return rc

    v.thread.start()
    try:
        rc = _container.run(entrypoint, pid1=True, pod_pid_file=v.pod_pid_file)
        v.thread.join(30)
    finally:
        v.end()
    assert v.error is None, v.error
    assert rc == 0
    with open(record) as f:
        rec = json.load(f)
    assert rec["state"] == "REAPED" and rec["containment"]["backend"] == "subreaper", rec["containment"]
    assert v.alive_after_record, "the visitor's orphan was killed by the run's stop"
    assert wait_gone(pod.token) == []


@pytest.mark.forked
@pytest.mark.skipif(__import__("shutil").which("nsenter") is None, reason="nsenter (util-linux) is not installed")
def test_the_library_as_pid_1_never_counts_a_visitors_orphan_as_a_member(pod, tmp_path) -> None:
    """A library process that is the pod's PID 1 gets the subreaper wall
    without asking (every orphan of the namespace comes to it anyway), and
    with it the visitors' orphans: one it never saw below a member is not
    the tree's, is not signalled, and keeps the run from claiming more
    than was observed (EXITED, naming it)."""
    v = Visitor(tmp_path)
    record = os.path.join(v.dir, "record.json")

    def runtime() -> dict:
        import launcher

        rec = launcher.run(["sh", "-c", v.worker()], record_file=record).to_dict()
        _wait_file(os.path.join(v.dir, "checked"))
        return rec

    v.thread.start()
    try:
        rec = _container.run(runtime, pid1=True, pod_pid_file=v.pod_pid_file)
        v.thread.join(30)
    finally:
        v.end()
    assert v.error is None, v.error
    assert rec["containment"]["backend"] == "subreaper", rec["containment"]
    assert v.alive_after_record, "the visitor's orphan was killed by the run's stop"
    wall = rec["containment"]["walls"][0]
    assert rec["state"] == "EXITED" and wall["observed_empty"] is None, wall
    assert wall.get("unattributed"), wall
    members = rec["evidence"]["descendants_exit"]["detail"]["seen"]
    assert all(m["pid"] not in [u["pid"] for u in wall["unattributed"]] for m in members), members
    assert wait_gone(pod.token) == []


# -- the wall without a /proc of its own ---------------------------------------------

def _wall_in_a_masked_proc() -> dict:
    """Kubernetes' default (no seccomp filter), masked /proc: a user
    namespace and a PID namespace are allowed, a new /proc in them is not."""
    from launcher._platform import posix

    problem = posix.wall_available("self", mount_proc=True)
    r, w = os.pipe()
    req = posix.SpawnRequest(["sh", "-c", "echo $$; ls /proc | grep -c '^[0-9]'"], env=dict(os.environ),
                             stdio=(-1, w, -1), pidns=True, userns="self", mount_proc=True)
    sp = posix.spawn(req)
    os.close(w)
    out = b""
    while chunk := os.read(r, 4096):
        out += chunk
    os.close(r)
    os.waitid(os.P_PIDFD, sp.init_pidfd, os.WEXITED)
    notes = [e.text for e in sp.events + posix.read_init_events(sp.report_fd) if isinstance(e, posix.InitNote)]
    for fd in (sp.pidfd, sp.init_pidfd, sp.report_fd):
        if fd >= 0:
            os.close(fd)
    return {"problem": problem, "out": out.decode().split(), "notes": notes}


@pytest.mark.forked
def test_a_wall_whose_proc_cannot_be_mounted_is_kept_and_says_the_worker_sees_the_outer_proc(pod) -> None:
    """Before, a refused /proc mount made the wall "unavailable" and auto fell
    back to degraded mode, though the namespaces themselves were allowed."""
    got = _container.run(_wall_in_a_masked_proc, seccomp=False)
    assert got["problem"] is None, got
    pid_inside, procs_seen = got["out"]
    assert pid_inside == "2", got          # behind the wall: its init is 1
    assert int(procs_seen) > 2, got        # the outer /proc: the pod's processes, not the namespace's
    assert any("the worker sees the outer /proc" in n for n in got["notes"]), got["notes"]


# -- a plain user -------------------------------------------------------------------

@pytest.mark.forked
def test_the_readme_example_works_for_a_plain_user_with_no_runtime_dir_in_a_default_container(pod) -> None:
    """A container's numeric uid has no XDG_RUNTIME_DIR and HOME=/: before,
    exit 125 ("set CONTAIN_STATE_DIR"). Now its state directory is
    /tmp/contain-<uid> (made 0700 by it, refused if another user made it)."""
    import shutil

    import _users

    why = _users.why_not()
    if why:
        pytest.skip(why)
    uid = _users.spare_uids(1)[0]
    python = _users.python()                  # staged before the container: what a spare uid can run
    env = dict(_users.user_env(HOME="/"), **{"CONTAIN_TEST_TOKEN": pod.token})
    state = f"/tmp/contain-{uid}"
    if os.path.exists(state):
        pytest.skip(f"{state} exists already (another user's, or a leftover)")

    def as_plain_user() -> tuple[int, str, str]:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        p = subprocess.run([python, "-m", "launcher", "run", "--record", "-", "--", "sh", "-c",
                            SETSID_SLEEPER], env=env, capture_output=True, text=True, timeout=60, cwd="/")
        return p.returncode, p.stdout, p.stderr

    try:
        rc, out, err = _container.run(as_plain_user)
        assert rc == 0, err
        rec = _record(out)
        assert rec["state"] == "REAPED" and rec["containment"]["backend"] == "subreaper", rec["containment"]
        st = os.stat(state)
        assert (st.st_uid, st.st_mode & 0o777) == (uid, 0o700)
        assert wait_gone(pod.token) == []
    finally:
        shutil.rmtree(state, ignore_errors=True)
