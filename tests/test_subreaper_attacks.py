"""Attacks on the subreaper wall (_platform/subreaper.py): a worker that
reaches into its supervisor to turn its subreaper flag off and on again, and
another run's orphan that a subreaper run must not take for its own. Each
asserts what the victim relies on: no REAPED while a tree process lives, no
signal to a process that is not the tree's."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import _container
from conftest import ROOT

# A worker (same uid as the supervisor) that ptrace-injects
# prctl(PR_SET_CHILD_SUBREAPER, 0) into its supervisor, orphans a daemon
# (which then reparents past the supervisor), and sets the flag back.
PTRACE_WORKER = r"""
SUP=$PPID
gdb -p $SUP -batch -ex 'call (int)prctl(36,0,0,0,0)' >/dev/null 2>&1
sh -c 'setsid sleep 300 >/dev/null 2>&1 </dev/null & echo $! > "$1"' x "$ESCAPED"
sleep 0.3
gdb -p $SUP -batch -ex 'call (int)prctl(36,1,0,0,0)' >/dev/null 2>&1
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _ptrace_attack(tmp: str) -> dict:
    esc = os.path.join(tmp, "escaped.pid")
    env = dict(os.environ, PYTHONPATH=ROOT, ESCAPED=esc)
    p = subprocess.run([sys.executable, "-m", "launcher", "run", "--backend", "subreaper", "--record", "-", "--",
                        "sh", "-c", PTRACE_WORKER], env=env, capture_output=True, text=True, timeout=120)
    rec = json.loads(p.stdout[p.stdout.index("{"):])
    pid = int(open(esc).read())
    out = {"state": rec["state"], "escaped_pid": pid, "escaped_alive_after_record": _alive(pid)}
    try:
        os.kill(pid, 9)
    except OSError:
        pass
    return out


@pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb")
@pytest.mark.forked
def test_a_worker_that_ptraces_its_supervisor_to_clear_the_subreaper_flag_is_never_reaped(box, tmp_path) -> None:
    got = _ptrace_attack(str(tmp_path))
    assert not (got["state"] == "REAPED" and got["escaped_alive_after_record"]), got


@pytest.mark.skipif(shutil.which("gdb") is None or _container.why_not() is not None, reason="needs gdb, container")
@pytest.mark.forked
def test_a_ptrace_of_the_supervisor_in_a_default_container_is_refused(box, tmp_path, monkeypatch) -> None:
    """Docker's capabilities (no CAP_SYS_PTRACE) did not stop a same-uid,
    same-caps worker from tracing a dumpable supervisor: the supervisor is
    non-dumpable now, so the daemon stays in its subtree and is stopped."""
    monkeypatch.delenv("CONTAIN_CGROUP_BASE", raising=False)
    monkeypatch.delenv("CONTAIN_CGROUP_V1_BASE", raising=False)
    got = _container.run(lambda: _ptrace_attack(str(tmp_path)))
    assert not (got["state"] == "REAPED" and got["escaped_alive_after_record"]), got


@pytest.mark.forked             # subreaper=True is process-wide and for good
@pytest.mark.timeout(120)
def test_another_runs_orphan_is_not_signalled_by_a_subreaper_run(box, tmp_path) -> None:
    """Run A (subreaper=True, backend subreaper) and run B (same process,
    subreaper not asked, a cgroup without a PID namespace). B's orphan
    reparents to this process (a subreaper for good since A); A's stop
    takes it for its own ("the only run that could have left it": B was
    never noted) and signals it: a process not of A's tree."""
    import launcher

    a = launcher.spawn(["sleep", "300"], backend="subreaper", subreaper=True, grace=0.3)
    f = tmp_path / "x.pid"
    b = launcher.spawn(["sh", "-c", f"(trap '' TERM; setsid sleep 302 & echo $! > {f}); exec sleep 300"],
                       pidns=False, grace=0.3)
    deadline = time.monotonic() + 10
    while not f.exists() or not f.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    x = int(f.read_text())
    time.sleep(0.3)
    assert open(f"/proc/{x}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid())
    a.cancel()
    rec_a = a.wait(30).to_dict()
    x_alive = _alive(x)
    b_state = b.record().state
    b.cancel()
    assert b.wait(30).state == "REAPED"                # B's own stop takes its orphan
    seen = json.dumps(rec_a["evidence"]["signal_sent"])
    assert x_alive and f'"pid": {x}' not in seen, (x, x_alive, b_state, seen[:1500])
    assert not _alive(x)
