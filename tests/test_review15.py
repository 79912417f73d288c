"""Review 15: another local user, and the worker, against `contain`'s own
walks and reads; the library under stress.

Real kernel throughout: runs under the fixtures' private state directory and
cgroup base, survival by the test's own /proc scan (the token in the
workload's environment), every wait bounded, everything made removed.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from _proc import holders, kill_holders, run_contain

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a cgroup base of the test's own)")


def _rm_deep(path: str) -> None:
    # rm(1), not shutil.rmtree: 3.11's rmtree recurses too.
    subprocess.run(["rm", "-rf", "--one-file-system", path], timeout=60, check=False)


@needs_root
def test_worker_nesting_directories_past_the_recursion_limit_in_its_workspace_cannot_crash_contain(
        contained, tmp_path):
    """Python 3.11's os.walk recurses: a workspace 1,500 directories deep
    raised RecursionError out of the stop, so `contain run` printed a
    traceback, wrote no record and exited 1, as if the worker had."""
    ws = tmp_path / "ws"
    ws.mkdir()
    rec = tmp_path / "rec.json"
    deep = ("import os\nos.chdir(%r)\nfor _ in range(1500):\n    os.mkdir('a'); os.chdir('a')\n" % str(ws))
    try:
        p = run_contain(contained["env"], "run", "--workspace", str(ws), "--record", str(rec), "--",
                        "python3", "-c", deep, timeout=120)
        assert "Traceback" not in p.stderr, p.stderr[-2000:]
        assert p.returncode == 0, p.stderr[-2000:]
        r = json.loads(rec.read_text())
        assert r["state"] == "REAPED" and r["outcome"] == "exited", r
        layer = r["evidence"]["workspace_quiescent"]
        assert layer["observed"] is True, layer
        assert holders(contained["token"]) == []
    finally:
        kill_holders(contained["token"])
        _rm_deep(str(ws))
