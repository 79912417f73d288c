"""The suite's last line of defence against a test that blocks for ever.

pytest-timeout's SIGALRM reaches a test only through Python's own signal
handler, which runs when the blocked thread next returns to the
interpreter. A thread waiting in C that retries EINTR, or in the kernel in
a killable-only sleep (a vfork parent, a /proc read that waits for another
process's mmap lock), never returns: the handler never runs. A forked test
is timed in its child only, so a child stuck outside its test function (or
one that cannot exit) holds the parent in waitpid. CI then waits out its
own limit with nothing printed after the last dot.

So a watchdog process started with the session (not a thread: every
forked test would copy it) hears from pytest when each test starts and
ends. A test that outlives its own timeout by GRACE_S is dumped
(faulthandler's stacks of the pytest process and its forked children,
taken by SIGUSR2 in C whatever the thread is doing; each of the session's
processes with its threads' kernel state, wchan and kernel stack), then
every process the session started is SIGKILLed (the test then fails as
crashed or with the error its wait saw). A session still stuck after that
is SIGKILLed itself, so CI ends with the dump instead of at its limit.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time

import pytest

# Past the test's own timeout; and for the test to end once its processes
# are gone. tests/test_watchdog.py sets them short.
GRACE_S = float(os.environ.get("CONTAIN_WATCHDOG_GRACE_S", "60"))
AFTER_KILL_S = float(os.environ.get("CONTAIN_WATCHDOG_AFTER_KILL_S", "30"))
DUMP = signal.SIGUSR2


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(64 * 1024).decode(errors="replace")
    except OSError as e:
        return f"<{e.strerror}>"


def _stat(pid: str) -> tuple[int, str] | None:
    """(ppid, state) of `pid`, or None once it is gone."""
    s = _read(f"/proc/{pid}/stat")
    try:
        rest = s[s.rindex(")") + 2:].split()
        return int(rest[1]), rest[0]
    except (ValueError, IndexError):     # gone: "<No such file or directory>"
        return None


def descendants(root: int) -> list[int]:
    """Every live process below `root`, parents before their children."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(name)
            if st is not None:
                kids.setdefault(st[0], []).append(int(name))
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def describe(pid: int) -> str:
    lines = [f"  pid {pid}: {_read(f'/proc/{pid}/cmdline').replace(chr(0), ' ').strip()[:300]}"]
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return lines[0] + " (gone)"
    for tid in tids:
        t = f"/proc/{pid}/task/{tid}"
        st = _read(f"{t}/stat")
        state = st[st.rindex(")") + 2:].split(" ", 1)[0] if ")" in st else "?"
        lines.append(f"    tid {tid} {_read(f'{t}/comm').strip()} state {state} wchan {_read(f'{t}/wchan').strip()} "
                     f"syscall {_read(f'{t}/syscall').strip()}")
        stack = _read(f"{t}/stack").strip()
        if stack:
            lines += [f"      {ln}" for ln in stack.splitlines()[:20]]
    return "\n".join(lines)


def _say(text: str) -> None:
    os.write(2, f"\nwatchdog: {text}\n".encode(errors="replace"))


def _forks_of(session: int, pids: list[int]) -> list[int]:
    """The session's forked children (pytest-forked): its own command line."""
    own = _read(f"/proc/{session}/cmdline")
    return [p for p in pids if _read(f"/proc/{p}/cmdline") == own]


def _stuck(session: int, nodeid: str, ran: float) -> None:
    _say(f"{nodeid} has run {ran:.0f} s, {GRACE_S:.0f} s past its own timeout, which could not stop it: "
         "the stacks and the session's processes, then every process the session started is killed")
    me = os.getpid()
    pids = [p for p in descendants(session) if p != me]
    for p in _forks_of(session, pids) + [session]:      # one at a time: their dumps share the stderr
        try:
            os.kill(p, DUMP)
        except OSError:
            pass
        time.sleep(1.0)
    _say("processes:\n" + "\n".join(describe(p) for p in [session] + pids))
    for p in reversed(pids):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def main() -> int:
    session = int(sys.argv[1])
    if os.fork() > 0:
        os._exit(0)
    current: tuple[str, float, float] | None = None     # nodeid, started, limit
    killed = False
    buf = b""
    while True:
        r, _, _ = select.select([0], [], [], 1.0)
        if r:
            chunk = os.read(0, 4096)
            if not chunk:
                return 0            # the session ended
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                word, _, rest = line.decode(errors="replace").partition(" ")
                if word == "start":
                    limit, _, nodeid = rest.partition(" ")
                    current, killed = (nodeid, time.monotonic(), float(limit)), False
                elif word == "end":
                    current = None
        if current is None:
            continue
        nodeid, started, limit = current
        ran = time.monotonic() - started
        if not killed and ran > limit + GRACE_S:
            _stuck(session, nodeid, ran)
            killed = True
        elif killed and ran > limit + GRACE_S + AFTER_KILL_S:
            _say(f"{nodeid} is still stuck with its processes gone: the session is killed")
            os.kill(session, signal.SIGKILL)
            return 1


# -- the pytest side (tests/conftest.py registers it) ----------------------------

class Plugin:
    """Starts the watchdog with the session and tells it each test's start
    (with the timeout it has) and end. The watchdog's stderr and the
    faulthandler dumps go to the session's real stderr, taken while
    pytest's capture is off."""

    def __init__(self, config) -> None:
        import faulthandler
        import subprocess

        try:
            self.default = float(config.getini("timeout") or 0) or 3600.0
        except (ValueError, TypeError):     # pytest-timeout is not installed
            self.default = 3600.0
        capman = config.pluginmanager.getplugin("capturemanager")
        with capman.global_and_fixture_disabled() if capman is not None else contextlib.nullcontext():
            self.err = os.dup(2)
        os.set_inheritable(self.err, False)
        faulthandler.register(DUMP, file=self.err, all_threads=True, chain=False)
        # Not a child of the session's: tests count their process's children.
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid())], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=self.err, start_new_session=True)
        proc.wait()         # the watchdog is its child, orphaned at once
        self.stdin = proc.stdin

    def _tell(self, line: str) -> None:
        try:
            assert self.stdin is not None
            self.stdin.write(line.encode() + b"\n")
            self.stdin.flush()
        except (OSError, ValueError):
            pass            # the watchdog is gone: the suite goes on without it

    def limit(self, item) -> float:
        m = item.get_closest_marker("timeout")
        if m is not None:
            v = m.args[0] if m.args else m.kwargs.get("timeout")
            if v is not None:
                return float(v) if float(v) > 0 else 3600.0     # 0: pytest-timeout's "none"
        return self.default

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self._tell(f"start {self.limit(item)} {item.nodeid}")
        try:
            yield
        finally:
            self._tell("end")

    def close(self) -> None:
        """The watchdog sees end of file and exits."""
        try:
            if self.stdin is not None:
                self.stdin.close()
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
