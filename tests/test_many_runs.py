"""Many runs in one process: one owner loop for every Worker, a few
descriptors per live run, and all of them stopped together.

Real runs against the real kernel; what survived is decided by the test's
own /proc scan (the token in every worker's environment), and the counts
from /proc/self/fd and /proc/self/task.
"""
from __future__ import annotations

import errno
import os
import time

import pytest

import launcher
from _proc import wait_gone
from conftest import pids_with_token

N = 500
# A live walled run holds the worker's pidfd: its owner lock is a byte of
# the process's one owners file, its run directory is opened again through
# the process's held state directory, the init's report socket is closed
# once the worker runs and the init's pidfd rests till the worker ends
# (the kernel keeps the worker's status for its pidfd: Linux 6.15; before
# that the socket and the init's pidfd stay: 3).
_KERNEL = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
FDS_PER_WALLED_RUN = 1 if _KERNEL >= (6, 15) else 3
# Open for a moment while the count is taken (the event loop's, a turn's file).
TRANSIENT_FDS = 8
# Over N runs: a few more descriptors of the event loop's own (trio's) are
# no descriptor per run.
SLACK_PER_RUN = 0.05


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _gone(token: str) -> list[int]:
    return wait_gone(token, 30.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["cancel_all", "exit"])
def test_500_workers_through_a_supervisor_share_one_owner_thread_and_are_stopped_together(
        cgroup_base, state_dir, env, token, how) -> None:
    """Before, each live Worker was a thread with 11 descriptors. Stopped
    together by `cancel_all()` (the supervisor stays open) or by leaving
    the block: every intent written, one wake-up of the owner loop, then
    every container waited for."""
    with launcher.Supervisor(grace=0.5, env=env) as warm:
        warm.spawn(["sleep", "60"])          # the process's owner loop exists, and every lazy import is done
    fds, threads = _fds(), _threads()
    with launcher.Supervisor(grace=0.5, env=env) as sup:
        for _ in range(N):
            sup.spawn(["sleep", "300"])
        live = [w for w in sup.workers if not w.done()]
        assert len(live) == N
        per_run = (_fds() - fds - TRANSIENT_FDS) / N
        assert _threads() - threads == 0, f"{_threads() - threads} threads for {N} live workers"
        assert per_run <= FDS_PER_WALLED_RUN + SLACK_PER_RUN, f"{per_run} descriptors per live worker"
        workers = sup.workers
        if how == "cancel_all":
            recs = sup.cancel_all()
            assert [r.state for r in recs].count("REAPED") == N, {r.state for r in recs}
            assert all(w.done() for w in workers)
            assert _gone(token) == []
    states = [w.record().state for w in workers]
    assert states.count("REAPED") == N, {s: states.count(s) for s in set(states)}
    assert _gone(token) == []
    assert _fds() <= fds


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["cancel_all", "exit"])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_500_async_workers_on_one_event_loop_start_no_thread_and_are_stopped_together(
        cgroup_base, state_dir, env, token, backend, how) -> None:
    """Before, each live async worker held 10 descriptors of its own (its
    owner task's epoll, wake-up pipe and inbox FIFO besides a Worker's):
    now the process's one owner loop owns them as it owns Workers. Stopped
    together by `await cancel_all()` or by leaving the block, their ends
    awaited together (one event, not an await per worker)."""
    import anyio

    async def main() -> list[str]:
        async with launcher.AsyncSupervisor(grace=0.5, env=env) as warm:
            await warm.spawn(["sleep", "60"])     # the owner loop exists, every lazy import is done
        fds, threads = _fds(), _threads()
        async with launcher.AsyncSupervisor(grace=0.5, env=env) as sup:
            for _ in range(N):
                await sup.spawn(["sleep", "300"])
            assert sum(not w.done() for w in sup.workers) == N
            per_run = (_fds() - fds - TRANSIENT_FDS) / N
            assert _threads() - threads == 0, f"{_threads() - threads} threads for {N} live async workers"
            assert per_run <= FDS_PER_WALLED_RUN + SLACK_PER_RUN, f"{per_run} descriptors per live async worker"
            workers = list(sup.workers)
            if how == "cancel_all":
                recs = await sup.cancel_all()
                assert [r.state for r in recs].count("REAPED") == N, {r.state for r in recs}
                assert all(w.done() for w in workers)
                assert _gone(token) == []
        assert _fds() <= fds
        return [w.record().state for w in workers]

    states = anyio.run(main, backend=backend)
    assert states.count("REAPED") == N, {s: states.count(s) for s in set(states)}
    assert _gone(token) == []


