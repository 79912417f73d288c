"""Signals that `contain run` forwards to the worker (docker run's sig-proxy,
tini), against real processes and real signals.

SIGUSR1, SIGUSR2, SIGALRM and every other signal whose default action ends
a process, and that does not cancel the run, used to kill the supervisor
by that default action and leave the worker running as an orphan. Now each
goes to the worker (by its pidfd), in order; the supervisor never dies of
it. The worker here records every signal it gets in a file and dies of the
last one; what lived and what survived is decided by the test's own /proc
scan.
"""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from _proc import comm_of, contain_cmd, holders, wait_holders, waiting_for_claim
from conftest import needs_cgroup

PY = sys.executable

FORWARDED = [signal.SIGUSR1, signal.SIGUSR2, signal.SIGVTALRM, signal.SIGPROF, signal.SIGXCPU,
             signal.SIGXFSZ, signal.SIGPWR, signal.SIGSTKFLT, signal.SIGIO,
             *range(signal.SIGRTMIN, signal.SIGRTMAX + 1)]
LAST = signal.SIGALRM       # the worker dies of this one

# Records each signal it gets (one number a line) and dies of `last` by its
# default action. A signal that was SIG_IGN at its start keeps SIG_IGN
# (but SIGXFSZ's SIG_IGN is the interpreter's own, set before this runs).
RECORDER = textwrap.dedent("""
    import os, signal, sys, time
    out, last = sys.argv[1], int(sys.argv[2])
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    def got(n, _f):
        os.write(fd, b"%d\\n" % n)
        if n == last:
            signal.signal(n, signal.SIG_DFL)
            os.kill(os.getpid(), n)
    for s in map(int, sys.argv[3:]):
        if signal.getsignal(s) != signal.SIG_IGN or s == signal.SIGXFSZ:
            signal.signal(s, got)
    with open(out + ".ready", "w") as f:
        f.write("ready\\n")
    while True:
        time.sleep(1)
""")


def alive(pid: int) -> bool:
    """From /proc: `pid` exists and is no zombie (contain is our child: a
    dead one stays a zombie until waited for)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
    except OSError:
        return False
    return st[st.rindex(b")") + 2:st.rindex(b")") + 3] not in (b"Z", b"X")


def wait_until(pred, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.01)


def lines(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def end(proc: subprocess.Popen | None, token: str) -> None:
    """Whatever the test started, gone: contain by its pid, then anything
    that carries the test's token."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(10)
    for pid in holders(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_recorder(box, tmp_path, args, sigs, **kw) -> tuple[subprocess.Popen, str]:
    out = str(tmp_path / "got")
    proc = subprocess.Popen(contain_cmd("run", "--id", "f", *args, "--", PY, "-c", RECORDER, out, str(int(LAST)),
                                        *(str(int(s)) for s in sigs)),
                            env=box.env, stderr=subprocess.PIPE, text=True, **kw)
    try:
        wait_until(lambda: os.path.exists(out + ".ready") or proc.poll() is not None, what="the worker's start")
    except AssertionError:
        end(proc, box.token)
        raise
    if proc.poll() is not None:
        err = proc.stderr.read() if proc.stderr else ""
        if proc.returncode == 125 and args:
            pytest.skip(f"contain run {' '.join(args)} cannot run here: {err.strip()}")
        raise AssertionError(f"contain ended before the worker started ({proc.returncode}): {err}")
    return proc, out


BACKENDS = [
    pytest.param([], "pidns", marks=needs_cgroup, id="cgroup2+pidns-wall"),
    pytest.param(["--no-pidns"], None, marks=needs_cgroup, id="cgroup2-no-pidns"),
    pytest.param(["--backend", "pidns"], "pidns", id="pidns"),
    pytest.param(["--backend", "none"], None, id="none"),
]


@pytest.mark.parametrize("args,wall", BACKENDS)
def test_signals_to_contain_reach_the_worker_and_never_kill_contain(box, tmp_path, args, wall):
    sigs = FORWARDED + [LAST]
    proc, out = start_recorder(box, tmp_path, args, sigs)
    try:
        worker = [p for p in holders(box.token) if p != proc.pid and comm_of(p) != "ct/init"]
        assert len(worker) == 1, worker
        for n, s in enumerate(FORWARDED, 1):
            proc.send_signal(s)
            wait_until(lambda: len(lines(out)) >= n or proc.poll() is not None, what=f"signal {s} at the worker")
            assert alive(proc.pid), f"contain died of signal {s} (status {proc.poll()})"
        assert lines(out) == [int(s) for s in FORWARDED], "not each signal, once, in order"
        assert alive(worker[0])
        proc.send_signal(LAST)
        rc = proc.wait(30)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        end(proc, box.token)
    assert rc == 128 + LAST, (rc, err)       # an exit of contain's, not its death by the signal
    assert lines(out) == [int(s) for s in sigs]
    assert not alive(worker[0])
    assert holders(box.token) == [], "something of the tree survived"
    rec = box.record("f")
    assert (rec["outcome"], rec["signal"]) == ("signaled", LAST), rec
    assert rec["state"] == ("EXITED" if args[-1:] == ["none"] else "REAPED"), rec
    kinds = [w.get("kind") for w in rec["containment"]["walls"]]
    assert ("pidns" in kinds) == (wall == "pidns"), kinds






@needs_cgroup
def test_signals_sent_before_the_worker_exists_reach_it_in_order(box, tmp_path):
    """SIGUSR2 then SIGUSR1 while contain waits for the claim: both wait for
    the worker and are sent in that order. `sleep` dies of the first one
    sent to it (complete_signal makes the group exit code the first fatal
    signal), so 140 says USR2 came first; by number, USR1 would be first."""
    from launcher._layout import RunDir

    root = RunDir.runs_root(box.state_dir)
    os.makedirs(root, mode=0o700, exist_ok=True)
    os.chmod(box.state_dir, 0o700)
    os.chmod(root, 0o700)
    lock_path = os.path.join(root, ".claim.lock")
    guard = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    proc = None
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)           # the claim now waits for us
        proc = subprocess.Popen(contain_cmd("run", "--id", "e", "--", "sleep", "300"),
                                env=box.env, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: waiting_for_claim(proc.pid, lock_path) or proc.poll() is not None,
                   what="contain at the claim")
        assert proc.poll() is None and holders(box.token) == [proc.pid], "a worker before the claim"
        proc.send_signal(signal.SIGUSR2)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        assert alive(proc.pid), f"contain died of an early signal (status {proc.poll()})"
        fcntl.flock(guard, fcntl.LOCK_UN)
        rc = proc.wait(30)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        os.close(guard)
        end(proc, box.token)
    assert rc == 128 + signal.SIGUSR2, (rc, err)
    rec = box.record("e")
    assert (rec["state"], rec["outcome"], rec["signal"]) == ("REAPED", "signaled", signal.SIGUSR2), rec
    assert holders(box.token) == []


