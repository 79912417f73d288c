"""The owner lock as a byte of the process's owners file (issue 27: no
descriptor per live run), and the old layout's `owner.lock` still read.

Each test runs real owners (library processes this test starts and
SIGKILLs), and checks the locks itself with fcntl on the files the run
directory names, and what survived by its own /proc scan: never by asking
`contain`.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from _proc import ROOT, contain_cmd, readline_within, wait_gone, wait_holders
from conftest import needs_cgroup

pytestmark = needs_cgroup
PY = sys.executable
_FLOCK = "hhqqi"


def _held(path: str, start: int = 0, length: int = 0) -> bool:
    """Whether any open file description holds an OFD write lock on the
    range: F_OFD_GETLK, done here (not the code under test)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        arg = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, length, 0) + b"\0" * 4
        res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, arg)
        return struct.unpack_from("h", res)[0] != fcntl.F_UNLCK
    finally:
        os.close(fd)


def _slot_of(state_dir: str, run_id: str) -> tuple[str, int]:
    target = os.readlink(os.path.join(state_dir, "runs", run_id, "owner"))
    name, _, k = target.rpartition(":")
    return os.path.join(state_dir, "owners", name), int(k)


_OWNER = textwrap.dedent("""
    import sys, launcher
    sup = launcher.Supervisor(grace=0.5)
    ids = [sup.spawn(["sleep", "300"]).id for _ in range(int(sys.argv[1]))]
    print(" ".join(ids), flush=True)
    sys.stdin.read()
""")


