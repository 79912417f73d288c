"""What every benchmark shares: the checkout under test, timing, the machine,
scratch cgroups, and an independent /proc scan for survivors.

Nothing here uses the code under test to decide what is alive: survivors are
found by a token in the environment of every process a benchmark starts
(/proc/<pid>/environ), and are killed by pid only after their identity (pid +
start time + token) is re-checked through a pidfd.
"""
from __future__ import annotations

import errno
import glob
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TOKEN_VAR = "CONTAIN_BENCH_TOKEN"


# -- the checkout under test ------------------------------------------------

def child_env(**extra: str) -> dict[str, str]:
    """Environment for every process a benchmark starts: this checkout first
    on sys.path, so `launcher` is the code under test, not an installed copy."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def ensure_ready() -> list[str]:
    """Make the checkout runnable as an installed package would be: the cffi
    extension built in place and bytecode compiled. Returns what was done.

    The extension is built out of tree with cffi (the same build.py that
    setup.py names), because `setup.py build_ext --inplace` needs
    setuptools >= 77 for pyproject's SPDX `license`. Bytecode is compiled
    because pip does so at install time; without it, a host that sets
    PYTHONDONTWRITEBYTECODE would recompile launcher/*.py in every `contain`
    process while the standard library's .pyc files are used: that would
    measure the compiler, not the launcher."""
    done = []
    native = os.path.join(ROOT, "launcher", "_native")
    if not glob.glob(os.path.join(native, "_ct*.so")):
        tmp = tempfile.mkdtemp(prefix="contain-build-")
        try:
            code = ("import sys; sys.path.insert(0, %r)\n"
                    "from build import ffibuilder\n"
                    "ffibuilder.compile(tmpdir='.', verbose=False)\n" % native)
            subprocess.run([sys.executable, "-c", code], cwd=tmp, check=True,
                           stdout=subprocess.DEVNULL)
            built = glob.glob(os.path.join(tmp, "launcher", "_native", "_ct*.so"))
            if not built:
                raise RuntimeError("cffi build produced no extension")
            shutil.copy2(built[0], native)
            done.append(f"built {os.path.basename(built[0])} in place")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    import compileall

    compileall.compile_dir(os.path.join(ROOT, "launcher"), quiet=1)
    done.append("compiled launcher/ bytecode")
    out = subprocess.run([sys.executable, "-c", "import launcher._native, launcher; print(launcher.__file__)"],
                         env=child_env(), capture_output=True, text=True, check=True).stdout.strip()
    if not out.startswith(ROOT + os.sep):
        raise RuntimeError(f"`launcher` resolves to {out}, not to this checkout {ROOT}")
    done.append(f"launcher imported from {os.path.dirname(out)}")
    return done


# -- numbers ------------------------------------------------------------------

def summary(xs: list[float]) -> dict[str, Any]:
    """Seconds in, milliseconds out."""
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "median_ms": round(statistics.median(xs) * 1e3, 3),
            "min_ms": round(min(xs) * 1e3, 3), "max_ms": round(max(xs) * 1e3, 3)}


def ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    if not a.get("n") or not b.get("n") or not b["median_ms"]:
        return None
    return round(a["median_ms"] / b["median_ms"], 3)


def loadavg() -> float:
    """The 1-minute load average: this is a shared host, and a busy one
    slows every contender (ratios hold up better than absolute times)."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def fs_type(path: str) -> str:
    """The filesystem `path` is on, from /proc/self/mountinfo (longest mount)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            mnt = left.split()[4]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, right.split()[0]
    return kind


def machine() -> dict[str, Any]:
    mem_kb = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    import resource

    return {
        "nproc": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem_kb / 2**20, 1),
        "kernel": platform.release(), "python": platform.python_version(),
        "pid_max": pid_max, "ulimit_u": resource.getrlimit(resource.RLIMIT_NPROC)[0],
        "state_dir_fs": fs_type(tempfile.gettempdir()),
        "processes_on_host": sum(1 for p in os.listdir("/proc") if p.isdigit()),
        "loadavg_1min": loadavg(),
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
    }


# -- an independent scan ------------------------------------------------------

class Seen:
    __slots__ = ("pid", "ppid", "state", "start")

    def __init__(self, pid: int, ppid: int, state: str, start: int) -> None:
        self.pid, self.ppid, self.state, self.start = pid, ppid, state, start


def _stat(pid: int | str) -> tuple[str, int, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rindex(b")") + 2:].split()
    return rest[0].decode(), int(rest[1]), int(rest[19])


def _has_token(pid: int | str, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


def scan(token: str) -> list[Seen]:
    """Every live (non-zombie) process whose environment holds the token."""
    needle = f"{TOKEN_VAR}={token}".encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or not _has_token(name, needle):
            continue
        st = _stat(name)
        if st is not None and st[0] not in ("Z", "X"):
            out.append(Seen(int(name), st[1], st[0], st[2]))
    return out


def settle_survivors(token: str, timeout: float = 5.0) -> list[Seen]:
    """Survivors once the dying are dead: scan until two scans 0.1 s apart
    agree (a SIGKILLed process is visible until its exit finishes)."""
    prev = scan(token)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        cur = scan(token)
        if {s.pid for s in cur} == {s.pid for s in prev}:
            return cur
        prev = cur
    return prev


def kill_survivors(token: str, seen: Iterable[Seen]) -> int:
    """SIGKILL exactly these processes: each pinned by pidfd, then its start
    time and token re-read, so a reused pid is never signalled."""
    import signal

    needle = f"{TOKEN_VAR}={token}".encode()
    n = 0
    for s in seen:
        try:
            fd = os.pidfd_open(s.pid)
        except OSError:
            continue
        try:
            st = _stat(s.pid)
            if st is not None and st[2] == s.start and _has_token(s.pid, needle):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


def reap_children(timeout: float = 10.0) -> int:
    """Reap every child of this process. Only called between trials, when
    every child is a tree member that was killed (this process is the child
    subreaper of the trees it starts, see set_subreaper)."""
    me = os.getpid()
    n = 0
    deadline = time.monotonic() + timeout
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return n
        if pid:
            n += 1
            continue
        if time.monotonic() > deadline:
            return n
        if not any((_stat(p) or ("", 0, 0))[1] == me for p in os.listdir("/proc") if p.isdigit()):
            return n
        time.sleep(0.005)


def set_subreaper() -> None:
    """Orphans of the trees come to this process, not to PID 1 (which does
    not reap on every host), so every process a benchmark makes is reaped."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:   # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


# -- scratch cgroups ------------------------------------------------------------

def cgroup2_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                return left.split()[4]
    return None


def populated(events_fd: int) -> bool:
    for line in os.pread(events_fd, 4096, 0).split(b"\n"):
        if line.startswith(b"populated "):
            return line[10:].strip() != b"0"
    raise OSError(errno.EIO, "no populated line in cgroup.events")


def wait_empty(events_fd: int, timeout: float) -> bool:
    """POLLPRI on cgroup.events, re-reading after each wake-up (the way the
    kernel's selftest test_kill.c waits)."""
    p = select.poll()
    p.register(events_fd, select.POLLPRI | select.POLLERR)
    deadline = time.monotonic() + timeout
    while populated(events_fd):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        p.poll(int(left * 1000) + 1)
    return True


class Scratch:
    """A cgroup of our own, `<cgroup2 mount>/contain-bench-<hex>`, for the
    bare cgroup.kill baseline, for the contain runs (CONTAIN_CGROUP_BASE) and
    as a safety net around the baseline trees. `close()` kills what is left
    inside it (our cgroup only), waits for it to empty and removes it."""

    def __init__(self) -> None:
        mnt = cgroup2_mount()
        if mnt is None:
            raise RuntimeError("no cgroup2 mount")
        self.path = os.path.join(mnt, f"contain-bench-{os.urandom(4).hex()}")
        os.mkdir(self.path)

    def sub(self, name: str) -> str:
        d = os.path.join(self.path, name)
        os.mkdir(d)
        return d

    def close(self) -> list[str]:
        problems = []
        if not os.path.isdir(self.path):
            return problems
        fd = os.open(os.path.join(self.path, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            if populated(fd):
                problems.append(f"{self.path} still populated at the end: killed by its cgroup.kill")
                with open(os.path.join(self.path, "cgroup.kill"), "w") as f:
                    f.write("1")
                if not wait_empty(fd, 10.0):
                    problems.append(f"{self.path} did not empty within 10 s")
        finally:
            os.close(fd)
        reap_children(2.0)
        for d, _dirs, _files in sorted(os.walk(self.path, topdown=False), key=lambda t: -len(t[0])):
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        problems.append(f"rmdir {d}: {e}")
                        break
                    time.sleep(0.01)
            else:
                problems.append(f"rmdir {d}: still busy")
        return problems


def wait_line(fd: int, timeout: float) -> str:
    """Read one line from a pipe within `timeout` seconds."""
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no line within {timeout} s (got {buf!r})")
        r, _, _ = select.select([fd], [], [], left)
        if r:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError(f"pipe closed (got {buf!r})")
            buf += chunk
    return buf.split(b"\n", 1)[0].decode()
