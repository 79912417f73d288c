"""Supervisor: many workers, and nothing left behind however the scope ends."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

import launcher
from conftest import assert_graces_overlap, children_of, fd_count, pids_with_token, warm_up

# Escapes from the worker's process group and session, and a TERM-ignorer:
# only the container (cgroup.kill) catches all of them. At least 7 processes
# (dash execs the last command of `sh -c`).
STUBBORN = [
    ["sh", "-c", "trap '' TERM; sleep 60"],
    ["sh", "-c", "setsid sh -c 'sleep 60 & sleep 60' & sleep 60"],
    ["sh", "-c", "(sleep 60 &) ; sleep 60"],
]


def _start(sup: launcher.Supervisor) -> list[launcher.Worker]:
    ws = [sup.spawn(argv) for argv in STUBBORN]
    ws.append(sup.spawn(["sh", "-c", "cat >/dev/null"], stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    return ws


def _wait_for_tree(token: str, n: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while len(pids_with_token(token)) < n:
        assert time.monotonic() < deadline, "workloads did not start"
        time.sleep(0.01)


def _nothing_left(c: dict, workers: list[launcher.Worker]) -> None:
    assert pids_with_token(c["token"]) == []
    assert children_of(os.getpid()) == []
    assert [d for d in os.listdir(c["cgroup_base"]) if d.startswith("run-")] == []
    for w in workers:
        rec = w.record()
        assert rec.state == "REAPED", rec.to_dict()
        for f in (w.stdin, w.stdout, w.stderr):
            assert f is None or f.closed


def test_exit_cancels_and_reaps_everything(contained: dict) -> None:
    warm_up(contained["env"])
    fds = fd_count()
    with launcher.Supervisor(grace=0.3, env=contained["env"]) as sup:
        ws = _start(sup)
        _wait_for_tree(contained["token"], 7)
    _nothing_left(contained, ws)
    assert_graces_overlap([w.record() for w in ws])
    assert [w.record().outcome for w in ws] == ["cancelled"] * 4
    assert fd_count() == fds


def test_an_exception_cancels_and_propagates(contained: dict) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with launcher.Supervisor(grace=0.3, env=contained["env"]) as sup:
            ws = _start(sup)
            raise RuntimeError("boom")
    _nothing_left(contained, ws)


def test_finished_workers_keep_their_own_result(contained: dict) -> None:
    with launcher.Supervisor(env=contained["env"]) as sup:
        a = sup.spawn(["sh", "-c", "exit 7"])
        b = sup.spawn(["sleep", "60"])
        assert a.wait(30).exit_code == 7
    assert (a.record().outcome, b.record().outcome) == ("exited", "cancelled")
    assert len(sup.workers) == 2
    with pytest.raises(RuntimeError):
        sup.spawn(["true"])


@pytest.mark.forked
def test_keyboard_interrupt_leaves_nothing_alive(contained: dict) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt):
        with launcher.Supervisor(grace=0.3, env=contained["env"]) as sup:
            ws = _start(sup)
            _wait_for_tree(contained["token"], 7)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)                      # interrupted long before this ends
    _nothing_left(contained, ws)


@pytest.mark.forked
def test_keyboard_interrupt_during_the_cleanup_is_held(contained: dict) -> None:
    """A second Ctrl-C while the supervisor is stopping does not cut the stop
    short: it is raised once everything is reaped."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with pytest.raises(KeyboardInterrupt):
        with launcher.Supervisor(grace=1.0, env=contained["env"]) as sup:
            ws = _start(sup)
            _wait_for_tree(contained["token"], 7)
            # SIGINT again 0.3 s into the 1 s grace, from outside.
            killer = subprocess.Popen(["sh", "-c", f"sleep 0.3; kill -INT {os.getpid()}"])
            raise KeyboardInterrupt
    killer.wait(10)
    _nothing_left(contained, ws)


@pytest.mark.forked
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_keyboard_interrupt_in_an_async_supervisor_leaves_nothing_alive(contained: dict, backend: str) -> None:
    import anyio

    signal.signal(signal.SIGINT, signal.default_int_handler)
    workers: list[launcher.AsyncWorker] = []

    async def main() -> None:
        async with launcher.AsyncSupervisor(grace=0.3, env=contained["env"]) as sup:
            for argv in STUBBORN:
                workers.append(await sup.spawn(argv))
            async with launcher.open_worker(["sleep", "60"], env=contained["env"]) as w:
                workers.append(w)
                deadline = time.monotonic() + 10
                while len(pids_with_token(contained["token"])) < 7:
                    assert time.monotonic() < deadline, "workloads did not start"
                    await anyio.sleep(0.01)
                os.kill(os.getpid(), signal.SIGINT)
                await anyio.sleep(30)

    with pytest.raises(KeyboardInterrupt):
        anyio.run(main, backend=backend)
    assert pids_with_token(contained["token"]) == []
    assert children_of(os.getpid()) == []
    assert [d for d in os.listdir(contained["cgroup_base"]) if d.startswith("run-")] == []
    assert [w.record().state for w in workers] == ["REAPED"] * 4


@pytest.mark.forked
def test_keyboard_interrupt_inside_launcher_run_stops_the_run_and_frees_its_id(contained: dict) -> None:
    """Ctrl-C while `launcher.run` owns a run in the calling thread: the
    owner loop is cut short, yet the run is stopped and recorded (not left
    running, unowned, with its lock held), and its id can be used again."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    killer = subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -INT {os.getpid()}"])
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.run(["sh", "-c", "setsid sleep 300 & trap '' TERM; sleep 300"], id="ki", env=contained["env"])
    finally:
        killer.wait(10)
    assert pids_with_token(contained["token"]) == []
    assert children_of(os.getpid()) == []
    with open(os.path.join(contained["state_dir"], "runs", "ki", "record.json")) as f:
        rec = json.load(f)
    assert rec["state"] == "REAPED" and rec["evidence"]["cancel_requested"]["via"] == "the owner loop failed", rec
    again = launcher.run(["true"], id="ki", env=contained["env"])
    assert again.state == "REAPED" and again.exit_code == 0
