"""Unsealed root workers that leave: the fork ledger sees them and the stop
gets them, or the record says the escape layer was not observed. The ledger
is what holds a run without the PID-namespace wall (`--no-pidns`); the same
escapes behind the wall (the default) are held by the namespace itself.

The test first checks, from outside, that the escape really happened (a
process of the workload sits in the parent cgroup), then cancels the run and
checks the record against its own /proc scan: never REAPED while a process
of the tree lives.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from _survivors import IS_ROOT, ROOT, Contain, kill_survivors, new_token, survivors, wait_for
from test_seal import ATTEMPTS, BASE, _attempt, _finish, _inside

needs_root = pytest.mark.skipif(not IS_ROOT, reason="the escapes tried need a root worker "
                                "(a non-root uid owns no cgroup.procs to move into)")




def _outside(c: Contain, where: dict[str, str | None]) -> dict[str, str | None]:
    return {p: w for p, w in where.items() if w is not None and not _inside(c, w)}


ESCAPES = {
    # name: (attempt, how many sleepers to wait for, how many escape)
    "write_parent_procs": (ATTEMPTS["write_parent_procs"], 1, 1),
    "nested_sh_write_parent_procs": (ATTEMPTS["nested_sh_write_parent_procs"], 2, 1),
    "clone3_into_parent": (ATTEMPTS["clone3_into_parent"], 2, 1),
    # The escaper forks after leaving: its child was forked by a tracked
    # process, so the ledger has it too.
    "escaper_forks_after_leaving": (f"sh -c 'echo $$ > {BASE}/cgroup.procs || exit; sleep 300 & exec sleep 300' &", 3, 2),
    # The escaper leaves the session and group as well.
    "escaper_setsid_double_fork": (f"sh -c 'echo $$ > {BASE}/cgroup.procs || exit; setsid sh -c \"sleep 300 &\"; "
                                   "exec sleep 300' &", 3, 2),
}


@needs_root
@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_unsealed_escape_is_caught(contain_runs, tmp_path, name):
    attempt, sleepers, escapers = ESCAPES[name]
    c = contain_runs()
    where = _attempt(c, ["--no-pidns"], attempt, str(tmp_path), expect_sleepers=sleepers)
    out = _outside(c, where)
    assert len(out) >= escapers, f"{name} did not escape unsealed (the test is void): {where}"
    rec = _finish(c)
    assert rec["containment"]["sealed"] is False
    esc = rec["evidence"]["escapes"]
    assert esc["observed"] is True, esc
    listed = {e["pid"] for e in esc["detail"]}
    assert set(map(int, out)) <= listed, (out, esc["detail"])
    assert rec["state"] in ("REAPED", "BREACHED")
    if rec["state"] == "REAPED":
        assert all(e["killed"] and e["gone"] and e["alive_at_end"] is False for e in esc["detail"])
    assert rec["_left"] == [] or rec["state"] == "BREACHED"


@needs_root
@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_escape_from_the_cgroup_is_held_by_the_pid_namespace_wall(contain_runs, tmp_path, name):
    """The same escapes behind the wall (the default): the process leaves
    the cgroup but not the namespace, and dies with it. Never REAPED while
    anything of the tree lives (the test's own /proc scan); with the wall,
    nothing lives."""
    attempt, sleepers, escapers = ESCAPES[name]
    c = contain_runs()
    where = _attempt(c, [], attempt, str(tmp_path), expect_sleepers=sleepers)
    out = _outside(c, where)
    assert len(out) >= escapers, f"{name} did not leave the cgroup (the test is void): {where}"
    rec = _finish(c)
    walls = [w["kind"] for w in rec["containment"]["walls"]]
    assert "pidns" in walls, walls
    assert rec["_left"] == [], f"survivors behind the wall: {rec['_left']}"
    assert rec["state"] == "REAPED" and rec["evidence"]["descendants_exit"]["observed"] is True


@needs_root
@pytest.mark.parametrize("migrate", [False, True], ids=["stays", "migrates_at_once"])
def test_clone_parent_child_is_held_by_the_pid_namespace_wall(contain_runs, tmp_path, migrate):
    """CLONE_PARENT behind the wall: the child is the init's (the worker's
    parent inside the namespace), still a member, and dies with it."""
    helper = _clone_parent_helper(tmp_path)
    c = contain_runs()
    target = f"{BASE}/cgroup.procs" if migrate else "-"
    rc = c.run(["--grace", "0.5"], [helper, target, "sleep", "300"])
    rec = c.record()
    assert survivors(c.token) == [] and rec["state"] == "REAPED" and rc == 0, rec["state"]


@needs_root
def test_unsealed_escape_through_capless_root_process_is_caught(contain_runs, tmp_path):
    """/proc/<pid>/root of a root process without capabilities leads to the
    host's cgroup mount. (/proc/1/root is denied here even to root: pid 1
    holds a capability outside this host's bounding set.)"""
    import shutil

    if shutil.which("setpriv") is None:
        pytest.skip("setpriv not installed")
    helper_token = new_token()
    helper = subprocess.Popen(["setpriv", "--bounding-set=-all", "--inh-caps=-all", "sleep", "300"],
                              env=dict(os.environ, SEALTEST_TOKEN=helper_token))
    try:
        assert wait_for(lambda: survivors(helper_token), 5)
        c = contain_runs()
        where = _attempt(c, ["--no-pidns"], f"echo $$ > /proc/{helper.pid}/root{BASE}/cgroup.procs", str(tmp_path))
        out = _outside(c, where)
        assert out, f"did not escape unsealed (the test is void): {where}"
        rec = _finish(c)
        assert {e["pid"] for e in rec["evidence"]["escapes"]["detail"]} >= set(map(int, out))
        assert rec["_left"] == [] or rec["state"] == "BREACHED"
    finally:
        helper.kill()
        helper.wait(10)
        kill_survivors(helper_token)


