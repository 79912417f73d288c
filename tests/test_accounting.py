"""What a run cost and what it may use, measured on the real kernel (issue 14).

Every tree here is placed in cgroups the test creates, the way the spawn will
place the worker (tests/_cgworld.py); survivors are decided by the test's own
/proc scan for the token. On this hybrid host the numbers come from the v1
memory and pids hierarchies and the v2 cpu.stat.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import time

import pytest

from _cgworld import World, wait_line
from conftest import CGROUP_SKIP, pids_with_token

from launcher import _accounting as A
from launcher import _controllers as C
from launcher import _runcgroups as R
from launcher import _limits as L
from launcher import _procfs as P
from launcher._errors import ContainmentUnavailable

pytestmark = pytest.mark.skipif(CGROUP_SKIP is not None, reason=CGROUP_SKIP or "")


def _v1(controller: str) -> C.V1Hierarchy | None:
    return next((h for h in C.v1_hierarchies() if controller in h.controllers), None)


needs_v1 = pytest.mark.skipif(_v1("memory") is None or _v1("pids") is None,
                              reason="needs the cgroup v1 memory and pids hierarchies (a hybrid host)")


@pytest.fixture
def world(token: str):
    w = World(token)
    try:
        yield w
    finally:
        w.close()


def _wait4(p: subprocess.Popen[bytes], timeout: float = 20.0) -> tuple[int, resource.struct_rusage]:
    """Reap the worker ourselves to see what its parent's getrusage would."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            return p.returncode, ru
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {p.pid} did not exit")
        time.sleep(0.01)


GRANDCHILD = textwrap.dedent("""
    import os, sys, time
    what, amount = sys.argv[1], float(sys.argv[2])
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            if what == "mem":
                b = b"\\x01" * (int(amount) << 20)      # every page written
                time.sleep(0.3)
            else:
                while time.process_time() < amount:     # a fixed amount of CPU, whatever the load
                    pass
            os._exit(0)
        os._exit(0)
    os._exit(0)                                        # the worker waits for nobody
""")


# -- the snapshot ----------------------------------------------------------------

@needs_v1
def test_peak_memory_of_a_grandchild_never_waited_for(world):
    c, rc = world.run()
    t0 = time.monotonic()
    p = world.spawn(c, rc, [sys.executable, "-c", GRANDCHILD, "mem", "200"])
    code, ru = _wait4(p)
    assert code == 0
    t1 = world.wait_empty(c)
    snap = A.final_snapshot(rc, v2_dir=c.dir, wall_s=A.wall_time(t0, t1))
    peak = snap["memory_peak_bytes"]
    assert peak["value"] >= 200 << 20, peak
    assert "memory.max_usage_in_bytes" in peak["source"]
    # What the worker's parent sees: the worker's own RSS, not the tree's
    # 200 MB. (A child's maxrss starts from the process it was cloned from:
    # exec_mmap keeps the old mm's high-water mark, so this test process's
    # own, larger in a whole session than alone, is a floor.)
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert ru.ru_maxrss * 1024 < 200 << 20, ru.ru_maxrss
    assert ru.ru_maxrss < own + (100 << 10), (ru.ru_maxrss, own)
    assert snap["wall_s"]["value"] >= 0.3
    assert snap["empty_when_taken"]["observed"] is True
    assert snap["tasks_peak"]["value"] >= 2                # never fewer than two alive at once
    assert pids_with_token(world.token) == []


@needs_v1
def test_cpu_of_a_setsid_grandchild_is_counted(world):
    c, rc = world.run()
    p = world.spawn(c, rc, [sys.executable, "-c", GRANDCHILD, "cpu", "0.6"])
    code, ru = _wait4(p)
    assert code == 0
    world.wait_empty(c)
    snap = A.final_snapshot(rc, v2_dir=c.dir, wall_s=None, wall_reason="not measured by this test")
    total = snap["cpu_usec"]
    assert total["value"] >= 600_000, snap                 # the grandchild alone burned 0.6 s
    assert "cpu.stat usage_usec" in total["source"]
    # (its loop's clock reads are system calls: user and system both count)
    assert snap["cpu_user_usec"]["value"] + snap["cpu_system_usec"]["value"] >= 590_000
    assert ru.ru_utime + ru.ru_stime < 0.3, ru             # the parent's view missed it
    assert snap["wall_s"] == {"value": None, "reason": "not measured by this test"}


