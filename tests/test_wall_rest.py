"""The wall's init, quiet and resting (Init.quiet, Init.rest: Linux 6.15+,
one descriptor per live run): the worker's exit must still be noticed when
its init reaps it late.

The worker's pidfd polls readable at its exit, before its init reaps it;
the kernel keeps PIDFD_INFO_EXIT only at the reaping. An init that does not
reap within _REAP_WAIT_S (5 ms: a loaded host, a stopped or frozen init)
leaves the worker's pidfd unwatched, and the owner then waits on the init's
pidfd alone: but the init does not end while another member lives."""
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
    import os, signal, sys, time, launcher
    from launcher._platform.posixwait import kernel_keeps_exit_status
    if not kernel_keeps_exit_status():
        print("SKIP no PIDFD_INFO_EXIT", flush=True)
        sys.exit(0)
    sup = launcher.Supervisor(grace=0.5)
    w = sup.spawn(["sh", "-c", "sleep 1000 & sleep 1; exit 3"])
    init = None
    for line in open(f"/proc/{w.pid}/status"):
        if line.startswith("PPid:"):
            init = int(line.split()[1])
    if sys.argv[1] == "stop":
        os.kill(init, signal.SIGSTOP)      # the init cannot reap the worker for a while
        time.sleep(2.0)
        os.kill(init, signal.SIGCONT)
    t = time.monotonic()
    try:
        r = w.wait(timeout=float(sys.argv[2]))
    except Exception as e:
        print("NOT NOTICED", type(e).__name__, round(time.monotonic() - t, 2), flush=True)
        w.stop()
        sys.exit(0)
    print("NOTICED", round(time.monotonic() - t, 2), w.returncode, flush=True)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("init", ["run", "stop"])
def test_a_worker_reaped_late_by_its_init_is_noticed(state_dir, cgroup_base, env, token, init) -> None:
    """The worker exits while its init is stopped (as a frozen cgroup or a
    busy host would leave it), with a member left behind (so the init does
    not end). Once the init runs again and reaps it, the owner must see the
    worker's exit (status 3) within seconds, not at a guard minutes later."""
    out = subprocess.run([PY, "-c", _OWNER, init, "15"], env={**env, "PYTHONPATH": ROOT}, capture_output=True,
                         text=True, timeout=90)
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert out.stdout.startswith("NOTICED"), (out.stdout, out.stderr[-2000:])
    assert out.stdout.split()[2] == "3", out.stdout
    assert wait_gone(token, 20) == []
