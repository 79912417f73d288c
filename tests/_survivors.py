"""The tests' own view of what survived, independent of the code under test.

Each workload carries a unique token in its environment; survival is decided
by scanning /proc/*/environ for it. Cleanup kills by pid after re-reading the
token through a pidfd-pinned process, and removes only the run cgroups whose
id the test chose.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from _proc import cgroup2_mount as cgroup2_mount, holders  # noqa: E402

IS_ROOT = os.geteuid() == 0


def new_token() -> str:
    return f"CONTAIN_SEALTEST_{secrets.token_hex(6)}"


def survivors(token: str) -> list[int]:
    """Live (non-zombie) processes whose environment holds `token`."""
    return sorted(holders(token, "SEALTEST_TOKEN"))


def cgroup_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        return None
    return None


def kill_survivors(token: str) -> list[int]:
    """SIGKILL every process holding the token, each pinned by a pidfd and
    re-checked before the signal. Returns the pids signalled."""
    needle = f"SEALTEST_TOKEN={token}".encode()
    killed = []
    for _ in range(20):
        pids = survivors(token)
        if not pids:
            break
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                # Pinned by the pidfd: re-read that it is still ours.
                with open(f"/proc/{pid}/environ", "rb") as f:
                    ours = needle in f.read().split(b"\0")
                if ours:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    killed.append(pid)
            except OSError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.05)
    return killed


def wait_for(pred: Any, timeout: float, step: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(step)


def cgroup2_nsdelegate() -> bool | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            rf = right.split()
            if rf[:1] == ["cgroup2"]:
                return "nsdelegate" in rf[2].split(",")
    return None


def contain_base() -> str | None:
    """Where `contain` puts runs as root (<mount>/contain), and so the parent
    cgroup the escape tests move into."""
    m = cgroup2_mount()
    return os.path.join(m, "contain") if m else None


def remove_run_cgroups(run_id: str) -> None:
    """Stop and remove the cgroups of runs whose id this test chose (and
    so created, through contain): cgroup.kill of our own run directory,
    then rmdir bottom-up."""
    base = contain_base()
    if not base or not os.path.isdir(base):
        return
    for name in os.listdir(base):
        if not name.startswith(f"run-{run_id}-"):
            continue
        d = os.path.join(base, name)
        try:
            with open(os.path.join(d, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass
        for sub, _dirs, _files in sorted(os.walk(d, topdown=False), key=lambda t: -len(t[0])):
            for _ in range(100):
                try:
                    os.rmdir(sub)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


class Contain:
    """One `contain run` as a subprocess, with the test's token and state dir."""

    def __init__(self, tmp: str, token: str, run_id: str | None = None) -> None:
        self.tmp = tmp
        self.token = token
        self.run_id = run_id or f"st{secrets.token_hex(4)}"
        self.record_path = os.path.join(tmp, f"{self.run_id}.record.json")
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"CONTAIN_STATE_DIR": os.path.join(self.tmp, "state"), "PYTHONPATH": ROOT,
                    "SEALTEST_TOKEN": self.token})
        env.pop("CONTAIN_BACKEND", None)
        env.pop("CONTAIN_LEDGER", None)
        env.update(extra or {})
        return env

    def argv(self, opts: list[str], cmd: list[str]) -> list[str]:
        return [sys.executable, "-m", "launcher", "run", "--id", self.run_id, "--record", self.record_path,
                *opts, "--", *cmd]

    def start(self, opts: list[str], cmd: list[str], extra_env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(self.argv(opts, cmd), cwd=ROOT, env=self.env(extra_env),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def wait(self, timeout: float = 60) -> int:
        assert self.proc is not None
        out, err = self.proc.communicate(timeout=timeout)
        self.stdout, self.stderr = out.decode(errors="replace"), err.decode(errors="replace")
        return self.proc.returncode

    def run(self, opts: list[str], cmd: list[str], extra_env: dict[str, str] | None = None,
            timeout: float = 60) -> int:
        self.start(opts, cmd, extra_env)
        return self.wait(timeout)

    def record(self) -> dict[str, Any]:
        with open(self.record_path) as f:
            return json.load(f)

    def cancel(self) -> None:
        """SIGTERM to `contain run` cancels the run (CONTRACT.md)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        kill_survivors(self.token)
        remove_run_cgroups(self.run_id)
