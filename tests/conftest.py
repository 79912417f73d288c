from __future__ import annotations

import json
import os
import secrets

import pytest

from _proc import ROOT, TOKEN_VAR, cgroup2_mount, kill_holders, new_token, remove_cgroup_tree


def _cgroup_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CI runs as root) to create cgroups under the cgroup2 mount"
    mnt = cgroup2_mount()
    if mnt is None:
        return "no cgroup v2 hierarchy mounted"
    if not os.access(mnt, os.W_OK):
        return f"{mnt} is not writable"
    return None


CGROUP_SKIP = _cgroup_reason()
needs_cgroup = pytest.mark.skipif(CGROUP_SKIP is not None, reason=CGROUP_SKIP or "")


class Box:
    """One test's world: its own state dir, its own cgroup base (created and
    removed by the test), and a token in every workload's environment."""

    def __init__(self, tmp_path) -> None:
        self.token = new_token()
        self.state_dir = str(tmp_path / "state")
        mnt = cgroup2_mount()
        self.base = os.path.join(mnt, f"contain-test-{secrets.token_hex(4)}") if mnt else None
        self.env = dict(os.environ)
        self.env.update({
            "CONTAIN_STATE_DIR": self.state_dir,
            TOKEN_VAR: self.token,
            "PYTHONPATH": ROOT + os.pathsep + self.env.get("PYTHONPATH", ""),
        })
        if self.base:
            self.env["CONTAIN_CGROUP_BASE"] = self.base
        self.env.pop("CONTAIN_BACKEND", None)
        self.env.pop("CONTAIN_RUN_CGROUP", None)

    def record(self, run_id: str) -> dict:
        with open(os.path.join(self.state_dir, "runs", run_id, "record.json")) as f:
            return json.load(f)

    def ack(self, run_id: str, op: str) -> dict:
        with open(os.path.join(self.state_dir, "runs", run_id, "cancellations", f"{op}.json")) as f:
            return json.load(f)

    def leaves(self) -> list[str]:
        if not self.base or not os.path.isdir(self.base):
            return []
        return sorted(d for d in os.listdir(self.base) if os.path.isdir(os.path.join(self.base, d)))


@pytest.fixture
def box(tmp_path, monkeypatch):
    b = Box(tmp_path)
    # The library under test reads these from the environment too.
    monkeypatch.setenv("CONTAIN_STATE_DIR", b.state_dir)
    monkeypatch.setenv(TOKEN_VAR, b.token)
    if b.base:
        monkeypatch.setenv("CONTAIN_CGROUP_BASE", b.base)
    monkeypatch.delenv("CONTAIN_BACKEND", raising=False)
    monkeypatch.delenv("CONTAIN_RUN_CGROUP", raising=False)
    try:
        yield b
    finally:
        kill_holders(b.token)
        if b.base:
            remove_cgroup_tree(b.base)
