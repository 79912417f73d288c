"""Signals as a shell expects them (issue 12, items 2, 6 and 7; issue 10,
items 10 and 12), against real processes, real signals and a real pty.

Anchored on GNU `timeout` and `docker run`'s signal proxy: a SIGINT, SIGTERM
or SIGHUP to `contain run` is sent to the tree first, and `contain` then
dies by it; a second one skips the grace; a signal the caller ignored stays
ignored. What survived is decided by the test's own /proc scan.
"""
from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from _proc import (cgroup2_mount, contain_cmd, holders, remove_cgroup_tree, run_contain, wait_comm, wait_holders,
                   waiting_for_claim)
from _users import as_uid, python, pythonpath, spare_uids, why_not
from conftest import needs_cgroup

pytestmark = needs_cgroup

PY = sys.executable


def start(box, run_id: str, *args: str, want: int = 2, **kw) -> subprocess.Popen:
    proc = subprocess.Popen(contain_cmd("run", "--id", run_id, *args), env=box.env,
                            stderr=subprocess.PIPE, text=True, **kw)
    if len(wait_holders(box.token, want, timeout=20)) < want:
        proc.kill()
        raise AssertionError(f"workload did not start: {proc.communicate(timeout=10)[1]}")
    return proc


def steps(rec: dict) -> list[dict]:
    detail = rec["evidence"]["signal_sent"]["detail"]
    return detail["steps"] if isinstance(detail, dict) else []


def at(step: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(step["at"].replace("Z", "+00:00")).timestamp()


def wait_for_file(path: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                text = f.read()
            if text.endswith("\n"):
                return text
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"{path} never written")


def wait_for_record(box, run_id: str, pred, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            rec = box.record(run_id)
            if pred(rec):
                return rec
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.02)
    raise AssertionError(f"record of {run_id} never matched")


def sig_ign(pid: int) -> int:
    """The kernel's mask of signals `pid` ignores (/proc/<pid>/status SigIgn)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigIgn:"):
                return int(line.split()[1], 16)
    raise AssertionError("no SigIgn line")


def ignores(mask: int, sig: int) -> bool:
    return bool(mask & (1 << (sig - 1)))


# A worker that traps each cancel signal, says which it got, and exits 0.
TRAPPER = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[1]
    def got(n, _f):
        with open(out, "w") as f:
            f.write(signal.Signals(n).name + "\\n")
        os._exit(0)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, got)
    with open(out + ".ready", "w") as f:
        f.write("ready\\n")
    time.sleep(300)
""")


# -- the signal is sent first, and contain dies by it ---------------------------------

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_signal_to_contain_is_sent_to_the_tree_first_and_contain_dies_by_it(box, tmp_path, sig):
    got = str(tmp_path / "got")
    proc = start(box, "s", "--grace", "5", "--", PY, "-c", TRAPPER, got)
    wait_for_file(got + ".ready")
    proc.send_signal(sig)
    rc = proc.wait(30)
    assert wait_for_file(got) == signal.Signals(sig).name + "\n", "the worker got another signal first"
    # Dies by it (what a shell sees as 128 + N), even though the worker
    # exited 0: the status says the run was cancelled.
    assert rc == -sig, proc.stderr.read() if proc.stderr else rc
    rec = box.record("s")
    assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled"
    assert rec["exit_code"] == 0 and rec["signal"] is None, rec
    first = steps(rec)[0]
    assert first["kind"] == "term" and first["detail"]["signal"] == signal.Signals(sig).name
    assert first["via"].startswith(signal.Signals(sig).name)
    assert holders(box.token) == []
    assert box.leaves() == []


def test_a_worker_that_traps_term_and_exits_0_still_reads_as_cancelled_after_contain_cancel(box, tmp_path):
    got = str(tmp_path / "got")
    proc = start(box, "c", "--", PY, "-c", TRAPPER, got)
    wait_for_file(got + ".ready")
    p = run_contain(box.env, "cancel", "c", "--op-id", "stop-it", "--wait")
    assert p.returncode == 0, p.stderr
    # Cancelled by another process: 143 (as if `contain` had been sent
    # SIGTERM), never the worker's 0.
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert wait_for_file(got) == "SIGTERM\n"
    rec = box.record("c")
    assert rec["outcome"] == "cancelled" and rec["exit_code"] == 0
    assert holders(box.token) == []


