"""Degraded mode (--backend none) across the escape scenarios: it stops what
it can see, says what it saw, and never reports REAPED.

Survival is decided by the test's own /proc scan. Works as any user (the
fork ledger is used where the process connector answers)."""
from __future__ import annotations

import sys

import pytest

from _survivors import Contain, survivors, wait_for

PY = sys.executable

SCENARIOS = {
    "setsid_daemon": "setsid sleep 300 &\nsleep 0.3",
    "double_fork": "(sh -c 'sleep 300 &' &)\nsleep 0.3",
    "process_group_change": f"{PY} -c \"import os; os.setpgid(0, 0); os.execvp('sleep', ['sleep', '300'])\" &\n"
                            "sleep 0.3",
    "setsid_then_double_fork": "setsid sh -c 'sleep 300 & exit'\nsleep 0.3",
    "new_session_and_group_grandchild": f"{PY} -c \"import os, subprocess; os.setsid(); "
                                        "subprocess.Popen(['sh', '-c', 'sleep 300 &'], start_new_session=True)\"\n"
                                        "sleep 0.3",
}




def _check(c: Contain, rc: int) -> dict:
    rec = c.record()
    left = survivors(c.token)
    assert rec["state"] != "REAPED", rec["state"]          # never, in degraded mode
    assert rec["containment"]["backend"] == "none"
    assert rec["containment"]["sealed"] is False
    assert rec["evidence"]["container_empty"]["observed"] is None
    return {"rec": rec, "left": left, "rc": rc}


@pytest.mark.parametrize("ledger", ["on", "off"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_degraded_never_reaped(contain_runs, name, ledger):
    c = contain_runs()
    rc = c.run(["--backend", "none", "--grace", "0.3"], ["sh", "-c", SCENARIOS[name]],
               extra_env={"CONTAIN_LEDGER": ledger})
    r = _check(c, rc)
    rec = r["rec"]
    assert rec["state"] == "EXITED" and rec["outcome"] == "exited" and rc == 0, (rec["state"], c.stderr)
    assert rec["evidence"]["descendants_exit"]["observed"] is None, "no container: not provable"
    d = rec["evidence"]["descendants_exit"]["detail"]
    assert d["seen_count"] >= 2, d           # the worker and what it left behind
    assert d["unprovable"], d                # and what it cannot prove
    # With the child subreaper (the CLI) and /proc scans, every scenario
    # here is found and stopped; the test's own scan confirms it.
    assert wait_for(lambda: not survivors(c.token), 5), f"{name}: left {survivors(c.token)}"


def test_degraded_with_ledger_finds_by_ledger(contain_runs):
    c = contain_runs()
    rc = c.run(["--backend", "none", "--grace", "0.3"], ["sh", "-c", SCENARIOS["setsid_daemon"]])
    rec = _check(c, rc)["rec"]
    assert rec["evidence"]["descendants_exit"]["observed"] is None, "no container: not provable"
    d = rec["evidence"]["descendants_exit"]["detail"]
    if d["fork_ledger"] is None:
        pytest.skip("process connector unavailable here")
    assert d["found_by"].get("fork ledger", 0) >= 1, d
    esc = rec["evidence"]["escapes"]
    assert esc["observed"] is None and esc["detail"]["tracked"] >= 2


def test_degraded_plain_exit_is_exited(contain_runs):
    c = contain_runs()
    rc = c.run(["--backend", "none"], ["sh", "-c", "exit 3"])
    assert rc == 3
    assert _check(c, rc)["rec"]["state"] == "EXITED"


def test_degraded_cancel_is_not_reaped(contain_runs):
    c = contain_runs()
    c.start(["--backend", "none", "--grace", "0.3"], ["sh", "-c", "setsid sleep 300 & exec sleep 300"])
    assert wait_for(lambda: len(survivors(c.token)) >= 3, 10)   # supervisor, worker, daemon
    c.cancel()
    rc = c.wait(30)
    rec = _check(c, rc)["rec"]
    assert rec["state"] == "EXITED" and rec["outcome"] == "cancelled"
    assert wait_for(lambda: not survivors(c.token), 5)


def test_cancel_wait_of_a_degraded_run_that_stopped_exits_0(contain_runs):
    """`contain cancel --wait` of a --backend none run exited 1 ("the
    operation did not hold") although the run was stopped and ended EXITED
    /cancelled: every cancel of a degraded run read as a failure. The effect
    stays `cancel_requested` (no container was observed empty)."""
    import json
    import subprocess

    c = contain_runs()
    c.start(["--backend", "none", "--grace", "0.3"], ["sh", "-c", "setsid sleep 300 & exec sleep 300"])
    try:
        assert wait_for(lambda: len(survivors(c.token)) >= 3, 10)
        p = subprocess.run([sys.executable, "-m", "launcher", "cancel", c.run_id, "--wait", "--json"],
                           env=c.env(), capture_output=True, text=True, timeout=60)
        ack = json.loads(p.stdout)
        assert (ack["effect"], ack["state"], ack["outcome"]) == ("cancel_requested", "EXITED", "cancelled"), ack
        assert p.returncode == 0, (p.returncode, p.stderr)
        assert wait_for(lambda: not survivors(c.token), 5)
    finally:
        c.wait(30)


def test_seal_is_refused_in_degraded_mode(contain_runs):
    c = contain_runs()
    rc = c.run(["--backend", "none", "--seal"], ["true"])
    assert rc == 125
    assert "seal" in c.stderr
