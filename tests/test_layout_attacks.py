"""The run directory, the record and every input are untrusted (issue 10).

One test per attack, named after it, with real second uids (setpriv), real
symlinks, real device nodes and FIFOs, a real tmpfs that fills up and real
corrupt files. Each asserts what the victim relies on: nothing forged,
nothing of the victim's touched, nothing leaked, no traceback.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time

import pytest

import launcher

from _proc import contain_cmd, holders, run_contain, wait_holders
from _users import ROOT, Shared, as_uid, contain_as, python, spare_uids, user_env, why_not
from conftest import needs_cgroup

USERS_SKIP = why_not()
needs_users = pytest.mark.skipif(USERS_SKIP is not None, reason=USERS_SKIP or "")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, mount namespaces, chown)")
UID = "0123456789abcdef"


def one_line(stderr: str) -> str:
    """The refusal is one line (plus nothing else) and never a traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def snapshot(top: str) -> list[tuple[str, int, int, str]]:
    """Every entry under `top`: path, owner, mode, and a digest of content."""
    out = []
    for d, dirs, files in os.walk(top):
        for n in sorted(dirs + files):
            p = os.path.join(d, n)
            st = os.lstat(p)
            digest = ""
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(p)
            out.append((os.path.relpath(p, top), st.st_uid, st.st_mode, digest))
    return sorted(out)


def good_record(run_id: str, **extra: object) -> dict:
    return {"schema": "contain.stop-record/1", "run_id": run_id, "run_uid": UID, "state": "REAPED",
            "outcome": "exited", "exit_code": 0, "signal": None, "argv": ["true"], "evidence": {},
            "timings": {"spawned_at": "2026-01-01T00:00:00.000000Z", "ended_at": "2026-01-01T00:00:01.000000Z"},
            "notes": [], **extra}


# -- 1. a state directory that is ours ------------------------------------------------

@needs_users
@pytest.mark.parametrize("how", ["owned_by_another_user", "world_writable", "symlink_to_attackers_dir",
                                 "under_a_world_writable_parent"])
def test_squatted_state_dir_is_refused(box, how):
    attacker, = spare_uids(1)
    with Shared() as sh:
        if how == "owned_by_another_user":
            sd = sh.sub("state", uid=attacker, mode=0o700)
            os.mkdir(os.path.join(sd, "runs"))
            os.chown(os.path.join(sd, "runs"), attacker, attacker)
            watched, expect = sd, f"uid {attacker}"
        elif how == "world_writable":
            sd = sh.sub("state", mode=0o777)
            watched, expect = sd, "writable by its group and others"
        elif how == "symlink_to_attackers_dir":
            target = sh.sub("attackers", uid=attacker, mode=0o777)
            sd = os.path.join(sh.path, "state")
            os.symlink(target, sd)
            os.lchown(sd, attacker, attacker)
            watched, expect = target, "symlink"
        else:
            parent = sh.sub("open", mode=0o777)           # no sticky bit: anyone may rename entries
            sd = os.path.join(parent, "state")
            os.mkdir(sd, 0o700)
            watched, expect = parent, "another user could replace"
        before = snapshot(watched)
        env = dict(box.env, CONTAIN_STATE_DIR=sd)
        for args in (["run", "--id", "r", "--", "true"], ["ls"], ["status", "r"], ["cancel", "r"],
                     ["wait", "r"], ["gc"]):
            p = run_contain(env, *args)
            line = one_line(p.stderr)
            assert p.returncode == 125, (args, p.returncode, p.stderr)
            assert expect in line, line
        assert snapshot(watched) == before, "nothing may be created in or changed under a refused directory"
    assert holders(box.token) == []


@needs_users
def test_a_squatted_tmp_default_is_refused_never_used():
    """Without XDG_RUNTIME_DIR, /run/user/<uid> or a home (cron, su, a
    container's numeric uid), the state directory is /tmp/contain-<uid>. One
    that another user made first is refused with advice, and nothing is
    written into it: the squatter can deny the default, never read or forge
    the victim's runs."""
    victim, attacker = spare_uids(2)
    assert not os.path.exists(f"/run/user/{victim}")
    squat = f"/tmp/contain-{victim}"
    p = as_uid(attacker, ["mkdir", "-m", "0777", squat])
    assert p.returncode == 0, p.stderr
    try:
        before = snapshot(squat)
        for args in (["ls"], ["run", "--backend", "none", "--", "true"]):
            p = contain_as(victim, *args, env=user_env())
            line = one_line(p.stderr)
            assert p.returncode == 125, p.stderr
            assert "CONTAIN_STATE_DIR" in line and "XDG_RUNTIME_DIR" in line and f"uid {attacker}" in line, line
        assert snapshot(squat) == before == []
    finally:
        shutil.rmtree(squat, ignore_errors=True)


@needs_users
def test_no_runtime_dir_and_no_home_means_a_private_tmp_default():
    """The same user with no squatter: its own /tmp/contain-<uid>, made 0700."""
    victim, = spare_uids(1)
    mine = f"/tmp/contain-{victim}"
    assert not os.path.exists(mine)
    try:
        p = contain_as(victim, "run", "--backend", "none", "--", "true", env=user_env(HOME="/"))
        assert p.returncode == 0, p.stderr
        st = os.lstat(mine)
        assert stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_mode & 0o777) == (victim, 0o700)
    finally:
        shutil.rmtree(mine, ignore_errors=True)


