"""launcher.ray on a real local Ray cluster (issue 29; docs/ray.md).

One `ray.init()` serves the module (a Ray cluster takes ~20 s to start
here); the two-node test makes its own `ray.cluster_utils.Cluster` last.
Ray's workers inherit the driver's environment at `ray.init()`, so the
module's state directory and cgroup base are set in os.environ before it.
Survivors are found by the suite's own /proc scan for a token put in each
command's environment, never by asking launcher; whatever the scan finds
is killed by pidfd (after re-checking the token) at the end of each test.

Tests that need `die_with_owner` or `contain janitor` (another piece of
issue 29) skip with the reason until the engine has them.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import pytest

import launcher
from _proc import ROOT
from conftest import TOKEN_VAR, kill_token, needs_cgroup, pids_with_token, remove_cgroup_tree

ray = pytest.importorskip("ray", reason="ray is not installed (pip install '.[test]' or 'contain[ray]')")

pytestmark = [needs_cgroup]

SETSID_TREE = "setsid sleep 300 & sleep 300"


def _janitor_missing() -> str | None:
    p = subprocess.run([sys.executable, "-m", "launcher", "janitor", "--help"], capture_output=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, timeout=60)
    return None if p.returncode == 0 else "`python -m launcher janitor` is not there yet (issue 29 item 2)"


def _die_with_owner_missing(state_dir: str) -> str | None:
    try:
        launcher.run(["true"], die_with_owner=True, state_dir=state_dir)
    except TypeError as e:
        return f"launcher.run does not accept die_with_owner yet (issue 29 item 1): {e}"
    return None


@pytest.fixture(scope="module")
def world() -> Iterator[dict[str, Any]]:
    """The module's state directory and cgroup base, in the environment
    every Ray worker inherits; removed (and the cgroup base emptied) at the end."""
    from conftest import _cgroup2_mount

    top = tempfile.mkdtemp(prefix="contain-ray-test-")
    state = os.path.join(top, "state")
    base = os.path.join(_cgroup2_mount(), f"contain-ray-test-{secrets.token_hex(4)}")
    os.mkdir(base)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONTAIN_STATE_DIR", state)
        mp.setenv("CONTAIN_CGROUP_BASE", base)
        mp.delenv("CONTAIN_RUN_CGROUP", raising=False)
        mp.delenv("CONTAIN_RUN_DIR", raising=False)
        try:
            yield {"state_dir": state, "cgroup_base": base, "dwo_missing": _die_with_owner_missing(state),
                   "janitor_missing": _janitor_missing()}
        finally:
            ray.shutdown()
            remove_cgroup_tree(base)
            subprocess.run(["rm", "-rf", "--one-file-system", top], check=False)


@pytest.fixture
def local(world: dict[str, Any]) -> dict[str, Any]:
    """A local one-node Ray cluster (started once for the module)."""
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return world


@pytest.fixture
def token() -> Iterator[str]:
    t = secrets.token_hex(8)
    try:
        yield t
    finally:
        kill_token(t)


def _env(token: str) -> dict[str, str]:
    return {**os.environ, TOKEN_VAR: token}


def _until(predicate: Any, timeout: float, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


def _record(state_dir: str, run_id: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(state_dir, "runs", run_id, "record.json")) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return None


def _final(state_dir: str, run_id: str) -> Any:
    rec = _record(state_dir, run_id)
    return rec if rec is not None and rec.get("state") != "RUNNING" else None


@ray.remote(max_retries=0)
def contained(argv: list[str], pid_file: str | None = None, **options: Any) -> dict[str, Any]:
    import launcher.ray as cray

    if pid_file:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    return cray.run(argv, **options)


@ray.remote(max_retries=0)
def plain(argv: list[str], env: dict[str, str]) -> int:
    return subprocess.run(argv, env=env).returncode


@ray.remote(max_restarts=0)
class Tool:
    def run(self, argv: list[str], **options: Any) -> dict[str, Any]:
        import launcher.ray as cray

        return cray.run(argv, **options)


def test_import_launcher_never_imports_ray() -> None:
    code = ("import sys, launcher; launcher.capabilities; launcher.spawn; launcher.run; import launcher._cli; "
            "assert 'ray' not in sys.modules, 'ray was imported'")
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr


@pytest.mark.timeout(180)
def test_a_setsid_grandchild_ends_reaped_with_the_workers_code_and_the_node(local: dict, token: str) -> None:
    run_id = f"ray-setsid-{token}"
    rec = ray.get(contained.remote(["sh", "-c", "setsid sleep 300 & exit 7"], id=run_id, grace=0.5,
                                   env=_env(token), die_with_owner=local["dwo_missing"] is None,
                                   capture_output=True, text=True), timeout=90)
    assert rec["state"] == "REAPED", rec
    assert rec["exit_code"] == 7 and rec["returncode"] == 7, rec
    assert rec["node"] == ray.get_runtime_context().get_node_id()
    assert rec["stdout"] == "" and rec["stderr"] == ""
    assert pids_with_token(token) == []
    assert _record(local["state_dir"], run_id)["state"] == "REAPED"


@pytest.mark.timeout(180)
def test_check_raises_the_librarys_error_through_ray(local: dict, token: str) -> None:
    with pytest.raises(launcher.RunFailed) as e:
        ray.get(contained.remote(["sh", "-c", "echo out; exit 3"], env=_env(token), check=True, capture_output=True,
                                 die_with_owner=local["dwo_missing"] is None), timeout=90)
    assert e.value.returncode == 3 and e.value.stdout == b"out\n"
    # Ray raises a RayTaskError that is also a RunFailed; a class attribute
    # of LauncherError (`record = None`) hides the cause's own: `.cause` has it.
    assert e.value.cause.record["state"] == "REAPED"


@pytest.mark.timeout(180)
def test_ray_cancel_stops_the_tree_with_its_grace_and_the_task_ends_cancelled(local: dict, token: str) -> None:
    run_id = f"ray-cancel-{token}"
    ref = contained.remote(["sh", "-c", SETSID_TREE], id=run_id, grace=1.0, env=_env(token),
                           die_with_owner=local["dwo_missing"] is None)
    assert len(_until(lambda: pids_with_token(token) if len(pids_with_token(token)) >= 3 else None, 60) or []) >= 3
    ray.cancel(ref)
    with pytest.raises((ray.exceptions.TaskCancelledError, KeyboardInterrupt)):
        ray.get(ref, timeout=60)
    assert _until(lambda: pids_with_token(token) == [], 10), pids_with_token(token)
    rec = _until(lambda: _final(local["state_dir"], run_id), 10)
    assert rec is not None and rec["state"] == "REAPED" and rec["outcome"] == "cancelled", rec
    steps = rec["evidence"]["signal_sent"]["detail"]["steps"]
    assert steps[0]["kind"] == "term", steps       # the grace was given: SIGTERM first


@pytest.mark.timeout(180)
def test_control_ray_cancel_of_plain_subprocess_run_leaves_survivors(local: dict, token: str) -> None:
    """What Ray does on its own (issue 29's observation): the same tree run
    by subprocess.run outlives ray.cancel."""
    ref = plain.remote(["sh", "-c", SETSID_TREE], _env(token))
    assert len(_until(lambda: pids_with_token(token) if len(pids_with_token(token)) >= 3 else None, 60) or []) >= 3
    ray.cancel(ref)
    time.sleep(3.0)
    survivors = pids_with_token(token)
    assert survivors, "the control did not reproduce: Ray's cancel left nothing alive"
    kill_token(token)               # ours to end, by pidfd after re-checking the token
    assert _until(lambda: pids_with_token(token) == [], 10)
    with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
        ray.get(ref, timeout=60)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
    except OSError:
        return False
    return st[st.rindex(b")") + 2:st.rindex(b")") + 3] not in (b"Z", b"X")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["cancel_force", "ray_kill_actor", "sigkill_worker"])
def test_the_owner_dying_ends_the_tree_and_the_janitor_finishes_the_record(local: dict, token: str,
                                                                            how: str, tmp_path: Any) -> None:
    if local["dwo_missing"]:
        pytest.skip(local["dwo_missing"])
    import launcher.ray as cray

    janitor = local["janitor_missing"] is None
    if janitor:
        cray.install()
    run_id = f"ray-{how.replace('_', '-')}-{token}"
    pid_file = str(tmp_path / "worker.pid")
    options = {"id": run_id, "grace": 1.0, "env": _env(token)}
    actor = None
    if how == "ray_kill_actor":
        actor = Tool.remote()
        ref = actor.run.remote(["sh", "-c", SETSID_TREE], **options)
    else:
        ref = contained.remote(["sh", "-c", SETSID_TREE], pid_file=pid_file, **options)
    assert len(_until(lambda: pids_with_token(token) if len(pids_with_token(token)) >= 3 else None, 60) or []) >= 3
    if how == "cancel_force":
        ray.cancel(ref, force=True)
    elif how == "ray_kill_actor":
        ray.kill(actor, no_restart=True)
    else:
        worker = int(open(pid_file).read())
        pfd = os.pidfd_open(worker)
        try:
            signal.pidfd_send_signal(pfd, signal.SIGKILL)
        finally:
            os.close(pfd)
    with pytest.raises(Exception):
        ray.get(ref, timeout=60)
    assert _until(lambda: pids_with_token(token) == [], 10), pids_with_token(token)
    if not janitor:
        pytest.skip(f"the tree ended with its owner; the record part needs the janitor: {local['janitor_missing']}")
    rec = _until(lambda: _final(local["state_dir"], run_id), 10)
    assert rec is not None and rec["state"] == "REAPED", rec


@pytest.mark.timeout(240)
def test_install_is_idempotent_and_places_one_janitor_per_node(local: dict) -> None:
    import launcher.ray as cray

    try:
        first = cray.install()
        again = cray.install()
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert {i["node"] for i in first} == nodes and len(first) == len(nodes)
        assert [i["actor_pid"] for i in again] == [i["actor_pid"] for i in first]
        assert all(i["state_dir"] == local["state_dir"] for i in first), first
        if local["janitor_missing"] is None:
            assert _until(lambda: all(i["janitor_pid"] for i in cray.install()), 20)
        else:
            # No janitor command yet: the actor's keeper still starts one
            # and starts it again after each exit.
            info = _until(lambda: [i for i in cray.install() if i["started"] >= 2 and i["exits"]], 20)
            assert info, cray.install()
    finally:
        cray.uninstall()


@pytest.mark.timeout(300)
def test_two_nodes_on_one_host_keep_their_runs_apart(world: dict, token: str) -> None:
    """A two-node ray.cluster_utils.Cluster on this machine: each node's runs
    in its own state directory, and runs() names both nodes."""
    from ray.cluster_utils import Cluster

    import launcher.ray as cray

    ray.shutdown()                 # the module's one-node cluster: a driver joins one cluster at a time
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        head = [i["node"] for i in cray.install()]
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        assert len(nodes) == 2 and len(head) == 1
        # The node that joined gets its janitor from the watcher, without another install().
        assert _until(lambda: len(cray.janitors()) == 2, 3 * cray.WATCH_S, 0.5), cray.janitors()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        refs = [contained.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            ["true"], id=f"ray-node-{i}-{token}", env=_env(token), die_with_owner=world["dwo_missing"] is None)
            for i, node in enumerate(nodes)]
        recs = ray.get(refs, timeout=120)
        assert [r["node"] for r in recs] == nodes
        assert all(r["state"] == "REAPED" for r in recs), recs
        dirs = {r["node"]: cray.node_state_dir(r["node"]) for r in recs}
        assert len(set(dirs.values())) == 2, dirs
        assert world["state_dir"] in dirs.values()
        for i, node in enumerate(nodes):
            assert _record(dirs[node], f"ray-node-{i}-{token}") is not None
            assert _record(dirs[nodes[1 - i]], f"ray-node-{i}-{token}") is None
        listed = {(row["node"], row.get("id")) for row in cray.runs()}
        assert {(node, f"ray-node-{i}-{token}") for i, node in enumerate(nodes)} <= listed, listed
    finally:
        if ray.is_initialized():
            cray.uninstall()
        ray.shutdown()
        cluster.shutdown()
        for extra in _extra_state_dirs(world["state_dir"]):
            subprocess.run(["rm", "-rf", "--one-file-system", extra], check=False)


def _extra_state_dirs(state_dir: str) -> list[str]:
    parent, name = os.path.split(state_dir)
    return [os.path.join(parent, x) for x in os.listdir(parent) if x.startswith(name + "-ray-")]
