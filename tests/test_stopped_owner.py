"""A cancel of a run whose supervisor is stopped (SIGSTOP; a Ctrl-Z that
stopped `contain run` and not its worker; a `--no-pidns` root worker that
stops its own supervisor).

A stopped owner never reads the request, and `contain cancel --wait` used
to wait on it for ever. Now the canceller resumes it (SIGCONT by the pidfd
it took with the owner's identity checked) and says so in the record it
returns. What survived is decided by the test's own /proc scan.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _proc import comm_of, contain_cmd, holders
from conftest import needs_cgroup

PY = sys.executable


def state_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
    except OSError:
        return "gone"
    return st[st.rindex(b")") + 2:st.rindex(b")") + 3].decode()


def wait_until(pred, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.01)


def end(proc: subprocess.Popen | None, token: str) -> None:
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
    for pid in holders(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cancel_wait(box, run_id: str) -> tuple[int, dict]:
    # Bounded here: before the fix this waited for ever.
    p = subprocess.run(contain_cmd("cancel", run_id, "--wait", "--grace", "1", "--json"), env=box.env,
                       capture_output=True, text=True, timeout=40)
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else {"stderr": p.stderr}


@pytest.mark.parametrize("args", [pytest.param([], marks=needs_cgroup, id="wall"),
                                  pytest.param(["--backend", "pidns"], id="pidns"),
                                  pytest.param(["--backend", "none"], id="none")])
def test_cancel_wait_resumes_a_stopped_supervisor(box, args):
    proc = subprocess.Popen(contain_cmd("run", "--id", "s", *args, "--", "sleep", "300"), env=box.env,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: any(comm_of(p) == "sleep" for p in holders(box.token)), what="the worker's start")
        os.kill(proc.pid, signal.SIGSTOP)
        wait_until(lambda: state_of(proc.pid) == "T", what="contain stopped")
        rc, ack = cancel_wait(box, "s")
        status = proc.wait(30)
    finally:
        end(proc, box.token)
    assert rc == 0, ack
    # Degraded mode never proves the tree gone: the stop was issued, EXITED.
    want = ("cancel_requested", "EXITED") if args == ["--backend", "none"] else ("cancelled", "REAPED")
    assert (ack["effect"], ack["state"]) == want, ack
    assert any("SIGCONT" in n for n in ack.get("notes", [])), json.dumps(ack)
    assert status == -signal.SIGTERM or status == 128 + signal.SIGTERM, status
    assert holders(box.token) == [], "something of the tree survived"


def test_cancel_wait_is_not_left_waiting_when_the_supervisor_was_not_stopped(box):
    """No note, no SIGCONT where nothing was stopped."""
    proc = subprocess.Popen(contain_cmd("run", "--id", "r", "--backend", "pidns", "--", "sleep", "300"),
                            env=box.env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: any(comm_of(p) == "sleep" for p in holders(box.token)), what="the worker's start")
        rc, ack = cancel_wait(box, "r")
        proc.wait(30)
    finally:
        end(proc, box.token)
    assert (rc, ack["effect"]) == (0, "cancelled"), ack
    assert "notes" not in ack, ack


@needs_cgroup
@pytest.mark.skipif(os.geteuid() != 0, reason="a worker that can signal its supervisor: root without the wall")
def test_a_worker_that_keeps_stopping_its_supervisor_is_still_stopped(box):
    # --no-pidns: the worker shares the supervisor's PID namespace, and as
    # root it may signal it. It stops its supervisor every 20 ms.
    loop = "import os, time\nwhile True:\n    os.kill(os.getppid(), 19)\n    time.sleep(0.02)\n"
    proc = subprocess.Popen(contain_cmd("run", "--id", "k", "--no-pidns", "--", PY, "-c", loop), env=box.env,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: state_of(proc.pid) == "T", what="the worker stopping contain")
        rc, ack = cancel_wait(box, "k")
        status = proc.wait(30)
    finally:
        end(proc, box.token)
    assert (rc, ack["effect"], ack["state"]) == (0, "cancelled", "REAPED"), ack
    assert status in (-signal.SIGTERM, 128 + signal.SIGTERM), status
    assert holders(box.token) == [], "something of the tree survived"