def test_a_cancel_from_another_process_reaches_a_worker_owned_by_the_shared_loop(
        cgroup_base, state_dir, env, token) -> None:
    """The shared owner loop has no FIFO per run: `contain cancel` appends to
    the run's inbox, and the loop's inotify watch on cancellations/ wakes it."""
    import subprocess
    import sys

    from conftest import ROOT

    w = launcher.spawn(["sh", "-c", "trap '' TERM; sleep 300"], env=env, grace=0.3)
    try:
        assert not os.path.exists(os.path.join(state_dir, "runs", w.id, "cancellations", "wake"))
        p = subprocess.run([sys.executable, "-m", "launcher", "cancel", w.id, "--wait", "--json"],
                           env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        rec = w.wait(30)
        assert rec.state == "REAPED" and rec.outcome == "cancelled", rec.to_dict()
    finally:
        w.stop(grace=0)
    assert _gone(token) == []


def test_a_worker_that_swaps_its_cancellations_dir_still_hears_a_cancel_from_another_process(
        cgroup_base, state_dir, env, token, tmp_path) -> None:
    """The shared loop watches cancellations/ by inode; a worker that can
    write its run directory (no wall: pidns=False) moves it away and makes
    another, where `contain cancel` then writes. The watch reports the move
    and the loop watches the new one: the cancel is heard at once, not at
    the guard timer (60 s for a watched inbox)."""
    import subprocess
    import sys

    from conftest import ROOT

    ready = tmp_path / "swapped"
    swap = ("import os, sys, time; d = os.environ['CONTAIN_RUN_DIR']; "
            "os.rename(d + '/cancellations', d + '/cancellations.old'); "
            "os.mkdir(d + '/cancellations', 0o700); open(sys.argv[1], 'w').close(); time.sleep(300)")
    w = launcher.spawn([sys.executable, "-c", swap, str(ready)], env=env, grace=0.3, pidns=False)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline and not w.done():
            time.sleep(0.05)
        assert ready.exists(), w.record().to_dict() if w.done() else "the worker did not swap in 30 s"
        time.sleep(0.2)
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "launcher", "cancel", w.id, "--wait", "--json"],
                           env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        assert p.returncode == 0, p.stderr
        rec = w.wait(30)
        # (EXITED as root without the wall: the fork ledger cannot vouch that
        # no member left unseen. What is asserted is that the cancel came.)
        assert rec.terminal and rec.outcome == "cancelled", rec.to_dict()
        # Not a speed check: the guard timer alone would have taken 60 s.
        assert took < 45, f"the cancel was heard after {took:.1f} s: only by the guard timer"
    finally:
        w.stop(grace=0)
    assert _gone(token) == []


