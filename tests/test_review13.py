"""Review 13: `contain` driven through CONTRACT.md as a user would, at the
awkward places (a terminal, signals at the edges, bad input).

Each test is named after the failure it attacks. Real kernel and real
terminals (pty pairs of the test's own); survival by the test's own /proc
scan (tests/_proc.py); every wait is bounded.
"""
from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time

import pytest

from _proc import ROOT, TOKEN_VAR, holders, kill_holders, new_token

CONTAIN = [sys.executable, os.path.join(ROOT, "bin", "contain")]


def _pty_contain(box, args: list[str], token: str) -> tuple[int, int]:
    """`contain ARGS` as the foreground job of a terminal of its own (the
    child of pty.fork() leads a new session whose controlling terminal is
    the pty). Returns (pid, master fd)."""
    env = dict(box.env, **{TOKEN_VAR: token})
    pid, fd = pty.fork()
    if pid == 0:                               # pragma: no cover (the child)
        try:
            os.execve(CONTAIN[0], CONTAIN + args, env)
        finally:
            os._exit(127)
    return pid, fd


def _read_until(fd: int, want: bytes, timeout: float) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while want not in out and time.monotonic() < deadline:
        r, _, _ = select.select([fd], [], [], 0.05)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:                    # EIO: the slave side is closed
                break
            if not chunk:
                break
            out += chunk
    return out


def _wait_exit(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            wp, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:            # reaped already
            return None
        if wp == pid:
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)


