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

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _proc import holders, kill_holders
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


# The worker forks K and exits at once; K spins until the kernel has
# reparented it (getppid changes: the worker's exit_notify), then makes C
# with clone(CLONE_PARENT). The process connector names K's new parent (a
# reaper outside the tree) as C's, and C's fork can be queued before the
# worker's exit event, which is what told the old ledger to look at that
# reaper's forks. C moves itself out of every cgroup of the run (the test's
# own v2 and v1 cgroups: `ESC_FILES`) and sleeps, deaf to the polite signal.
# With CREATOR_LEAVES, K leaves first, so C is born outside the run and can
# only be told from the host's other forks by what the ledger knows of K.
RACER_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
static void leave(void) {
    char *files = strdup(getenv("ESC_FILES")), *save = 0;
    for (char *f = strtok_r(files, ":", &save); f; f = strtok_r(0, ":", &save)) {
        int fd = open(f, O_WRONLY | O_CLOEXEC);
        if (fd >= 0) { if (write(fd, "0", 1) < 0) {} close(fd); }
    }
}
int main(void) {
    pid_t w = getpid();
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    if (fork() != 0) _exit(0);
    while (getppid() == w) ;
    if (getenv("CREATOR_LEAVES")) leave();       /* C is born outside */
    long c = syscall(SYS_clone, CLONE_PARENT | SIGCHLD, 0, 0, 0, 0);
    if (c == 0) {
        leave();
        execlp("sleep", "sleep", "300", (char *)0);
        _exit(127);
    }
    _exit(0);
}
"""


def _v1_escape_cgroups(box) -> list[str]:
    """A cgroup of the test's own in every v1 hierarchy (under the box's v1
    base, removed with it): where the racer's child goes."""
    from conftest import v1_mounts

    out = []
    for mnt in v1_mounts():
        d = os.path.join(mnt, box.v1_base.lstrip("/"), "esc")
        try:
            os.makedirs(d, exist_ok=True)
        except OSError:
            continue
        out.append(os.path.join(d, "tasks"))
    return out


def _race_runs(exe: str, env: dict[str, str], token: str, runs: int, out: str) -> None:
    """In a forked child: become a child subreaper (the reaper of the
    tree's orphans, outside the tree, reaping at once), fork the library
    supervisor, which runs the racer `runs` times and writes, for each
    run, the record's state and what the test's own /proc scan found."""
    import ctypes

    import launcher

    os.setpgid(0, 0)           # a group of the test's own: ended whole if the runs overrun
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)     # PR_SET_CHILD_SUBREAPER
    sup = os.fork()
    if sup == 0:
        rows = []
        for i in range(runs):
            rec = launcher.run([exe], id=f"race{i}", grace=0.2, pidns=False, env=env, kill_timeout=2).to_dict()
            left = holders(token)
            ev = rec["evidence"]
            rows.append({"state": rec["state"], "left": left, "escapes": ev["escapes"],
                         "descendants_exit": ev["descendants_exit"]})
            kill_holders(token)
        with open(out, "w") as f:
            json.dump(rows, f)
        os._exit(0)
    while True:          # reap everything, the supervisor last
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == sup:
            break
    os._exit(0)


@needs_root
@pytest.mark.timeout(360)        # its own bound is 300 s for the 30 runs (under load, more than the default 120)
@pytest.mark.parametrize("creator", ["stays", "leaves_first"])
def test_clone_parent_child_of_an_orphan_racing_its_parents_exit_is_never_reaped(box, tmp_path, creator):
    """Without the wall (library `pidns=False`), under a subreaper that is
    not the supervisor: the tree's orphans go to a reaper outside the tree,
    which reaps them at once. The worker forks K and exits; K, orphaned,
    makes C with clone(CLONE_PARENT) and exits; C leaves every cgroup of the
    run. Whatever order the kernel's fork and exit events arrive in, and
    whether K is still there to be read when they are, a run whose escaper
    lives is never REAPED, and `descendants_exit` is never true then (the
    test's own /proc scan decides what lives). Many runs: the order is a race."""
    import shutil

    if box.base is None:
        pytest.skip("no cgroup v2 mount")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the racer")
    src, exe = tmp_path / "racer.c", str(tmp_path / "racer")
    src.write_text(RACER_C)
    subprocess.run([cc, "-O1", "-o", exe, str(src)], check=True, timeout=60)
    os.makedirs(box.base, exist_ok=True)
    esc = os.path.join(box.base, "esc")
    os.makedirs(esc, exist_ok=True)
    env = dict(box.env, ESC_FILES=":".join([os.path.join(esc, "cgroup.procs"), *_v1_escape_cgroups(box)]))
    env.pop("CONTAIN_LEDGER", None)
    if creator == "leaves_first":
        env["CREATOR_LEAVES"] = "1"
    runs, out = 30, str(tmp_path / "rows.json")
    reaper = os.fork()
    if reaper == 0:
        try:
            _race_runs(exe, env, box.token, runs, out)
        finally:
            os._exit(1)
    deadline = time.monotonic() + 300
    while os.waitpid(reaper, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.killpg(reaper, signal.SIGKILL)
            os.waitpid(reaper, 0)
            pytest.fail("the runs did not end within 300 s")
        time.sleep(0.05)
    with open(out) as f:
        rows = json.load(f)
    assert len(rows) == runs
    lies = [(i, r) for i, r in enumerate(rows)
            if r["left"] and (r["state"] == "REAPED" or r["descendants_exit"]["observed"] is True)]
    caught = sum(1 for r in rows if r["escapes"]["observed"] is True)
    print(f"{len(lies)} lies, {caught} escapes caught, states {[r['state'] for r in rows]}")
    assert not lies, f"{len(lies)} of {runs} runs said more than was observed; first: {lies[0]}"
    # Where the ledger could not be sure, it says why.
    unsure = [r for r in rows if r["state"] != "REAPED"]
    assert all(r["descendants_exit"]["observed"] is not True and r["descendants_exit"]["detail"] for r in unsure)


def test_ledger_table_does_not_grow_with_forks_that_are_reaped():
    """A worker that forks 3,000 short children, each reaped at once: the
    ledger's table holds what may still be alive, not every fork it ever
    saw (it held 3,001 entries, and 30,001 for 30,000 forks: RSS 14.8 ->
    23.5 MB). Drives the Ledger directly."""
    sys.path.insert(0, ROOT)
    from launcher._ledger import Ledger
    from launcher._proccn import LedgerUnavailable

    try:
        led = Ledger.open()
    except LedgerUnavailable as e:
        pytest.skip(f"process connector unavailable here: {e.reason}")
    token = new_token()
    code = "import os\nfor i in range(3000):\n    p = os.fork()\n    if p == 0:\n        os._exit(0)\n    os.waitpid(p, 0)\n"
    p = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, SEALTEST_TOKEN=token))
    try:
        led.track_root(p.pid)
        assert p.wait(120) == 0
        led.sync()
        assert led.all_reaped() or led.live() == []
        assert len(led.tracked) < 600, f"{len(led.tracked)} entries held after 3,000 forks"
        assert led.forks >= 3001, led.forks
        assert led.complete(), led.summary()
    finally:
        led.close()
        if p.poll() is None:
            p.kill()
            p.wait(10)
        kill_survivors(token)

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
