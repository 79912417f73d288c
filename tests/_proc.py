"""Test-side helpers that do NOT use the code under test.

Survival is decided by scanning /proc/*/environ for a token put in each
workload's environment (tini's test/reaping does the same): a process the
launcher lost track of still carries it.
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

TOKEN_VAR = "CONTAIN_TEST_TOKEN"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def new_token() -> str:
    return f"t{secrets.token_hex(8)}"


def holders(token: str, var: str = TOKEN_VAR) -> list[int]:
    """Live (non-zombie) processes whose environment holds `var=token`
    as one entry. The one survivor scan of the test suite. A process whose
    leader thread exited alone (SYS_exit) while another thread runs on
    shows Z and has no readable environ at /proc/<pid>: its threads are looked at."""
    needle = f"{var}={token}".encode()
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        for where in _live_task_dirs(name):
            try:
                with open(f"{where}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            if needle in env.split(b"\0"):
                found.append(int(name))
            break
    return found


def _state(stat_path: str) -> bytes | None:
    try:
        with open(stat_path, "rb") as f:
            st = f.read()
    except OSError:
        return None
    return st[st.rindex(b")") + 2:st.rindex(b")") + 3]


def _live_task_dirs(pid: str) -> list[str]:
    """/proc/<pid> if its leader is not a zombie, else the directories of
    its threads that are not (none for a true zombie)."""
    state = _state(f"/proc/{pid}/stat")
    if state is None:
        return []
    if state not in (b"Z", b"X"):
        return [f"/proc/{pid}"]
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    return [f"/proc/{pid}/task/{t}" for t in tids if _state(f"/proc/{pid}/task/{t}/stat") not in (None, b"Z", b"X")]


def readline_within(f, timeout: float = 30.0) -> bytes:
    """One line from a child's pipe, or b"" if none came within `timeout`
    (a child that never starts fails the test instead of hanging it)."""
    import select

    r, _, _ = select.select([f], [], [], timeout)
    return f.readline() if r else b""


def wait_holders(token: str, want: int, timeout: float = 10.0) -> list[int]:
    """Wait until at least `want` token holders exist (the workload is up)."""
    deadline = time.monotonic() + timeout
    while True:
        h = holders(token)
        if len(h) >= want or time.monotonic() > deadline:
            return h
        time.sleep(0.02)


def wait_gone(token: str, timeout: float = 10.0) -> list[int]:
    """Wait until no process carries `token` (the test's own scan); the
    holders left when `timeout` passed ([] once all are gone)."""
    deadline = time.monotonic() + timeout
    while (left := holders(token)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def wait_comm(token: str, comm: str, timeout: float = 10.0) -> bool:
    """Wait until a token holder named `comm` exists (that program has been
    exec'd: counting holders is not enough, since contain's init and a
    worker not yet exec'd carry the token too)."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in holders(token):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == comm:
                        return True
            except OSError:
                pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def kill_holders(token: str) -> None:
    """Clean-up: SIGKILL, by pid, only processes carrying our own token."""
    for _ in range(20):
        pids = holders(token)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def end_started(p: subprocess.Popen | None, *tokens: str) -> None:
    """A test's cleanup: the process it started killed and reaped if it still
    runs, then whatever carries each token."""
    if p is not None and p.poll() is None:
        p.kill()
        p.wait(10)
    for t in tokens:
        kill_holders(t)


def contain_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *args]


def run_contain(env: dict[str, str], *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(contain_cmd(*args), env=env, timeout=timeout, capture_output=True, text=True, **kw)


def contain_in(box, *args: str, env: dict[str, str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`contain ARGS` in `box`'s environment, with `env` added to it."""
    e = dict(box.env)
    e.update(env or {})
    return subprocess.run(contain_cmd(*args), env=e, capture_output=True, text=True, timeout=timeout)


def cgroup2_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                return left.split()[4]
    return None


def remove_cgroup_tree(path: str) -> None:
    """Kill and remove a cgroup subtree that the test itself created."""
    if not os.path.isdir(path):
        return
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
    except OSError:
        pass
    deadline = time.monotonic() + 10
    for d, _subs, _files in sorted(os.walk(path, topdown=False), key=lambda t: -len(t[0])):
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


def host_pid(token: str, ns_pid: int, var: str = TOKEN_VAR) -> int | None:
    """The host pid of the token holder that calls itself `ns_pid` in its
    own PID namespace (the last NSpid field of /proc/<pid>/status). A pid a
    worker prints ($$, $!) is a number in the worker's namespace: acting on
    it from the host without this translation would hit another process."""
    for pid in holders(token, var):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        if int(line.split()[-1]) == ns_pid:
                            return pid
                        break
        except OSError:
            continue
    return None


# -- a state directory that holds no tag (ramfs), for tests that need one -------

def _needs_mount():
    import shutil

    import pytest

    return pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                              reason="needs root and unshare(1) to mount a ramfs in a namespace of its own")


needs_mount = _needs_mount()

def ramfs_state_script(mnt) -> str:
    """Shell lines, for `unshare -m --propagation private sh -c`, that mount
    a ramfs at `mnt` (gone with the namespace), make its `state` directory
    and point CONTAIN_STATE_DIR there. Exit 99: no ramfs here; 98: this one
    keeps extended attributes after all (no untagged state directory)."""
    return f"""set -u
mount -t ramfs none {mnt} || exit 99
mkdir -m 700 {mnt}/state || exit 99
python3 -c 'import os; os.setxattr("{mnt}/state", "trusted.x", b"1")' 2>/dev/null && exit 98
export CONTAIN_STATE_DIR={mnt}/state
"""


def run_in_ramfs_namespace(script: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`script` (after ramfs_state_script) in a mount namespace of its own;
    skips the test when no untagged ramfs can be had here."""
    import pytest

    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                       env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode in (99, 98):
        pytest.skip(f"no xattr-less ramfs here (rc {p.returncode}): {p.stderr.strip()[:200]}")
    return p


def contain_killed_at(path, target: str, *, after: bool, when: str = "lambda *a, **k: True") -> str:
    """Write to `path` a wrapper of contain's CLI that SIGKILLs its own
    process at `target` ("module:attr.attr"), before that function runs
    (when `when(*args)` holds) or right after it returns. Returns the path."""
    module, _, attr = target.partition(":")
    with open(path, "w") as f:
        f.write(f"""import importlib, os, signal, sys
sys.path.insert(0, {ROOT!r})
owner = importlib.import_module({module!r})
*where, name = {attr!r}.split(".")
for w in where:
    owner = getattr(owner, w)
orig = getattr(owner, name)
when = {when}
def hooked(*a, **k):
    if not {after!r} and when(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    out = orig(*a, **k)
    if {after!r}:
        os.kill(os.getpid(), signal.SIGKILL)
    return out
setattr(owner, name, hooked)
from launcher._cli import console
sys.argv = ["contain"] + sys.argv[1:]
sys.exit(console())
""")
    return str(path)


def comm_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def waiting_for_claim(pid: int, lock_path: str) -> bool:
    """Whether `pid` waits for the claim lock: blocked in flock (a "->" line
    of /proc/locks), or holding the lock file open while it retries a
    non-blocking flock (the claim waits at most CLAIM_WAIT_S that way)."""
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields and "FLOCK" in fields:
                i = fields.index("FLOCK")
                if len(fields) > i + 3 and fields[i + 3] == str(pid):
                    return True
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == lock_path:
                    return True
            except OSError:
                continue
    except OSError:
        pass
    return False