def test_exit_status_rules_are_one_table():
    from launcher import _state as S

    cancelled = S.Snapshot(S.Phase.REAPED, S.Outcome.CANCELLED)
    assert S.exit_status(cancelled, 0, None) == 143
    assert S.exit_status(cancelled, None, signal.SIGKILL) == 143
    assert S.exit_status(S.Snapshot(S.Phase.UNCONFIRMED, S.Outcome.CANCELLED), 0, None) == 125
    assert S.exit_status(S.Snapshot(S.Phase.REAPED, S.Outcome.TIMED_OUT), 0, None) == 124
    assert S.exit_status(S.Snapshot(S.Phase.REAPED, S.Outcome.EXITED), 0, None) == 0
    assert S.exit_status(S.Snapshot(S.Phase.REAPED, S.Outcome.SIGNALED), None, signal.SIGUSR1) == 128 + signal.SIGUSR1


# -- a second signal, a shorter grace -------------------------------------------------

# Notes every SIGINT, ignores SIGTERM: only the kill ends it.
STUBBORN = textwrap.dedent("""
    import signal, sys, time
    out = sys.argv[1]
    def note(n, _f):
        with open(out, "a") as f:
            f.write(signal.Signals(n).name + "\\n")
    signal.signal(signal.SIGINT, note)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(out + ".ready", "w") as f:
        f.write("ready\\n")
    while True:
        time.sleep(1)
""")


def test_a_second_sigint_skips_the_grace(box, tmp_path):
    got = str(tmp_path / "got")
    proc = start(box, "g", "--grace", "120", "--", PY, "-c", STUBBORN, got)
    wait_for_file(got + ".ready")
    proc.send_signal(signal.SIGINT)
    assert wait_for_file(got) == "SIGINT\n"       # the polite step reached the worker: the grace runs
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == -signal.SIGINT
    rec = box.record("g")
    kinds = [s["kind"] for s in steps(rec)]
    assert kinds[:2] == ["term", "kill"], kinds
    # Measured from the record's own steps: the kill came long before the
    # 120 s grace was over.
    assert at(steps(rec)[1]) - at(steps(rec)[0]) < 60
    assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled" and rec["signal"] == signal.SIGKILL
    assert holders(box.token) == []


def test_cancel_with_a_shorter_grace_shortens_the_running_one(box, tmp_path):
    got = str(tmp_path / "got")
    proc = start(box, "k", "--grace", "120", "--", PY, "-c", STUBBORN, got)
    wait_for_file(got + ".ready")
    p = run_contain(box.env, "cancel", "k", "--op-id", "first")
    assert p.returncode == 0, p.stderr
    wait_for_record(box, "k", lambda r: steps(r) and steps(r)[0]["kind"] == "term")
    p = run_contain(box.env, "cancel", "k", "--op-id", "hurry", "--grace", "0.5", "--wait", "--timeout", "60")
    assert p.returncode == 0, p.stderr
    assert proc.wait(60) == 128 + signal.SIGTERM
    rec = box.record("k")
    term, kill = steps(rec)[0], steps(rec)[1]
    assert (term["kind"], kill["kind"]) == ("term", "kill")
    assert 0.4 <= at(kill) - at(term) < 60, "the kill came at the shorter grace, not the run's 120 s"
    assert holders(box.token) == []


def test_library_cancel_with_a_shorter_grace_shortens_the_running_one(box, tmp_path):
    import launcher

    got = str(tmp_path / "got")
    w = launcher.spawn([PY, "-c", STUBBORN, got], grace=120, env=box.env)
    try:
        wait_for_file(got + ".ready")
        assert w.cancel(op_id="first").effect == "cancel_requested"
        w.cancel(op_id="hurry", grace=0.2)
        rec = w.wait(60).to_dict()
    finally:
        if not w.done():
            w.cancel(grace=0)
            w.wait(60)
    term, kill = steps(rec)[0], steps(rec)[1]
    assert (term["kind"], kill["kind"]) == ("term", "kill")
    assert at(kill) - at(term) < 60
    assert holders(box.token) == []


# -- a real terminal: the bash loop ---------------------------------------------------

def _pty_run(argv: list[str], env: dict[str, str]) -> tuple[int, int]:
    pid, fd = pty.fork()
    if pid == 0:          # the child: a session leader with the pty as its controlling terminal
        try:
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    return pid, fd