@needs_users
def test_su_inherited_runtime_dir_of_another_user_is_not_used():
    """`su` keeps the caller's XDG_RUNTIME_DIR: the other user's directory is
    not taken as ours (the next default is)."""
    victim, other = spare_uids(2)
    with Shared() as sh:
        theirs = sh.sub("run-user", uid=other, mode=0o700)
        home = sh.sub("home", uid=victim, mode=0o700)
        p = contain_as(victim, "run", "--backend", "none", "--", "true",
                       env=user_env(XDG_RUNTIME_DIR=theirs, HOME=home))
        assert p.returncode == 0, p.stderr
        assert os.listdir(theirs) == []
        assert os.path.isdir(os.path.join(home, ".local", "state", "contain", "runs"))


@needs_root
def test_elevated_contain_ignores_the_callers_state_dir():
    """A contain with privilege its caller lacks (uid != euid, gid != egid)
    never lets the caller's environment choose where it writes."""
    code = ("from launcher._statedir import location, policy_env, elevated; "
            "e = {'CONTAIN_STATE_DIR': '/tmp/evil', 'CONTAIN_CGROUP_BASE': '/evil', 'XDG_RUNTIME_DIR': '/tmp'}; "
            "print(elevated(), location(e), policy_env('CONTAIN_CGROUP_BASE', e))")
    uid, = spare_uids(1)
    env = user_env()
    for flags in ([f"--ruid={uid}"], [f"--rgid={uid}", "--keep-groups"]):
        p = subprocess.run(["setpriv", *flags, "--", sys.executable, "-c", code], env=env,
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 0, p.stderr
        assert p.stdout.split() == ["True", "/run/contain", "None"], p.stdout
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert p.stdout.split() == ["False", "/tmp/evil", "/evil"], p.stdout


@needs_cgroup
def test_umask_000_does_not_open_the_run_dir(box):
    proc = subprocess.Popen(contain_cmd("run", "--id", "r", "--", "sleep", "300"), env=box.env,
                            preexec_fn=lambda: os.umask(0), stderr=subprocess.PIPE, text=True)
    try:
        assert wait_holders(box.token, 2), "workload did not start"
        p = run_contain(box.env, "cancel", "r", "--op-id", "x", "--wait")   # makes acks and waiters too
        assert p.returncode == 0, p.stderr
    finally:
        proc.wait(30)
    for rel, uid, mode, _ in snapshot(box.state_dir):
        if stat.S_ISLNK(mode):
            continue          # the `owner` link: a symlink's mode is always 0777 and means nothing
        perm = stat.S_IMODE(mode)
        assert perm & 0o022 == 0, (rel, oct(perm))
        if rel.startswith("runs/r"):
            assert perm & 0o077 == 0, (rel, oct(perm))     # the run directory is private, whatever the umask
    assert stat.S_IMODE(os.stat(box.state_dir).st_mode) == 0o755     # root's top: listable, no more


# -- 1. the owner's wake-up cannot be driven by other users ---------------------------

@needs_users
@needs_cgroup
def test_other_users_cannot_poke_the_owner(box):
    sh = Shared()
    try:
        sd = os.path.join(sh.path, "state")
        env = dict(box.env, CONTAIN_STATE_DIR=sd)
        proc = subprocess.Popen(contain_cmd("run", "--id", "r", "--", "sleep", "300"), env=env,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert wait_holders(box.token, 2), "workload did not start"
            wake = os.path.join(sd, "runs", "r", "cancellations", "wake")
            for _ in range(100):
                if os.path.exists(wake):
                    break
                time.sleep(0.02)
            assert stat.S_IMODE(os.stat(wake).st_mode) == 0o600
            attacker, = spare_uids(1)
            code = ("import os, sys\n"
                    "for p in sys.argv[1:]:\n"
                    "    try:\n"
                    "        os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK | os.O_APPEND | os.O_CREAT, 0o666))\n"
                    "        print('opened', p)\n"
                    "    except OSError as e:\n"
                    "        print('refused', e.errno)\n")
            inbox = os.path.join(sd, "runs", "r", "cancellations", "requests.ndjson")
            p = as_uid(attacker, [python(), "-c", code, wake, inbox])
            assert p.stdout.split() == ["refused", str(errno.EACCES)] * 2, p.stdout + p.stderr
            assert proc.poll() is None, "the run is untouched"
        finally:
            proc.terminate()
            proc.wait(30)
    finally:
        sh.close()
    assert holders(box.token) == []


# -- 2. --record is safe ------------------------------------------------------------------

@needs_users
@needs_cgroup
def test_symlinked_record_path_is_not_followed(box, tmp_path):
    """Another user's symlink where root's --record points: refused before
    anything runs; what it points at is untouched, the link stays a link."""
    attacker, = spare_uids(1)
    secret = tmp_path / "secret"
    secret.write_text("SECRET\n")
    secret.chmod(0o600)
    with Shared(mode=0o1777) as sh:              # a /tmp-like shared directory
        link = os.path.join(sh.path, "rec.json")
        assert as_uid(attacker, ["ln", "-s", str(secret), link]).returncode == 0
        p = run_contain(box.env, "run", "--id", "r", "--record", link, "--", "true")
        line = one_line(p.stderr)
        assert p.returncode == 125 and "not followed" in line, p.stderr
        assert os.readlink(link) == str(secret)
    assert secret.read_text() == "SECRET\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not os.path.exists(os.path.join(box.state_dir, "runs", "r")), "refused before the claim"


@needs_users
@needs_cgroup
def test_symlink_spray_on_record_temp_names_is_harmless(box, tmp_path):
    """The temp file of --record had a predictable name (FILE.tmp.<pid>):
    a spray of symlinks there made root overwrite its own files. Temp names
    are random and made O_EXCL|O_NOFOLLOW now."""
    attacker, = spare_uids(1)
    secret = tmp_path / "secret"
    secret.write_text("SECRET\n")
    secret.chmod(0o600)
    with Shared(mode=0o1777) as sh:
        out = os.path.join(sh.path, "out.json")
        with open("/proc/sys/kernel/ns_last_pid") as f:
            last = int(f.read())
        names = " ".join(f"{out}.tmp.{pid}" for pid in range(last, last + 400))
        p = as_uid(attacker, ["sh", "-c", f"for n in {names}; do ln -s {secret} $n; done"])
        assert p.returncode == 0, p.stderr
        p = run_contain(box.env, "run", "--id", "r", "--record", out, "--", "true")
        assert p.returncode == 0, p.stderr
        st = os.lstat(out)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
        with open(out) as f:
            assert json.load(f) == box.record("r")
    assert secret.read_text() == "SECRET\n"


@needs_root
@needs_cgroup
@pytest.mark.parametrize("node", ["full", "null"])
def test_record_to_dev_full_is_not_replaced(box, tmp_path, node):
    """`--record /dev/full` made /dev/full a regular file (rename over it).
    Real device nodes of our own (the same major:minor as /dev/full and
    /dev/null), never the host's: code with the bug must not break the host
    it is tested on. Written in place, never replaced; /dev/full's ENOSPC is
    an error the user sees (125), the run itself still ends and is recorded."""
    dev = os.makedev(1, 7) if node == "full" else os.makedev(1, 3)
    path = str(tmp_path / node)
    os.mknod(path, stat.S_IFCHR | 0o666, dev)
    p = run_contain(box.env, "run", "--id", "r", "--record", path, "--", "true")
    st = os.lstat(path)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == dev, "the device node is still the device"
    if node == "full":
        line = one_line(p.stderr)
        assert p.returncode == 125 and "No space left on device" in line, p.stderr
    else:
        assert p.returncode == 0 and p.stderr == "", p.stderr
    assert box.record("r")["state"] == "REAPED"
    assert holders(box.token) == []


@needs_cgroup
def test_record_dash_is_stdout_not_a_file_named_dash(box, tmp_path):
    p = run_contain(box.env, "run", "--id", "r", "--record", "-", "--", "echo", "hi", cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("hi\n")
    assert json.loads(p.stdout[3:]) == box.record("r")
    assert not (tmp_path / "-").exists()


@needs_cgroup
def test_record_to_dev_stdout_does_not_clobber_the_workers_output(box, tmp_path):
    """`> out --record /dev/stdout`: /dev/stdout names the file stdout is
    redirected to; it is written through stdout (after the worker's output),
    never reopened from offset 0 or replaced."""
    # What /dev/stdout is (a root-owned symlink to /proc/self/fd/1), made
    # here: code with the bug replaced the host's /dev/stdout with a file.
    dev_stdout = tmp_path / "stdout"
    os.symlink("/proc/self/fd/1", dev_stdout)
    out = tmp_path / "out"
    with open(out, "w") as f:
        p = subprocess.run(contain_cmd("run", "--id", "r", "--record", str(dev_stdout), "--", "echo", "hi"),
                           env=box.env, stdout=f, stderr=subprocess.PIPE, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert text.startswith("hi\n") and json.loads(text[3:]) == box.record("r")
    assert os.readlink(dev_stdout) == "/proc/self/fd/1"


@needs_cgroup
def test_record_to_a_fifo_is_written_in_place(box, tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    p = run_contain(box.env, "run", "--id", "early", "--record", fifo, "--", "true")
    assert p.returncode == 125 and "no reader" in one_line(p.stderr)
    assert not os.path.exists(os.path.join(box.state_dir, "runs", "early")), "refused before the spawn"
    got: list[bytes] = []

    def reader() -> None:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                try:
                    b = os.read(fd, 65536)
                except BlockingIOError:
                    time.sleep(0.01)
                    continue
                if b:
                    got.append(b)
                elif got:
                    return
                else:
                    time.sleep(0.01)
        finally:
            os.close(fd)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.1)
    p = run_contain(box.env, "run", "--id", "r", "--record", fifo, "--", "true")
    t.join(40)
    assert p.returncode == 0, p.stderr
    assert json.loads(b"".join(got)) == box.record("r")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# -- 4. every request is validated ------------------------------------------------------

POISON = [
    b"[]",
    b'"x"',
    b"null",
    b'{"op_id": "soon", "run_uid": "%s", "grace": "soon"}' % UID.encode(),
    b'{"op_id": 5, "run_uid": "%s"}' % UID.encode(),
    b'{"op_id": "huge", "run_uid": "%s", "grace": 1e999}' % UID.encode(),          # inf
    b'{"op_id": "nan", "run_uid": "%s", "grace": NaN}' % UID.encode(),
    b'{"op_id": "bool", "run_uid": "%s", "grace": true}' % UID.encode(),
    b'{"op_id": "neg", "run_uid": "%s", "grace": -1}' % UID.encode(),
    b'{"op_id": "by", "run_uid": "%s", "by": "me"}' % UID.encode(),
    b'{"op_id": "when", "run_uid": "%s", "requested_at": 7}' % UID.encode(),
    b'{"op_id": "nouid"}',
    b'{"op_id": "stale", "run_uid": "ffffffffffffffff"}',
    b'{"op_id": "' + b"x" * 300 + b'", "run_uid": "%s"}' % UID.encode(),
    b"[" * 3000 + b"]" * 3000,
    b"\xff\xfe not utf-8",
    b"{truncated",
]


def test_poisoned_inbox_line_is_rejected(tmp_path):
    """Lines a worker (same uid) could write into its own inbox: every one is
    rejected with a reason, the one real request is accepted, nothing raises."""
    from launcher._layout import RunDir

    d = RunDir.claim("r", str(tmp_path / "state"))
    try:
        real = b'{"op_id": "real", "run_uid": "%s", "grace": 1.5, "requested_at": "2026-01-01T00:00:00.5Z"}' % (
            UID.encode())
        with open(d.requests, "ab") as f:
            f.write(b"\n".join(POISON[:8] + [real] + POISON[8:]) + b"\n")
        got = d.read_inbox(0, UID)
        assert [(r.op_id, r.grace, r.run_uid) for r in got.accepted] == [("real", 1.5, UID)]
        assert len(got.rejected) == len(POISON)
        assert all(isinstance(r.reason, str) and r.reason for r in got.rejected)
        named = {r.op_id for r in got.rejected if r.op_id}
        assert {"soon", "huge", "nan", "bool", "neg", "by", "when", "nouid", "stale"} <= named
        assert got.offset == os.path.getsize(d.requests)
        # The interface the driver uses today hands on only well-formed requests.
        reqs, off = d.read_requests(0)
        assert off == got.offset
        for r in reqs:
            assert isinstance(r["op_id"], str) and (r.get("grace") is None or 0 <= r["grace"] <= 1e9)
        assert [r["op_id"] for r in reqs] == ["real", "nouid", "stale"]   # run uid is the owner's to compare
    finally:
        d.release()


def test_huge_unterminated_line_is_read_once(tmp_path):
    """A 16 MB line with no newline: rejected once, then skipped; each read
    of the inbox is bounded (bytes read, from /proc/self/io), and the request
    after it is found."""
    from launcher._layout import RunDir
    from launcher._requests import INBOX_CHUNK

    d = RunDir.claim("r", str(tmp_path / "state"))
    try:
        with open(d.requests, "wb") as f:
            f.write(b"{" + b"x" * (16 << 20))

        def rchar() -> int:
            with open("/proc/self/io") as f:
                return int(next(x for x in f if x.startswith("rchar")).split()[1])

        offset, rejected, calls = 0, 0, 0
        while True:
            before = rchar()
            got = d.read_inbox(offset, UID)
            assert rchar() - before <= INBOX_CHUNK + 4096, "one call reads one bounded chunk"
            assert got.offset > offset or not got.more
            rejected += len(got.rejected)
            assert not got.accepted
            offset = got.offset
            calls += 1
            if not got.more:
                break
        assert rejected == 1 and offset == os.path.getsize(d.requests)
        with open(d.requests, "ab") as f:
            f.write(b'\n{"op_id": "after", "run_uid": "%s"}\n' % UID.encode())
        got = d.read_inbox(offset, UID)
        assert [r.op_id for r in got.accepted] == ["after"] and not got.rejected
    finally:
        d.release()


@needs_cgroup
def test_poisoned_inbox_line_does_not_stop_a_cancel(box):
    """A worker writes non-requests into its own inbox (it has the owner's
    uid): the owner survives them and the real cancel still stops the run."""
    proc = subprocess.Popen(contain_cmd("run", "--id", "r", "--", "sh", "-c", "setsid sleep 300 & sleep 300"),
                            env=box.env, stderr=subprocess.PIPE, text=True)
    try:
        assert len(wait_holders(box.token, 3)) >= 3, "workload did not start"
        inbox = os.path.join(box.state_dir, "runs", "r", "cancellations", "requests.ndjson")
        with open(os.path.join(box.state_dir, "runs", "r", "run.json")) as f:
            uid = json.load(f)["run_uid"]         # written before the worker ran (the record may not be yet)
        # (Not the lines without a run uid: the driver of today still takes
        # those as its own run's, and the worker may cancel its own run.)
        poison = [p.replace(UID.encode(), uid.encode()) for p in POISON if b"nouid" not in p]
        with open(inbox, "ab") as f:
            f.write(b"\n".join(poison) + b"\n")
            f.write(b"{" + b"y" * 200_000)          # unterminated
        time.sleep(0.3)
        assert proc.poll() is None
        p = run_contain(box.env, "cancel", "r", "--op-id", "real", "--wait", "--json")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["effect"] == "cancelled"
    finally:
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise
    assert rc == 143
    assert "Traceback" not in proc.stderr.read()
    assert box.record("r")["state"] == "REAPED"
    assert holders(box.token) == []


# -- 5. one owner, provably ------------------------------------------------------------

_OWNER = """
import sys, time
sys.path.insert(0, {root!r})
from launcher._layout import RunDir
d = RunDir.claim("r", {sd!r})
print("owning", flush=True)
sys.stdin.read()
"""

_PROBE = """
import sys, time
sys.path.insert(0, {root!r})
from launcher._layout import RunDir
d = RunDir.find("r", {sd!r})
seen = {{True: 0, False: 0, None: 0}}
end = time.monotonic() + {secs}
while time.monotonic() < end:
    seen[d.owner()] += 1
print(seen[True], seen[False], seen[None])
"""

_ADOPT = """
import sys, time
sys.path.insert(0, {root!r})
from launcher._layout import RunDir
d = RunDir.find("r", {sd!r})
won = 0
end = time.monotonic() + {secs}
while time.monotonic() < end:
    if d.take_ownership():
        won += 1
        d.release()
print(won)
"""


def test_readers_never_make_a_live_run_look_orphaned(tmp_path):
    """Readers (ls, status, wait) probing the owner lock while an adopter
    tries to take it: with flock, a reader's LOCK_SH made a live run look
    orphaned and a claim lose its lock. Readers take nothing now: every probe
    sees the owner, and nobody else becomes the owner while it lives."""
    sd = str(tmp_path / "state")
    owner = subprocess.Popen([sys.executable, "-c", _OWNER.format(root=ROOT, sd=sd)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "owning"
        probes = [subprocess.Popen([sys.executable, "-c", _PROBE.format(root=ROOT, sd=sd, secs=1.5)],
                                   stdout=subprocess.PIPE, text=True) for _ in range(3)]
        adopters = [subprocess.Popen([sys.executable, "-c", _ADOPT.format(root=ROOT, sd=sd, secs=1.5)],
                                     stdout=subprocess.PIPE, text=True) for _ in range(2)]
        for p in probes:
            alive, orphaned, unknown = map(int, p.communicate(timeout=30)[0].split())
            assert alive > 100 and orphaned == 0 and unknown == 0, (alive, orphaned, unknown)
        for a in adopters:
            assert a.communicate(timeout=30)[0].strip() == "0", "nobody adopts a run whose owner lives"
    finally:
        owner.stdin.close()
        owner.wait(30)
    # The owner is gone: exactly one of two racing adopters wins.
    code = f"""
import sys
sys.path.insert(0, {ROOT!r})
from launcher._layout import RunDir
d = RunDir.find("r", {sd!r})
sys.stdin.readline()
print(d.take_ownership(), flush=True)
sys.stdin.readline()
"""
    racers = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True) for _ in range(2)]
    try:
        time.sleep(0.5)
        for r in racers:
            r.stdin.write("go\n")
            r.stdin.flush()
        answers = sorted(r.stdout.readline().strip() for r in racers)
        assert answers == ["False", "True"], answers
    finally:
        for r in racers:
            r.stdin.close()
            r.wait(30)


# -- 6. persistence never tears a good file -------------------------------------------

_FULL = r"""
import json, os, sys
sys.path.insert(0, {root!r})
from launcher._layout import RunDir
from launcher._safefs import PersistError

mnt = sys.argv[1]
UID = {uid!r}
d = RunDir.claim("r", os.path.join(mnt, "state"))
good = json.loads({good!r})
d.write_record(good, durable=True)
d.append_request({{"op_id": "r1", "run_uid": UID, "pad": "a" * 3000}})
d.journal("start")
rec_path = os.path.join(d.path, "record.json")
before = open(rec_path, "rb").read()

filler = os.path.join(mnt, "filler")
with open(filler, "wb", buffering=0) as f:
    try:
        while True:
            f.write(b"\0" * 4096)
    except OSError:
        pass
results = {{}}
attempts = {{
    "record": lambda: d.write_record(dict(good, notes=["x" * 20000]), durable=True),
    "journal": lambda: d.journal("torn", pad="y" * 6000),
    "request": lambda: d.append_request({{"op_id": "r2", "run_uid": UID, "pad": "b" * 2000}}),
    "ack": lambda: d.write_ack("r1", {{"op_id": "r1", "effect": "cancelled", "pad": "q" * 20000}}, durable=True),
    "run": lambda: d.write_run({{"run_id": "r", "run_uid": UID, "argv": ["x" * 20000]}}),
}}
for name, fn in attempts.items():
    try:
        fn()
        results[name] = "written"
    except PersistError as e:
        results[name] = ["PersistError", e.errno, str(e)]
    except BaseException as e:
        results[name] = ["other", type(e).__name__, str(e)]
same = open(rec_path, "rb").read() == before
leftovers = [n for top in (d.path, d.cancellations) for n in os.listdir(top) if n.endswith(".tmp")]
os.unlink(filler)
d.journal("after")
d.append_request({{"op_id": "r3", "run_uid": UID}})
events = [e["event"] for e in d.read_journal()]
inbox = d.read_inbox(0, UID)
from launcher._safefs import in_memory
mfd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
print(json.dumps({{"in_memory": in_memory(mfd), "results": results, "same": same, "leftovers": leftovers, "events": events,
                  "accepted": [r.op_id for r in inbox.accepted], "rejected": len(inbox.rejected),
                  "record": json.loads(open(rec_path).read()) == good}}))
"""


def _in_full_tmpfs(script_args: list[str], size: str = "64k", timeout: float = 60,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command with a fresh tmpfs of `size` mounted at a directory of
    ours, in a private mount namespace: the mount vanishes with it."""
    import tempfile

    mnt = tempfile.mkdtemp(prefix="contain-full-")
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               'mount -t tmpfs -o size="$1",mode=0700 tmpfs "$2" && shift 2 && exec "$@"',
                               "sh", size, mnt, *[a.replace("{mnt}", mnt) for a in script_args]],
                              capture_output=True, text=True, timeout=timeout, env=env)
    finally:
        os.rmdir(mnt)


def _unshare_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs in a mount namespace"
    if shutil.which("unshare") is None:
        return "unshare not installed"
    return None


needs_mount = pytest.mark.skipif(_unshare_reason() is not None, reason=_unshare_reason() or "")


@needs_mount
def test_full_state_dir_never_tears_the_record(tmp_path):
    from launcher._safefs import in_memory

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        on_disk = in_memory(fd)
    finally:
        os.close(fd)
    with open("/proc/self/mountinfo") as f:
        assert on_disk == any(line.split(" - ")[1].startswith("tmpfs ") and
                              os.path.realpath(str(tmp_path)).startswith(line.split()[4].rstrip("/") + "/")
                              for line in f)
    good = json.dumps(good_record("r"))
    p = _in_full_tmpfs([sys.executable, "-c", _FULL.format(root=ROOT, uid=UID, good=good), "{mnt}"])
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["in_memory"] is True, "fsync is skipped on tmpfs (and only there)"
    for name, res in out["results"].items():
        assert res[0] == "PersistError" and res[1] in (errno.ENOSPC, errno.EDQUOT), (name, res)
    assert out["same"] and out["record"], "the good record is still there, whole"
    assert out["leftovers"] == [], "no temp file is left behind"
    assert out["events"] == ["start", "after"], "a torn journal line never swallows the next one"
    assert out["accepted"] == ["r1", "r3"] and out["rejected"] == 1, out


@needs_mount
@needs_cgroup
def test_record_that_cannot_be_written_is_an_error_the_user_sees(box):
    """--record on a file system that is full by the time the run ends: the
    run is stopped and recorded in its state directory, the old --record
    file is intact, and contain says so on one line with exit 125."""
    script = ('printf OLD > {mnt}/rec.json && head -c 1M /dev/zero > {mnt}/filler 2>/dev/null; '
              f'exec {sys.executable} -m launcher run --id r --record {{mnt}}/rec.json -- '
              'sh -c "setsid sleep 300 & exit 0"; ')
    p = _in_full_tmpfs(["sh", "-c", script + "echo rc=$? >&2"], env=box.env)
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 125, p.stderr
    assert "could not be written" in p.stderr and "No space left on device" in p.stderr
    assert box.record("r")["state"] == "REAPED"
    assert holders(box.token) == []


# -- 7. every failure after the claim rolls back ----------------------------------------

@needs_cgroup
@pytest.mark.forked        # it lowers RLIMIT_NOFILE of the test process
def test_a_start_that_runs_out_of_descriptors_wedges_nothing(contained):
    """EMFILE at every point of the start-up in turn (the soft descriptor
    limit raised one at a time): each failed start is an error the caller
    gets, and leaves no descriptor, no child, no cgroup and no held id
    behind; the id then runs normally."""
    import resource

    from conftest import children_of, fd_count

    env = contained["env"]
    launcher.run(["true"], env=env)           # warm: imports, the base, the state directory
    base_fds, kids = fd_count(), children_of(os.getpid())
    cgroups = sorted(os.listdir(contained["cgroup_base"]))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    failures = 0
    try:
        for limit in range(base_fds + 1, base_fds + 60):
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            try:
                rec = launcher.run(["true"], id="e", env=env)
            except (launcher.LauncherError, OSError):
                rec = None
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            assert fd_count() == base_fds, f"descriptors leaked by a start that failed at limit {limit}"
            assert children_of(os.getpid()) == kids
            assert sorted(os.listdir(contained["cgroup_base"])) == cgroups, f"a cgroup left at limit {limit}"
            if rec is not None and rec.outcome == "exited":
                break
            failures += 1
            assert rec is None or rec.state in ("REAPED", "UNCONFIRMED"), rec.to_dict()
        else:
            pytest.fail("the run never started, even with 60 descriptors to spare")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert failures > 3, "the limit never bit: the test proved nothing"
    again = launcher.run(["true"], id="e", env=env)
    assert again.state == "REAPED" and again.exit_code == 0


@needs_cgroup
def test_an_unknown_user_is_refused_before_anything_is_made(box):
    p = run_contain(box.env, "run", "--id", "nu", "--user", "contain-no-such-user", "--", "true")
    assert p.returncode == 2 and "no such user" in one_line(p.stderr)
    assert not os.path.exists(os.path.join(box.state_dir, "runs", "nu")) or \
        box.record("nu")["outcome"] == "spawn_failed"
    assert box.leaves() == []
    p = run_contain(box.env, "run", "--id", "nu", "--", "true")
    assert p.returncode == 0, p.stderr


# -- 8. readers are robust ---------------------------------------------------------------

@needs_cgroup
def test_summary_that_does_not_name_the_record_beside_it_is_not_believed(box):
    """`ls` reads each run's summary.json (what it shows of record.json) and
    believes it only while it names the record.json there now (inode, size,
    mtime): a record rewritten in any way, even to the same length with its
    old mtime put back, is read whole again, and a summary copied from
    another run says nothing."""
    for rid in ("a", "b", "c"):
        assert run_contain(box.env, "run", "--id", rid, "--", "true").returncode == 0
    runs = os.path.join(box.state_dir, "runs")
    rec_a, sum_a = (os.path.join(runs, "a", n) for n in ("record.json", "summary.json"))
    with open(sum_a) as f:
        summary = json.load(f)
    st = os.stat(rec_a)
    assert summary["of"] == [st.st_ino, st.st_size, st.st_mtime_ns] and summary["state"] == "REAPED", summary
    # Same length, same inode, mtime put back: the summary still names it,
    # so `ls` shows what the owner wrote; status reads the record itself.
    with open(rec_a, "r+b") as f:
        f.write(b"x" * st.st_size)
    os.utime(rec_a, ns=(st.st_atime_ns, st.st_mtime_ns))
    # Another length: the summary no longer names it.
    with open(os.path.join(runs, "b", "record.json"), "wb") as f:
        f.write(b'"x"')
    shutil.copy(sum_a, os.path.join(runs, "c", "summary.json"))       # run a's summary in run c
    views = {v["id"]: v for v in json.loads(run_contain(box.env, "ls", "--all", "--json").stdout)}
    assert views["a"]["state"] == "REAPED"
    assert views["b"]["state"] == "UNREADABLE", views["b"]
    assert views["c"]["state"] == "REAPED" and views["c"]["run_uid"] == box.record("c")["run_uid"], views["c"]
    s = run_contain(box.env, "status", "a", timeout=20)
    assert "UNREADABLE" in s.stdout, s.stdout


@needs_cgroup
def test_corrupt_record_shows_unreadable(box):
    for rid in ("good", "str", "torn", "norid", "runjson", "fifo"):
        assert run_contain(box.env, "run", "--id", rid, "--", "true").returncode == 0
    runs = os.path.join(box.state_dir, "runs")

    def put(rid: str, name: str, data: bytes) -> None:
        with open(os.path.join(runs, rid, name), "wb") as f:
            f.write(data)

    put("str", "record.json", b'"x"')
    with open(os.path.join(runs, "torn", "record.json"), "rb") as f:
        head = f.read(100)
    put("torn", "record.json", head)
    put("norid", "record.json", b'{"state": "RUNNING"}')
    put("runjson", "run.json", b"[]")
    os.unlink(os.path.join(runs, "runjson", "record.json"))
    os.unlink(os.path.join(runs, "fifo", "record.json"))
    os.mkfifo(os.path.join(runs, "fifo", "record.json"))
    p = run_contain(box.env, "ls", "--all", timeout=20)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    rows = {line.split()[0]: line for line in p.stdout.splitlines()[1:] if line.strip()}
    assert "REAPED" in rows["good"]
    for rid in ("str", "torn", "norid", "runjson", "fifo"):
        assert "UNREADABLE" in rows[rid] and "(" in rows[rid], rows[rid]      # with why
    views = {v["id"]: v for v in json.loads(run_contain(box.env, "ls", "--all", "--json").stdout)}
    assert views["good"]["state"] == "REAPED"
    assert all(views[r]["state"] == "UNREADABLE" and views[r]["unreadable"] for r in
               ("str", "torn", "norid", "runjson", "fifo"))
    # Unreadable runs need attention: the default `ls` shows them, not the ended one.
    shown = {line.split()[0] for line in run_contain(box.env, "ls").stdout.splitlines()[1:-1]}
    assert shown == {"str", "torn", "norid", "runjson", "fifo"}
    s = run_contain(box.env, "status", "torn", timeout=20)
    assert s.returncode == 0 and "UNREADABLE" in s.stdout and "not JSON" in s.stdout, s.stdout + s.stderr
    # Never "live for ever": the id can be used again.
    p = run_contain(box.env, "run", "--id", "str", "--", "true")
    assert p.returncode == 0, p.stderr
    assert box.record("str")["state"] == "REAPED"


@needs_users
@needs_cgroup
def test_non_root_observer_gets_no_traceback(box):
    """Another user pointed at root's state directory: it may list the ids
    (the top is 0755), never read a run (0700), and gets UNREADABLE or one
    line, never a traceback nor a byte of the runs' argv."""
    observer, = spare_uids(1)
    with Shared() as sh:
        sd = os.path.join(sh.path, "rootstate")
        env = dict(box.env, CONTAIN_STATE_DIR=sd)
        assert run_contain(env, "run", "--id", "ended", "--", "sh", "-c", "true", "TOPSECRET").returncode == 0
        proc = subprocess.Popen(contain_cmd("run", "--id", "live", "--", "sh", "-c", "sleep 300", "TOPSECRET"),
                                env=env, stderr=subprocess.PIPE, text=True)
        try:
            assert wait_holders(box.token, 2), "workload did not start"
            uenv = user_env(CONTAIN_STATE_DIR=sd)
            p = contain_as(observer, "ls", "--all", env=uenv)
            assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
            for rid in ("ended", "live"):
                line = next(x for x in p.stdout.splitlines() if x.startswith(rid + " "))
                assert "UNREADABLE" in line and "permission denied" in line, line
            outputs = [p.stdout + p.stderr]
            for args in (["ls", "--json"], ["status", "ended"], ["status", "live"], ["wait", "live", "--timeout", "1"],
                         ["cancel", "live"], ["gc"]):
                q = contain_as(observer, *args, env=uenv)
                assert "Traceback" not in q.stderr, (args, q.stderr)
                outputs.append(q.stdout + q.stderr)
                if args[0] in ("status", "wait", "cancel", "gc"):
                    one_line(q.stderr)
                    assert q.returncode == (125 if args[0] in ("cancel", "gc") else 1), (args, q.returncode)
            assert not any("TOPSECRET" in o for o in outputs)
            assert proc.poll() is None, "the observer's cancel did nothing"
        finally:
            proc.terminate()
            proc.wait(30)
    assert holders(box.token) == []


def test_symlinked_run_files_are_not_followed(tmp_path):
    """A worker with the owner's uid swaps the run's files for symlinks to a
    victim file: nothing reads it, nothing writes it."""
    from launcher._layout import RunDir
    from launcher._runfiles import Unreadable
    from launcher._safefs import UnsafePath

    victim = tmp_path / "victim"
    victim.write_text("SECRET\n")
    sd = str(tmp_path / "state")
    d = RunDir.claim("r", sd)
    try:
        d.write_run({"run_id": "r", "run_uid": UID, "argv": ["true"]})
        d.write_record(good_record("r"), durable=False)
        d.journal("claimed")
        for name in ("record.json", "run.json", "journal.ndjson", "cancellations/requests.ndjson"):
            p = os.path.join(d.path, name)
            if os.path.exists(p):
                os.unlink(p)
            os.symlink(victim, p)
        rec = d.load_record()
        assert isinstance(rec, Unreadable) and "symlink" in rec.reason
        assert isinstance(d.load_run(), Unreadable)
        got = d.read_inbox(0, UID)
        assert not got.accepted and "symlink" in got.rejected[0].reason
        d.release()                                  # the cached journal fd is dropped with ownership
        assert d.take_ownership()
        with pytest.raises(UnsafePath):
            d.journal("through the link")
        with pytest.raises(UnsafePath):
            d.append_request({"op_id": "x", "run_uid": UID})
        d.write_record(good_record("r"), durable=True)   # replaces the link itself, not what it names
        assert not os.path.islink(os.path.join(d.path, "record.json"))
        s = run_contain(dict(os.environ, CONTAIN_STATE_DIR=sd), "status", "r")
        assert s.returncode == 0 and "SECRET" not in s.stdout + s.stderr
    finally:
        d.release()
    assert victim.read_text() == "SECRET\n"
    # The run directory itself swapped for a link: refused outright.
    os.rename(d.path, d.path + "-real")
    os.symlink(d.path + "-real", d.path)
    s = run_contain(dict(os.environ, CONTAIN_STATE_DIR=sd), "status", "r")
    assert s.returncode == 125 and "symlink" in one_line(s.stderr)


# -- numbers --------------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["run", "--timeout", "-1", "--", "true"], ["run", "--kill-timeout", "0", "--", "true"],
    ["run", "--grace", "inf", "--", "true"], ["cancel", "x", "--grace", "1e999"],
    ["wait", "x", "--timeout", "nan"], ["gc", "--older-than", "soon"], ["gc", "--keep", "-1"],
    ["ls", "--since", "yesterday-ish"], ["ls", "--state", "SLEEPING"],
])
def test_numbers_contain_cannot_honour_are_usage_errors(tmp_path, args):
    env = dict(os.environ, CONTAIN_STATE_DIR=str(tmp_path / "state"))
    p = run_contain(env, *args)
    assert p.returncode == 2, (args, p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and p.stderr.startswith("contain: ")
    assert not os.path.exists(tmp_path / "state" / "runs" / "x")


def test_forged_nested_registrations_are_skipped(tmp_path):
    """The registry of runs nested in a lead is written from inside the
    lead's tree: a line that does not name a run (or names a relative
    directory) is skipped, a real one is read, and the file is never
    followed through a link."""
    from launcher._layout import RunDir
    from launcher._safefs import UnsafePath

    d = RunDir.claim("lead", str(tmp_path / "state"))
    try:
        good = {"id": "sub", "run_uid": UID, "cgroup": "/contain/run-lead-00000000/sub-sub-11111111",
                "run_dir": str(tmp_path / "state" / "runs" / "sub"), "at": "2026-01-01T00:00:00.000000Z"}
        d.append_nested(good)
        with open(d.file("nested.ndjson"), "ab") as f:
            f.write(b'[]\n{"id": "x", "run_uid": "%s", "cgroup": "../../"}\n{"id": "y"}\n' % UID.encode())
        assert d.read_nested() == [good]
        with pytest.raises(ValueError):
            d.append_nested({"id": "../etc", "run_uid": UID, "cgroup": "/c"})
        os.unlink(d.file("nested.ndjson"))
        victim = tmp_path / "victim"
        victim.write_text("x")
        os.symlink(victim, d.file("nested.ndjson"))
        assert d.read_nested() == []
        with pytest.raises(UnsafePath):
            d.append_nested(good)
        assert victim.read_text() == "x"
    finally:
        d.release()


@needs_mount
@needs_cgroup
def test_full_state_dir_during_a_run_still_stops_the_worker(box):
    """The state directory fills up while the run goes on; then SIGTERM.
    The stop happens all the same (the test's own scan finds nothing of
    the tree), contain says on stderr that the record could not be
    written, exits non-zero, and never with a traceback."""
    script = (
        f'CONTAIN_STATE_DIR={{mnt}}/state {sys.executable} -m launcher run --id f -- '
        'sh -c "setsid sleep 300 & exec sleep 300" & pid=$!; '
        'for i in $(seq 100); do [ -e {mnt}/state/runs/f/run.json ] && break; sleep 0.05; done; '
        'sleep 0.3; head -c 4M /dev/zero > {mnt}/filler 2>/dev/null; '
        'kill -TERM $pid; wait $pid; echo "rc=$?" >&2')
    p = _in_full_tmpfs(["sh", "-c", script], size="256k", env=box.env)
    assert "Traceback" not in p.stderr, p.stderr
    rc = int(p.stderr.rsplit("rc=", 1)[1].split()[0])
    assert rc != 0, p.stderr
    assert "No space left on device" in p.stderr, p.stderr
    assert holders(box.token) == [], "the worker's tree outlived a stop on a full disk"