@needs_v1
def test_live_numbers_while_running(world):
    c, rc = world.run()
    p = world.python(c, rc, "import sys, time\nb = b'x' * (40 << 20)\nprint('ok', flush=True)\ntime.sleep(30)\n",
                     stdout=subprocess.PIPE)
    wait_line(p)
    now = A.live(rc, v2_dir=c.dir)
    assert now["tasks"]["value"] == 1
    assert now["memory_bytes"]["value"] >= 40 << 20
    assert now["cpu_usec"]["value"] > 0
    for k in ("tasks", "memory_bytes", "cpu_usec"):
        assert now[k]["source"].startswith(("cgroup1 ", "cgroup2 ")), now[k]
    world.stop(c)
    assert pids_with_token(world.token) == []


def test_unreadable_numbers_are_null_with_the_reason_never_zero(world):
    """Accounting with v1 turned off and a v2 base without controllers: the
    CPU is still there (cpu.stat needs no controller), everything else is
    null and says why."""
    env = dict(world.env, CONTAIN_CGROUP_V1="off")
    from launcher._platform import linux

    c = linux.Container.create("n", env)
    world.containers.append(c)
    rc = R.RunCgroups.create(os.path.basename(c.dir), None, v2_dir=c.dir, env=env)
    world.runs.append(rc)
    assert rc.v1 == {}
    p = world.spawn(c, rc, ["true"])
    assert p.wait(20) == 0
    world.wait_empty(c)
    snap = A.final_snapshot(rc, v2_dir=c.dir, wall_s=0.01)
    assert snap["cpu_usec"]["value"] is not None
    for k in ("memory_peak_bytes", "oom_kills", "tasks_peak", "pids_max_events", "io_read_bytes"):
        assert snap[k]["value"] is None, (k, snap[k])
        assert "turned off" in snap[k]["reason"] or "blkio" in snap[k]["reason"], snap[k]
    hits = A.limit_hits(snap)
    assert hits["oom_kill"]["observed"] is None and hits["pids_max"]["observed"] is None


# -- limits ----------------------------------------------------------------------

@needs_v1
def test_fork_bomb_is_stopped_by_pids_max(world):
    c, rc = world.run(L.Limits(pids_max=24))
    assert rc.applied["pids_max"]["files"] == {"pids.max": "24"}
    bomb = world.spawn(c, rc, ["sh", "-c", "b() { b & b & wait; }; b"], stderr=subprocess.DEVNULL)
    pids_dir = rc.where("pids")[0]
    deadline = time.monotonic() + 15
    hit = 0
    while time.monotonic() < deadline:
        hit = A.parse_flat_keyed(open(os.path.join(pids_dir, "pids.events")).read())["max"]
        if hit:
            break
        time.sleep(0.02)
    assert hit, "the bomb never reached the limit"
    live = A.live(rc, v2_dir=c.dir)
    assert 1 < live["tasks"]["value"] <= 24
    world.stop(c)
    bomb.wait(10)
    snap = A.final_snapshot(rc, v2_dir=c.dir)
    assert snap["tasks_peak"]["value"] == 24, snap["tasks_peak"]
    assert snap["pids_max_events"]["value"] >= 1
    hits = A.limit_hits(snap)
    assert hits["pids_max"]["observed"] is True
    assert hits["oom_kill"]["observed"] is False
    assert pids_with_token(world.token) == []


