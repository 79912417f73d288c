"""A run directory renamed under its live owner (by anything of the
owner's uid that can write the state directory: a worker without the wall,
another program of the user's).

The owner no longer holds its run directory's descriptor: it keeps (dev,
ino) and reopens by name (_rundir._reopen), refusing a directory that is not
its own. Once the name is gone, every reopen fails (ESTALE), and here a stop
asked in-process never returns: no final record, and the caller blocks."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from _proc import ROOT, wait_gone
from conftest import needs_cgroup

pytestmark = needs_cgroup
PY = sys.executable

_OWNER = textwrap.dedent("""
    import os, sys, time, launcher
    sup = launcher.Supervisor(grace=0.5)
    w = sup.spawn(["sleep", "300"])
    time.sleep(0.3)
    os.rename(w.run_dir, w.run_dir + "-moved")
    r = w.stop(grace=0.5)
    print("STOPPED", r.to_dict().get("state"), flush=True)
""")


@pytest.mark.timeout(120)
def test_a_stop_returns_after_the_run_directory_was_renamed(state_dir, cgroup_base, env, token) -> None:
    try:
        out = subprocess.run([PY, "-c", _OWNER], env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                             timeout=30)
        said = out.stdout + out.stderr[-1500:]
    except subprocess.TimeoutExpired:
        said = "the owner's stop did not return in 30 s"
    assert said.startswith("STOPPED"), said
    assert wait_gone(token, 20) == []
