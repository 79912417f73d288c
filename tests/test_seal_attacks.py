"""The seal's uid against other users and the sealed worker: it never takes
the uid of a logged-out account, a holder of the claims lock or a fork
during a claim cannot wedge sealed runs, a refused seal claims nothing, and
SysV shared memory a sealed worker made does not outlive its run."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from _proc import contain_cmd, holders, run_contain
from _users import Shared, contain_as, python, spare_uids, user_env, why_not
from conftest import needs_cgroup


_SEAL_IN_OWN_PASSWD = r"""
set -e
mount --bind "$1" /etc/passwd
shift
exec "$@"
"""


@needs_cgroup
@pytest.mark.timeout(90)
def test_seal_never_takes_the_uid_of_an_account_that_is_logged_out(box, tmp_path):
    """`--seal` picks a host uid from 61184-65519 that no live process has.
    A local account in that range (a user, logged out right now) was not
    excluded: the sealed worker ran as that user's uid, so it could write
    that user's files, and that user, once back, could signal or ptrace the
    'sealed' tree. Here every uid of the range but one is an account (in a
    passwd file bind-mounted in a mount namespace of the test's own): the
    run must get that one."""
    from launcher._platform.sealing import DYNAMIC_FIRST, DYNAMIC_LAST, _uids_in_use

    used = _uids_in_use()
    free = next(u for u in range(DYNAMIC_LAST, DYNAMIC_FIRST, -1) if u not in used)
    passwd = tmp_path / "passwd"
    with open("/etc/passwd") as f:
        lines = f.read().splitlines()
    lines += [f"acct{u}:x:{u}:{u}::/home/acct{u}:/bin/sh" for u in range(DYNAMIC_FIRST, DYNAMIC_LAST + 1)
              if u != free]
    passwd.write_text("\n".join(lines) + "\n")
    rec_path = tmp_path / "rec.json"
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", _SEAL_IN_OWN_PASSWD, "sh",
                        str(passwd), *contain_cmd("run", "-q", "--seal", "--id", "su", "--record", str(rec_path),
                                                  "--", "true")],
                       env=box.env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr)
    seal = json.loads(rec_path.read_text())["containment"]["seal"]
    assert seal["host_uid"] == free, f"sealed as uid {seal['host_uid']}, an account's (acct{seal['host_uid']})"
    assert holders(box.token) == []


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a cgroup base of the test's own)")


def _claims_dir(tmp_path) -> str:
    from launcher._platform import sealing

    sd = tmp_path / "state"
    sd.mkdir(mode=0o700)
    d = sd / sealing.CLAIMS
    d.mkdir(mode=0o700)
    return str(sd)


def test_holder_of_the_seal_uid_claims_lock_cannot_wedge_sealed_runs_for_ever(tmp_path, monkeypatch):
    """The claim of a sealed run's uid took a blocking flock of
    dynamic-uids/: one stopped claimer (Ctrl-Z at that moment), or any
    process keeping that lock, made every later `contain run --seal` wait
    for ever, deaf to SIGTERM. It now gives up after a bound, with the reason."""
    import fcntl

    from launcher._platform import sealing

    monkeypatch.setattr(sealing, "_CLAIMS_WAIT_S", 0.5, raising=False)
    sd = _claims_dir(tmp_path)
    monkeypatch.setattr(sealing, "CLAIMS_HOST", os.path.join(sd, sealing.CLAIMS))   # this test's own
    holder = os.open(os.path.join(sd, sealing.CLAIMS), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(holder, fcntl.LOCK_EX)
    claim = _Claim(sealing, sd, "r1")
    try:
        claim.thread.join(5)
        assert not claim.thread.is_alive(), "the claim still waits on the lock after 5 s"
        assert isinstance(claim.error, OSError) and "held its lock" in str(claim.error), claim.error
    finally:
        os.close(holder)          # (a claim still waiting then finishes)
        claim.thread.join(10)
    uid, path = sealing.claim_dynamic_uid(sd, "r2")     # free again: claims go on
    sealing.release_claim(path)


def test_fork_during_a_seal_uid_claim_does_not_keep_the_claims_lock(tmp_path, monkeypatch):
    """The claims directory's fd was only closed, never unlocked: a fork of
    the claimer at that moment (another thread of a library caller) shares
    the flock's open file description and kept the lock as long as the child
    lived, wedging every later sealed run."""
    import signal

    from launcher._platform import sealing

    monkeypatch.setattr(sealing, "_CLAIMS_WAIT_S", 0.5, raising=False)
    sd = _claims_dir(tmp_path)
    monkeypatch.setattr(sealing, "CLAIMS_HOST", os.path.join(sd, sealing.CLAIMS))   # this test's own
    real = sealing._uids_in_use
    children: list[int] = []

    def forking() -> set[int]:
        pid = os.fork()
        if pid == 0:            # the other thread's child: lives on, fds and all
            time.sleep(30)
            os._exit(0)
        children.append(pid)
        return real()

    monkeypatch.setattr(sealing, "_uids_in_use", forking)
    try:
        _uid, p1 = sealing.claim_dynamic_uid(sd, "r1")
        monkeypatch.setattr(sealing, "_uids_in_use", real)
        sealing.release_claim(p1)
        claim = _Claim(sealing, sd, "r2")
        claim.thread.join(5)
        assert not claim.thread.is_alive(), "the next claim still waits on the lock the fork kept"
        assert claim.error is None, claim.error
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    claim.thread.join(10)
    sealing.release_claim(claim.path)


class _Claim:
    """claim_dynamic_uid in a thread of its own, so that a claim that waits
    for ever fails the test instead of hanging it."""

    def __init__(self, sealing, sd: str, run_id: str) -> None:
        import threading

        self.error: BaseException | None = None
        self.path: str | None = None

        def go() -> None:
            try:
                _uid, self.path = sealing.claim_dynamic_uid(sd, run_id)
            except BaseException as e:      # noqa: BLE001 (reported by the test)
                self.error = e

        self.thread = threading.Thread(target=go, daemon=True)
        self.thread.start()


_SHM = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(int(sys.argv[1]), 1 << 20, 0o1000 | 0o600)     # IPC_CREAT, 1 MiB
print("shmid", shmid, ctypes.get_errno(), flush=True)
"""


def _shm_with_key(key: int) -> list[int]:
    with open("/proc/sysvipc/shm") as f:
        next(f)
        return [int(line.split()[1]) for line in f if int(line.split()[0]) == key]


@needs_root
def test_sealed_worker_leaving_sysv_shared_memory_leaves_nothing_behind_its_run(contained):
    """A sealed run shared the host's IPC namespace: its worker made a SysV
    shared memory segment and exited, the run ended REAPED and sealed, and
    the segment stayed for good (pinned memory, in no live cgroup), owned by
    the dynamic uid that a later sealed run may be given, which could then
    attach it and read what this run left."""
    import secrets

    key = 0x5e000000 + secrets.randbelow(1 << 24)
    try:
        p = run_contain(contained["env"], "run", "-q", "--seal", "--", python(), "-c", _SHM, str(key))
        assert p.returncode == 0, p.stderr
        assert "shmid -1" not in p.stdout, p.stdout      # the worker did make it
        assert _shm_with_key(key) == [], "the sealed run's shared memory outlived it"
    finally:
        for shmid in _shm_with_key(key):
            subprocess.run(["ipcrm", "-m", str(shmid)], timeout=10)


USERS_SKIP = why_not()


@needs_cgroup
@pytest.mark.timeout(60)
@pytest.mark.skipif(USERS_SKIP is not None, reason=USERS_SKIP or "")
def test_refused_seal_of_an_unprivileged_caller_claims_no_reaped_namespace():
    # A caller without root asks for --seal, which the pidns backend refuses
    # before anything is spawned (exit 125). The record said
    # container_empty observed true "via the PID namespace's init was
    # reaped" (and descendants_exit on the same proof) for a namespace that
    # was never made: nothing was there to be reaped.
    uid = spare_uids(1)[0]
    with Shared() as sh:
        env = user_env(XDG_RUNTIME_DIR=sh.sub("xdg", uid=uid, mode=0o700))
        p = contain_as(uid, "run", "-q", "--id", "sl", "--seal", "--", "true", env=env)
        assert p.returncode == 125 and "Traceback" not in p.stderr, p.stderr
        with open(os.path.join(env["XDG_RUNTIME_DIR"], "contain", "runs", "sl", "record.json")) as f:
            rec = json.load(f)
        assert rec["outcome"] == "spawn_failed" and rec["containment"]["walls"] == [], rec["containment"]
        for layer in ("container_empty", "descendants_exit"):
            assert "init was reaped" not in (rec["evidence"][layer]["via"] or ""), rec["evidence"][layer]