@needs_v1
def test_memory_hog_is_oom_killed_and_recognised(world):
    c, rc = world.run(L.Limits(memory_max=L.parse_bytes("64M")))
    files = rc.applied["memory_max_bytes"]["files"]
    assert files["memory.limit_in_bytes"] == str(64 << 20)
    hog = world.python(c, rc, "chunks = []\nwhile True:\n    chunks.append(b'\\x01' * (1 << 20))\n")
    code, _ru = _wait4(hog, 30)
    assert code == -9
    world.wait_empty(c)
    snap = A.final_snapshot(rc, v2_dir=c.dir)
    assert snap["oom_kills"]["value"] >= 1, snap["oom_kills"]
    assert 48 << 20 <= snap["memory_peak_bytes"]["value"] <= 64 << 20
    hits = A.limit_hits(snap)
    assert hits["oom_kill"]["observed"] is True and hits["memory_max"]["observed"] is True
    cause = A.signal_cause(9, hits, kill_sent_before_exit=False)
    assert cause is not None and cause["cause"] == "oom_kill", cause
    # The same status from contain's own stop is not an OOM kill.
    assert A.signal_cause(9, hits, kill_sent_before_exit=True)["cause"] == "contain_stop"


@needs_v1
def test_sigkill_from_another_process_is_not_an_oom_kill(world):
    c, rc = world.run(L.Limits(memory_max=L.parse_bytes("64M")))
    p = world.spawn(c, rc, ["sleep", "30"])
    time.sleep(0.05)
    p.kill()                                     # "another process"
    code, _ru = _wait4(p)
    assert code == -9
    world.wait_empty(c)
    hits = A.limit_hits(A.final_snapshot(rc, v2_dir=c.dir))
    assert hits["oom_kill"]["observed"] is False
    assert A.signal_cause(9, hits, kill_sent_before_exit=False)["cause"] == "other"
    assert A.signal_cause(0, hits, kill_sent_before_exit=False) is None


@pytest.mark.skipif(_v1("cpu") is None, reason="needs the cgroup v1 cpu hierarchy")
def test_cpu_max_holds_a_setsid_burner(world):
    c, rc = world.run(L.Limits(cpu_max=L.parse_cpu_max("0.2")))
    assert rc.applied["cpu_max"]["files"] == {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "20000"}
    t0 = time.monotonic()
    p = world.spawn(c, rc, [sys.executable, "-c", GRANDCHILD, "cpu", "0.3"])
    assert _wait4(p)[0] == 0
    world.wait_empty(c, 30)
    wall = time.monotonic() - t0
    snap = A.final_snapshot(rc, v2_dir=c.dir)
    assert snap["cpu_usec"]["value"] >= 300_000
    # 0.3 s of CPU at 0.2 CPU cannot take less than 1.5 s (unlimited: 0.3 s).
    assert wall >= 1.2, wall
    cpu_dir = rc.where("cpu")[0]
    st = A.parse_flat_keyed(open(os.path.join(cpu_dir, "cpu.stat")).read())
    assert st["nr_throttled"] > 0 and st["throttled_time"] > 0, st


# -- placement -------------------------------------------------------------------

@needs_v1
def test_placement_is_verified_from_proc(world):
    c, rc = world.run()
    joined = world.spawn(c, rc, ["sleep", "30"])
    ok = rc.verify(joined.pid)
    assert ok["observed"] is True, ok
    for name, d in ok["detail"]["v1"].items():
        assert d["found"] == d["expected"] and d["expected"].endswith("/" + rc.name)
    # A child that skipped the join fds is named as misplaced, not passed.
    c2, rc2 = world.run(run_id="u")
    stray = world.spawn(c2, None, ["sleep", "30"])
    bad = rc2.verify(stray.pid)
    assert bad["observed"] is False
    assert bad["detail"]["v1"]["memory"]["found"] != bad["detail"]["v1"]["memory"]["expected"]
    world.stop(c)
    world.stop(c2)
    assert rc.verify(joined.pid)["observed"] is None          # gone: not readable, not "placed"


