"""`contain run` and a caller's low descriptor limit: the supervisor raises
its own soft RLIMIT_NOFILE to the hard one (as systemd does for itself),
and the worker still starts with the caller's limits.

Before: at a soft limit of 16, `contain run -- true` failed with "clone
failed: Too many open files"; at 12 with a bare `[Errno 24] ...
_accounting.py`."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from conftest import ROOT


def _contain_run(soft: int, state_dir: str, env: dict[str, str], *cmd: str) -> subprocess.CompletedProcess[str]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    rec = os.path.join(os.path.dirname(state_dir), f"rec-{soft}.json")
    p = subprocess.run([sys.executable, "-m", "launcher", "run", "-q", "--record", rec, "--", *cmd],
                       env=dict(env, PYTHONPATH=ROOT), preexec_fn=low, capture_output=True, text=True,
                       timeout=120)
    p.record = json.load(open(rec)) if os.path.exists(rec) else None  # type: ignore[attr-defined]
    return p


@pytest.mark.timeout(240)
@pytest.mark.parametrize("soft", [12, 16, 24])
def test_contain_run_at_a_low_soft_descriptor_limit_runs_and_the_worker_keeps_the_callers_limits(
        cgroup_base, state_dir, env, soft) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard <= soft:
        pytest.skip(f"the hard RLIMIT_NOFILE ({hard}) leaves no room to raise")
    p = _contain_run(soft, state_dir, env, "sh", "-c", "ulimit -Sn; ulimit -Hn")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "Too many open files" not in p.stderr, p.stderr
    assert p.stdout.split() == [str(soft), str(hard)], p.stdout
    assert p.record is not None and p.record["state"] == "REAPED", p.record
