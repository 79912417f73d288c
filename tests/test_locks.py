"""locks_released: a lock a member took is free once the tree is gone, or the
layer says who holds it (issue 14). Real locks, real processes, the kernel's
own /proc/locks; the test decides independently whether the lock is held by
trying to take it."""
from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
import textwrap

import pytest

from _cgworld import World, wait_line
from _users import as_uid, python, spare_uids, why_not
from conftest import CGROUP_SKIP, pids_with_token

from launcher import _locks as L

F_OFD_SETLK = 37

RECEIVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen()
    print("ready", flush=True)
    c, _ = s.accept()
    _m, fds, _f, _a = socket.recv_fds(c, 16, 4)
    print("got", fds[0], flush=True)
    sys.stdin.read()                      # holds the descriptor until the test closes stdin
""")

WORKER = textwrap.dedent("""
    import fcntl, os, socket, struct, sys, time
    path, sock, kind, then = sys.argv[1:5]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    if kind == "flock":
        fcntl.flock(fd, fcntl.LOCK_EX)
    else:
        fcntl.fcntl(fd, 37, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))   # F_OFD_SETLK, whole file
    u = socket.socket(socket.AF_UNIX); u.connect(sock)
    socket.send_fds(u, [b"x"], [fd])
    print("sent", flush=True)
    if then == "stay":
        time.sleep(300)