def _read_until(fd: int, buf: bytearray, want: bytes | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if want is not None and want in buf:
            return True
        r, _, _ = select.select([fd], [], [], 0.05)
        if r:
            try:
                data = os.read(fd, 4096)
            except OSError:          # EIO: every slave end is closed
                return want is not None and want in buf
            if not data:
                return want is not None and want in buf
            buf += data
    return want is not None and want in buf


def _wait_pty_child(pid: int, fd: int, buf: bytearray, timeout: float) -> int | None:
    """The child's wait status, draining the pty meanwhile; None on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _read_until(fd, buf, None, 0.1)
            return status
        _read_until(fd, buf, None, 0.05)
    return None


LOOP = ('for i in 1 2 3; do echo "start $i"; {contain} run --id loop-$i {opts} -- {cmd}; '
        'echo "rc $i $?"; done; echo loop-finished')


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_one_ctrl_c_in_a_terminal_ends_a_bash_loop_around_contain(box):
    contain = " ".join(contain_cmd())
    script = LOOP.format(contain=contain, opts="--grace 5", cmd="sleep 100")
    pid, fd = _pty_run(["bash", "--norc", "--noprofile", "-c", script], box.env)
    buf = bytearray()
    try:
        assert len(wait_holders(box.token, 3, timeout=20)) >= 3     # bash, contain, sleep
        _read_until(fd, buf, b"start 1", 5)
        os.write(fd, b"\x03")                                      # Ctrl-C, through the line discipline
        status = _wait_pty_child(pid, fd, buf, 60)
        assert status is not None, f"the loop went on: {buf.decode(errors='replace')}"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    out = buf.decode(errors="replace")
    assert "start 2" not in out and "loop-finished" not in out, out
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT, (status, out)
    rec = box.record("loop-1")
    assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled", rec
    assert not os.path.exists(os.path.join(box.state_dir, "runs", "loop-2"))
    assert holders(box.token) == []
    assert box.leaves() == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_in_a_terminal_contain_says_it_is_stopping_and_a_second_ctrl_c_kills_now(box):
    contain = " ".join(contain_cmd())
    # The worker ignores SIGINT and SIGTERM (a trap '' is inherited across
    # exec): only the kill can end it, so the grace really runs (a member
    # that ignores SIGINT alone gets SIGTERM at once: _deaf.py).
    script = LOOP.format(contain=contain, opts="--grace 120", cmd="sh -c \"trap '' INT TERM; sleep 100\"")
    pid, fd = _pty_run(["bash", "--norc", "--noprofile", "-c", script], box.env)
    buf = bytearray()
    try:
        # sleep exec'd: sh has set its trap (a Ctrl-C before it would kill sh).
        assert wait_comm(box.token, "sleep", timeout=20), "the worker's sleep did not start"
        os.write(fd, b"\x03")
        said = _read_until(fd, buf, b"Ctrl-C again kills now", 30)
        assert said, buf.decode(errors="replace")
        os.write(fd, b"\x03")
        status = _wait_pty_child(pid, fd, buf, 60)
        assert status is not None, f"the second Ctrl-C did not end it: {buf.decode(errors='replace')}"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    out = buf.decode(errors="replace")
    assert "start 2" not in out, out
    rec = box.record("loop-1")
    kinds = [s["kind"] for s in steps(rec)]
    kill = next(s for s in steps(rec) if s["kind"] == "kill")
    assert kinds[0] == "term" and at(kill) - at(steps(rec)[0]) < 60, rec
    assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled"
    assert holders(box.token) == []


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_in_a_terminal_a_run_that_left_leftovers_says_what_was_stopped(box):
    contain = " ".join(contain_cmd())
    script = f"{contain} run --id t --grace 5 -- sh -c 'sleep 300 & sleep 0.3'; echo rc=$?"
    pid, fd = _pty_run(["bash", "--norc", "--noprofile", "-c", script], box.env)
    buf = bytearray()
    try:
        status = _wait_pty_child(pid, fd, buf, 60)
        assert status is not None and os.WIFEXITED(status), buf.decode(errors="replace")
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
    out = buf.decode(errors="replace")
    assert "rc=0" in out
    assert "stopped 1 leftover process (sleep) with SIGTERM" in out and "REAPED" in out, out
    assert os.path.join(box.state_dir, "runs", "t", "record.json") in out
    assert holders(box.token) == []


# -- what the caller ignored stays ignored -----------------------------------------

def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def worker_pid(box, supervisor: int) -> int:
    """The one token holder besides the supervisor and the PID-namespace
    wall's init (`ct/init`, a clone of the supervisor): the worker, `sleep`,
    which changes no disposition of its own, unlike a Python worker."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        others = [p for p in holders(box.token) if p != supervisor and _comm(p) != "ct/init"]
        if len(others) == 1:
            with open(f"/proc/{others[0]}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0].endswith(b"sleep"):
                    return others[0]
        time.sleep(0.02)
    raise AssertionError("the worker did not start")


@pytest.mark.skipif(shutil.which("nohup") is None, reason="needs nohup")
def test_nohup_contain_survives_a_hangup_and_the_worker_keeps_ignoring_it(box):
    proc = subprocess.Popen(["nohup", *contain_cmd("run", "--id", "n", "--", "sleep", "300")],
                            env=box.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        mask = sig_ign(worker_pid(box, proc.pid))
        assert ignores(mask, signal.SIGHUP), "the worker lost nohup's SIG_IGN"
        # What Python ignores for itself is not passed on.
        assert not ignores(mask, signal.SIGPIPE) and not ignores(mask, signal.SIGXFSZ)
        assert ignores(sig_ign(proc.pid), signal.SIGHUP), "contain installed a handler over the caller's ignore"
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert proc.poll() is None, "a hangup the caller ignored cancelled the run"
        assert box.record("n")["state"] == "RUNNING"
        assert not os.path.exists(os.path.join(box.state_dir, "runs", "n", "cancellations", "requests.ndjson"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert box.record("n")["outcome"] == "cancelled"
    assert holders(box.token) == []


def test_a_sigint_the_caller_ignored_is_no_cancel(box):
    # A background job of a script (`contain run ... &` without job control)
    # starts with SIGINT ignored; so does its worker.
    def ignore_int() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen(contain_cmd("run", "--id", "b", "--", "sleep", "300"),
                            env=box.env, stderr=subprocess.PIPE, text=True, preexec_fn=ignore_int)
    try:
        mask = sig_ign(worker_pid(box, proc.pid))
        assert ignores(mask, signal.SIGINT) and not ignores(mask, signal.SIGPIPE)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None and box.record("b")["state"] == "RUNNING"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert holders(box.token) == []


def test_a_worker_starts_with_default_dispositions_besides_what_the_caller_ignored(box):
    proc = subprocess.Popen(contain_cmd("run", "--id", "d", "--", "sleep", "300"), env=box.env,
                            stderr=subprocess.PIPE, text=True)
    try:
        # contain catches INT/TERM/HUP/CHLD and Python ignores PIPE/XFSZ:
        # none of that reaches the worker.
        assert sig_ign(worker_pid(box, proc.pid)) == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# -- early signals: during the start-up ----------------------------------------------



def test_a_sigterm_during_a_slow_claim_ends_the_run_with_nothing_started(box, tmp_path):
    from launcher._layout import RunDir

    marker = tmp_path / "started"
    root = RunDir.runs_root(box.state_dir)
    os.makedirs(root, mode=0o700, exist_ok=True)
    os.chmod(box.state_dir, 0o700)
    os.chmod(root, 0o700)
    guard = os.open(os.path.join(root, ".claim.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    proc = None
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)           # the claim now waits for us
        proc = subprocess.Popen(contain_cmd("run", "--id", "e", "--", "sh", "-c", f"touch {marker}; sleep 300"),
                                env=box.env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while not waiting_for_claim(proc.pid, os.path.join(root, ".claim.lock")):
            assert time.monotonic() < deadline and proc.poll() is None, "contain never reached the claim"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert proc.poll() is None, "the SIGTERM was not caught: it killed contain during the claim"
    finally:
        fcntl.flock(guard, fcntl.LOCK_UN)
        os.close(guard)
    assert proc is not None
    rc = proc.wait(30)
    assert rc == -signal.SIGTERM, proc.stderr.read() if proc.stderr else rc
    rec = box.record("e")
    assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled", rec
    assert rec["identity"] is None and rec["evidence"]["root_exit"]["observed"] is None
    assert "before the spawn" in rec["evidence"]["root_exit"]["detail"]
    assert rec["evidence"]["signal_sent"]["observed"] is False, "nothing existed to be signalled"
    assert not marker.exists(), "the worker ran after the run was cancelled"
    assert holders(box.token) == []
    assert box.leaves() == []


# -- --linger -------------------------------------------------------------------------

def test_linger_lets_a_short_background_job_finish_unsignalled(box):
    # (1 s: a supervisor starved of CPU for longer than the job lives finds
    # the tree empty at the worker's exit, a linger of 0 s.)
    p = run_contain(box.env, "run", "--id", "l", "--linger", "10", "--", "sh", "-c", "sleep 1 &")
    assert p.returncode == 0, p.stderr
    rec = box.record("l")
    assert rec["state"] == "REAPED" and rec["outcome"] == "exited"
    assert rec["evidence"]["signal_sent"]["observed"] is False, "the background job was signalled"
    lg = rec["linger"]
    assert lg["asked_s"] == 10 and lg["ended_by"] == "emptied", lg
    assert 0.1 <= lg["lingered_s"] < 10 and lg["seen"]["count"] >= 1


def test_linger_of_a_tree_already_empty_says_it_took_no_time(box):
    """A worker that leaves nothing: the record still says what was asked
    (it left `linger` out, as if none had been)."""
    p = run_contain(box.env, "run", "--id", "e", "--linger", "10", "--", "true")
    assert p.returncode == 0, p.stderr
    lg = box.record("e")["linger"]
    # 0 s when the init was gone by the worker's exit; a few ms when it was
    # still exiting (the namespace empties only once the init is reaped).
    assert (lg["asked_s"], lg["ended_by"]) == (10, "emptied") and 0.0 <= lg["lingered_s"] < 5, lg
    assert holders(box.token) == []


def test_linger_ends_and_the_stop_follows_for_a_long_background_job(box):
    p = run_contain(box.env, "run", "--id", "l", "--linger", "0.5", "--grace", "1", "--",
                    "sh", "-c", "sleep 300 &")
    assert p.returncode == 0, p.stderr
    rec = box.record("l")
    assert rec["state"] == "REAPED"
    assert rec["linger"]["ended_by"] == "deadline" and rec["linger"]["lingered_s"] >= 0.5
    first = steps(rec)[0]
    assert first["kind"] == "term" and first["detail"]["signal"] == "SIGTERM"
    assert first["detail"]["seen"]["processes"][0]["comm"] == "sleep"
    assert at(first) >= at({"at": rec["linger"]["began_at"]}) + 0.5
    assert holders(box.token) == []


def test_library_linger_lets_a_background_job_finish(box):
    import launcher

    rec = launcher.run(["sh", "-c", "sleep 1 &"], linger=30, env=box.env).to_dict()
    assert rec["state"] == "REAPED" and rec["evidence"]["signal_sent"]["observed"] is False
    assert rec["linger"]["ended_by"] == "emptied"
    assert holders(box.token) == []


def test_a_cancel_during_the_linger_starts_the_stop_at_once(box):
    proc = start(box, "l", "--linger", "120", "--grace", "1", "--", "sh", "-c", "sleep 300 &")
    wait_for_record(box, "l", lambda r: (r.get("linger") or {}).get("began_at"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM
    rec = box.record("l")
    assert rec["linger"]["ended_by"] == "cancel" and rec["linger"]["lingered_s"] < 60
    assert rec["outcome"] == "exited", "one result: the worker had exited before the cancel"
    assert steps(rec)[0]["detail"]["signal"] == "SIGTERM"
    assert holders(box.token) == []


# -- saying what happened ---------------------------------------------------------------

def test_verbose_names_what_was_stopped_and_where_the_record_is(box):
    # The worker outlives its child's exec (a leftover seen before its exec is still named `sh`).
    p = run_contain(box.env, "run", "--id", "v", "-v", "--grace", "2", "--", "sh", "-c", "sleep 300 & sleep 0.3")
    assert p.returncode == 0
    line = p.stderr.strip().splitlines()[-1]
    assert "stopped 1 leftover process (sleep) with SIGTERM" in line, line
    assert "REAPED" in line and os.path.join(box.state_dir, "runs", "v", "record.json") in line
    # Not on a terminal and not asked: nothing.
    q = run_contain(box.env, "run", "--id", "w", "--grace", "2", "--", "sh", "-c", "sleep 300 &")
    assert q.returncode == 0 and q.stderr == ""


def _as_spare_uid(spare: tuple[int, dict[str, str]], *args: str, **extra: str) -> subprocess.CompletedProcess:
    uid, env = spare
    return as_uid(uid, [python(), "-m", "launcher", *args], env=dict(env, **extra))


@pytest.fixture
def spare(box):
    """A spare uid and an environment for it: its own state directory, no
    cgroup base, nothing of root's, the launcher it can read."""
    if (why := why_not()) is not None:
        pytest.skip(why)
    uid, = spare_uids(1)
    d = tempfile.mkdtemp(prefix="contain-spare-", dir="/tmp")      # not $TMPDIR: the uid must reach it
    os.chmod(d, 0o755)
    state = os.path.join(d, "state")
    os.mkdir(state, 0o700)
    os.chown(state, uid, uid)
    env = {k: v for k, v in box.env.items() if not k.startswith("CONTAIN_") and k != "XDG_RUNTIME_DIR"}
    env.update(CONTAIN_STATE_DIR=state, HOME=d, CONTAIN_TEST_TOKEN=box.token, PYTHONPATH=pythonpath())
    try:
        yield uid, env
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_weaker_container_is_said_on_stderr_and_quiet_silences_it(spare):
    p = _as_spare_uid(spare, "run", "--backend", "auto", "--", "true")
    assert p.returncode == 0, p.stderr
    # What auto fell back to, by name (pidns where the wall works, else none).
    assert ("backend pidns" in p.stderr or "backend none" in p.stderr) and "contain doctor" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    q = _as_spare_uid(spare, "run", "--backend", "auto", "--quiet", "--", "true")
    assert q.returncode == 0 and q.stderr == "", q.stderr


def test_an_explicit_cgroup_base_the_user_cannot_use_is_125_not_a_fallback(spare, box):
    mnt = cgroup2_mount()
    base = os.path.join(mnt, f"contain-test-root-only-{box.token}")
    os.mkdir(base)                          # root's, not delegated
    try:
        p = _as_spare_uid(spare, "run", "--backend", "auto", "--", "true", CONTAIN_CGROUP_BASE=base)
        assert p.returncode == 125, p.stderr
        assert "CONTAIN_CGROUP_BASE" in p.stderr and "Traceback" not in p.stderr
        assert os.listdir(base) == [] or all(not os.path.isdir(os.path.join(base, e)) for e in os.listdir(base))
    finally:
        remove_cgroup_tree(base)


def test_an_explicit_cgroup_base_that_cannot_be_made_is_125_and_leaves_nothing(box):
    mnt = cgroup2_mount()
    before = set(os.listdir(mnt))
    env = dict(box.env, CONTAIN_CGROUP_BASE=os.path.join(mnt, "cgroup.procs", "nope"))
    p = run_contain(env, "run", "--backend", "auto", "--", "true")
    assert p.returncode == 125 and "CONTAIN_CGROUP_BASE" in p.stderr, p.stderr
    assert set(os.listdir(mnt)) == before


def test_a_missing_cgroup_base_is_made_for_the_run_and_removed_after_it(box):
    mnt = cgroup2_mount()
    top = os.path.join(mnt, f"contain-test-made-{box.token}")
    env = dict(box.env, CONTAIN_CGROUP_BASE=os.path.join(top, "deeper"))
    try:
        p = run_contain(env, "run", "--id", "m", "--", "sh", "-c", "sleep 300 &")
        assert p.returncode == 0, p.stderr
        assert box.record("m")["containment"]["backend"] == "cgroup2"
        assert not os.path.exists(top), "contain left the base it made"
    finally:
        remove_cgroup_tree(top)


# -- time bounds ----------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ("--timeout", "1w"), ("--kill-timeout", "0"), ("--timeout", "nan"), ("--grace", "inf"),
    ("--timeout", "-1"), ("--linger", "nan"), ("--linger", "-1"), ("--kill-timeout", "inf"),
])
def test_time_bounds_contain_cannot_honour_are_usage_errors(box, args):
    p = run_contain(box.env, "run", *args, "--", "true")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr


def test_huge_finite_time_bounds_work_in_the_owner_loop(box):
    proc = start(box, "h", "--timeout", "2200000", "--grace", "1e300", "--kill-timeout", "1e9",
                 "--linger", "1e300", "--", "sh", "-c", "trap '' TERM; sleep 300")
    p = run_contain(box.env, "cancel", "h", "--grace", "0", "--wait", "--timeout", "60")
    assert p.returncode == 0, p.stderr
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert "Traceback" not in proc.stderr.read()
    assert box.record("h")["state"] == "REAPED"
    assert holders(box.token) == []


@pytest.mark.parametrize("value", [1e300, 2200000.0])
def test_huge_finite_time_bounds_work_in_the_async_owner_loop(box, anyio_backend, value):
    import anyio

    import launcher

    async def main() -> dict:
        async with launcher.open_worker(["sh", "-c", "trap '' TERM; sleep 300"], grace=value, timeout=value,
                                        env=box.env) as w:
            assert len(wait_holders(box.token, 1)) >= 1
            with anyio.fail_after(60):
                await w.cancel(grace=0)
                return (await w.wait()).to_dict()

    rec = anyio.run(main, backend=anyio_backend)
    assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled"
    assert holders(box.token) == []


@pytest.mark.parametrize("kw", [{"grace": float("nan")}, {"timeout": float("inf")}, {"kill_timeout": 0},
                                {"linger": -1.0}, {"grace": float("inf")}])
def test_options_refuse_time_bounds_that_cannot_be_honoured(kw):
    from launcher._options import Options

    with pytest.raises(ValueError):
        Options(**kw)


def test_a_worker_that_exits_before_its_init_reports_it_is_noticed_at_once(box):
    """A worker that exits before its init has said EXEC (a busy host, a
    quick `sh -c 'job &'`) had its exit read by the spawn, and the owner
    loop then waited before looking: nothing woke it until the namespace
    emptied, so the stop (here the linger) began only once the background
    job was gone, and a job that never ends would never have been stopped.
    Twelve at once make the race likely; each record must show the linger
    that began while its job still ran."""
    import concurrent.futures

    def one(i: int) -> dict:
        p = run_contain(box.env, "run", "--id", f"q{i}", "--linger", "30", "--", "sh", "-c", "sleep 1 &")
        assert p.returncode == 0, p.stderr
        return box.record(f"q{i}")["linger"]

    with concurrent.futures.ThreadPoolExecutor(12) as ex:
        lingers = list(ex.map(one, range(12)))
    late = [lg for lg in lingers if lg["seen"]["count"] < 1 or lg["lingered_s"] < 0.3]
    assert not late, late
    assert holders(box.token) == []


@pytest.mark.parametrize("backend", ["auto", "cgroup2"])
def test_ctrl_c_of_a_script_with_background_jobs_does_not_wait_the_grace(box, backend):
    """A shell starts its `&` jobs with SIGINT ignored: they never react to
    the Ctrl-C the stop sends first. Before, the stop waited the whole grace
    (5 s by default) for them; now a member that ignores SIGINT gets SIGTERM
    at once (issue 31). Through a real pty, as a user's Ctrl-C."""
    env = dict(box.env, CONTAIN_BACKEND=backend)
    argv = contain_cmd("run", "--id", f"cc-{backend}", "--grace", "60", "--",
                       "bash", "-c", "sleep 300 & sleep 301 & wait")
    pid, master = pty.fork()
    if pid == 0:                                   # the child: contain, on the pty, foreground
        try:
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    try:
        deadline = time.monotonic() + 30
        while len(holders(box.token)) < 3:          # bash and its two sleeps
            assert time.monotonic() < deadline, "the workload did not start"
            time.sleep(0.05)
        sleeps = [p for p in holders(box.token) if _comm(p) == "sleep"]
        assert sleeps and all(_ignores_sigint(p) for p in sleeps), "bash left SIGINT ignored in its & jobs"
        os.write(master, b"\x03")                   # Ctrl-C: SIGINT to the foreground process group
        _, status = os.waitpid(pid, 0)
        pid = -1
    finally:
        if pid > 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(master)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT
    rec = box.record(f"cc-{backend}")
    assert rec["state"] == "REAPED", rec["state"]
    kinds = [s["kind"] for s in steps(rec)]
    assert "kill" not in kinds, f"the stop needed SIGKILL after the grace: {kinds}"
    assert holders(box.token) == []


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _ignores_sigint(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False
