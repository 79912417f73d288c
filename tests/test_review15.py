"""Review 15: another local user, and the worker, against `contain`'s own
walks and reads; the library under stress.

Real kernel throughout: runs under the fixtures' private state directory and
cgroup base, survival by the test's own /proc scan (the token in the
workload's environment), every wait bounded, everything made removed.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from _proc import holders, kill_holders, run_contain
from _users import Shared, python, spare_uids, why_not

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a cgroup base of the test's own)")


def _rm_deep(path: str) -> None:
    # rm(1), not shutil.rmtree: 3.11's rmtree recurses too.
    subprocess.run(["rm", "-rf", "--one-file-system", path], timeout=60, check=False)


@needs_root
def test_worker_nesting_directories_past_the_recursion_limit_in_its_workspace_cannot_crash_contain(
        contained, tmp_path):
    """Python 3.11's os.walk recurses: a workspace 1,500 directories deep
    raised RecursionError out of the stop, so `contain run` printed a
    traceback, wrote no record and exited 1, as if the worker had."""
    ws = tmp_path / "ws"
    ws.mkdir()
    rec = tmp_path / "rec.json"
    deep = ("import os\nos.chdir(%r)\nfor _ in range(1500):\n    os.mkdir('a'); os.chdir('a')\n" % str(ws))
    try:
        p = run_contain(contained["env"], "run", "--workspace", str(ws), "--record", str(rec), "--",
                        "python3", "-c", deep, timeout=120)
        assert "Traceback" not in p.stderr, p.stderr[-2000:]
        assert p.returncode == 0, p.stderr[-2000:]
        r = json.loads(rec.read_text())
        assert r["state"] == "REAPED" and r["outcome"] == "exited", r
        layer = r["evidence"]["workspace_quiescent"]
        assert layer["observed"] is True, layer
        assert holders(contained["token"]) == []
    finally:
        kill_holders(contained["token"])
        _rm_deep(str(ws))


_NEST_CGROUPS = r"""
import os
mounts = {}
for line in open("/proc/self/mountinfo"):
    left, _, right = line.partition(" - ")
    fs, _src, opts = right.split()[:3]
    if fs == "cgroup2":
        mounts[""] = left.split()[4]
    elif fs == "cgroup" and "memory" in opts.split(","):
        mounts["memory"] = left.split()[4]
made = []
for line in open("/proc/self/cgroup"):
    _n, ctrls, path = line.rstrip("\n").split(":", 2)
    key = "" if ctrls == "" else ("memory" if "memory" in ctrls.split(",") else None)
    for m in line.split(":", 2)[1].split(","):
        p = "/sys/fs/cgroup/" + m + path
        if m and m not in ("memory",) and os.path.isdir(p):
            made.append(p)      # the run's other v1 leaves: for the test to remove if the stop does not
    if key is None or key not in mounts:
        continue
    os.chdir(mounts[key] + path)
    for _ in range(1100):
        os.mkdir("a"); os.chdir("a")
    made.append(mounts[key] + path)
