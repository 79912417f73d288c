"""A SIGINT stop of a tree with more deaf members (a shell's `&` jobs,
SIGINT ignored) than the owner has descriptors to spare (_deaf.py pins every
one of them by pidfd at once before signalling any): those it could not pin
are neither told with SIGTERM nor named, and the stop waits out the grace."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time

import pytest

from _proc import contain_cmd, wait_gone, wait_holders
from conftest import needs_cgroup

pytestmark = needs_cgroup
N = 300


@pytest.mark.timeout(180)
def test_a_sigint_stop_tells_every_deaf_member_under_a_low_descriptor_limit(state_dir, cgroup_base, env,
                                                                            token) -> None:
    script = f"i=0; while [ $i -lt {N} ]; do sleep 1000 & i=$((i+1)); done; wait"

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    p = subprocess.Popen(contain_cmd("run", "--grace", "30", "--", "sh", "-c", script), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=low_limit)
    try:
        got = len(wait_holders(token, N + 1, 20))
        if got < N + 1:
            p.kill()
            o, e = p.communicate(timeout=30)
            pytest.skip(f"could not start the deaf members ({got}): {e.decode()[-800:]} {o.decode()[-300:]}")
        time.sleep(0.5)
        t = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=90)
        took = time.monotonic() - t
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert took < 15, (f"the SIGINT stop waited {took:.1f} s (the grace is 30 s): deaf members not told",
                       err.decode()[-1500:])
    assert wait_gone(token, 30) == []
