"""The owner loop's waiting piece on Windows (winsync.Waiter): it returns on
each input on its own (the worker's exit, the job's completion port, a poke
from another process, wake() from another thread, a console control event)
and otherwise only at its timeout. Each test isolates one input, and the
bounds on waiting are only there so that no test can hang."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

if sys.platform != "win32":
    pytest.skip("the Windows suite: a Windows CPython runs it (tools/winlane.py)", allow_module_level=True)

import _census
from _job import Job, child

from launcher._platform import windows, winsync

CREATE_NEW_CONSOLE = 0x00000010
LONG = 30.0   # a bound, never expected to be reached


def _timed_wait(w: winsync.Waiter, timeout: float = LONG) -> float:
    t0 = time.monotonic()
    w.wait(timeout)
    return time.monotonic() - t0


def test_timeout_returns_with_nothing_seen() -> None:
    with winsync.Waiter() as w:
        took = _timed_wait(w, 0.3)
        assert took >= 0.29
        assert w.last["packets"] == 0


def test_wakes_on_process_exit(helpers) -> None:  # type: ignore[no-untyped-def]
    p = subprocess.Popen(child("sleep", helpers.dir, "x", "0.5"), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with winsync.Waiter() as w:
        w.watch_process(int(p._handle))   # type: ignore[attr-defined]
        took = _timed_wait(w)
        assert w.last["process_exits"] == 1 and took < LONG
        assert p.poll() is not None
        # The handle stays signalled: registered once, it posts once.
        assert _timed_wait(w, 0.2) >= 0.19 and w.last["packets"] == 0


def test_wakes_on_the_job_completion_port(helpers) -> None:  # type: ignore[no-untyped-def]
    """No watch on the process: only the job's own messages can wake it."""
    j = Job(helpers.dir)
    try:
        j.c.spawn(windows.Request(child("sleep", helpers.dir, "q", "0.5")))
        j.w.wait(LONG)              # NEW_PROCESS, queued at spawn
        assert j.w.last["job_new_process"] >= 1
        while j.c.populated():
            took = _timed_wait(j.w)
            assert took < LONG and j.w.last["job_messages"] >= 1
        assert j.w.seen["job_active_zero"] + j.w.seen["job_exit_process"] >= 1
        assert j.w.seen["process_exits"] == 0
    finally:
        j.close()


def test_wakes_on_a_poke_from_another_process(helpers) -> None:  # type: ignore[no-untyped-def]
    uid = os.urandom(8).hex()
    with winsync.Waiter() as w:
        w.listen(winsync.owner_event_name(uid))
        p = subprocess.Popen(child("poke", winsync.owner_event_name(uid), "0.3"), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        took = _timed_wait(w)
        out = p.communicate(timeout=LONG)[0]
        assert w.last["events"] == 1 and took < LONG, out
        assert out.strip() == b"True", out
        # Two pokes before the owner looks: at least one packet, never lost.
        assert winsync.poke_owner(uid) and winsync.poke_owner(uid)
        w.wait(LONG)
        assert w.last["events"] >= 1


def test_poke_without_a_listener_says_so() -> None:
    assert winsync.poke_owner(os.urandom(8).hex()) is False


def test_wake_from_another_thread() -> None:
    with winsync.Waiter() as w:
        threading.Timer(0.3, w.wake).start()
        took = _timed_wait(w)
        assert w.last["wakes"] == 1 and took < LONG


def test_wake_before_wait_is_not_lost() -> None:
    with winsync.Waiter() as w:
        w.wake()
        took = _timed_wait(w)
        assert w.last["wakes"] == 1 and took < LONG


def test_wake_after_close_is_a_no_op_and_listeners_are_gone() -> None:
    uid = os.urandom(8).hex()
    w = winsync.Waiter()
    w.listen(winsync.owner_event_name(uid))
    w.close()
    w.wake()
    assert winsync.poke_owner(uid) is False   # the name went with our handle


def test_listen_on_a_name_we_already_hold_is_accepted_or_refused_for_cause() -> None:
    """The owner event exists already (a stale requester holds it open).
    Ours: accepted. Under Wine objects made without a descriptor have no
    owner, so it cannot be verified and is refused, with the reason."""
    uid = os.urandom(8).hex()
    name = winsync.owner_event_name(uid)
    with winsync.Waiter() as a, winsync.Waiter() as b:
        a.listen(name)
        try:
            b.listen(name)
        except OSError as e:
            assert "cannot be read" in str(e), e
            if _census.wine_version():
                pytest.skip(f"Wine records no owner for unnamed-descriptor objects: {e}")
            raise
        # One auto-reset event, two registered waits: a poke satisfies one.
        assert winsync.poke(name)
        deadline = time.monotonic() + LONG
        while a.seen["events"] + b.seen["events"] == 0 and time.monotonic() < deadline:
            a.wait(0.05)
            b.wait(0.05)
        assert a.seen["events"] + b.seen["events"] == 1


@pytest.mark.parametrize("bad", ["", "..\\x", "a/b", "Global\\x", "x" * 65, "a b"])
def test_unsafe_run_uid_never_becomes_an_object_name(bad: str) -> None:
    with pytest.raises(ValueError):
        winsync.owner_event_name(bad)


def test_owner_waiter_wakes_on_worker_exit_and_on_poke(helpers) -> None:  # type: ignore[no-untyped-def]
    uid = os.urandom(8).hex()
    c = windows.Container.create("ow")
    w = None
    try:
        c.spawn(windows.Request(child("sleep", helpers.dir, "ow", "0.5")))
        w = winsync.owner_waiter(c, uid)
        assert winsync.poke_owner(uid)
        deadline = time.monotonic() + LONG
        # Until both packets came: the handle is signalled a moment before
        # the thread-pool wait posts its packet.
        while (w.seen["events"] == 0 or w.seen["process_exits"] == 0) and time.monotonic() < deadline:
            w.wait(deadline - time.monotonic())
        assert w.seen["events"] >= 1 and w.seen["process_exits"] == 1
        assert c.root_status() == (False, 0)
    finally:
        if w is not None:
            w.close()
        if c.populated():
            c.kill()
        c.remove()


def test_console_ctrl_wakes_the_waiter_and_python_still_sees_it(helpers) -> None:  # type: ignore[no-untyped-def]
    """In a console of its own: a Waiter blocked with no timeout returns on
    Ctrl-C, and CPython's SIGINT handler runs afterwards (ours passes the
    event on)."""
    p = subprocess.Popen(child("ctrl", helpers.dir), creationflags=CREATE_NEW_CONSOLE, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert p.wait(60) == 0
    with open(os.path.join(helpers.dir, "ctrl.json")) as f:
        out = json.load(f)
    sent = open(os.path.join(helpers.dir, "ctrl.sent")).read()
    assert sent.split()[0] == "1", sent
    assert out["ctrls"] >= 1 and out["last_ctrl"] == 0 and out["elapsed"] < 20, out
    assert out["python_handler"] == [2], out   # signal.SIGINT