@pytest.mark.forked
@pytest.mark.timeout(180)
def test_a_flooded_inotify_queue_still_lets_every_run_hear_its_cancel(cgroup_base, state_dir, env, token) -> None:
    """One worker floods its own cancellations/ while the owner loop is
    busy (one of its turns held for 3 s here): the shared inotify queue
    overflows and the kernel drops events, another run's cancel among them.
    The overflow makes every run look again (inotify(7)); before, the
    other run's cancel went unheard for the 60 s guard."""
    import subprocess
    import sys
    import threading

    from conftest import ROOT
    from launcher import _reactor

    v1 = launcher.spawn(["sleep", "300"], env=env, grace=0.3)
    v2 = launcher.spawn(["sleep", "300"], env=env, grace=0.3)
    try:
        time.sleep(0.3)
        loop = _reactor.reactor()
        stall, release = threading.Event(), threading.Event()
        turn = loop._turn

        def slow_turn(e, ready):                 # a slow turn, as a busy caller's threads make one
            if stall.is_set() and e.run is v2._run:
                stall.clear()
                release.wait(90)
            return turn(e, ready)

        loop._turn = slow_turn
        inbox = os.path.join(state_dir, "runs", v2.id, "cancellations")
        stall.set()
        open(os.path.join(inbox, "first"), "w").close()
        time.sleep(0.2)
        with open("/proc/sys/fs/inotify/max_queued_events") as f:
            flood = int(f.read()) + 4000
        try:
            for i in range(flood):
                open(os.path.join(inbox, f"f{i}"), "w").close()
            cancel = subprocess.Popen([sys.executable, "-m", "launcher", "cancel", v1.id, "--json"],
                                      env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
            asked = os.path.join(state_dir, "runs", v1.id, "cancellations", "requests.ndjson")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not (os.path.exists(asked) and os.path.getsize(asked)):
                time.sleep(0.05)                 # until its request is written (and its event dropped)
        finally:
            release.set()
        out = cancel.communicate(timeout=60)[0]
        assert cancel.returncode == 0, out
        rec = v1.wait(30)        # the guard alone would take 60 s
        assert rec.state == "REAPED" and rec.outcome == "cancelled", rec.to_dict()
    finally:
        v1.stop(grace=0)
        v2.stop(grace=0)
    assert _gone(token) == []


def _cgroups_left(base: str) -> list[str]:
    return sorted(d for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)))


