"""A test's own cgroups, v2 and v1, and children placed in them the way the
spawn will place the worker (issue 14): each child writes "0" to the
`cgroup.procs` fds of its run's cgroups before it execs, so the whole tree is
inside from its first instruction. Only children this test starts are
placed, only in cgroups this test creates, and everything is removed at the
end, whatever happened.

Until the driver is wired (the join fds land in the C spawn), the children
are started with `subprocess.Popen(preexec_fn=...)`: the preexec writes are
exactly what the C child will do.
"""
from __future__ import annotations

import errno
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from typing import Any

from conftest import TOKEN_VAR, remove_cgroup_tree

from launcher import _controllers as C
from launcher import _runcgroups as R
from launcher import _limits as L
from launcher import _procfs as P
from launcher._platform import linux


class World:
    def __init__(self, token: str) -> None:
        hs = linux.hierarchies()
        if not hs:
            raise RuntimeError("no cgroup v2 hierarchy")
        tag = secrets.token_hex(4)
        self.token = token
        self.v2_base = os.path.join(hs[0].mount, f"contain-acct-test-{tag}")
        self.v1_base = f"/contain-acct-test-{tag}"
        os.mkdir(self.v2_base)
        self.env = dict(os.environ)
        self.env.update({TOKEN_VAR: token, "CONTAIN_CGROUP_BASE": self.v2_base,
                         "CONTAIN_CGROUP_V1_BASE": self.v1_base})
        self.env.pop("CONTAIN_CGROUP_V1", None)
        self.containers: list[Any] = []
        self.runs: list[R.RunCgroups] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    # -- making runs -----------------------------------------------------------

    def run(self, limits: L.Limits | None = None, run_id: str = "t", **kw: Any) -> tuple[Any, R.RunCgroups]:
        c = linux.Container.create(run_id, self.env)
        self.containers.append(c)
        rc = R.RunCgroups.create(os.path.basename(c.dir), limits, v2_dir=c.dir, env=self.env, **kw)
        self.runs.append(rc)
        return c, rc

    def spawn(self, c: Any, rc: R.RunCgroups | None, argv: list[str], **popen_kw: Any) -> subprocess.Popen[bytes]:
        """Start argv with the v2 leaf and every join fd written "0" by the
        child before exec (the join-fd protocol)."""
        fds = rc.join_fds() if rc is not None else []
        leaf = os.open(os.path.join(c.leaf, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)

        def join() -> None:
            os.write(leaf, b"0")
            for fd in fds:
                os.write(fd, b"0")

        popen_kw.setdefault("env", self.env)
        try:
            p = subprocess.Popen(argv, preexec_fn=join, **popen_kw)
        finally:
            os.close(leaf)
            if rc is not None:
                rc.close_join_fds()
        self.procs.append(p)
        return p

    def python(self, c: Any, rc: R.RunCgroups | None, code: str, **kw: Any) -> subprocess.Popen[bytes]:
        return self.spawn(c, rc, [sys.executable, "-c", code], **kw)

    # -- stopping ----------------------------------------------------------------

    @staticmethod
    def wait_empty(c: Any, timeout: float = 20.0) -> float:
        """Wait for `populated 0` (POLLPRI); returns the monotonic time it was seen."""
        deadline = time.monotonic() + timeout
        while c.populated():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{c.dir} still populated after {timeout} s")
            c.wait_change(min(left, 0.5))
        return time.monotonic()

    def stop(self, c: Any, timeout: float = 20.0) -> float:
        """cgroup.kill the run (a cgroup this test created) and wait for empty."""
        if c.populated():
            c.kill()
        return self.wait_empty(c, timeout)

    # -- cleaning up -------------------------------------------------------------

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.kill()
                except OSError:
                    pass
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for c in self.containers:
            try:
                if os.path.isdir(c.dir) and c.populated():
                    self.stop(c, 10)
            except (OSError, TimeoutError):
                pass
        remove_cgroup_tree(self.v2_base)
        for rc in self.runs:
            rc.remove()
        remove_v1_base(self.v1_base)


def _kill_members(h: C.V1Hierarchy, d: str) -> None:
    """SIGKILL the processes left in a v1 cgroup this test created, each
    pinned by pidfd and re-checked to be in it."""
    try:
        with open(os.path.join(d, "cgroup.procs")) as f:
            pids = [int(x) for x in f.read().split()]
    except OSError:
        return
    for pid in pids:
        try:
            pfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if P.cgroups_of(pid).get(h.name) == h.cg_path(d):
                signal.pidfd_send_signal(pfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pfd)


def remove_v1_base(cg_base: str) -> None:
    """Remove the test's v1 base in every hierarchy, bottom-up, killing any
    member left in it first (only possible for a process that left the v2
    container; all of them are this test's children)."""
    for h in C.v1_hierarchies():
        try:
            top = h.fs_path(cg_base)
        except ValueError:
            continue
        if not os.path.isdir(top):
            continue
        for d, _s, _f in sorted(os.walk(top, topdown=False), key=lambda t: -len(t[0])):
            for attempt in range(200):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        break
                    if attempt % 20 == 0:
                        _kill_members(h, d)
                    time.sleep(0.01)


def wait_line(p: subprocess.Popen[bytes], timeout: float = 20.0) -> bytes:
    """One line from a child's stdout, with a deadline."""
    assert p.stdout is not None
    fd = p.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no line from pid {p.pid} in {timeout} s (got {buf!r})")
        r, _, _ = select.select([fd], [], [], left)
        if r:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError(f"pid {p.pid} closed stdout (got {buf!r})")
            buf += chunk
    return buf.split(b"\n", 1)[0]
