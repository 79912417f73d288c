"""`contain` at an interactive terminal, as a user types it: the worker reads
the terminal it inherits, Ctrl-C (once or held down) makes contain die by
SIGINT without a traceback and leaves nothing, and a worker cannot type into
the caller's terminal or wedge contain by stopping its output."""
from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest

from _proc import ROOT, TOKEN_VAR, contain_cmd, holders, kill_holders, new_token
from _users import python
from conftest import needs_cgroup


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
def test_worker_reading_the_terminal_of_a_degraded_run_is_not_stopped_by_sigttin(box, backend):
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
def test_ctrl_c_at_the_terminal_kills_contain_by_sigint_and_leaves_nothing(box, backend):
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
def test_ctrl_c_held_down_on_wait_dies_by_sigint_without_a_traceback(box, attempt):
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


def test_degraded_run_on_a_terminal_still_stops_its_daemons(box):
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


def test_ctrl_c_held_down_while_contain_loads_prints_no_traceback(tmp_path):
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


_TIOCSTI = r"""
import fcntl, os, sys, termios
try:
    for ch in b"echo INJECTED\n":
        fcntl.ioctl(0, termios.TIOCSTI, bytes([ch]))
    print("injected", flush=True)
except OSError as e:
    print("refused", e.errno, flush=True)
"""


@needs_cgroup
@pytest.mark.forked          # the test process takes a new session and a controlling terminal
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [["--user", "nobody"], ["--seal"], ["--user", "nobody", "--backend", "pidns"]],
                         ids=["user", "seal", "pidns-user"])
def test_sealed_worker_cannot_type_into_the_callers_terminal(box, mode):
    """contain run from an interactive root shell: the worker inherits the
    terminal, which is its controlling terminal too. With
    dev.tty.legacy_tiocsti on (the default before 6.2, and here), a worker
    the record called sealed pushed "echo INJECTED" into the terminal's
    input with TIOCSTI; the root shell reads it as soon as contain returns."""
    import fcntl
    import pty
    import select
    import termios

    try:
        with open("/proc/sys/dev/tty/legacy_tiocsti") as f:
            if f.read().strip() == "0":
                pytest.skip("TIOCSTI is off for everyone here (dev.tty.legacy_tiocsti = 0)")
    except OSError:
        pass
    master, slave = pty.openpty()

    def own_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        p = subprocess.run(contain_cmd("run", "-q", "--id", "tty", *mode, "--", python(), "-c", _TIOCSTI),
                           env=box.env, stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal,
                           timeout=30)
        out = b""
        while select.select([master], [], [], 0.3)[0]:
            out += os.read(master, 4096)
        os.set_blocking(slave, False)
        try:
            pending = os.read(slave, 4096)      # what the caller's shell would read next
        except BlockingIOError:
            pending = b""
        rec = box.record("tty")
        assert p.returncode == 0, out
        assert rec["containment"]["sealed"] is True, rec["containment"]["sealed_reason"]
        assert b"INJECTED" not in pending, f"a sealed worker typed into root's terminal: {pending!r} ({out!r})"
        assert b"refused" in out, out
    finally:
        os.close(master)
        os.close(slave)
    assert holders(box.token) == []


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a cgroup base of the test's own)")


def _contain_argv() -> list[str]:
    import sys

    return [sys.executable, "-m", "launcher"]


_STOP_TERMINAL = r"""
import signal, termios
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
termios.tcflow(1, termios.TCOOFF)
"""


@needs_root
@pytest.mark.parametrize("record", ["/dev/stdout", "-"])
def test_sealed_worker_stopping_the_terminals_output_cannot_wedge_contain(contained, record):
    """The worker shares the caller's terminal (stdio is inherited, never
    copied). tcflow(TCOOFF), what ^S does, needs no controlling terminal,
    so even a sealed worker in a session of its own could stop the
    terminal's output and exit: contain's final write of `--record
    /dev/stdout` (or `-`) then blocked for ever, long after the tree was
    gone, and a script around it never got an exit status."""
    import pty
    import termios
    import threading

    master, slave = pty.openpty()
    got = bytearray()

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            got.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        try:
            p = subprocess.run([*_contain_argv(), "run", "-q", "--seal", "--record", record, "--",
                                python(), "-c", _STOP_TERMINAL],
                               env=contained["env"], stdin=slave, stdout=slave, stderr=slave,
                               start_new_session=True, timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("contain run was still writing to the stopped terminal after 30 s")
        assert p.returncode == 0
        deadline = time.monotonic() + 10
        while b'"run_id"' not in got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b'"state": "REAPED"' in got and b'"sealed": true' in got, bytes(got[-500:])
        assert holders(contained["token"]) == []
    finally:
        try:
            termios.tcflow(slave, termios.TCOON)
        except termios.error:
            pass
        os.close(slave)
        os.close(master)
        reader.join(5)
        kill_holders(contained["token"])


@needs_cgroup
@pytest.mark.timeout(60)
def test_newline_and_escape_in_argv_cannot_forge_ls_rows_or_reach_the_terminal(box):
    """A command with a newline (any multi-line `sh -c` script) and an
    escape sequence (here one that would set the terminal's title, or OSC 52,
    the clipboard) was printed raw by `ls` and `status`: the newline forged
    a row of its own ("fake  REAPED ...") and the escape went to the
    terminal. A worker that can write its record.json chooses this text."""
    script = "true\nfake  REAPED   exited   0\n\x1b]0;owned\x07\x1b]52;c;ZWNobyBvd25lZA==\x07"
    r = subprocess.run(contain_cmd("run", "-q", "--id", "nl", "--", "sh", "-c", script), env=box.env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    ls = subprocess.run(contain_cmd("ls", "--all"), env=box.env, capture_output=True, text=True, timeout=30)
    st = subprocess.run(contain_cmd("status", "nl"), env=box.env, capture_output=True, text=True, timeout=30)
    for out in (ls.stdout, st.stdout):
        assert "\x1b" not in out and "\x07" not in out, repr(out)
        assert not any(line.startswith("fake") for line in out.splitlines()), out
    assert len(ls.stdout.splitlines()) == 2, ls.stdout     # the header and one row
    assert "\\n" in ls.stdout and "\\x1b" in st.stdout, (ls.stdout, st.stdout)
    assert holders(box.token) == []