@pytest.mark.forked
@pytest.mark.timeout(180)
@pytest.mark.parametrize("api", ["sync", "asyncio", "trio"])
def test_at_rlimit_nofile_256_a_spawn_is_refused_before_anything_starts_and_every_run_still_ends_reaped(
        cgroup_base, state_dir, env, token, api) -> None:
    """Before: asyncio refused with a bare OSError (EMFILE on owner.lock),
    every cancel() raised EMFILE and 22 records stayed RUNNING with their
    workers alive in their cgroups; trio the same after a SpawnFailed."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    refusals: list[BaseException] = []
    records: list[str] = []
    if api == "sync":
        with launcher.Supervisor(grace=0.3, env=env) as sup:
            for _ in range(200):
                try:
                    sup.spawn(["sleep", "300"])
                except Exception as e:
                    refusals.append(e)
                    break
            workers = sup.workers
        records = [w.record().state for w in workers]
    else:
        import anyio

        async def main() -> list[str]:
            async with launcher.AsyncSupervisor(grace=0.3, env=env) as sup:
                for _ in range(200):
                    try:
                        await sup.spawn(["sleep", "300"])
                    except Exception as e:
                        refusals.append(e)
                        break
                workers = list(sup.workers)
            return [w.record().state for w in workers]

        records = anyio.run(main, backend=api)
    assert refusals, "200 runs fit in 256 descriptors: the test is void"
    err = refusals[0]
    assert isinstance(err, launcher.LauncherError) and getattr(err, "errno", None) == errno.EMFILE, repr(err)
    assert len(records) > 10, records
    assert records.count("REAPED") == len(records), {s: records.count(s) for s in set(records)}
    assert _gone(token) == []
    assert _cgroups_left(cgroup_base) == []


@pytest.mark.parametrize("api", ["sync", "asyncio"])
def test_cancel_all_stops_every_worker_in_one_pass(cgroup_base, state_dir, env, token, api) -> None:
    n = 40
    if api == "sync":
        with launcher.Supervisor(env=env) as sup:
            for _ in range(n):
                sup.spawn(["sh", "-c", "trap '' TERM; sleep 300"])
            recs = sup.cancel_all(grace=0.5)
            assert sup.spawn(["true"]).wait().state == "REAPED"     # the supervisor stays open
    else:
        import anyio

        async def main() -> list:
            async with launcher.AsyncSupervisor(env=env) as sup:
                for _ in range(n):
                    await sup.spawn(["sh", "-c", "trap '' TERM; sleep 300"])
                return await sup.cancel_all(grace=0.5)

        recs = anyio.run(main)
    assert [r.state for r in recs] == ["REAPED"] * n, [r.state for r in recs]
    assert all(r.outcome == "cancelled" for r in recs)
    # One pass: every polite signal was sent before any kill (the graces
    # ran together), by the records' own step times.
    steps = [s for r in recs for s in r.to_dict()["evidence"]["signal_sent"]["detail"]["steps"]]
    terms = [s["at"] for s in steps if s.get("kind") == "term"]
    kills = [s["at"] for s in steps if s.get("kind") == "kill"]
    assert len(terms) == n and len(kills) == n and max(terms) < min(kills), (max(terms), min(kills))
    assert _gone(token) == []


@pytest.mark.forked
@pytest.mark.timeout(240)
@pytest.mark.parametrize("limit", [160, 256])
def test_threads_spawning_together_at_a_low_limit_are_refused_as_launcher_errors_and_every_run_is_reaped(cgroup_base, state_dir, env, token, limit) -> None:
    """Each of 8 threads saw room for one spawn's peak, then all spawned at
    once: a spawn hung for ever (the wall's report cut short: EMFILE on the
    pidfd it passed), runs were left without a record, and bare OSErrors
    came out. Spawns under way are counted now."""
    import resource
    import threading

    import launcher

    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    errors: list[BaseException] = []
    with launcher.Supervisor(grace=0.3, env=env) as sup:
        go = threading.Barrier(8)

        def spawner() -> None:
            go.wait()
            for _ in range(60):
                try:
                    sup.spawn(["sleep", "300"])
                except BaseException as e:   # noqa: BLE001
                    errors.append(e)
                    if not isinstance(e, launcher.LauncherError):
                        return
        ts = [threading.Thread(target=spawner) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        workers = list(sup.workers)
    states = [w.record().state for w in workers]
    bad = [repr(e) for e in errors if not isinstance(e, launcher.LauncherError)]
    assert bad == [], bad[:5]
    assert states.count("REAPED") == len(states), {s: states.count(s) for s in set(states)}
    assert pids_with_token(token) == []
    assert _cgroups_left(cgroup_base) == []


@pytest.mark.forked
@pytest.mark.timeout(240)
def test_a_thread_that_takes_every_free_descriptor_cannot_keep_runs_from_their_final_record(cgroup_base, state_dir, env, token) -> None:
    """The caller's own thread keeps opening descriptors at the limit (an
    accept loop): every run must still reach a final record."""
    import resource
    import threading

    import launcher

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    sup = launcher.Supervisor(grace=0.3, env=env)
    ws = [sup.spawn(["sleep", "1"]) for _ in range(15)]
    held: list[int] = []
    stop = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            try:
                held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                time.sleep(0)
    t = threading.Thread(target=hog)
    t.start()
    time.sleep(4)                        # every worker exited meanwhile
    stop.set()
    t.join()
    states = [w.record().state for w in ws]
    for fd in held:
        os.close(fd)
    final, raised = [], []
    for w in ws:
        try:
            final.append(w.wait(30).state)
        except BaseException as e:   # noqa: BLE001
            raised.append(repr(e)[:120])
            final.append(w.record().state)
    try:
        sup.close()
    except BaseException as e:   # noqa: BLE001
        raised.append("close: " + repr(e)[:120])
    got = {"states_at_limit": {s: states.count(s) for s in set(states)},
           "final": {s: final.count(s) for s in set(final)}, "wait_raised": raised[:3], "n_raised": len(raised),
           "live": len(pids_with_token(token)), "cgroups_left": len(_cgroups_left(cgroup_base))}
    assert got["final"] == {"REAPED": len(ws)} and not raised and not got["live"] and not got["cgroups_left"], got
