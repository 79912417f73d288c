"""Review 18: the acceptance checker's view, driving `contain` only through
its outside contract (CONTRACT.md) with adversarial inputs.

Real kernel throughout: every workload carries the box's token and is
killed by it at the end; survival is decided by the test's own /proc scan;
every wait is bounded.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _proc import holders
from conftest import TOKEN_VAR, needs_cgroup

PY = sys.executable


def _contain(box, *args: str, env: dict[str, str] | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    e = dict(box.env)
    e.update(env or {})
    return subprocess.run([PY, "-m", "launcher", *args], env=e, capture_output=True, timeout=timeout)


def _survivors(box) -> list[int]:
    return sorted(holders(box.token, TOKEN_VAR))


@needs_cgroup
def test_a_limit_that_could_not_be_applied_is_still_in_the_records_asked_limits(box):
    """A scheduler reads `limits.asked` to see what a failed run wanted: a
    run refused because its --pids-max could not be applied (no cgroup of
    any kind: degraded mode with cgroup v1 turned off) must say the limit
    was asked and that none was applied, not `asked: {}` as if the caller
    had asked for nothing."""
    p = _contain(box, "run", "--backend", "none", "--pids-max", "10", "--record", "-", "--", "true",
                 env={"CONTAIN_CGROUP_V1": "off"})
    assert p.returncode == 125, p.stderr
    assert b"Traceback" not in p.stderr
    rec = json.loads(p.stdout)
    assert rec["outcome"] == "spawn_failed"
    assert rec["limits"]["asked"] == {"pids_max": 10}, rec["limits"]
    assert rec["limits"]["applied"] == {}, rec["limits"]
    assert any("--pids-max" in n for n in rec["limits"].get("notes", [])), rec["limits"]
    assert _survivors(box) == []
