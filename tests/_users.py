"""Playing another local user: a spare uid nobody uses, commands run as it
with `setpriv`, and directories both users can reach.

Test-side only; nothing here uses the code under test. The interpreter of
the test venv lives under /root (0700), so commands of another uid use the
system python with this checkout on PYTHONPATH.
"""
from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYS_PY = "/usr/bin/python3"


def _uids_in_use() -> set[int]:
    used = {p.pw_uid for p in pwd.getpwall()}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        used.update(int(x) for x in line.split()[1:])
                        break
        except OSError:
            continue
    return used


def spare_uids(n: int) -> list[int]:
    """`n` distinct uids with no passwd entry and no process."""
    used = _uids_in_use()
    out: list[int] = []
    while len(out) < n:
        u = 47000 + secrets.randbelow(3000)
        if u not in used and u not in out:
            out.append(u)
    return out


def why_not() -> str | None:
    """Why commands cannot be run as another uid here, or None."""
    if os.geteuid() != 0:
        return "needs root to switch to a spare uid"
    if shutil.which("setpriv") is None:
        return "setpriv not installed"
    if not os.path.exists(SYS_PY):
        return f"no {SYS_PY} for the spare uid"
    uid = spare_uids(1)[0]
    p = as_uid(uid, [SYS_PY, "-c", "import launcher._native, launcher._layout"])
    if p.returncode != 0:
        return f"a spare uid cannot import launcher with {SYS_PY}: {p.stderr.strip()[-200:]}"
    return None


def user_env(**extra: str) -> dict[str, str]:
    """A clean environment for another user's commands."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "PYTHONPATH": ROOT, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.update(extra)
    return env


def as_uid(uid: int, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 60,
           cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `argv` as `uid` (and gid `uid`, no supplementary groups)."""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv],
                          env=env if env is not None else user_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or "/")


def contain_as(uid: int, *args: str, env: dict[str, str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return as_uid(uid, [SYS_PY, "-m", "launcher", *args], env=env, timeout=timeout)


class Shared:
    """A directory under /tmp that every user can reach (0755, root's),
    removed with everything in it at the end."""

    def __init__(self, mode: int = 0o755) -> None:
        self.path = tempfile.mkdtemp(prefix="contain-shared-", dir="/tmp")
        os.chmod(self.path, mode)

    def sub(self, name: str, *, uid: int = 0, mode: int = 0o755) -> str:
        d = os.path.join(self.path, name)
        os.mkdir(d)
        os.chown(d, uid, uid)
        os.chmod(d, mode)
        return d

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "Shared":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