@needs_cgroup
def test_a_signal_the_caller_ignored_stays_ignored(box, tmp_path):
    """SIGUSR1 ignored by contain's caller: contain installs nothing over
    it, the worker starts with it ignored, and it reaches nobody; SIGUSR2
    is forwarded as ever."""
    proc, out = start_recorder(box, tmp_path, [], [signal.SIGUSR1, signal.SIGUSR2, LAST],
                               preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN))
    try:
        worker = [p for p in holders(box.token) if p != proc.pid and comm_of(p) != "ct/init"]
        assert len(worker) == 1, worker
        with open(f"/proc/{worker[0]}/status") as f:
            ign = int(next(x for x in f if x.startswith("SigIgn:")).split()[1], 16)
        assert ign & (1 << (signal.SIGUSR1 - 1)), "the worker does not ignore SIGUSR1"
        proc.send_signal(signal.SIGUSR1)
        proc.send_signal(signal.SIGUSR2)
        wait_until(lambda: lines(out) or proc.poll() is not None, what="SIGUSR2 at the worker")
        assert alive(proc.pid) and alive(worker[0])
        proc.send_signal(LAST)
        rc = proc.wait(30)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        end(proc, box.token)
    assert rc == 128 + LAST, (rc, err)
    assert lines(out) == [signal.SIGUSR2, LAST]
    assert holders(box.token) == []


@needs_cgroup
def test_a_signal_after_the_worker_ended_is_dropped_and_contain_lives(box, tmp_path):
    """The worker has exited; what it left ignores SIGTERM, so the stop
    waits out its grace. A SIGUSR1 then has nothing to go to: contain lives
    on, the leftover is not sent it (it dies by the stop's SIGKILL), and the
    run ends with the worker's own status."""
    proc = subprocess.Popen(contain_cmd("run", "--id", "d", "--grace", "2", "--",
                                        "sh", "-c", "trap '' TERM; sleep 300 & exit 3"),
                            env=box.env, stderr=subprocess.PIPE, text=True)
    try:
        # Only the leftover (and the wall's init) besides contain: the worker is gone.
        wait_until(lambda: proc.poll() is not None or (
            [comm_of(p) for p in holders(box.token) if p != proc.pid and comm_of(p) != "ct/init"] == ["sleep"]),
            what="the worker's exit with its leftover running")
        assert wait_holders(box.token, 2, timeout=5)
        time.sleep(0.2)                     # past the stop's SIGTERM, inside its grace
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.3)
        assert alive(proc.pid), f"contain died of SIGUSR1 after its worker ended (status {proc.poll()})"
        rc = proc.wait(30)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        end(proc, box.token)
    assert rc == 3, (rc, err)
    rec = box.record("d")
    assert (rec["state"], rec["outcome"], rec["exit_code"]) == ("REAPED", "exited", 3), rec
    detail = rec["evidence"]["signal_sent"]["detail"]
    assert [s["kind"] for s in detail["steps"]][-1] == "kill", "the leftover ended before the SIGKILL"
    assert holders(box.token) == []
