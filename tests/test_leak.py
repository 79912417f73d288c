"""Many sequential runs leave the process exactly as they found it: the same
descriptors, no child (zombies included), the same cgroup base listing.

A leak test, not a timed one: the elapsed time is printed for the record
(`-s`). CONTAIN_LEAK_RUNS overrides the count (the issue asks for 10,000).
Marked slow (about 90 s for both tests here) so a quick local loop can
deselect it with `-m "not slow"`; a plain `pytest`, as CI runs it, includes it."""
from __future__ import annotations

import os
import subprocess
import time

import anyio
import pytest

import launcher
from conftest import children_of, fd_count, warm_up

RUNS = int(os.environ.get("CONTAIN_LEAK_RUNS", "10000"))


def _snapshot(base: str) -> tuple[int, list[int], list[str]]:
    return fd_count(), children_of(os.getpid()), sorted(os.listdir(base))


@pytest.mark.slow      # about 75 s here (7 ms a run, mostly fsync); it runs in CI all the same
@pytest.mark.timeout(600)   # the suite's 120 s is too tight for 10,000 runs on a loaded host
def test_sequential_runs_leave_nothing(contained: dict) -> None:
    env = contained["env"]
    warm_up(env)
    before = _snapshot(contained["cgroup_base"])
    assert before[1] == []
    t0 = time.monotonic()
    for i in range(RUNS):
        rec = launcher.run(["/bin/true"], env=env)
        if rec.state != "REAPED" or rec.exit_code != 0:
            pytest.fail(f"run {i}: {rec.to_dict()}")
    took = time.monotonic() - t0
    print(f"\n{RUNS} runs of /bin/true through launcher.run: {took:.1f} s, {took / RUNS * 1e3:.2f} ms a run")
    assert _snapshot(contained["cgroup_base"]) == before


@pytest.mark.slow
def test_workers_with_pipes_and_async_runs_leave_nothing(contained: dict) -> None:
    """The other paths, fewer times each: spawn with pipes and cancels, and
    open_worker on both event loops."""
    env = contained["env"]
    n = max(1, RUNS // 20)
    warm_up(env)
    before = _snapshot(contained["cgroup_base"])
    for i in range(n):
        with launcher.spawn(["/bin/true"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL) as w:
            if i % 3 == 0:
                w.cancel(grace=0)
            w.communicate(timeout=30)

    async def many() -> None:
        for i in range(n):
            async with launcher.open_worker(["/bin/true"], env=env, stdout=subprocess.PIPE) as w:
                if i % 3 == 0:
                    await w.cancel(grace=0)
                await w.wait()

    for backend in ("asyncio", "trio"):
        anyio.run(many, backend=backend)
    assert _snapshot(contained["cgroup_base"]) == before