""")


def _held_elsewhere(path: str, kind: str) -> bool:
    """The test's own check: can a fresh description take the lock now?"""
    fd = os.open(path, os.O_RDWR)
    try:
        if kind == "flock":
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            fcntl.fcntl(fd, F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
        return False
    except (BlockingIOError, PermissionError):
        return True
    finally:
        os.close(fd)


@pytest.fixture
def world(token: str):
    if CGROUP_SKIP is not None:
        pytest.skip(CGROUP_SKIP)
    w = World(token)
    try:
        yield w
    finally:
        w.close()


def _receiver(world: World, sock: str) -> subprocess.Popen[bytes]:
    r = subprocess.Popen([sys.executable, "-c", RECEIVER, sock], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env=world.env)
    world.procs.append(r)
    assert wait_line(r) == b"ready"
    return r


@pytest.mark.parametrize("kind", ["flock", "ofd"])
def test_lock_handed_to_an_outside_process_names_the_holder(world, tmp_path, kind):
    path, sock = str(tmp_path / "ws.lock"), str(tmp_path / "recv.sock")
    recv = _receiver(world, sock)
    c, _rc = world.run()
    w = world.spawn(c, None, [sys.executable, "-c", WORKER, path, sock, kind, "stay"], stdout=subprocess.PIPE)
    assert wait_line(w) == b"sent"
    assert wait_line(recv).startswith(b"got")
    held = L.held_by(c.members())                    # at the stop, members alive
    assert any(k[0] == ("FLOCK" if kind == "flock" else "OFDLCK") for k in held.locks), held.locks
    world.stop(c)
    assert pids_with_token(world.token) == [recv.pid]   # only the outsider is left
    assert _held_elsewhere(path, kind)
    layer = L.locks_released(held)
    assert layer["observed"] is False, layer
    (still,) = layer["detail"]["still_held"]
    assert recv.pid in [h["pid"] for h in still["holders"]]
    assert all(h["path"] == path for h in still["holders"])
    assert still["held_at_stop_via"][0]["pid"] == w.pid
    # The holder lets go: the same observation now holds.
    assert recv.stdin is not None
    recv.stdin.close()
    recv.wait(10)
    assert not _held_elsewhere(path, kind)
    assert L.locks_released(held)["observed"] is True


def test_flock_handed_out_by_a_worker_that_exited_before_the_stop(world, tmp_path):
    """The container is already empty when the stop begins, so nothing was
    collected; the flock still shows the worker's pid (the kernel keeps the
    taker's number), which is enough to find it and name the holder."""
    path, sock = str(tmp_path / "ws.lock"), str(tmp_path / "recv.sock")
    recv = _receiver(world, sock)
    c, _rc = world.run()
    w = world.spawn(c, None, [sys.executable, "-c", WORKER, path, sock, "flock", "exit"], stdout=subprocess.PIPE)
    assert wait_line(w) == b"sent"
    assert w.wait(20) == 0
    assert wait_line(recv).startswith(b"got")
    world.wait_empty(c)
    layer = L.locks_released(None, exited_pids=[w.pid])
    assert layer["observed"] is False, layer
    assert "already empty" in layer["detail"]["note"]
    assert recv.pid in [h["pid"] for h in layer["detail"]["still_held"][0]["holders"]]
    recv.stdin.close()
    recv.wait(10)


def test_every_kind_of_lock_is_released_when_the_tree_is_killed(world, tmp_path):
    code = textwrap.dedent(f"""
        import fcntl, os, struct, time
        d = {str(tmp_path)!r}
        a = open(d + "/a", "w"); fcntl.flock(a, fcntl.LOCK_EX)
        b = open(d + "/b", "w"); fcntl.lockf(b, fcntl.LOCK_EX)
        c = os.open(d + "/c", os.O_RDWR | os.O_CREAT)
        fcntl.fcntl(c, 37, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 10, 0))
        e = os.open(d + "/e", os.O_RDONLY | os.O_CREAT)
        fcntl.fcntl(e, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        if os.fork() == 0:
            os.setsid()
            g = open(d + "/g", "w"); fcntl.flock(g, fcntl.LOCK_SH)
            print("ok", flush=True)
            time.sleep(300)
        time.sleep(300)
    """)
    c, _rc = world.run()
    w = world.python(c, None, code, stdout=subprocess.PIPE)
    assert wait_line(w) == b"ok"
    held = L.held_by(c.members())
    kinds = sorted(k[0] for k in held.locks)
    assert kinds == ["FLOCK", "FLOCK", "LEASE", "OFDLCK", "POSIX"], kinds
    world.stop(c)
    layer = L.locks_released(held)
    assert layer["observed"] is True, layer
    assert layer["detail"]["held_at_stop"] == 5


def test_locks_not_inspectable_make_the_layer_null(world, tmp_path):
    """A supervisor that cannot read a member's fdinfo (here: the check runs
    as a spare uid against a root member) does not call the locks released."""
    if (why := why_not()) is not None:
        pytest.skip(why)
    c, _rc = world.run()
    w = world.python(c, None, "import fcntl, time\nf = open('/dev/null')\nprint('ok', flush=True)\ntime.sleep(300)\n",
                     stdout=subprocess.PIPE)
    assert wait_line(w) == b"ok"
    probe = textwrap.dedent(f"""
        import json
        from launcher import _locks as L
        held = L.held_by([{w.pid}])
        print(json.dumps(L.locks_released(held)))
    """)
    # Some lock must exist on the host: with /proc/locks empty, "no member
    # holds a lock" is an observation that needs no fd of theirs.
    import fcntl as _fcntl

    held_here = open(tmp_path / "a-lock", "w")
    _fcntl.flock(held_here, _fcntl.LOCK_EX)
    try:
        out = as_uid(spare_uids(1)[0], [python(), "-c", probe], timeout=30)
    finally:
        held_here.close()
    assert out.returncode == 0, out.stderr
    import json

    layer = json.loads(out.stdout)
    assert layer["observed"] is None, layer
    assert any(str(w.pid) in p for p in layer["detail"]["unobservable"])
    world.stop(c)


# -- parsing (fixture lines as this kernel prints them) --------------------------

PROC_LOCKS = """\
1: FLOCK  ADVISORY  WRITE 32325 fe:00:3040460 0 EOF
1: -> FLOCK  ADVISORY  WRITE 4242 fe:00:3040460 0 EOF
2: LEASE  BREAKING  READ 8545 fe:00:2894782 0 EOF
3: OFDLCK ADVISORY  WRITE -1 fe:00:2892898 0 9
4: POSIX  ADVISORY  WRITE 8545 00:1f:2892867 100 200
5: DELEG  ACTIVE    READ 77 00:2a:12 0 EOF
6: garbage
"""


def test_proc_locks_lines_parse_and_waiters_hold_nothing():
    locks = L.parse_proc_locks(PROC_LOCKS)
    assert [(lk.kind, lk.pid) for lk in locks] == [("FLOCK", 32325), ("LEASE", 8545), ("OFDLCK", -1),
                                                    ("POSIX", 8545), ("DELEG", 77)]
    posix = locks[3]
    assert (posix.major, posix.minor, posix.ino, posix.start, posix.end) == (0, 0x1F, 2892867, "100", "200")
    assert locks[0].dev == os.makedev(0xFE, 0)
    assert locks[2].key[-1] is None                 # OFD: no owner pid in the key
    assert locks[1].mode == "BREAKING"


def test_fdinfo_lock_lines_parse():
    txt = "pos:\t0\nflags:\t02100001\nmnt_id:\t27\nino:\t2892851\nlock:\t1: FLOCK  ADVISORY  WRITE 8545 fe:00:2892851 0 EOF\n"
    (lk,) = L.fdinfo_locks(txt)
    assert (lk.kind, lk.access, lk.pid, lk.ino) == ("FLOCK", "WRITE", 8545, 2892851)
    assert L.fdinfo_locks("pos:\t0\n") == []


def test_a_reused_member_pid_is_not_judged(tmp_path, env):
    """Already empty at the stop: a lock whose pid now belongs to a live
    process (a reused number) is that process's business, not the run's."""
    path = str(tmp_path / "own.lock")
    own = subprocess.Popen([sys.executable, "-c", "import fcntl, sys\nf = open(sys.argv[1], 'w')\n"
                            "fcntl.flock(f, fcntl.LOCK_EX)\nprint('ok', flush=True)\nsys.stdin.read()\n", path],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert wait_line(own) == b"ok"
        layer = L.locks_released(None, exited_pids=[own.pid])
        assert layer["observed"] is None, layer
        assert layer["detail"]["pid_reused"] == [own.pid]
    finally:
        own.stdin.close()
        own.wait(10)


def test_a_lock_the_caller_took_and_the_worker_inherited_is_not_the_runs(world, tmp_path):
    """The worker's stdin is a file its caller (this test) flocked: the lock
    outlives the tree, but the tree never took it."""
    path = str(tmp_path / "caller.lock")
    mine = open(path, "w")
    fcntl.flock(mine, fcntl.LOCK_EX)
    try:
        c, _rc = world.run()
        # The same open file description as the caller's (a fresh open() would
        # be another description, which holds no lock).
        w = world.python(c, None, "import time\nprint('ok', flush=True)\ntime.sleep(300)\n", stdin=mine,
                         stdout=subprocess.PIPE)
        assert wait_line(w) == b"ok"
        held = L.held_by(c.members())
        assert [e["origin"] for e in held.locks.values()] == ["outside"]
        world.stop(c)
        layer = L.locks_released(held)
        assert layer["observed"] is True, layer
        assert layer["detail"]["inherited"][0]["lock"]["pid"] == os.getpid()
    finally:
        mine.close()