def _end(pid: int, fd: int, token: str) -> None:
    try:
        # Not reaped yet (a zombie at worst), so the pid is still ours.
        if os.waitpid(pid, os.WNOHANG)[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    except ChildProcessError:                # reaped already by _wait_exit
        pass
    kill_holders(token)
    os.close(fd)


@pytest.mark.parametrize("backend", ["none", "auto"])
def test_terminal_read_stops_worker_by_sigttin(box, backend):
    """`contain run --backend none -- CMD` typed at a shell: the worker was
    put in a process group of its own, not the terminal's foreground one,
    so its first read of the terminal it inherited stopped it (SIGTTIN) and
    the run hung for ever. stdin is inherited: the worker must read it."""
    token = new_token()
    pid, fd = _pty_contain(box, ["run", "--backend", backend, "--grace", "0.2", "--",
                                 "sh", "-c", "read x; echo got:$x"], token)
    try:
        _read_until(fd, b"never", 0.5)          # let it start
        os.write(fd, b"hello\n")
        out = _read_until(fd, b"got:hello", 10)
        status = _wait_exit(pid, 10)
        assert b"got:hello" in out, out
        assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert holders(token) == []
    finally:
        _end(pid, fd, token)


@pytest.mark.parametrize("backend", ["none", "auto"])
def test_terminal_ctrl_c_leaves_worker_or_contain_alive(box, backend):
    """Ctrl-C at the terminal of a degraded run: contain dies by SIGINT (so
    a shell loop around it stops) and nothing of the tree survives, the
    worker included (it reads the terminal first, so it is not stopped)."""
    token = new_token()
    pid, fd = _pty_contain(box, ["run", "--backend", backend, "--grace", "0.2", "--",
                                 "sh", "-c", "read x; echo got:$x; sleep 30"], token)
    try:
        _read_until(fd, b"never", 0.5)
        os.write(fd, b"hello\n")
        assert b"got:hello" in _read_until(fd, b"got:hello", 10)
        os.write(fd, b"\x03")
        status = _wait_exit(pid, 10)
        assert status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT, status
        assert holders(token) == []
    finally:
        _end(pid, fd, token)


def _flood(p, signum: int, timeout: float = 10.0) -> None:
    """Send `signum` to `p` as fast as possible until it ends."""
    deadline = time.monotonic() + timeout
    while p.poll() is None and time.monotonic() < deadline:
        try:
            p.send_signal(signum)
        except ProcessLookupError:
            break
        time.sleep(0.0002)


@pytest.mark.parametrize("attempt", range(3))
def test_second_ctrl_c_while_dying_prints_traceback(box, attempt):
    """Ctrl-C held down (a flood of SIGINT) on `contain wait`: the first
    became "die by SIGINT", the next landed in the code doing that (main()'s
    handler, the flush, the import of die_by) and escaped as a Python
    traceback with status 1. No command prints a traceback; it dies by
    SIGINT."""
    import subprocess

    token = new_token()
    env = dict(box.env, **{TOKEN_VAR: token})
    rid = f"rev13-flood-{attempt}"
    run = subprocess.Popen(CONTAIN + ["run", "--id", rid, "--grace", "0.1", "--", "sleep", "30"], env=env,
                           stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(os.path.join(box.state_dir, "runs", rid, "run.json")):
            assert time.monotonic() < deadline and run.poll() is None
            time.sleep(0.02)
        w = subprocess.Popen(CONTAIN + ["wait", rid], env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(0.8)                      # well inside its wait
        _flood(w, signal.SIGINT)
        _out, err = w.communicate(timeout=10)
        assert b"Traceback" not in err, err.decode()
        assert w.returncode == -signal.SIGINT, (w.returncode, err)
    finally:
        subprocess.run(CONTAIN + ["cancel", rid, "--grace", "0"], env=env, capture_output=True, timeout=30)
        try:
            run.wait(10)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
        kill_holders(token)


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
def test_adopter_ignores_later_cancel_grace(box, backend_env):
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


def test_adopter_forgets_first_cancel_grace(box):
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


def test_ctrl_c_on_adopting_cancel_leaves_tree_unconfirmed(box):
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


def test_terminal_degraded_run_loses_its_daemons(box):
    """The worker of a degraded run on a terminal shares contain's process
    group (above), so the group is no evidence there: the setsid'd and
    double-forked leftovers must still be found (ancestry, the subreaper)
    and stopped when the worker exits."""
    token = new_token()
    pid, fd = _pty_contain(box, ["run", "--backend", "none", "--grace", "0.2", "--", "sh", "-c",
                                 "setsid sh -c \"trap '' TERM; sleep 30\" & (sleep 40 &); "
                                 "sh -c 'sleep 50 &'; sleep 0.3; echo started"], token)
    try:
        assert b"started" in _read_until(fd, b"started", 10)
        status = _wait_exit(pid, 10)
        assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert holders(token) == []
    finally:
        _end(pid, fd, token)


def _ours(err: bytes) -> bool:
    """A traceback through contain's own code (a line of bin/contain or the
    launcher package). One whose frames are all Python's (its start-up,
    computing sys.path or before bin/contain's first line, 'line 0'; its
    teardown, after sys.stderr is gone) is Python's to report: a flood lands
    there too."""
    text = err.decode(errors="replace")
    frames = [ln for ln in text.splitlines() if ln.strip().startswith("File ")]
    # 'line 0': bin/contain named, but before its first line ran (Python's).
    return "Traceback" in text and any(("bin/contain" in f and ", line 0," not in f) or
                                       f"{os.sep}launcher{os.sep}" in f for f in frames)


def test_ctrl_c_held_down_while_contain_loads_prints_traceback(tmp_path):
    """A flood of SIGINT while bin/contain imports the package (made slow
    here: no bytecode cache, no site): the first became "die by SIGINT" in
    its KeyboardInterrupt handler, the next interrupted that handler and
    escaped as a traceback."""
    import subprocess

    bad = []
    for i in range(10):
        cache = tmp_path / f"pycache{i}"
        cache.mkdir()
        env = dict(os.environ, PYTHONPYCACHEPREFIX=str(cache), PYTHONPATH=ROOT,
                   CONTAIN_STATE_DIR=str(tmp_path / "state"))
        p = subprocess.Popen([sys.executable, "-S", CONTAIN[1], "ls"], env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.01)                      # Python's own start-up is over; the import is not
        _flood(p, signal.SIGINT)
        _out, err = p.communicate(timeout=10)
        if _ours(err):
            bad.append(err.decode(errors="replace")[-400:])
    assert not bad, bad[0]
