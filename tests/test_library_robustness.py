"""Robustness review of the library as an agent runtime or CI runner embeds
it: the caller forks, the caller is interrupted at awkward moments.

Each test failed on the code it was written against. Real processes and
cgroups; survival is decided by the test's own /proc scan (the token in the
worker's environment), never by asking contain. Every wait is bounded.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import launcher
from conftest import children_of, pids_with_token


def _gone(token: str, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := pids_with_token(token)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


@pytest.mark.forked
@pytest.mark.timeout(60)
def test_a_forked_child_of_the_caller_does_not_keep_an_ended_run_locked(contained: dict) -> None:
    """A CI runner forks (multiprocessing's fork start method, a pre-fork
    server) while a worker runs. The fork copies the descriptor of the run's
    OFD owner lock, and the owner gave the lock up only by closing its own
    copy: after the run ended REAPED its id stayed 'held by a live run'
    (RunConflict) and `contain wait` blocked, for as long as the forked
    child lived."""
    w = launcher.spawn(["sleep", "0.3"], id="forked", env=contained["env"])
    child = os.fork()
    if child == 0:                      # the caller's fork: holds copies of every fd, lives on
        time.sleep(30)
        os._exit(0)
    try:
        rec = w.wait(30)
        assert rec.state == "REAPED", rec.to_dict()
        again = launcher.run(["true"], id="forked", env=contained["env"])
        assert again.state == "REAPED" and again.exit_code == 0, again.to_dict()
        p = subprocess.run([sys.executable, "-m", "launcher", "wait", "forked"], env=contained["env"],
                           capture_output=True, text=True, timeout=10)
        assert p.returncode == 0, p.stderr
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        w.close()


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> None:
    """Ctrl-C landing the moment `owner.name` returns (the signal handler
    runs at the next bytecode; here, deterministically, once)."""
    real = getattr(owner, name)
    fired = []

    def interrupted(*a: object, **kw: object) -> object:
        out = real(*a, **kw)
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(owner, name, interrupted)


@pytest.mark.forked
@pytest.mark.timeout(60)
@pytest.mark.parametrize("moment", ["spawn: child ends closed", "run: before the owner loop"])
def test_keyboard_interrupt_right_after_the_spawn_leaves_no_unowned_worker(
        contained: dict, monkeypatch: pytest.MonkeyPatch, moment: str) -> None:
    """Ctrl-C after the worker was spawned but before anything owned it
    (while `spawn` closed the caller's copies of the child's pipe ends, or
    between `run`'s start and its owner loop): the KeyboardInterrupt came
    out and the worker ran on with no owner loop, its owner lock held (the
    id refused as live) and nothing left to stop it."""
    from launcher import _stdio, _worker

    env = contained["env"]
    if moment.startswith("spawn"):
        _interrupt_after(monkeypatch, _stdio.Stdio, "spawned")
        call = lambda: launcher.spawn(["sleep", "300"], id="ki", env=env, stdout=subprocess.PIPE)  # noqa: E731
    else:
        _interrupt_after(monkeypatch, _worker, "start_run")
        call = lambda: launcher.run(["sleep", "300"], id="ki", env=env)  # noqa: E731
    try:
        with pytest.raises(KeyboardInterrupt):
            call()
        assert _gone(contained["token"], 5.0) == []
        assert children_of(os.getpid()) == []
        monkeypatch.undo()
        again = launcher.run(["true"], id="ki", env=env)
        assert again.state == "REAPED" and again.exit_code == 0, again.to_dict()
    finally:
        monkeypatch.undo()


@pytest.mark.forked
@pytest.mark.timeout(60)
def test_keyboard_interrupt_as_the_owner_thread_starts_leaves_one_owner(
        contained: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C lands in `Thread.start()` of the Worker's owner thread once
    the thread exists (start() waits for it to begin). `spawn` then owned
    the run itself too (abandon), so two owner loops ran one run at once:
    the second close of the wall's pidfd raised EBADF instead of the
    KeyboardInterrupt (an fd number closed twice may be another thread's
    fresh descriptor), and the run ended twice."""
    import json
    import threading

    real = threading.Thread.start
    fired = []

    def start(self: threading.Thread) -> None:
        real(self)
        if self.name.startswith("contain-") and not fired:
            fired.append(True)
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start)
    env = contained["env"]
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.spawn(["sh", "-c", "trap '' TERM; sleep 300"], id="ki2", env=env, stdout=subprocess.PIPE)
        assert _gone(contained["token"], 10.0) == []
        p = subprocess.run([sys.executable, "-m", "launcher", "wait", "ki2"], env=env,
                           capture_output=True, text=True, timeout=20)
        assert p.returncode == 143 and "REAPED" in p.stdout, (p.stdout, p.stderr)    # cancelled: 143, as contain run
        with open(os.path.join(contained["state_dir"], "runs", "ki2", "journal.ndjson")) as f:
            events = [json.loads(line).get("event") for line in f]
        assert events.count("ended") == 1, events
        again = launcher.run(["true"], id="ki2", env=env)
        assert again.state == "REAPED" and again.exit_code == 0, again.to_dict()
        assert children_of(os.getpid()) == []
    finally:
        monkeypatch.undo()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["line\nbreak", "nul\x00byte", "tab\there", "\ud800"])
