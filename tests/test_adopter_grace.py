"""An adopter finishing a stop its dead owner began in the grace: it keeps the
grace of the cancel that began the stop, takes a later cancel's shorter one,
and, interrupted, kills the tree at once and ends the run REAPED."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from _proc import ROOT, TOKEN_VAR, holders, kill_holders, new_token


CONTAIN = [sys.executable, os.path.join(ROOT, "bin", "contain")]


def _stop_began(box, rid: str) -> bool:
    try:
        rec = box.record(rid)
    except (OSError, ValueError):
        return False
    return rec.get("evidence", {}).get("signal_sent", {}).get("observed") is True


def _orphan_mid_grace(box, rid: str, token: str, first_cancel: list[str]):
    """A run (--grace 30) whose tree ignores SIGTERM, cancelled with
    `first_cancel`, and whose supervisor is then SIGKILLed in the grace."""
    import subprocess

    env = dict(box.env, **{TOKEN_VAR: token})
    run = subprocess.Popen(CONTAIN + ["run", "--id", rid, "--grace", "30", "--", "sh", "-c",
                                      "trap '' TERM; setsid sh -c \"trap '' TERM; sleep 60\" & sleep 60"],
                           env=env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while len(holders(token)) < 3:           # the worker, its setsid'd child, their sleeps
        assert time.monotonic() < deadline and run.poll() is None
        time.sleep(0.02)
    got = subprocess.run(CONTAIN + ["cancel", rid] + first_cancel, env=env, capture_output=True, timeout=30)
    assert got.returncode == 0, got.stderr
    while not _stop_began(box, rid):         # the owner's record says SIGTERM went out
        assert time.monotonic() < deadline and run.poll() is None
        time.sleep(0.02)
    run.kill()                               # in the 30 s grace: the run is orphaned mid-stop
    run.wait(10)
    return env


@pytest.mark.parametrize("backend_env", ["auto", "none"])
def test_adopter_takes_the_shorter_grace_of_a_later_cancel(box, backend_env):
    """`contain cancel --grace 0.2 --wait` of a run orphaned in the grace of
    an earlier cancel: the adopter began the stop again with the run's own
    30 s grace, ignoring this cancel's (a live owner shortens the grace
    under way). It must end within the grace asked."""
    import subprocess

    token = new_token()
    rid = f"rev13-later-{backend_env}"
    box.env["CONTAIN_BACKEND"] = backend_env
    try:
        env = _orphan_mid_grace(box, rid, token, ["--op-id", "first"])
        t0 = time.monotonic()
        got = subprocess.run(CONTAIN + ["cancel", rid, "--op-id", "second", "--grace", "0.2", "--wait", "--json"],
                             env=env, capture_output=True, timeout=60)
        took = time.monotonic() - t0
        assert got.returncode == 0, got.stderr
        assert took < 15, f"the adopter waited {took:.1f} s: the run's 30 s grace, not the 0.2 s asked"
        assert holders(token) == []
    finally:
        kill_holders(token)


def test_adopter_keeps_the_grace_of_the_cancel_that_began_the_stop(box):
    """The cancel that began the stop asked `--grace 2`; its supervisor died
    in that grace. The adopter (`contain cancel --wait`, no grace of its
    own) waited the run's 30 s again: the first cancel's grace replaces the
    run's, for whoever finishes the stop."""
    import subprocess

    token = new_token()
    rid = "rev13-first"
    try:
        env = _orphan_mid_grace(box, rid, token, ["--op-id", "first", "--grace", "2"])
        t0 = time.monotonic()
        got = subprocess.run(CONTAIN + ["cancel", rid, "--op-id", "second", "--wait", "--json"],
                             env=env, capture_output=True, timeout=60)
        took = time.monotonic() - t0
        assert got.returncode == 0, got.stderr
        assert took < 15, f"the adopter waited {took:.1f} s: the run's 30 s grace, not the 2 s asked"
        assert holders(token) == []
        # The operation asked again with another grace is the same one: never applied twice.
        again = subprocess.run(CONTAIN + ["cancel", rid, "--op-id", "first", "--grace", "0", "--json"],
                               env=env, capture_output=True, timeout=30)
        assert again.returncode == 0 and b'"cancelled"' in again.stdout, again.stdout
    finally:
        kill_holders(token)


def test_ctrl_c_on_an_adopting_cancel_kills_the_tree_and_ends_reaped(box):
    """Ctrl-C on a `contain cancel --wait` that adopted an orphaned run and
    is in its grace (the tree ignores SIGTERM): the interrupted owner only
    waited for the tree to empty by itself, 10 s of kill timeout, then
    recorded UNCONFIRMED with the tree still there. Interrupted, nobody is
    left to wait out the grace: the kill comes now, and the run ends
    REAPED."""
    import subprocess

    token = new_token()
    env = dict(box.env, **{TOKEN_VAR: token})
    rid = "rev13-adopt-int"
    run = subprocess.Popen(CONTAIN + ["run", "--id", rid, "--grace", "30", "--", "sh", "-c",
                                      "trap '' TERM; sleep 60"], env=env, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while len(holders(token)) < 2:
            assert time.monotonic() < deadline and run.poll() is None
            time.sleep(0.02)
        run.kill()
        run.wait(10)
        adopter = subprocess.Popen(CONTAIN + ["cancel", rid, "--wait"], env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        while not _stop_began(box, rid):    # the adopter sent SIGTERM: its grace is under way
            assert time.monotonic() < deadline and adopter.poll() is None
            time.sleep(0.02)
        t0 = time.monotonic()
        adopter.send_signal(signal.SIGINT)
        _out, err = adopter.communicate(timeout=30)
        took = time.monotonic() - t0
        assert b"Traceback" not in err, err.decode()
        assert adopter.returncode == -signal.SIGINT, (adopter.returncode, err)
        assert took < 5, f"the interrupted adopter took {took:.1f} s"
        assert box.record(rid)["state"] == "REAPED", box.record(rid)["state"]
        assert holders(token) == []
    finally:
        subprocess.run(CONTAIN + ["cancel", rid, "--grace", "0", "--wait"], env=env, capture_output=True,
                       timeout=60)
        kill_holders(token)
