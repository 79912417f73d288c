"""An unprivileged user as the victim: a runtime directory of its own, a
token in its workloads' environment, and `contain` run as that user."""
from __future__ import annotations

import os
import subprocess

from _proc import TOKEN_VAR, new_token
from _users import Shared, python, user_env


def setpriv(uid: int, *argv: str) -> list[str]:
    """`argv` as `uid` (its own group, no supplementary groups)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]


class Victim:
    """An unprivileged user with a runtime directory of its own (made by
    the test) and a token in its workloads' environment."""

    def __init__(self, sh: Shared, uid: int) -> None:
        self.uid = uid
        self.token = new_token()
        self.env = user_env(XDG_RUNTIME_DIR=sh.sub(f"xdg-{uid}", uid=uid, mode=0o700),
                            **{TOKEN_VAR: self.token})

    def contain(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(setpriv(self.uid, python(), "-m", "launcher", *args), env=self.env, capture_output=True,
                              text=True, timeout=timeout, cwd="/")

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(setpriv(self.uid, python(), "-m", "launcher", *args), env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")

    def run_dir(self, run_id: str) -> str:
        return os.path.join(self.env["XDG_RUNTIME_DIR"], "contain", "runs", run_id)

    def forge(self, run_id: str, script: str, *args: str) -> str:
        """Run `script` as this user, outside the run (the run's own worker
        cannot reach its run directory: the init hides the state directory
        from it), with CONTAIN_RUN_DIR naming the run's directory."""
        p = subprocess.run(setpriv(self.uid, python(), "-c", script, *args), capture_output=True, text=True,
                           env=dict(self.env, CONTAIN_RUN_DIR=self.run_dir(run_id)), cwd="/", timeout=30)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()
