"""A run directory renamed under its live owner (by anything of the
owner's uid that can write the state directory: a worker without the wall,
another program of the user's).

The owner no longer holds its run directory's descriptor: it keeps (dev,
ino) and reopens by name (_rundir._reopen), refusing a directory that is not
its own. Before it also looked for it elsewhere, once the name was gone
every reopen failed (ESTALE): a stop asked in-process raised, and the run
went on, its slot held, with no final record while its owner lived. Now
one renamed within runs/ is found again by its identity (a scan of runs/),
as the held descriptor of before followed it, and the stop reaches REAPED."""
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
    try:
        r = w.stop(grace=0.5)
        print("STOPPED", r.to_dict().get("state"), flush=True)
    except Exception as e:
        print("RAISED", repr(e)[:400], flush=True)
        w.kill()                   # the worker by its pidfd, so that the test leaves nothing
""")


@pytest.mark.timeout(120)
def test_a_stop_reaches_reaped_after_the_run_directory_was_renamed(state_dir, cgroup_base, env, token,
                                                                   tmp_path) -> None:
    log = tmp_path / "owner.out"
    with open(log, "w") as f:      # a file, not a pipe: the worker inherits the owner's stdio
        try:
            subprocess.run([PY, "-c", _OWNER], env={**env, "PYTHONPATH": ROOT}, stdout=f, stderr=subprocess.STDOUT,
                           timeout=60)
        except subprocess.TimeoutExpired:
            pass
    said = log.read_text()
    assert said.startswith("STOPPED REAPED"), said[-2000:]
    assert wait_gone(token, 20) == []