def _start_owner(env: dict[str, str], n: int) -> tuple[subprocess.Popen, list[str]]:
    p = subprocess.Popen([PY, "-c", _OWNER, str(n)], env={**env, "PYTHONPATH": ROOT}, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        ids = readline_within(p.stdout, 60).decode().split()
    except BaseException:
        p.kill()
        p.wait(10)
        raise
    assert len(ids) == n
    return p, ids


def _cancel(env: dict[str, str], run_id: str) -> dict:
    out = subprocess.run(contain_cmd("cancel", "--wait", "--json", run_id), env=env, capture_output=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return json.loads(out.stdout)


@pytest.mark.timeout(120)
def test_a_killed_owners_slots_are_free_and_its_runs_are_adopted_and_reaped(state_dir, cgroup_base, env,
                                                                            token) -> None:
    """Three runs of one library process share its owners file; SIGKILL of
    the process frees every slot (the kernel drops its locks), each run is
    then adopted by `contain cancel` and ends REAPED, and nothing is left."""
    p, ids = _start_owner(env, 3)
    try:
        assert len(wait_holders(token, 3)) >= 3
        slots = [_slot_of(state_dir, i) for i in ids]
        assert len({f for f, _ in slots}) == 1, "one owners file per process"
        assert len({k for _, k in slots}) == 3
        assert not os.path.exists(os.path.join(state_dir, "runs", ids[0], "owner.lock"))
        assert all(_held(f, k, 1) for f, k in slots)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    assert not any(_held(f, k, 1) for f, k in slots)
    for run_id in ids:
        ack = _cancel(env, run_id)
        assert ack.get("state") == "REAPED", ack
    assert wait_gone(token, 20) == []


@pytest.mark.timeout(120)
def test_two_adopters_of_one_slot_in_one_process_exclude_each_other(state_dir, cgroup_base, env, token) -> None:
    """One open file description holds every slot of a file it took, so a
    second take of the same byte through it would succeed: the process
    refuses it itself. Two processes exclude each other through the kernel."""
    from launcher._layout import RunDir

    p, ids = _start_owner(env, 1)
    try:
        assert wait_holders(token, 1)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    path = os.path.join(state_dir, "runs", ids[0])
    a, b = RunDir(path), RunDir(path)
    try:
        assert a.owner() is False
        assert a.take_ownership() is True
        assert b.take_ownership() is False
        f, k = _slot_of(state_dir, ids[0])
        assert _held(f, k, 1)
        other = subprocess.run([PY, "-c", textwrap.dedent(f"""
            from launcher._layout import RunDir
            print(RunDir({path!r}).take_ownership())""")], env={**env, "PYTHONPATH": ROOT},
            capture_output=True, text=True, timeout=60)
        assert other.stdout.strip() == "False", other.stderr
        assert b.owner() is True
    finally:
        a.release()
        b.release()
    assert not _held(f, k, 1)
    assert _cancel(env, ids[0]).get("state") == "REAPED"
    assert wait_gone(token, 20) == []


_LOCKER = textwrap.dedent("""
    import fcntl, os, struct, sys
    fd = os.open(sys.argv[1], os.O_RDWR)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0) + bytes(4))
    print("locked", flush=True)
    sys.stdin.read()
""")


@pytest.mark.timeout(120)
def test_a_run_directory_of_the_old_layout_is_still_read(state_dir, cgroup_base, env) -> None:
    """A run directory written before the owners file (its own owner.lock,
    no `owner` link): while a process holds that lock the run's owner is
    alive for `ls` and for an adopter; once it is gone, it is not."""
    from launcher._layout import RunDir

    out = subprocess.run(contain_cmd("run", "--id", "oldlayout", "--", "true"), env=env, timeout=60)
    assert out.returncode == 0
    d = os.path.join(state_dir, "runs", "oldlayout")
    os.unlink(os.path.join(d, "owner"))
    lock = os.path.join(d, "owner.lock")
    with open(lock, "wb"):
        pass
    os.chmod(lock, 0o600)
    holder = subprocess.Popen([PY, "-c", _LOCKER, lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        assert readline_within(holder.stdout, 30).strip() == b"locked"
        assert RunDir(d).owner() is True
        assert RunDir(d).take_ownership() is False
        ls = subprocess.run(contain_cmd("ls", "--json"), env=env, capture_output=True, timeout=60)
        view = [v for v in json.loads(ls.stdout) if v.get("id") == "oldlayout"]
        assert view and view[0].get("owner_alive") is True, view
    finally:
        holder.kill()
        holder.wait(10)
    r = RunDir(d)
    assert r.owner() is False
    assert r.take_ownership() is True
    try:
        assert _held(lock)
    finally:
        r.release()
    assert not _held(lock)


@pytest.mark.timeout(120)
def test_gc_sweeps_the_owners_files_of_dead_processes_only(state_dir, cgroup_base, env, token) -> None:
    """`contain gc` removes an owners file once no lock is held on it (its
    process and every adopter gone), never a live process's."""
    p, ids = _start_owner(env, 1)
    live_file, _ = _slot_of(state_dir, ids[0])
    try:
        out = subprocess.run(contain_cmd("run", "--", "true"), env=env, timeout=60)
        assert out.returncode == 0
        subprocess.run(contain_cmd("gc"), env=env, timeout=60, check=True)
        left = os.listdir(os.path.join(state_dir, "owners"))
        assert left == [os.path.basename(live_file)], left
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    assert _cancel(env, ids[0]).get("state") == "REAPED"
    subprocess.run(contain_cmd("gc"), env=env, timeout=60, check=True)
    assert os.listdir(os.path.join(state_dir, "owners")) == []
    assert wait_gone(token, 20) == []


@pytest.mark.timeout(60)
def test_an_owner_link_that_names_no_slot_is_not_taken_for_a_dead_owner(state_dir, cgroup_base, env) -> None:
    """The run directory is untrusted: an `owner` that is not a symlink to
    "<file>:<k>" makes the owner unknown (None), never "gone", and an
    adopter refuses it."""
    from launcher._layout import RunDir
    from launcher._safefs import UnsafePath

    out = subprocess.run(contain_cmd("run", "--id", "forged", "--", "true"), env=env, timeout=60)
    assert out.returncode == 0
    d = os.path.join(state_dir, "runs", "forged")
    os.unlink(os.path.join(d, "owner"))
    os.symlink("../../../etc/passwd", os.path.join(d, "owner"))
    assert RunDir(d).owner() is None
    with pytest.raises(UnsafePath):
        RunDir(d).take_ownership()
    os.unlink(os.path.join(d, "owner"))
    with open(os.path.join(d, "owner"), "w"):
        pass
    assert RunDir(d).owner() is None


_ADOPTER = textwrap.dedent("""
    import sys
    from launcher._layout import RunDir
    r = RunDir(sys.argv[1])
    print(r.take_ownership(), flush=True)
    sys.stdin.read()
    r.release()
""")


def _adopter(env: dict[str, str], path: str) -> tuple[subprocess.Popen, str]:
    a = subprocess.Popen([PY, "-c", _ADOPTER, path], env={**env, "PYTHONPATH": ROOT}, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    assert a.stdout is not None
    try:
        return a, readline_within(a.stdout, 60).decode().strip()
    except BaseException:
        a.kill()
        a.wait(10)
        raise


@pytest.mark.timeout(180)
def test_a_sweep_racing_an_adopter_leaves_one_owner(state_dir, cgroup_base, env, token, monkeypatch) -> None:
    """The sweep checks an owners file has no lock, then unlinks it by name.
    An adopter that opens, locks and re-stats the file between those two
    steps finds its name still naming its file and takes the slot; the
    unlink then leaves its lock on a nameless inode. The run now looks
    ownerless (`held` finds no file), and a second adopter makes the file
    anew and takes the same slot: two owners of one run. The window is
    made wide here by running the first adopter just before the sweep's
    unlink (timing only: the locks and processes are real)."""
    from launcher import _ownerslots
    from launcher._layout import RunDir
    from launcher._statedir import StateDir

    p, ids = _start_owner(env, 1)
    try:
        assert wait_holders(token, 1)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    path = os.path.join(state_dir, "runs", ids[0])
    fname, k = _slot_of(state_dir, ids[0])
    adopters: list[subprocess.Popen] = []
    said: list[str] = []
    real_unlink = os.unlink

    def adopt_then_unlink(name, *a, **kw):     # the sweep decided; an adopter comes before its unlink
        if name == os.path.basename(fname) and not adopters:
            proc, out = _adopter(env, path)
            adopters.append(proc)
            said.append(out)
        return real_unlink(name, *a, **kw)

    st = StateDir.open(state_dir, write=True)
    try:
        monkeypatch.setattr(os, "unlink", adopt_then_unlink)
        try:
            _ownerslots.sweep(st, time.time())
        finally:
            monkeypatch.setattr(os, "unlink", real_unlink)
        assert len(said) == 1, said
        seen = RunDir(path).owner()
        second, out = _adopter(env, path)
        adopters.append(second)
        said.append(out)
        assert seen is (said[0] == "True"), "a live adopter's run looks ownerless"
        assert said.count("True") == 1, f"two adopters own one run: {said}"
    finally:
        st.close()
        for a in adopters:
            a.kill()
            a.wait(10)
    assert _cancel(env, ids[0]).get("state") == "REAPED"
    assert wait_gone(token, 20) == []


_FORGED_ADOPTER = textwrap.dedent("""
    import os, sys, launcher
    from launcher._layout import RunDir
    state, orphan = sys.argv[1], sys.argv[2]
    sup = launcher.Supervisor(grace=0.5)
    first = sup.spawn(["sleep", "300"])
    print(first.id, os.readlink(os.path.join(state, "runs", first.id, "owner")), flush=True)
    sys.stdin.readline()                         # the orphan's link now names this process's next slot
    x = RunDir(os.path.join(state, "runs", orphan))
    print("adopted", x.take_ownership(), flush=True)
    second = sup.spawn(["sleep", "300"])         # while the orphan is still adopted
    print(second.id, os.readlink(os.path.join(state, "runs", second.id, "owner")), flush=True)
    sys.stdin.readline()
    x.release()                                  # the adoption ends
    print("released", flush=True)
    sys.stdin.read()
""")


@pytest.mark.timeout(180)
def test_a_slot_adopted_through_a_forged_link_is_not_given_to_a_new_run(state_dir, cgroup_base, env,
                                                                        token) -> None:
    """An orphan's `owner` link is the run directory's, which its worker can
    write: it can name a slot of a live process's owners file that the
    process has not given out yet. If that process adopts the orphan (a
    library process calling launcher.cancel on it, in-process), it takes
    the byte through its own descriptor, and a run it starts meanwhile is
    then given the same byte (a second lock on one open file description
    always succeeds). When the adoption ends and the byte is dropped, the
    new run's owner lock goes with it: a live run looks orphaned (the
    janitor, an adopter, `contain ls` would take it for one)."""
    p, ids = _start_owner(env, 1)
    try:
        assert wait_holders(token, 1)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    orphan = ids[0]
    q = subprocess.Popen([PY, "-c", _FORGED_ADOPTER, state_dir, orphan], env={**env, "PYTHONPATH": ROOT},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    started: list[str] = []
    try:
        assert q.stdout is not None and q.stdin is not None
        first, target1 = readline_within(q.stdout, 60).decode().split()
        started.append(first)
        name, _, k = target1.rpartition(":")
        link = os.path.join(state_dir, "runs", orphan, "owner")
        os.unlink(link)
        os.symlink(f"{name}:{int(k) + 1}", link)          # what the orphan's worker could do
        q.stdin.write(b"go\n")
        q.stdin.flush()
        assert readline_within(q.stdout, 60).decode().split() == ["adopted", "True"]
        second, target = readline_within(q.stdout, 60).decode().split()
        started.append(second)
        q.stdin.write(b"go\n")
        q.stdin.flush()
        assert readline_within(q.stdout, 60).strip() == b"released"
        f2, k2 = target.rpartition(":")[0], int(target.rpartition(":")[2])
        assert _held(os.path.join(state_dir, "owners", f2), k2, 1), \
            f"the live run {second} ({target}) lost its owner lock when an adoption of the same slot ended"
    finally:
        q.kill()
        q.wait(10)
    for rid in [orphan, *started]:
        _cancel(env, rid)
    assert wait_gone(token, 30) == []