@needs_root
def test_ledger_turned_off_says_escapes_not_observed(contain_runs, tmp_path):
    """Without a ledger (here: turned off), an escape cannot be seen: the
    layer is null with the reason, never "none seen". The escaper here exits
    by itself before the stop, so nothing is left to lie about."""
    c = contain_runs()
    script = f"sh -c 'echo $$ > {BASE}/cgroup.procs && sleep 0.2'\nexit 0"
    assert c.run(["--no-pidns"], ["sh", "-c", script], extra_env={"CONTAIN_LEDGER": "off"}) == 0
    rec = c.record()
    esc = rec["evidence"]["escapes"]
    assert esc["observed"] is None and "would not be seen" in esc["detail"]
    assert rec["containment"]["sealed"] is False
    assert survivors(c.token) == [] or rec["state"] != "REAPED"


@needs_root
def test_no_escape_is_observed_false_with_ledger(contain_runs):
    c = contain_runs()
    assert c.run(["--no-pidns"], ["sh", "-c", "sleep 0.1 & sleep 0.1 & wait"]) == 0
    rec = c.record()
    esc = rec["evidence"]["escapes"]
    assert esc["observed"] is False, esc
    assert esc["detail"]["tracked"] >= 3 and esc["detail"]["lost_events"] == 0
    assert rec["state"] == "REAPED"


def test_ledger_tracks_forks_made_before_the_root_is_registered():
    """Events that arrive before track_root are replayed: a worker that
    forks at once is not missed. Drives the Ledger directly."""
    sys.path.insert(0, ROOT)
    from launcher._ledger import Ledger
    from launcher._proccn import LedgerUnavailable

    try:
        led = Ledger.open()
    except LedgerUnavailable as e:
        pytest.skip(f"process connector unavailable here: {e.reason}")
    token = new_token()
    p = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & sh -c 'sleep 30 &' ; wait"],
                         env=dict(os.environ, SEALTEST_TOKEN=token))
    try:
        time.sleep(0.3)          # every fork has happened before the root is known
        led.track_root(p.pid)
        live = {t.pid for t in led.live()}
        mine = set(survivors(token))
        assert mine <= live, (mine, live)
        assert all(t.start_time for t in led.tracked if t.pid in mine)
    finally:
        led.close()
        p.kill()
        p.wait(10)
        kill_survivors(token)


CLONE_PARENT_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
/* argv[1]: a cgroup.procs to move the child into at once ("-": stay);
 * argv[2..]: what the child execs. The child is made with CLONE_PARENT, so
 * the kernel (and its process connector) names our parent as its parent;
 * we stay 0.5 s, long enough for the child to have moved. */