print("\n".join(made), flush=True)
"""


@needs_root
def test_root_worker_nesting_cgroups_past_the_recursion_limit_cannot_crash_the_stop(contained, tmp_path):
    """The stop lists and removes the run's cgroup subtree (v2, and the
    run's own v1 cgroups on a hybrid host) with os.walk, which recurses in
    3.11: a root worker that made 1,100 nested cgroups in its own leaf made
    `contain run` raise RecursionError after the worker exited: a
    traceback, no record, exit 1, and the subtree left in the hierarchy."""
    rec = tmp_path / "rec.json"
    p = run_contain(contained["env"], "run", "--record", str(rec), "--", "python3", "-c", _NEST_CGROUPS,
                    timeout=180)
    try:
        assert contained["cgroup_base"] + "/" in p.stdout, (p.stdout, p.stderr[-2000:])
        assert "Traceback" not in p.stderr, p.stderr[-2000:]
        assert p.returncode == 0, p.stderr[-2000:]
        r = json.loads(rec.read_text())
        assert r["state"] == "REAPED" and r["outcome"] == "exited", r
        left = [d for d, _s, _f in _walk_shallow(contained["cgroup_base"])]
        assert left == [contained["cgroup_base"]], left[:5]
        assert holders(contained["token"]) == []
    finally:
        kill_holders(contained["token"])
        for leaf in p.stdout.split():
            _rmdir_chain(leaf)      # what a failing stop left (the fixture's own walk recurses too)


def _rmdir_chain(leaf: str) -> None:
    if not leaf.startswith("/sys/fs/cgroup/") or not os.path.isdir(leaf):
        return
    chain = [leaf]
    while os.path.isdir(chain[-1] + "/a"):
        chain.append(chain[-1] + "/a")
    for d in reversed(chain):
        try:
            os.rmdir(d)
        except OSError:
            return


def _walk_shallow(top: str):
    # The test's own look at what is left: the base's direct children only
    # (the run's leaf is one of them, whatever is below it).
    yield top, None, None
    for e in os.scandir(top):
        if e.is_dir(follow_symlinks=False):
            yield e.path, None, None


def test_another_users_symlink_raced_into_a_missing_level_of_the_state_dir_is_not_followed():
    """CONTAIN_STATE_DIR=/tmp/x/b/state with /tmp/x missing: the check found
    /tmp/x missing, and the missing levels were then made by path. Another
    user toggling a symlink /tmp/x -> a directory of root's made root
    create `b` there (945 times in 3 s here), where the link pointed."""
    why = why_not()
    if why:
        pytest.skip(why)
    from launcher._statedir import StateDir, StateDirError

    uid = spare_uids(1)[0]
    with Shared(mode=0o1777) as sh:
        target = sh.sub("target")             # root's, 0755: where the link points
        link = os.path.join(sh.path, "x")
        toggler = subprocess.Popen(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", python(), "-c",
             "import os, sys\nt, l = sys.argv[1:]\nwhile True:\n"
             "    try: os.symlink(t, l)\n    except OSError: pass\n"
             "    try: os.unlink(l)\n    except OSError: pass\n", target, link],
            stdin=subprocess.DEVNULL)
        made = []
        try:
            time.sleep(0.2)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and not made:
                try:
                    StateDir.open(os.path.join(link, "b", "state"), write=True, create=True).close()
                    subprocess.run(["rm", "-rf", link], timeout=10)    # ours, made while the link was away
                except StateDirError:
                    pass
                made = os.listdir(target)
        finally:
            toggler.kill()
            toggler.wait(10)
        assert made == [], f"root made {made} in {target} through another user's symlink"


@needs_root
def test_worker_nesting_directories_in_its_run_directory_cannot_wedge_gc(contained):
    """gc removed a run directory only four levels deep: a worker that can
    write its run directory (a root worker, or one of the state directory's
    own user) nested a few more, and gc set the run aside as `.gc-*`,
    failed, and failed again on every later gc (exit 1), the directory
    never removed."""
    env = contained["env"]
    p = run_contain(env, "run", "--id", "deep", "--", "true")
    assert p.returncode == 0, p.stderr
    runs = os.path.join(contained["state_dir"], "runs")
    d = os.path.join(runs, "deep")
    for _ in range(200):
        d = os.path.join(d, "d")
        os.mkdir(d)
        with open(os.path.join(d, "f"), "w"):
            pass
        os.symlink("/etc/passwd", os.path.join(d, "l"))
    passwd = os.stat("/etc/passwd")
    for _ in range(2):
        g = run_contain(env, "gc", "--keep", "0")
        assert "Traceback" not in g.stderr, g.stderr
        assert g.returncode == 0, g.stdout + g.stderr
    assert [n for n in os.listdir(runs) if n != ".claim.lock"] == []
    assert os.stat("/etc/passwd").st_ino == passwd.st_ino


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


def _deep_object(levels: int) -> str:
    return '{"":' * levels + "1" + "}" * levels


def _wait_file(path: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


@needs_root
def test_cancel_request_with_a_deeply_nested_by_cannot_crash_contain_or_status(contained):
    """A request's `by` was checked only to be an object: one 790 levels
    deep (a 4 KB line, within the inbox's bound) passed json.loads, was
    taken as a cancel, and copied into the record, and everything that
    walks a record recursively then raised RecursionError: `contain run`
    printed a traceback after its stop (exit 1) and every `contain status`
    of the run did too."""
    env = contained["env"]
    run_dir = os.path.join(contained["state_dir"], "runs", "deep-by")
    p = subprocess.Popen([*_contain(), "run", "--id", "deep-by", "--", "sleep", "60"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_file(os.path.join(run_dir, "run.json"))
        _wait_file(os.path.join(run_dir, "cancellations", "wake"))
        with open(os.path.join(run_dir, "run.json")) as f:
            uid = json.load(f)["run_uid"]
        line = '{"op_id":"deep","run_uid":"%s","by":%s}\n' % (uid, _deep_object(790))
        assert len(line) < 4096
        with open(os.path.join(run_dir, "cancellations", "requests.ndjson"), "a") as f:
            f.write(line)
        c = run_contain(env, "cancel", "deep-by", "--wait", "--timeout", "30")
        assert "Traceback" not in c.stderr, c.stderr[-1500:]
        _out, err = p.communicate(timeout=60)
        assert "Traceback" not in err, err[-1500:]
        assert p.returncode in (0, -15, 143), (p.returncode, err[-1500:])
        s = run_contain(env, "status", "deep-by")
        assert "Traceback" not in s.stderr, s.stderr[-1500:]
        assert s.returncode == 0, s.stdout + s.stderr[-1500:]
        assert holders(contained["token"]) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)
        kill_holders(contained["token"])


def _contain() -> list[str]:
    import sys

    return [sys.executable, "-m", "launcher"]


_BROKEN_CONTAIN = """
import sys
import launcher._postconditions as p

def broken(*a, **k):
    raise RuntimeError("injected fault in the stop's postconditions")

p.measure = broken
from launcher._cli import console
sys.argv = ["contain", *sys.argv[1:]]
console()
"""


@needs_root
def test_a_bug_raised_while_supervising_exits_125_not_an_exit_status_the_worker_could_have(contained, tmp_path):
    """Each RecursionError above came out of `contain run` as a traceback
    and exit status 1: to a script, the worker's own `exit 1`. Whatever
    escapes the supervision is contain's failure: 125 (CONTRACT.md), with
    the way out (`contain cancel` adopts the orphaned run)."""
    import sys

    env = contained["env"]
    p = subprocess.run([sys.executable, "-c", _BROKEN_CONTAIN, "run", "--id", "bug", "--workspace", str(tmp_path),
                        "--", "true"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 125, p.stderr[-1500:]
    assert "contain cancel bug" in p.stderr
    c = run_contain(env, "cancel", "bug", "--wait", "--timeout", "30")
    assert "Traceback" not in c.stderr, c.stderr
    assert c.returncode == 0, c.stdout + c.stderr
    assert holders(contained["token"]) == []


_STOP_TERMINAL = r"""
import signal, termios
signal.signal(signal.SIGTTOU, signal.SIG_IGN)
termios.tcflow(1, termios.TCOOFF)
"""


@needs_root
@pytest.mark.parametrize("record", ["/dev/stdout", "-"])
def test_sealed_worker_stopping_the_terminals_output_cannot_wedge_contain(contained, record):
    """The worker shares the caller's terminal (stdio is inherited, never
    copied). tcflow(TCOOFF), what ^S does, needs no controlling terminal,
    so even a sealed worker in a session of its own could stop the
    terminal's output and exit: contain's final write of `--record
    /dev/stdout` (or `-`) then blocked for ever, long after the tree was
    gone, and a script around it never got an exit status."""
    import pty
    import termios
    import threading

    master, slave = pty.openpty()
    got = bytearray()

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            got.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        try:
            p = subprocess.run([*_contain(), "run", "-q", "--seal", "--record", record, "--",
                                python(), "-c", _STOP_TERMINAL],
                               env=contained["env"], stdin=slave, stdout=slave, stderr=slave,
                               start_new_session=True, timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("contain run was still writing to the stopped terminal after 30 s")
        assert p.returncode == 0
        deadline = time.monotonic() + 10
        while b'"run_id"' not in got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b'"state": "REAPED"' in got and b'"sealed": true' in got, bytes(got[-500:])
        assert holders(contained["token"]) == []
    finally:
        try:
            termios.tcflow(slave, termios.TCOON)
        except termios.error:
            pass
        os.close(slave)
        os.close(master)
        reader.join(5)
        kill_holders(contained["token"])


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
