"""Adversarial review 3: hostile workloads and hostile local users against
`contain run`, black-box through the contract.

Each test is named after the attack and failed on the code it was written
against; the attacker is a spare uid (setpriv) working in directories it
made; survival is decided by the test's own /proc scan (a token in the
workload's environment), never by asking contain.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from _proc import contain_cmd, holders, readline_within
from _users import Shared, as_uid, python, spare_uids, user_env, why_not
from conftest import needs_cgroup
from test_review2 import _remove_v1_of

USERS_SKIP = why_not()
needs_users = pytest.mark.skipif(USERS_SKIP is not None, reason=USERS_SKIP or "")

_FILL_FIFO = r"""
import os, sys, time
os.mkfifo(sys.argv[1], 0o666)
# Both ends: the FIFO has a reader (so contain's open succeeds), and the
# pipe buffer is filled so that any further write blocks.
fd = os.open(sys.argv[1], os.O_RDWR | os.O_NONBLOCK)
try:
    while True:
        os.write(fd, b"x" * 4096)
except BlockingIOError:
    pass
print("full", flush=True)
time.sleep(120)
"""


@needs_users
@needs_cgroup
@pytest.mark.timeout(90)
def test_fifo_held_full_by_another_user_at_the_record_path_does_not_hang_contain(box):
    """Another user makes a FIFO where root's --record points, keeps it
    open for reading and fills its buffer. The run ends, and then `contain`
    blocked for ever in the final write of the record: the caller never got
    its exit status, for as long as the attacker liked."""
    attacker, = spare_uids(1)
    with Shared(mode=0o1777) as sh:
        fifo = os.path.join(sh.path, "rec.json")
        hold = subprocess.Popen(["setpriv", f"--reuid={attacker}", f"--regid={attacker}", "--clear-groups",
                                 "--", python(), "-c", _FILL_FIFO, fifo],
                                env=user_env(), stdout=subprocess.PIPE, cwd="/")
        try:
            assert readline_within(hold.stdout, 30).strip() == b"full"
            p = subprocess.Popen(contain_cmd("run", "--id", "ff", "--record", fifo, "--", "true"),
                                 env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                _out, err = p.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate(timeout=10)
                pytest.fail("contain hung writing --record into another user's full FIFO")
            assert p.returncode == 125, (p.returncode, err)
            assert "Traceback" not in err and "rec.json" in err, err
        finally:
            hold.kill()
            hold.wait(10)
    assert holders(box.token) == []


@needs_users
@needs_cgroup
@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--record", "--stats-json"])
def test_another_users_symlinked_directory_in_the_output_path_is_not_followed(box, tmp_path, flag):
    """Another user owns a directory in the middle of root's --record (or
    --stats-json) path and makes it a symlink to a directory of root's
    choosing (here a stand-in for /etc). The last component's link rule
    (followed only when it belongs to root or to us) was not applied to the
    directories above it: root created its file in the attacker's target."""
    attacker, = spare_uids(1)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    with Shared() as sh:
        theirs = sh.sub("theirs", uid=attacker)
        link = os.path.join(theirs, "out")
        assert as_uid(attacker, ["ln", "-s", str(victim), link]).returncode == 0
        target = os.path.join(link, "made-by-root")
        p = subprocess.run(contain_cmd("run", "-q", "--id", "sd", flag, target, "--", "true"), env=box.env,
                           capture_output=True, text=True, timeout=30)
        assert os.listdir(victim) == [], f"root wrote through another user's symlink: {os.listdir(victim)}"
        assert p.returncode == 125, (p.returncode, p.stderr)
        assert "Traceback" not in p.stderr and "not followed" in p.stderr, p.stderr
    assert holders(box.token) == []


@needs_cgroup
@pytest.mark.timeout(60)
def test_own_symlinked_directory_in_the_record_path_is_still_followed(box, tmp_path):
    """The rule above refuses only links another user made: a link of our
    own in the path still works (the record lands where it points)."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "via").symlink_to(real)
    p = subprocess.run(contain_cmd("run", "-q", "--id", "own", "--record", str(tmp_path / "via" / "r.json"),
                                   "--", "true"), env=box.env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert os.listdir(real) == ["r.json"]


# -- a worker that writes its own run directory (root, not sealed) ---------------------

_FORGER = r"""
import json, os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
d = os.environ["CONTAIN_RUN_DIR"]
info = json.load(open(os.path.join(d, "run.json")))
kid = subprocess.Popen(["sleep", "300"])          # inherits the ignored SIGTERM