@needs_v1
def test_a_run_started_inside_a_run_nests_below_it(world):
    c, rc = world.run()
    code = textwrap.dedent("""
        import json, os
        from launcher import _controllers as C
        from launcher import _runcgroups as R
        from launcher import _limits as L
        from launcher import _procfs as P
        env = dict(os.environ)
        sub = R.RunCgroups.create("sub-n-0123abcd", None, v2_dir=None, env=env)
        print(json.dumps(sub.describe()), flush=True)
        print(sub.remove(), flush=True)
    """)
    p = world.python(c, rc, code, stdout=subprocess.PIPE)
    desc = json.loads(wait_line(p))
    assert p.wait(20) == 0
    for name in ("memory", "pids"):
        lead = rc.describe()["v1"][name]["cgroup"]
        assert desc["v1"][name]["cgroup"] == lead + "/sub-n-0123abcd", desc["v1"][name]


@needs_v1
def test_pids_limit_hit_in_a_nested_cgroup_is_counted_for_the_run(world):
    """v1 pids.events counts a fork failure in the forking task's own cgroup:
    the run's number sums its subtree."""
    c, rc = world.run(L.Limits(pids_max=6))
    pids_dir = rc.where("pids")[0]
    sub = os.path.join(pids_dir, "sub-x")
    os.mkdir(sub)
    fd = os.open(os.path.join(sub, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
    leaf = os.open(os.path.join(c.leaf, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
    others = [x for x in rc.join_fds()]
    mem = [f for f, n in zip(others, sorted(rc.v1)) if n != "pids"]

    def join() -> None:
        os.write(leaf, b"0")
        for f in mem + [fd]:
            os.write(f, b"0")

    try:
        p = subprocess.Popen(["sh", "-c", "for i in 1 2 3 4 5 6 7 8 9; do sleep 5 & done; wait"],
                             preexec_fn=join, env=world.env, stderr=subprocess.DEVNULL)
    finally:
        os.close(fd)
        os.close(leaf)
        rc.close_join_fds()
    world.procs.append(p)
    deadline = time.monotonic() + 10
    while A.parse_flat_keyed(open(os.path.join(sub, "pids.events")).read())["max"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert A.parse_flat_keyed(open(os.path.join(pids_dir, "pids.events")).read())["max"] == 0
    world.stop(c)
    snap = A.final_snapshot(rc, v2_dir=c.dir)
    assert snap["pids_max_events"]["value"] >= 1
    assert "summed over the run's subtree" in snap["pids_max_events"]["source"]


# -- refusals (the v2 path: discovery and refusal on the real unified mount) -----

def test_v2_base_without_controllers_offers_none_and_is_not_written(world):
    before = open(os.path.join(world.v2_base, "cgroup.subtree_control")).read()
    routes = C.v2_offer(world.v2_base, ["memory", "pids", "cpu", "io"])
    avail = open(os.path.join(world.v2_base, "cgroup.controllers")).read().split()
    for c in ("memory", "pids", "cpu", "io"):
        if c in avail:
            pytest.skip(f"this host delegates {c} to cgroup v2: the refusal cannot be shown here")
        assert routes[c].kind is None
        assert "cgroup.controllers" in (routes[c].reason or "")
    assert open(os.path.join(world.v2_base, "cgroup.subtree_control")).read() == before


def test_limit_where_no_controller_exists_is_refused(world):
    env = dict(world.env, CONTAIN_CGROUP_V1="off")
    from launcher._platform import linux

    if "memory" in open(os.path.join(world.v2_base, "cgroup.controllers")).read().split():
        pytest.skip("this host delegates memory to cgroup v2")
    c = linux.Container.create("r", env)
    world.containers.append(c)
    with pytest.raises(ContainmentUnavailable) as ei:
        R.RunCgroups.create(os.path.basename(c.dir), L.Limits(memory_max=1 << 26, pids_max=10),
                            v2_dir=c.dir, env=env)
    msg = ei.value.reason
    assert "--memory-max cannot be applied" in msg and "--pids-max cannot be applied" in msg
    assert "cgroup.controllers" in msg and "CONTAIN_CGROUP_V1" in msg
    assert "contain doctor" in str(ei.value)
    for h in C.v1_hierarchies():
        assert not os.path.exists(os.path.join(h.fs_path(world.v1_base), os.path.basename(c.dir)))


@needs_v1
def test_refusal_when_the_v1_cgroup_cannot_be_made_leaves_nothing(world):
    env = dict(world.env, CONTAIN_CGROUP_V1_BASE=world.v1_base + "/missing/deeper")
    from launcher._platform import linux

    c = linux.Container.create("m", env)
    world.containers.append(c)
    with pytest.raises(ContainmentUnavailable) as ei:
        R.RunCgroups.create(os.path.basename(c.dir), L.Limits(pids_max=10), v2_dir=c.dir, env=env)
    assert "--pids-max cannot be applied" in ei.value.reason
    for h in C.v1_hierarchies():
        top = h.fs_path(world.v1_base)
        assert not os.path.exists(os.path.join(top, "missing")), top


def test_host_report_names_a_route_or_a_reason_for_each_controller(world):
    rep = C.host_report(world.v2_base, world.env)
    for c in ("memory", "pids", "cpu", "io"):
        assert rep[c]["via"] is not None or rep[c]["reason"], rep[c]


# -- adoption: the run info is untrusted -----------------------------------------

@needs_v1
def test_forged_run_info_cannot_point_at_another_cgroup(world):
    c, rc = world.run()
    desc = rc.describe()
    back = R.RunCgroups.attach(desc, v2_dir=c.dir)
    assert back.v1 == rc.v1
    forged = json.loads(json.dumps(desc))
    forged["v1"]["memory"]["cgroup"] = P.cgroups_of("self")["memory"]    # the session's own cgroup
    with pytest.raises(ValueError):
        R.RunCgroups.attach(forged, v2_dir=c.dir)
    forged = json.loads(json.dumps(desc))
    forged["v1"]["memory"]["cgroup"] = "/" + rc.name + "/../" + rc.name
    with pytest.raises(ValueError):
        R.RunCgroups.attach(forged, v2_dir=c.dir)
    with pytest.raises(ValueError):
        R.RunCgroups.attach(dict(desc, name="run-x-0123abcd"), v2_dir=c.dir)


@needs_v1
def test_removal_reports_a_member_that_left_the_v2_container(world):
    """A member moved out of the v2 run (by the test, standing in for a root
    worker) but left in the run's v1 cgroups: the v2 container reads empty,
    the snapshot says the v1 side is not, and removal names the pid."""
    c, rc = world.run()
    p = world.spawn(c, rc, ["sleep", "30"])
    out = os.path.join(world.v2_base, "elsewhere")
    os.mkdir(out)
    with open(os.path.join(out, "cgroup.procs"), "w") as f:
        f.write(str(p.pid))                            # our own child, into our own cgroup
    world.wait_empty(c)
    snap = A.final_snapshot(rc, v2_dir=c.dir)
    assert snap["empty_when_taken"]["observed"] is False
    assert p.pid in snap["empty_when_taken"]["detail"]["v1_members"]["memory"]
    problem = rc.remove()
    assert problem is not None and str(p.pid) in problem
    p.kill()
    p.wait(10)
    assert rc.remove() is None


@needs_v1
def test_a_v1_base_the_run_made_is_removed_with_it_and_one_it_found_is_kept(world):
    """CONTAIN_CGROUP_V1_BASE names a base that does not exist: the run makes
    it, and once its own cgroups are gone it removes the base too (it used to
    stay for ever, one empty cgroup per base named). A base that was there
    before the run is someone's: it stays."""
    from _cgworld import remove_v1_base
    from launcher._platform import linux

    made = world.v1_base + "-made-by-run"
    env = dict(world.env, CONTAIN_CGROUP_V1_BASE=made)
    try:
        c = linux.Container.create("vb", env)
        world.containers.append(c)
        rc = R.RunCgroups.create(os.path.basename(c.dir), L.Limits(pids_max=10), v2_dir=c.dir, env=env)
        tops = [h.fs_path(made) for h in C.v1_hierarchies() if h.name in rc.v1]
        assert tops and all(os.path.isdir(t) for t in tops), tops
        assert rc.remove() is None
        assert [t for t in tops if os.path.exists(t)] == [], "the base the run made outlived it"

        found = [h.fs_path(world.v1_base) for h in C.v1_hierarchies() if h.name in rc.v1]
        for t in found:
            os.mkdir(t)                      # this test's own base, there before the run
        rc2 = R.RunCgroups.create(os.path.basename(c.dir), L.Limits(pids_max=10), v2_dir=c.dir, env=world.env)
        world.runs.append(rc2)
        assert rc2.remove() is None
        assert all(os.path.isdir(t) for t in found), "a base the run found was removed"
    finally:
        remove_v1_base(made)


def test_v1_accounting_cgroups_are_made_only_for_a_run_that_asks(cgroup_base, state_dir, env) -> None:
    """On a hybrid host a run's v1 memory and pids cgroups cost about 0.85 ms
    of it: a plain run has none (peak memory and tasks null, with why), one
    with accounting=True has them and their numbers."""
    import launcher
    from launcher._controllers import v1_hierarchies

    if not any(h.name in ("memory", "pids") for h in v1_hierarchies()):
        pytest.skip("no cgroup v1 memory or pids hierarchy: nothing is made on demand here")
    plain = launcher.run(["true"], env=env).to_dict()
    asked = launcher.run(["true"], env=env, accounting=True).to_dict()
    assert plain["state"] == asked["state"] == "REAPED"
    assert plain["containment"]["cgroup_v1"]["v1"] == {}, plain["containment"]["cgroup_v1"]
    assert asked["containment"]["cgroup_v1"]["v1"], asked["containment"]["cgroup_v1"]
    for key in ("memory_peak_bytes", "tasks_peak"):
        p, a = plain["accounting"][key], asked["accounting"][key]
        assert p["value"] is None and "made only for a run that asks" in p["reason"], p
        assert a["value"] is not None and a["value"] > 0, a


@pytest.mark.skipif(os.geteuid() != 0 or _v1("cpuacct") is None,
                    reason="needs root and the cgroup v1 cpuacct hierarchy (a pidns run's own cgroup)")
@pytest.mark.forked         # the pidns backend's probe is kept per process (pidns.available)
def test_pidns_run_with_its_own_cgroup_counts_a_child_reaped_by_the_kernel(box, tmp_path):
    """On the `pidns` backend the init's rusage replaced the run's own
    cpuacct cgroup, and a member that ignores SIGCHLD has its children
    reaped by the kernel: their CPU reaches no rusage. The cgroup counts
    them: whole-tree CPU comes from it (a 0.6 s burner's child)."""
    import launcher

    burner = tmp_path / "burn.py"
    burner.write_text(textwrap.dedent("""\
        import os, signal, time
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        p = os.fork()
        if p == 0:
            t = time.process_time()
            while time.process_time() - t < 0.6:
                pass
            os._exit(0)
        try:
            os.waitpid(p, 0)
        except ChildProcessError:
            pass
        """))
    rec = launcher.run([sys.executable, str(burner)], backend="pidns", accounting=True, env=box.env).to_dict()
    assert rec["state"] == "REAPED" and rec["containment"]["backend"] == "pidns", rec["state"]
    cpu = rec["accounting"]["cpu_usec"]
    assert cpu["value"] is not None and cpu["value"] >= 550_000, cpu
    assert "cpuacct" in cpu["source"] and rec["cpu"]["usage_usec"] == cpu["value"], (cpu, rec["cpu"])