int main(int argc, char **argv) {
    if (argc < 3) return 2;
    long pid = syscall(SYS_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) {
        if (strcmp(argv[1], "-") != 0) {
            int fd = open(argv[1], O_WRONLY | O_CLOEXEC);
            if (fd >= 0) { if (write(fd, "0", 1) < 0) {} close(fd); }
        }
        execvp(argv[2], argv + 2);
        _exit(127);
    }
    usleep(500000);
    return pid < 0;
}
"""


def _clone_parent_helper(tmp_path) -> str:
    import shutil

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler to build the CLONE_PARENT helper")
    src = tmp_path / "clone_parent.c"
    src.write_text(CLONE_PARENT_C)
    exe = str(tmp_path / "clone_parent")
    subprocess.run([shutil.which("cc") or "gcc", "-O1", "-o", exe, str(src)], check=True)
    return exe


@needs_root
@pytest.mark.parametrize("migrate", [False, True], ids=["stays", "migrates_at_once"])
def test_clone_parent_child_is_still_contained(contain_runs, tmp_path, migrate):
    """A root worker's child made with clone(CLONE_PARENT) is reported as a
    child of the supervisor, not of the worker. Whether it stays or writes
    itself into the parent cgroup at once, the record never says REAPED or
    descendants_exit true while it lives (the test's own /proc scan)."""
    helper = _clone_parent_helper(tmp_path)
    c = contain_runs()
    target = f"{BASE}/cgroup.procs" if migrate else "-"
    # The worker itself makes the child: its parent is the supervisor.
    rc = c.run(["--grace", "0.5", "--no-pidns"], [helper, target, "sleep", "300"])
    rec = c.record()
    left = survivors(c.token)
    if left:
        assert rec["state"] != "REAPED", (left, rec["evidence"]["escapes"])
        assert rec["evidence"]["descendants_exit"]["observed"] is not True
    if not migrate:
        # It was born inside and stayed: the stop found it as a member.
        assert left == [] and rec["state"] == "REAPED" and rc == 0, (left, rec["state"])


@needs_root
def test_escaper_left_in_the_runs_v1_cgroups_is_stopped_without_a_ledger(contain_runs, tmp_path):
    """With the ledger off, a root worker that moved only its v2 cgroup
    (into the contain base) stayed in the run's own v1 memory and pids
    cgroups: it lived on after the run, and those cgroups could never be
    removed (cleanup.cgroups_v1_removed false, one leak per run). A process
    is born in its creator's cgroups, so one still in the run's v1 cgroups
    once the v2 container emptied left it: it is stopped and listed as an
    escaper, and the run is still not REAPED (nothing watched the whole
    run)."""
    from launcher import _controllers as C

    if not any(("memory" in h.controllers or "pids" in h.controllers) for h in C.v1_hierarchies()):
        pytest.skip("no v1 memory or pids hierarchy: the run has no v1 cgroups")
    c = contain_runs()
    ready = tmp_path / "moved"
    script = (f"sh -c 'echo $$ > {BASE}/cgroup.procs && echo $$ > {ready} && exec sleep 300' >/dev/null 2>&1 &\n"
              f"while [ ! -s {ready} ]; do sleep 0.05; done\nexit 0")
    rc = c.run(["--no-pidns", "--grace", "0.5"], ["sh", "-c", script], extra_env={"CONTAIN_LEDGER": "off"},
               timeout=90)
    escaper = int(ready.read_text())
    rec = c.record()
    left = survivors(c.token)
    assert rc == 0, c.stderr
    assert escaper not in left, f"the escaper {escaper} outlived the run: {rec['evidence']['escapes']}"
    esc = rec["evidence"]["escapes"]
    assert esc["observed"] is True, esc
    entry = next(e for e in esc["detail"] if e["pid"] == escaper)
    assert entry["killed"] is True and entry["gone"] is True and "v1" in entry["via"], entry
    assert rec["cleanup"]["cgroups_v1_removed"] is True, rec["cleanup"]
    assert rec["state"] == "EXITED", rec["state"]
    assert left == []