def test_an_operation_id_the_owner_refuses_is_a_value_error_at_once(contained: dict, op: str) -> None:
    """An op id the owner's inbox rejects (not printable: a newline, a NUL,
    a tab, a lone surrogate) was taken by Worker.cancel: the request was
    appended, the owner dropped it unanswered, and cancel() waited until
    the run ended on its own (for ever, for a worker that does not end),
    then raised a LauncherError; the run was never cancelled. A surrogate
    was a bare UnicodeEncodeError. It is a ValueError before anything is
    written, as an empty one is."""
    import anyio

    w = launcher.spawn(["sleep", "3"], env=contained["env"])
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="operation id"):
            w.cancel(op_id=op)
        assert time.monotonic() - t0 < 2.5, "cancel() waited for the run to end"
        with pytest.raises(ValueError, match="operation id"):
            launcher.cancel(w.id, op_id=op)
        with pytest.raises(ValueError, match="operation id"):
            w.cancel_record(op)
        assert not w.done()
        ack = w.cancel(op_id="then-a-good-one", grace=0)
        assert ack.effect == "cancel_requested"
        assert w.wait(30).outcome == "cancelled"

        async def main() -> None:
            async with launcher.open_worker(["sleep", "30"], env=contained["env"], grace=0) as aw:
                with pytest.raises(ValueError, match="operation id"):
                    await aw.cancel(op_id=op)
                assert not aw.done()

        anyio.run(main)
    finally:
        w.stop(grace=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("env_extra, error", [
    ({"A=B": "c"}, ValueError),          # the worker got A="B=c": another variable than the caller named
    ({"A": "b\x00c"}, ValueError),       # cut at the NUL: A="b"
    ({"A\x00B": "x"}, ValueError),       # dropped without a word
    ({"A": 1}, TypeError),               # str()ed: subprocess refuses it
    ({"A": None}, TypeError),            # became A="None"
])
def test_an_environment_the_worker_cannot_carry_is_refused_before_the_spawn(
        contained: dict, env_extra: dict, error: type) -> None:
    """env= was written out as f"{k}={v}" unchecked: a name with '=' became
    another variable, a NUL cut the string short, a non-string was str()ed.
    subprocess refuses each; so does the library, before anything starts."""
    env = dict(contained["env"], **env_extra)
    with pytest.raises(error):
        launcher.spawn(["sh", "-c", "env"], env=env, stdout=subprocess.DEVNULL)
    runs = os.path.join(contained["state_dir"], "runs")
    assert not os.path.isdir(runs) or os.listdir(runs) == []


@pytest.mark.timeout(60)
def test_cwd_and_user_and_pass_fds_of_the_wrong_kind_are_clear_errors(contained: dict) -> None:
    """cwd='/tmp\\0/x' ran in /tmp (cut at the NUL); user=65534 was an
    AttributeError from inside; pass_fds=3 'int object is not iterable';
    communicate(timeout='1') a TypeError from an addition."""
    env = contained["env"]
    with pytest.raises(ValueError, match="cwd"):
        launcher.run(["true"], env=env, cwd="/tmp\x00/nonexistent")
    with pytest.raises(TypeError, match="pass_fds"):
        launcher.run(["true"], env=env, pass_fds=3)
    rec = launcher.run(["id", "-u"], env=env, user=65534, stdout=subprocess.DEVNULL)
    assert rec.exit_code == 0, rec.to_dict()
    with pytest.raises(TypeError, match="user"):
        launcher.run(["true"], env=env, user=1.5)
    with launcher.spawn(["true"], env=env, stdout=subprocess.PIPE) as w:
        with pytest.raises(TypeError, match="timeout"):
            w.communicate(timeout="1")
        assert w.communicate(timeout=30) == (b"", None)


@pytest.mark.timeout(60)
def test_communicate_repeated_after_a_timeout_loses_no_output(contained: dict) -> None:
    """The docs say a communicate() that timed out can be repeated (as
    Popen's): the repeat returned only what came after the timeout, the
    bytes read before it were dropped with the first call's locals."""
    with launcher.spawn(["sh", "-c", "echo a; echo e >&2; read x; echo got $x; sleep 1; echo b"],
                        env=contained["env"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE) as w:
        with pytest.raises(TimeoutError):
            w.communicate(b"1\n", timeout=0.5)
        assert w.communicate(timeout=30) == (b"a\ngot 1\nb\n", b"e\n")


@pytest.mark.timeout(60)
def test_communicate_repeated_after_the_wait_timed_out_loses_no_output(contained: dict) -> None:
    """The pipes reached their ends but the run had not: the repeat must
    still return what was read."""
    with launcher.spawn(["sh", "-c", "echo a; exec >&-; sleep 1"], env=contained["env"],
                        stdout=subprocess.PIPE) as w:
        with pytest.raises(TimeoutError):
            w.communicate(timeout=0.5)
        assert w.communicate(timeout=30) == (b"a\n", None)


@pytest.mark.forked
@pytest.mark.timeout(60)
def test_a_fork_while_another_thread_claims_a_run_does_not_wedge_later_claims(
        contained: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread of the caller forks while a spawn holds the state
    directory's claim lock (an flock). The fork's copy of the descriptor
    shares the lock, and the claimer gave it up only by closing its own
    copy: every later claim, in the caller and in the forked child, waited
    CLAIM_WAIT_S and failed ('another claim held it for 10 s') for as long
    as the child lived. The fork is made at that moment here, by hand."""
    from launcher import _layout

    real = _layout.claim_lock
    children: list[int] = []

    def claim_then_fork(st: object) -> int:
        fd = real(st)                   # type: ignore[arg-type]
        if not children:
            pid = os.fork()
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            children.append(pid)
        return fd

    monkeypatch.setattr(_layout, "claim_lock", claim_then_fork)
    try:
        assert launcher.run(["true"], env=contained["env"]).state == "REAPED"
        assert launcher.run(["true"], env=contained["env"]).state == "REAPED"
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


@pytest.mark.timeout(120)
def test_supervisor_closed_while_another_thread_spawns_leaves_no_worker(contained: dict) -> None:
    """A runtime shuts its Supervisor down while a worker thread is still
    spawning through it. close() took its list of runs while a spawn was
    under way (past the `closed` check, not yet tracked): that worker ran
    on after close() returned, in 19 of 20 tries here."""
    import threading

    left = []
    for attempt in range(10):
        sup = launcher.Supervisor(grace=0, env=contained["env"])
        spawned: list = []

        def spawner() -> None:
            try:
                while True:
                    spawned.append(sup.spawn(["sleep", "300"]))
            except RuntimeError:
                pass

        t = threading.Thread(target=spawner)
        t.start()
        try:
            time.sleep(0.03 + 0.01 * (attempt % 5))
            sup.close()
        finally:
            t.join(60)
        left = pids_with_token(contained["token"])
        for w in spawned:
            if not w.done():
                w.stop(grace=0)
        assert left == [], f"attempt {attempt}: {left} alive after close()"
        assert all(w.done() and w.record().state == "REAPED" for w in spawned)


@pytest.mark.forked
@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("face", ["open_worker", "AsyncSupervisor.spawn"])
def test_keyboard_interrupt_right_after_an_async_spawn_leaves_no_unowned_worker(
        contained: dict, monkeypatch: pytest.MonkeyPatch, backend: str, face: str) -> None:
    """Ctrl-C between the spawn and the owner task (trio raises
    KeyboardInterrupt wherever the code runs): `open_worker`'s __aenter__
    and `AsyncSupervisor.spawn` had started the run and not yet handed it
    to an owner task or the supervisor's list, so the worker ran on with
    nothing to stop it, its id held."""
    import anyio

    from launcher import _aio

    _interrupt_after(monkeypatch, _aio, "start_run")
    env = contained["env"]

    async def main() -> None:
        if face == "open_worker":
            async with launcher.open_worker(["sleep", "300"], id="aki", env=env):
                pass
        else:
            async with launcher.AsyncSupervisor(grace=0) as sup:
                await sup.spawn(["sleep", "300"], id="aki", env=env)

    try:
        with pytest.raises(KeyboardInterrupt):
            anyio.run(main, backend=backend)
        assert _gone(contained["token"], 5.0) == []
        monkeypatch.undo()
        again = launcher.run(["true"], id="aki", env=env)
        assert again.state == "REAPED" and again.exit_code == 0, again.to_dict()
    finally:
        monkeypatch.undo()


@pytest.mark.forked
@pytest.mark.timeout(60)
def test_keyboard_interrupt_during_the_retention_prune_of_a_claim_frees_the_claimed_id(
        contained: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each claim prunes ended runs past the retention bound (milliseconds
    with thousands of runs: where a Ctrl-C during a spawn most often lands).
    An interrupt there came after the new run directory was made and
    locked, and before the Run held it: the directory's fds and its owner
    lock stayed open in the caller, so the id was 'held by a live run'
    until the process exited."""
    from conftest import fd_count
    from launcher import _layout

    env = contained["env"]
    launcher.run(["true"], env=env)           # the state directory exists: count from here
    fds = fd_count()

    def interrupted(st: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_layout._gc, "maybe_prune", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.run(["sleep", "300"], id="kp", env=env)
    finally:
        monkeypatch.undo()
    assert pids_with_token(contained["token"]) == []
    assert fd_count() == fds
    again = launcher.run(["true"], id="kp", env=env)
    assert again.state == "REAPED" and again.exit_code == 0, again.to_dict()


@pytest.mark.forked
@pytest.mark.timeout(60)
def test_keyboard_interrupt_while_the_run_cgroup_is_prepared_leaves_no_cgroup(
        contained: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after the run's cgroup directory was made, while it was being
    identified and given its leaf: only OSError removed it, so every such
    interrupt left an empty run cgroup under the base for good."""
    from launcher._platform import linux

    base = contained["cgroup_base"]
    before = sorted(os.listdir(base))

    def interrupted(*a: object, **kw: object) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(linux, "identify", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.run(["true"], env=contained["env"], backend="cgroup2")
    finally:
        monkeypatch.undo()
    assert sorted(os.listdir(base)) == before


@pytest.mark.forked
@pytest.mark.timeout(60)
def test_keyboard_interrupt_as_the_spawn_returns_leaves_no_zombie_or_pidfd(
        contained: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C the moment the clone3 spawn returned, before the container
    held the new wall: the roll-back killed the cgroup, but nobody reaped
    the wall's init (the caller's child) or closed its pidfds and report
    socket: a zombie in the caller and three descriptors, per interrupt."""
    from conftest import fd_count
    from launcher._platform import linux

    env = contained["env"]
    launcher.run(["true"], env=env)
    fds = fd_count()

    def interrupted(*a: object, **kw: object) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(linux.pidwall.PidWall, "of", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.run(["sleep", "300"], env=env, pidns=True)
    finally:
        monkeypatch.undo()
    assert _gone(contained["token"], 5.0) == []
    assert children_of(os.getpid()) == []
    assert fd_count() == fds