def put(path, obj):
    tmp = os.path.join(os.path.dirname(path), ".forged.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj))
    os.rename(tmp, path)

now = "2026-12-01T00:00:00.000000Z"
if sys.argv[1] == "record":
    put(os.path.join(d, "record.json"),
        {"schema": "contain.stop-record/1", "run_id": info["run_id"], "run_uid": info["run_uid"],
         "state": "REAPED", "outcome": "exited", "exit_code": 0, "signal": None, "argv": ["true"],
         "evidence": {}, "notes": [], "timings": {"spawned_at": now, "ended_at": now}})
print("forging", flush=True)
req = os.path.join(d, "cancellations", "requests.ndjson")
while sys.argv[1] == "ack":
    try:
        lines = open(req).read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            op = json.loads(line)["op_id"]
        except Exception:
            continue
        # Again and again, over whatever the owner writes.
        put(os.path.join(d, "cancellations", op + ".json"),
            {"op_id": op, "run_id": info["run_id"], "run_uid": info["run_uid"], "requested_at": now,
             "acknowledged_at": now, "by": {"pid": 1}, "effect": "cancelled", "state": "REAPED",
             "outcome": "cancelled", "settled_at": now})
    time.sleep(0.002)
time.sleep(300)
"""


def _start_forger(box, run_id: str, what: str) -> subprocess.Popen:
    p = subprocess.Popen(contain_cmd("run", "-q", "--id", run_id, "--grace", "5", "--",
                                     sys.executable, "-c", _FORGER, what),
                         env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = readline_within(p.stdout, 30)
    assert line.strip() == b"forging", (line, p.poll())
    return p


def _end(p: subprocess.Popen, box, run_id: str) -> None:
    subprocess.run(contain_cmd("cancel", run_id, "--grace", "0", "--wait"), env=box.env,
                   capture_output=True, timeout=30)
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(10)
    _remove_v1_of(run_id)


@needs_cgroup
@pytest.mark.timeout(90)
def test_worker_forging_a_reaped_record_does_not_end_contain_wait(box):
    """A root worker (not sealed: it can write its run directory) writes a
    record.json that says REAPED and goes on, with a child, ignoring
    SIGTERM. `contain wait` believed the file: it said REAPED and exited 0
    while the whole tree was alive and the owner still ran the run."""
    p = _start_forger(box, "fr", "record")
    try:
        alive = holders(box.token)
        assert len(alive) >= 2, alive
        w = subprocess.run(contain_cmd("wait", "fr", "--timeout", "2"), env=box.env, capture_output=True,
                           text=True, timeout=30)
        still = holders(box.token)
        assert not (w.returncode == 0 and still), \
            f"contain wait said {w.stdout.strip()!r} (exit 0) with {still} alive"
        assert w.returncode == 1 and "not final" in w.stderr, (w.returncode, w.stdout, w.stderr)
    finally:
        _end(p, box, "fr")
    assert holders(box.token) == []
    assert box.record("fr")["outcome"] == "cancelled", "the owner's own record replaced the forgery"


@needs_cgroup
@pytest.mark.timeout(90)
def test_worker_forging_a_reaped_record_is_still_listed_as_live_by_ls(box):
    """The same forger, seen by `contain ls`: it read the record alone, so
    the live run was hidden as ended (and `ls --all` said REAPED) while its
    tree ran and its owner held the run. The owner's lock is the kernel's
    word that the run is not over."""
    p = _start_forger(box, "fl", "record")
    try:
        assert len(holders(box.token)) >= 2
        ls = subprocess.run(contain_cmd("ls"), env=box.env, capture_output=True, text=True, timeout=30)
        assert ls.returncode == 0, ls.stderr
        rows = [line for line in ls.stdout.splitlines() if line.startswith("fl ")]
        assert rows and "not final" in rows[0], ls.stdout
        js = subprocess.run(contain_cmd("ls", "--json"), env=box.env, capture_output=True, text=True, timeout=30)
        view = [v for v in json.loads(js.stdout) if v["id"] == "fl"]
        assert view and view[0]["owner_alive"] is True and view[0]["not_final"], js.stdout
        js = subprocess.run(contain_cmd("ls", "--all", "--json"), env=box.env, capture_output=True, text=True,
                            timeout=30)
        view = [v for v in json.loads(js.stdout) if v["id"] == "fl"]
        assert view and view[0]["owner_alive"] is True and view[0]["not_final"], js.stdout
        st = subprocess.run(contain_cmd("status", "fl"), env=box.env, capture_output=True, text=True, timeout=30)
        assert "not final" in st.stdout, st.stdout
    finally:
        _end(p, box, "fl")
    assert holders(box.token) == []
    ls = subprocess.run(contain_cmd("ls", "--all"), env=box.env, capture_output=True, text=True, timeout=30)
    row = [line for line in ls.stdout.splitlines() if line.startswith("fl ")]
    assert row and "not final" not in row[0] and "REAPED" in row[0], ls.stdout


@needs_cgroup
@pytest.mark.timeout(90)
def test_worker_forging_a_settled_ack_does_not_end_cancel_wait(box):
    """The same worker answers every cancel request itself, at once, with an
    acknowledgement that says cancelled / REAPED. `contain cancel --wait`
    returned it (exit 0) while the tree lived on through a 5 s grace."""
    p = _start_forger(box, "fa", "ack")
    try:
        c = subprocess.run(contain_cmd("cancel", "fa", "--wait", "--timeout", "3"), env=box.env,
                           capture_output=True, text=True, timeout=30)
        still = holders(box.token)
        assert not (c.returncode == 0 and still), \
            f"contain cancel --wait said {c.stdout.strip()!r} (exit 0) with {still} alive"
    finally:
        _end(p, box, "fa")
    assert holders(box.token) == []


# -- a huge argv ---------------------------------------------------------------------------

@needs_cgroup
@pytest.mark.timeout(120)
def test_run_with_a_huge_argv_whose_supervisor_died_is_still_adopted(box):
    """argv as large as exec allows with the default 8 MiB stack (2 MiB in
    all). run.json carries it, and readers refused run.json above 1 MiB:
    after the supervisor was SIGKILLed, `contain cancel --wait` said
    "run.json unreadable" and left the whole tree running; the run was lost."""
    filler = ["x" * 100_000] * 18
    p = subprocess.Popen(contain_cmd("run", "-q", "--id", "huge", "--", "sh", "-c",
                                     "trap '' TERM; sleep 300 & echo up; sleep 300", "sh", *filler),
                         env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert readline_within(p.stdout, 30).strip() == b"up"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        assert holders(box.token), "the tree outlives its supervisor (else the test is void)"
        c = subprocess.run(contain_cmd("cancel", "huge", "--wait", "--grace", "0.5", "--timeout", "30"),
                           env=box.env, capture_output=True, text=True, timeout=60)
        assert holders(box.token) == [], (c.returncode, c.stdout[-300:], c.stderr[-300:])
        assert c.returncode == 0, (c.stdout[-300:], c.stderr[-300:])
        rec = box.record("huge")
        assert rec["state"] == "REAPED" and rec["argv"][4:] == filler
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        _remove_v1_of("huge")


_DEAFEN = r"""
import os, signal, subprocess, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
c = os.path.join(os.environ["CONTAIN_RUN_DIR"], "cancellations")
# A FIFO of the same name, not the owner's: every poke goes to it.
os.unlink(os.path.join(c, "wake"))
os.mkfifo(os.path.join(c, "wake"), 0o600)
kid = subprocess.Popen(["sleep", "300"])
print("deafened", flush=True)
time.sleep(300)
"""


@needs_cgroup
@pytest.mark.timeout(90)
def test_worker_replacing_the_wake_fifo_makes_its_run_deaf_to_cancel(box):
    """A root worker (not sealed) replaces cancellations/wake with a FIFO
    of its own. The owner still holds the old one, so no poke reaches it:
    a `contain cancel` is written to the inbox, durable, and never read;
    the tree lives on for as long as the worker likes."""
    p = subprocess.Popen(contain_cmd("run", "-q", "--id", "deaf", "--grace", "0.5", "--",
                                     sys.executable, "-c", _DEAFEN),
                         env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert readline_within(p.stdout, 30).strip() == b"deafened"
        c = subprocess.run(contain_cmd("cancel", "deaf", "--wait", "--timeout", "10"), env=box.env,
                           capture_output=True, text=True, timeout=60)
        # The supervisor carries the token too: it lets go of the run (what
        # --wait waits for) a moment before it exits itself.
        sup = p.wait(30)
        assert c.returncode == 0 and holders(box.token) == [], \
            f"cancel: {c.returncode} {c.stdout.strip()!r}; supervisor {sup}; alive {holders(box.token)}"
    finally:
        if p.poll() is None:
            p.terminate()             # contain's own signal path still works
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        _remove_v1_of("deaf")
    assert holders(box.token) == []


# -- a sealed worker and the caller's terminal ---------------------------------------------

_TIOCSTI = r"""
import fcntl, os, sys, termios
try:
    for ch in b"echo INJECTED\n":
        fcntl.ioctl(0, termios.TIOCSTI, bytes([ch]))
    print("injected", flush=True)
except OSError as e:
    print("refused", e.errno, flush=True)
"""


@needs_cgroup
@pytest.mark.forked          # the test process takes a new session and a controlling terminal
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [["--user", "nobody"], ["--seal"], ["--user", "nobody", "--backend", "pidns"]],
                         ids=["user", "seal", "pidns-user"])
def test_sealed_worker_cannot_type_into_the_callers_terminal(box, mode):
    """contain run from an interactive root shell: the worker inherits the
    terminal, which is its controlling terminal too. With
    dev.tty.legacy_tiocsti on (the default before 6.2, and here), a worker
    the record called sealed pushed "echo INJECTED" into the terminal's
    input with TIOCSTI; the root shell reads it as soon as contain returns."""
    import fcntl
    import pty
    import select
    import termios

    try:
        with open("/proc/sys/dev/tty/legacy_tiocsti") as f:
            if f.read().strip() == "0":
                pytest.skip("TIOCSTI is off for everyone here (dev.tty.legacy_tiocsti = 0)")
    except OSError:
        pass
    master, slave = pty.openpty()

    def own_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        p = subprocess.run(contain_cmd("run", "-q", "--id", "tty", *mode, "--", python(), "-c", _TIOCSTI),
                           env=box.env, stdin=slave, stdout=slave, stderr=slave, preexec_fn=own_terminal,
                           timeout=30)
        out = b""
        while select.select([master], [], [], 0.3)[0]:
            out += os.read(master, 4096)
        os.set_blocking(slave, False)
        try:
            pending = os.read(slave, 4096)      # what the caller's shell would read next
        except BlockingIOError:
            pending = b""
        rec = box.record("tty")
        assert p.returncode == 0, out
        assert rec["containment"]["sealed"] is True, rec["containment"]["sealed_reason"]
        assert b"INJECTED" not in pending, f"a sealed worker typed into root's terminal: {pending!r} ({out!r})"
        assert b"refused" in out, out
    finally:
        os.close(master)
        os.close(slave)
    assert holders(box.token) == []


@needs_cgroup
@pytest.mark.timeout(90)
def test_worker_forging_an_ack_does_not_swallow_the_cancel(box):
    """The forger above answers each request before the owner reads it.
    The owner took any acknowledgement on disk for "a repeated operation
    never applies twice" and skipped the real request: no cancel was ever
    applied, the run went on, and every later cancel was swallowed too."""
    p = _start_forger(box, "fs", "ack")
    try:
        subprocess.run(contain_cmd("cancel", "fs"), env=box.env, capture_output=True, timeout=30)
        try:
            p.wait(timeout=30)           # SIGTERM ignored: the kill comes after the 5 s grace
        except subprocess.TimeoutExpired:
            pytest.fail("the cancel was swallowed by a forged acknowledgement: the run goes on")
        assert holders(box.token) == []
        rec = box.record("fs")
        assert rec["outcome"] == "cancelled" and rec["state"] == "REAPED", (rec["state"], rec["outcome"])
    finally:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        _remove_v1_of("fs")
