"""Review 20: contain's stop guarantees with the worker as the adversary,
against what changed lately and what earlier reviews did not try.

Real kernel throughout: real `contain run` and `contain cancel` processes,
cgroups under the test's own base, survival decided by the test's own /proc
scan (tests/_proc.holders, which now looks at the threads of a process
whose leader shows `Z`: one whose leader thread exited alone while another
thread runs on has a zombie's /proc/<pid>/stat and an empty environ there). Everything started is killed by pid, every wait bounded.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from _proc import contain_cmd, holders, kill_holders
from conftest import needs_cgroup

PY = sys.executable
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the attack needs a root worker (it moves a process "
                                "between cgroups)")


def _kill_tasks(token: str) -> None:
    kill_holders(token)
    deadline = time.monotonic() + 10
    while holders(token) and time.monotonic() < deadline:
        time.sleep(0.02)


# A child of the worker moves itself into a cgroup of the test's own, starts a
# thread, and its leader thread exits alone (SYS_exit, not exit_group): the
# process runs on in that thread, and its /proc/<pid>/stat says Z. The thread
# writes READY once it sees that; the worker then exits.
LEADER_EXITS = textwrap.dedent("""\
    import ctypes, os, sys, threading, time
    esc, ready = os.environ["ESC_CG"], os.environ["READY"]
    if os.fork() == 0:
        with open(os.path.join(esc, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        def linger():
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                with open("/proc/self/stat", "rb") as f:
                    st = f.read()
                if st[st.rindex(b")") + 2:st.rindex(b")") + 3] == b"Z":
                    open(ready, "w").close()
                    break
                time.sleep(0.01)
            time.sleep(300)
        threading.Thread(target=linger).start()
        ctypes.CDLL(None).syscall(60, 0)      # SYS_exit: the leader thread only
    deadline = time.monotonic() + 20
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)
""")


@needs_root
@needs_cgroup
@pytest.mark.timeout(120)
@pytest.mark.parametrize("v1", ["on", "off"])
def test_escaper_whose_leader_thread_exited_while_a_thread_runs_on_is_not_reaped(box, tmp_path, v1):
    """A root worker without the wall (--no-pidns: the fork ledger watches
    for escapers) has a child leave the run's cgroup and end its leader
    thread alone, another thread running on. The ledger read the leader's
    `Z` in /proc/<pid>/stat as "exited" and never counted the escaper: the
    record said REAPED, descendants_exit true and escapes false, with the
    escaper's thread alive outside the run's cgroup."""
    esc = os.path.join(box.base, "esc")
    os.makedirs(esc)
    ready = str(tmp_path / "ready")
    rec_path = tmp_path / "record.json"
    env = dict(box.env, ESC_CG=esc, READY=ready)
    if v1 == "off":
        env["CONTAIN_CGROUP_V1"] = "off"
    try:
        # Files, not pipes: the escaper holds its stdio for as long as it lives.
        with open(tmp_path / "err", "w+") as err:
            subprocess.run(contain_cmd("run", "--no-pidns", "--grace", "0.3", "--record", str(rec_path), "--",
                                       PY, "-c", LEADER_EXITS), env=env, stdout=subprocess.DEVNULL, stderr=err,
                           timeout=60)
            err.seek(0)
            stderr = err.read()
        assert "Traceback" not in stderr, stderr
        assert os.path.exists(ready), f"the leader thread never exited (the test is void): {stderr}"
        rec = json.loads(rec_path.read_text())
        alive = holders(box.token)
        if alive:
            ev = rec["evidence"]
            assert rec["state"] != "REAPED", (alive, rec["state"], ev["escapes"])
            assert ev["descendants_exit"]["observed"] is not True, (alive, ev["descendants_exit"])
            assert ev["escapes"]["observed"] is not False, (alive, ev["escapes"])
        else:
            # The escaper was found and stopped: the record says so.
            assert rec["evidence"]["escapes"]["observed"] is True, rec["evidence"]["escapes"]
    finally:
        _kill_tasks(box.token)


# The same process without the cgroup move: a setsid child whose leader
# thread exits alone, a thread running on; the worker exits after it.
LEADER_EXITS_IN_PLACE = textwrap.dedent("""\
    import ctypes, os, threading, time
    ready = os.environ["READY"]
    if os.fork() == 0:
        os.setsid()
        def linger():
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                with open("/proc/self/stat", "rb") as f:
                    st = f.read()
                if st[st.rindex(b")") + 2:st.rindex(b")") + 3] == b"Z":
                    open(ready, "w").close()
                    break
                time.sleep(0.01)
            time.sleep(300)
        threading.Thread(target=linger).start()
        ctypes.CDLL(None).syscall(60, 0)      # SYS_exit: the leader thread only
    deadline = time.monotonic() + 20
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)
""")


@pytest.mark.timeout(120)
def test_degraded_stop_kills_a_member_whose_leader_thread_exited(box, tmp_path):
    """Degraded mode stops what it can see: the fork ledger saw the child,
    but the /proc closure read its leader's Z as "exited" and signalled
    nothing ('nothing was signalled', alive_at_last_scan []), and its
    thread ran on after the run ended."""
    ready = str(tmp_path / "ready")
    rec_path = tmp_path / "record.json"
    env = dict(box.env, READY=ready)
    try:
        with open(tmp_path / "err", "w+") as err:
            subprocess.run(contain_cmd("run", "--backend", "none", "--grace", "0.3", "--record", str(rec_path),
                                       "--", PY, "-c", LEADER_EXITS_IN_PLACE), env=env, stdout=subprocess.DEVNULL,
                           stderr=err, timeout=60)
            err.seek(0)
            stderr = err.read()
        assert "Traceback" not in stderr, stderr
        assert os.path.exists(ready), f"the leader thread never exited (the test is void): {stderr}"
        rec = json.loads(rec_path.read_text())
        assert rec["state"] == "EXITED", rec["state"]
        deadline = time.monotonic() + 5
        while holders(box.token) and time.monotonic() < deadline:
            time.sleep(0.02)
        alive = holders(box.token)
        assert not alive, (alive, rec["evidence"]["signal_sent"], rec["evidence"]["descendants_exit"]["detail"])
    finally:
        _kill_tasks(box.token)
