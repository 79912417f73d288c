"""open_worker and AsyncSupervisor on asyncio and on trio (the anyio plugin
runs each test once per backend)."""
from __future__ import annotations

import os
import subprocess
import time

import anyio
import pytest

import launcher
from conftest import assert_graces_overlap, children_of, fd_count, pids_with_token

pytestmark = pytest.mark.anyio


async def test_wait_returns_the_record(contained: dict) -> None:
    async with launcher.open_worker(["sh", "-c", "exit 3"], env=contained["env"]) as w:
        assert w.pid > 0 and w.id
        rec = await w.wait()
    assert (rec.state, rec.outcome, rec.exit_code) == ("REAPED", "exited", 3)
    assert rec.containment.backend == "cgroup2"
    assert w.record() == rec


async def test_wait_ends_with_the_worker_not_before(contained: dict) -> None:
    """wait() returns once the worker has exited and the container is empty
    (a hang guard, not a speed check: benchmarks/bench_api.py measures that)."""
    async with launcher.open_worker(["sleep", "0.3"], env=contained["env"]) as w:
        t0 = time.monotonic()
        rec = await w.wait()
        took = time.monotonic() - t0
    assert rec.state == "REAPED" and rec.evidence.root_exit.observed is True
    assert 0.25 < took < 30, took


async def test_cancel_with_an_operation_id(contained: dict) -> None:
    async with launcher.open_worker(["sleep", "60"], grace=2, env=contained["env"]) as w:
        ack = await w.cancel(op_id="op-stop-1")
        assert ack.effect == "cancel_requested"
        again = await w.cancel(op_id="op-stop-1")     # the same operation, never applied twice
        assert (again.op_id, again.requested_at, again.acknowledged_at) == \
            (ack.op_id, ack.requested_at, ack.acknowledged_at)
        rec = await w.wait()
    assert (rec.state, rec.outcome, rec.signal) == ("REAPED", "cancelled", 15)
    settled = w.cancel_record("op-stop-1")
    assert settled is not None and settled.effect == "cancelled"
    assert pids_with_token(contained["token"]) == []


async def test_cancel_after_the_end_is_not_live(contained: dict) -> None:
    async with launcher.open_worker(["true"], env=contained["env"]) as w:
        await w.wait()
        ack = await w.cancel(op_id="late")
    assert ack.effect == "not_live"


async def test_leaving_the_block_cancels_and_reaps(contained: dict) -> None:
    async with launcher.open_worker(["sh", "-c", "sleep 60 & sleep 60"], env=contained["env"]) as w:
        await anyio.sleep(0.05)
    assert w.done()
    rec = w.record()
    assert (rec.state, rec.outcome) == ("REAPED", "cancelled")
    assert pids_with_token(contained["token"]) == []


async def test_an_exception_in_the_block_cancels_and_comes_out_unwrapped(contained: dict) -> None:
    with pytest.raises(ZeroDivisionError):
        async with launcher.open_worker(["sleep", "60"], env=contained["env"]) as w:
            1 / 0
    assert w.record().state == "REAPED"
    assert pids_with_token(contained["token"]) == []


async def test_cancelling_the_enclosing_scope_reaps_shielded(contained: dict) -> None:
    """A TERM-ignoring worker needs the full grace then cgroup.kill: the
    cleanup runs to the end although its scope is cancelled."""
    with anyio.move_on_after(0.2) as scope:
        async with launcher.open_worker(["sh", "-c", "trap '' TERM; sleep 60"], grace=0.3,
                                        env=contained["env"]) as w:
            await anyio.sleep(60)
    assert scope.cancelled_caught
    rec = w.record()
    assert (rec.state, rec.outcome) == ("REAPED", "cancelled")
    kinds = [s["kind"] for s in rec.evidence.signal_sent.detail["steps"]]
    assert kinds == ["term", "kill"]
    assert pids_with_token(contained["token"]) == []


async def test_timeout_is_enforced_while_the_caller_is_busy(contained: dict) -> None:
    async with launcher.open_worker(["sleep", "60"], timeout=0.2, grace=0, env=contained["env"]) as w:
        t0 = time.monotonic()
        rec = await w.wait()
    assert (rec.state, rec.outcome) == ("REAPED", "timed_out")
    assert time.monotonic() - t0 < 30   # hang guard: the 60 s sleep did not run out


async def test_pipes_are_anyio_byte_streams(contained: dict) -> None:
    async with launcher.open_worker(["sh", "-c", "cat; echo done >&2"], env=contained["env"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE) as w:
        assert w.stdin is not None and w.stdout is not None and w.stderr is not None
        got = bytearray()

        async def read_all() -> None:
            assert w.stdout is not None
            async for chunk in w.stdout:
                got.extend(chunk)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read_all)
            await w.stdin.send(b"x" * 200_000)  # more than a pipe holds: both ends must be live
            await w.stdin.aclose()
        err = b"".join([c async for c in w.stderr])
        rec = await w.wait()
    assert bytes(got) == b"x" * 200_000
    assert err == b"done\n"
    assert rec.exit_code == 0


async def test_supervisor_stops_everything_on_exit(contained: dict) -> None:
    async with launcher.AsyncSupervisor(grace=0.2, env=contained["env"]) as sup:
        quick = await sup.spawn(["true"])
        slow = [await sup.spawn(["sh", "-c", "trap '' TERM; sleep 60"]) for _ in range(3)]
        assert (await quick.wait()).outcome == "exited"
    assert [w.record().outcome for w in slow] == ["cancelled"] * 3
    assert all(w.record().state == "REAPED" for w in slow)
    assert_graces_overlap([w.record() for w in slow])
    assert pids_with_token(contained["token"]) == []


async def test_no_fd_child_or_cgroup_is_left(contained: dict) -> None:
    async with launcher.open_worker(["true"], env=contained["env"]) as w:   # warm-up (inotify pool)
        await w.wait()
    fds, base = fd_count(), sorted(os.listdir(contained["cgroup_base"]))
    for i in range(50):
        async with launcher.open_worker(["true"], env=contained["env"], stdout=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL) as w:
            if i % 2:
                await w.cancel()
            await w.wait()
    assert fd_count() == fds
    assert children_of(os.getpid()) == []
    assert sorted(os.listdir(contained["cgroup_base"])) == base
