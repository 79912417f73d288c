"""The worker rewriting its own run directory (a root worker not sealed, or an
unprivileged user's own run): a forged REAPED or EXITED record, a forged
acknowledgement, a scrambled run.json, a FIFO in place of a run file, another
run's init named in its tag. Readers (`wait`, `ls`, `gc`, `cancel`, a reused
id) still see a live run, and cancel still stops it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _proc import (
    TOKEN_VAR, contain_cmd, contain_in, end_started, holders, kill_holders, new_token, readline_within,
    run_contain, wait_holders,
)
from _users import Shared, python, spare_uids, why_not
from _v1 import remove_v1_of
from _victim import Victim
from conftest import needs_cgroup
from test_signals import wait_for_file


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
    remove_v1_of(run_id)


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
        remove_v1_of("huge")


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
        remove_v1_of("fs")


USERS_SKIP = why_not()


needs_users = pytest.mark.skipif(USERS_SKIP is not None, reason=USERS_SKIP or "")


def _as(uid: int, *argv: str) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]


# The worker of these runs: a child, and itself, alive until killed.
_LIVE = ["sh", "-c", "sleep 300 & echo up; exec sleep 300"]


_FORGE_TERMINAL = r"""
import json, os, sys
d = os.environ["CONTAIN_RUN_DIR"]
path = os.path.join(d, "record.json")
rec = json.load(open(path))
rec.update(state=sys.argv[1], outcome="exited", exit_code=0, signal=None)
tmp = os.path.join(d, ".forged.tmp")
with open(tmp, "w") as f:
    f.write(json.dumps(rec))
os.rename(tmp, path)
print("forged", flush=True)
"""


# The same, by a worker that can write its run directory (root, not
# sealed), which then goes on with a child.
_FORGE_TERMINAL_AND_STAY = _FORGE_TERMINAL + r"""
import subprocess, time
kid = subprocess.Popen(["sleep", "300"])
time.sleep(300)
"""


@needs_users
@pytest.mark.timeout(120)
@pytest.mark.parametrize("state", ["REAPED", "EXITED"])
def test_own_worker_forging_a_terminal_record_then_orphaned_is_still_stopped_by_cancel(state):
    """An unprivileged user's run (the pidns backend) whose record.json is
    rewritten, by the same uid, to say the run ended, while the tree goes
    on. Its supervisor then dies (killed here). `contain cancel --wait`
    adopted the orphan, took the forged record as the previous owner's last
    word, answered `not_live` and stopped nothing; `contain wait` then said
    REAPED, exit 0, with the whole tree alive, for ever: the run was lost.
    (The forger was the run's own worker; it can no longer reach its run
    directory, test_own_worker_cannot_reach_the_state_directory, so here it
    is the same user outside the run.)"""
    victim, = spare_uids(1)
    with Shared() as sh:
        v = Victim(sh, victim)
        p = v.start("run", "-q", "--backend", "pidns", "--id", "fg", "--", *_LIVE)
        try:
            line = readline_within(p.stdout, 30)
            assert line.strip() == b"up", (line, p.poll(), p.stderr.read() if p.poll() is not None else b"")
            assert v.forge("fg", _FORGE_TERMINAL, state) == "forged"
            assert len(holders(v.token)) >= 2
            os.kill(p.pid, signal.SIGKILL)          # the supervisor dies (an OOM kill, a lost session)
            p.wait(10)
            c = v.contain("cancel", "fg", "--grace", "0", "--wait", "--json", timeout=60)
            ack = json.loads(c.stdout) if c.stdout.strip().startswith("{") else {}
            still = holders(v.token)
            assert still == [], f"cancel said {ack.get('effect')} {ack.get('state')} (exit {c.returncode}) " \
                                f"with {still} alive"
            assert c.returncode == 0 and ack.get("effect") == "cancelled", (c.returncode, c.stdout, c.stderr)
            w = v.contain("wait", "fg", "--json", timeout=30)
            rec = json.loads(w.stdout)
            assert w.returncode == 143 and rec["state"] == "REAPED" and rec["outcome"] == "cancelled", (w.stderr, w.stdout[:300])
            assert any("record.json" in n for n in rec["notes"]), rec["notes"]
        finally:
            end_started(p, v.token)
        assert holders(v.token) == []


@needs_cgroup
@pytest.mark.timeout(120)
def test_root_worker_forging_a_reaped_record_then_orphaned_is_still_stopped_by_cancel(box):
    """The same under root on cgroup2 (a root worker, not sealed, writes its
    run directory): once the supervisor died, cancel adopted, believed the
    forged REAPED and left the populated cgroup running."""
    p = subprocess.Popen(contain_cmd("run", "-q", "--id", "rf", "--", sys.executable, "-c", _FORGE_TERMINAL_AND_STAY,
                                     "REAPED"),
                         env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = readline_within(p.stdout, 30)
        assert line.strip() == b"forged", (line, p.poll())
        assert len(holders(box.token)) >= 2
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        c = subprocess.run(contain_cmd("cancel", "rf", "--grace", "0", "--wait", "--json"), env=box.env,
                           capture_output=True, text=True, timeout=60)
        still = holders(box.token)
        assert still == [], f"cancel said {c.stdout.strip()[-200:]!r} with {still} alive"
        assert c.returncode == 0 and json.loads(c.stdout)["effect"] == "cancelled", (c.stdout, c.stderr)
    finally:
        end_started(p, box.token)
        remove_v1_of("rf")
    assert holders(box.token) == []


@needs_users
@pytest.mark.timeout(120)
def test_own_worker_forging_a_reaped_record_then_orphaned_does_not_end_contain_wait():
    """The same forgery, asked by a reader: once the supervisor is dead,
    `contain wait` took the forged REAPED as final (the owner had let go of
    its lock: it died) and exited 0 with the whole tree alive."""
    victim, = spare_uids(1)
    with Shared() as sh:
        v = Victim(sh, victim)
        p = v.start("run", "-q", "--backend", "pidns", "--id", "fw", "--", *_LIVE)
        try:
            line = readline_within(p.stdout, 30)
            assert line.strip() == b"up", (line, p.poll())
            assert v.forge("fw", _FORGE_TERMINAL, "REAPED") == "forged"
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
            w = v.contain("wait", "fw", timeout=30)
            still = holders(v.token)
            assert len(still) >= 2, still
            assert w.returncode != 0, f"contain wait said {w.stdout.strip()!r} (exit 0) with {still} alive"
            assert w.returncode == 1 and "not final" in w.stderr and "Traceback" not in w.stderr, \
                (w.returncode, w.stdout, w.stderr)
            st = v.contain("status", "fw", timeout=30)
            assert "not final" in st.stdout and "Traceback" not in st.stderr, (st.stdout, st.stderr)
            sj = json.loads(v.contain("status", "fw", "--json", timeout=30).stdout)
            assert sj["live"]["orphaned"] is True, sj["live"]
            c = v.contain("cancel", "fw", "--grace", "0", "--wait", timeout=60)
            assert c.returncode == 0, (c.stdout, c.stderr)
            assert holders(v.token) == []
            w = v.contain("wait", "fw", timeout=30)
            # 143: what `contain run` gives a run cancelled by `contain cancel` (contain wait's status)
            assert w.returncode == 143 and "REAPED" in w.stdout, (w.stdout, w.stderr)
        finally:
            end_started(p, v.token)
        assert holders(v.token) == []


_NAME_ANOTHER_RUNS_INIT = r"""
import os, sys, time
d = os.environ["CONTAIN_RUN_DIR"]
other = os.path.join(os.path.dirname(d), sys.argv[1])
try:
    tag = os.getxattr(other, "user.contain.run")
    import json
    mine = json.loads(os.getxattr(d, "user.contain.run"))
    mine["wall"] = json.loads(tag)["wall"]        # the other run's init: pid 1 of its namespace
    os.setxattr(d, "user.contain.run", json.dumps(mine).encode())
    print("forged", flush=True)
except OSError as e:
    print("blocked", e.errno, flush=True)
time.sleep(300)
"""


@needs_users
@pytest.mark.timeout(120)
def test_own_worker_naming_another_runs_init_in_its_tag_cannot_make_cancel_kill_that_run():
    """Two runs of one unprivileged user (pidns backend). Run A's worker,
    walled in its own PID namespace, cannot signal run B. It copied B's wall
    (its init's pid and start time, B's namespace) into A's own `user.` tag;
    A's supervisor then died. The user's `contain cancel A` adopted, took
    B's init for A's (it is pid 1 of the namespace the tag names), killed
    run B's whole tree, and said A was REAPED with A's tree alive. The
    worker can no longer reach any run directory: the init covers the state
    directory in the run's mount namespace."""
    victim, = spare_uids(1)
    with Shared() as sh:
        v = Victim(sh, victim)
        b_token = new_token()
        env_b = dict(v.env, **{TOKEN_VAR: b_token})
        b = subprocess.Popen(_as(victim, python(), "-m", "launcher", "run", "-q", "--backend", "pidns", "--id", "b",
                                 "--", "sleep", "300"), env=env_b, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd="/")
        a = None
        try:
            deadline = time.monotonic() + 30
            while not holders(b_token) and b.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if not holders(b_token):
                b.kill()
                raise AssertionError(f"run b did not start: exit {b.wait(10)}, {b.communicate(timeout=10)[1]!r}")
            a = v.start("run", "-q", "--backend", "pidns", "--id", "a", "--", python(), "-c",
                        _NAME_ANOTHER_RUNS_INIT, "b")
            line = readline_within(a.stdout, 30)
            assert line.startswith(b"blocked"), (line, a.poll())
            os.kill(a.pid, signal.SIGKILL)
            a.wait(10)
            c = v.contain("cancel", "a", "--grace", "0", "--wait", "--json", timeout=60)
            assert holders(b_token), f"cancel of run a killed run b ({c.stdout.strip()[-200:]!r})"
            assert not (c.returncode == 0 and holders(v.token)), f"cancel said {c.stdout[-200:]!r}, run a alive"
        finally:
            for p in (a, b):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(10)
            kill_holders(v.token)
            kill_holders(b_token)
        assert holders(v.token) == [] and holders(b_token) == []


_FIFOS_FOR_RUN_FILES = r"""
import os, time
d = os.environ["CONTAIN_RUN_DIR"]
deadline = time.monotonic() + 20     # the first record is written a moment after the spawn
while time.monotonic() < deadline and not all(os.path.exists(os.path.join(d, n)) for n in ("run.json", "record.json")):
    time.sleep(0.05)
for name in ("run.json", "record.json"):
    os.unlink(os.path.join(d, name))
    os.mkfifo(os.path.join(d, name), 0o600)
print("replaced", flush=True)
"""


@needs_users
@pytest.mark.timeout(120)
def test_own_worker_replacing_run_json_with_a_fifo_cannot_make_its_run_deaf_to_cancel():
    """An unprivileged user's run.json and record.json replaced with FIFOs
    (by its worker then; the worker cannot reach them now, so by the same
    user outside). `contain cancel --wait` could not read the run uid, sent
    a request without one, which the owner rejected; it then waited for
    ever (the owner holds the run as long as the worker lives): the run was
    deaf to cancel and the user's cancel hung."""
    victim, = spare_uids(1)
    with Shared() as sh:
        v = Victim(sh, victim)
        p = v.start("run", "-q", "--backend", "pidns", "--id", "ff", "--", *_LIVE)
        try:
            line = readline_within(p.stdout, 30)
            assert line.strip() == b"up", (line, p.poll())
            assert v.forge("ff", _FIFOS_FOR_RUN_FILES) == "replaced"
            try:
                c = v.contain("cancel", "ff", "--grace", "0", "--wait", timeout=10)
            except subprocess.TimeoutExpired:
                pytest.fail("contain cancel --wait hung: the run did not stop")
            try:
                p.wait(30)            # the supervisor (it carries the token too) may still be exiting
            except subprocess.TimeoutExpired:
                pass
            still = holders(v.token)
            assert still == [], f"cancel exited {c.returncode} ({c.stdout.strip()} {c.stderr.strip()}) with {still} alive"
        finally:
            end_started(p, v.token)
        assert holders(v.token) == []


@needs_cgroup
@pytest.mark.timeout(60)
def test_root_worker_killing_its_supervisor_and_removing_the_record_leaves_no_reasonless_seal(box):
    # The owner dies before (or its first record is removed after) the
    # record says why the run is not sealed; the adopter's record said
    # `sealed: false, sealed_reason: null` ("else false with sealed_reason").
    script = ('kill -9 $PPID; rm -f "$CONTAIN_RUN_DIR/record.json"; exec sleep 300')
    p = subprocess.Popen(contain_cmd("run", "--id", "ks", "--no-pidns", "--grace", "0", "--", "sh", "-c", script),
                         env=box.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert p.wait(30) == -9
        assert wait_holders(box.token, 1), "the worker is not there"
        # `contain wait` of that orphan said "UNREADABLE": there is no record
        # yet, and nothing unreadable; it is a RUNNING run without an owner.
        w = run_contain(box.env, "wait", "ks", timeout=30)
        assert w.returncode == 1 and "RUNNING" in w.stdout and "UNREADABLE" not in w.stdout, (w.stdout, w.stderr)
        c = run_contain(box.env, "cancel", "ks", "--wait", "--json", timeout=30)
        assert "Traceback" not in c.stderr, c.stderr
        assert holders(box.token) == []
        rec = box.record("ks")
        assert rec["containment"]["sealed"] is False
        assert isinstance(rec["containment"]["sealed_reason"], str) and rec["containment"]["sealed_reason"], rec[
            "containment"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        remove_v1_of("ks")


@needs_cgroup
@pytest.mark.timeout(90)
def test_root_worker_scrambling_run_json_then_orphaned_is_still_stopped_by_cancel(box, tmp_path):
    # An unsealed root worker rewrites what it can reach (run.json and
    # record.json) and its supervisor dies: `contain cancel` answered "run.json
    # unreadable" (exit 1) for ever and the tree lived on. The adopter acts on
    # the owner's tag, never on run.json, so the tag is enough to stop it.
    done = tmp_path / "scrambled"
    script = ('sleep 0.5; cd "$CONTAIN_RUN_DIR" && echo junk > run.json && echo junk > record.json; '
              f'setsid sleep 300 & echo ok > {done}; exec sleep 300')
    p = subprocess.Popen(contain_cmd("run", "--id", "sc", "--", "sh", "-c", script),
                         env=box.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_file(str(done))
        assert len(wait_holders(box.token, 2)) >= 2, "workload did not start"
        p.kill()                                  # the supervisor dies (SIGKILL)
        p.wait(10)
        assert len(holders(box.token)) >= 2, "the tree went with its supervisor"
        # "ls shows it as orphaned" (it said UNREADABLE only)
        ls = run_contain(box.env, "ls", "--json")
        assert [v["orphaned"] for v in json.loads(ls.stdout) if v["id"] == "sc"] == [True], ls.stdout
        c = run_contain(box.env, "cancel", "sc", "--grace", "0", "--wait", "--json", timeout=60)
        assert "Traceback" not in c.stderr, c.stderr
        assert holders(box.token) == [], (c.returncode, c.stderr)
        assert c.returncode == 0, (c.returncode, c.stdout, c.stderr)
        assert json.loads(c.stdout)["effect"] == "cancelled"
        rec = box.record("sc")
        assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled", rec["state"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        remove_v1_of("sc")


_FORGE_ACCOUNTING = r"""
import json, os, time
d = os.environ["CONTAIN_RUN_DIR"]
for _ in range(500):
    try:
        rec = json.load(open(os.path.join(d, "record.json")))
        break
    except (OSError, ValueError):
        time.sleep(0.02)
rec["accounting"] = {"cpu_usec": {"value": "lots", "source": "me"}, "wall_s": {"value": "long", "source": "me"},
                     "memory_peak_bytes": {"value": [1], "source": "me"}}
tmp = os.path.join(d, ".forged.tmp")
with open(tmp, "w") as f:
    f.write(json.dumps(rec))
os.rename(tmp, os.path.join(d, "record.json"))
print("forged", flush=True)
time.sleep(300)
"""


@needs_cgroup
@pytest.mark.timeout(60)
def test_root_worker_rewriting_its_record_accounting_cannot_make_status_print_a_traceback(box):
    # "No command prints a Python traceback for bad input": a string where
    # the record has a number made `contain status` die in its cost line.
    import sys

    p = subprocess.Popen(contain_cmd("run", "--id", "fa", "--", sys.executable, "-c", _FORGE_ACCOUNTING),
                         env=box.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        from _proc import readline_within

        assert readline_within(p.stdout, 30) == b"forged\n"
        s = run_contain(box.env, "status", "fa", timeout=30)
        assert "Traceback" not in s.stderr, s.stderr
        assert s.returncode == 0 and "lots" in s.stdout, (s.returncode, s.stdout)
    finally:
        run_contain(box.env, "cancel", "fa", "--grace", "0", "--wait", timeout=30)
        if p.poll() is None:
            p.kill()
        p.wait(10)
        remove_v1_of("fa")
    assert holders(box.token) == []


PY = sys.executable


def _survivors(box) -> list[int]:
    return sorted(holders(box.token, TOKEN_VAR))


# A root worker (not sealed: it can write its run directory) rewrites its
# record to say REAPED, then goes on with a child. Its supervisor then dies
# (an OOM kill, a lost session; killed here). `contain status` and `wait`
# already see through it (what the run's tag names is alive: not final);
# what else must not take the forged record as the run's end?
_FORGE_REAPED_AND_STAY = r"""
import json, os, subprocess, sys, time
d = os.environ["CONTAIN_RUN_DIR"]
path = os.path.join(d, "record.json")
for _ in range(200):                       # the live record that names the worker
    rec = json.load(open(path))
    if (rec.get("identity") or {}).get("pid"):
        break
    time.sleep(0.05)
rec.update(state="REAPED", outcome="exited", exit_code=0, signal=None)
with open(os.path.join(d, ".forged.tmp"), "w") as f:
    f.write(json.dumps(rec))
os.rename(os.path.join(d, ".forged.tmp"), path)
kid = subprocess.Popen(["sleep", "300"])
print("forged", flush=True)
time.sleep(300)
"""


def _forged_orphan(box, run_id: str) -> subprocess.Popen[bytes]:
    """A run whose worker forged a REAPED record and whose supervisor is
    dead, its tree alive (two processes at least, by the test's scan)."""
    p = subprocess.Popen([PY, "-m", "launcher", "run", "-q", "--id", run_id, "--", PY, "-c", _FORGE_REAPED_AND_STAY],
                         env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = readline_within(p.stdout, 30)
    assert line.strip() == b"forged", (line, p.poll())
    assert len(_survivors(box)) >= 2
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    return p


def _still_stoppable(box, run_id: str) -> None:
    """The orphan is still there to stop: cancel adopts it and the scan
    finds nothing left."""
    c = contain_in(box, "cancel", run_id, "--grace", "0", "--wait", "--json")
    assert _survivors(box) == [], f"cancel exited {c.returncode}: {c.stdout.strip()[-200:]} {c.stderr.strip()}"
    assert c.returncode == 0 and json.loads(c.stdout)["effect"] == "cancelled", (c.stdout, c.stderr)


@needs_cgroup
@pytest.mark.timeout(120)
def test_ls_lists_an_orphan_whose_worker_forged_a_reaped_record(box):
    """CONTRACT.md: "A run whose supervisor died is never lost: `ls` shows
    it as orphaned". `contain status` said "REAPED? not final: ... the PID
    namespace's init is still alive and its supervisor is gone", while
    `contain ls` took the forged record as the run's end and printed "no
    live runs (1 ended)"."""
    p = None
    try:
        p = _forged_orphan(box, "lsf")
        ls = contain_in(box, "ls")
        assert ls.returncode == 0, ls.stderr
        rows = [line.split() for line in ls.stdout.splitlines()[1:]]
        assert any(r and r[0] == "lsf" for r in rows), f"{_survivors(box)} alive, ls says: {ls.stdout!r}"
        row = next(r for r in rows if r and r[0] == "lsf")
        assert "orphaned" in " ".join(row) or "final" in " ".join(row), row
        js = contain_in(box, "ls", "--json")
        ours = [v for v in json.loads(js.stdout) if "lsf" in (v.get("id"), v.get("run_id"))]
        assert ours and ours[0]["orphaned"] is True, js.stdout
        _still_stoppable(box, "lsf")
    finally:
        end_started(p, box.token)
    assert _survivors(box) == []


@needs_cgroup
@pytest.mark.timeout(120)
def test_gc_never_removes_an_orphan_whose_worker_forged_a_reaped_record(box):
    """`contain gc` removes ended runs only. It read the forged REAPED (and
    the free owner lock) as ended and removed the run directory while its
    tree ran on: afterwards `contain cancel` said "no run" (3), and nothing
    could stop the tree by its run any more."""
    p = None
    try:
        p = _forged_orphan(box, "gcf")
        g = contain_in(box, "gc", "--json")
        assert g.returncode == 0, g.stderr
        assert "gcf" not in json.loads(g.stdout)["removed"], (g.stdout, _survivors(box))
        assert os.path.isdir(os.path.join(box.state_dir, "runs", "gcf"))
        _still_stoppable(box, "gcf")
        g = contain_in(box, "gc", "--json")        # over now: gc may take it
        assert "gcf" in json.loads(g.stdout)["removed"], g.stdout
    finally:
        end_started(p, box.token)
    assert _survivors(box) == []


@needs_cgroup
@pytest.mark.timeout(120)
def test_reusing_the_id_of_an_orphan_whose_worker_forged_a_reaped_record_is_a_usage_error(box):
    """"A live run's id cannot be reused (2); an ended run's can (its
    directory is moved aside)". The forged record made the orphan look
    ended: `contain run --id` moved it aside (out of every listing, out of
    reach of `cancel ID`, and `gc` then removes what was moved aside) and
    ran a new run under its id."""
    p = None
    try:
        p = _forged_orphan(box, "rid")
        r = contain_in(box, "run", "-q", "--id", "rid", "--", "true")
        assert r.returncode == 2, (r.returncode, r.stderr, _survivors(box))
        assert "live" in r.stderr and "Traceback" not in r.stderr, r.stderr
        _still_stoppable(box, "rid")
        r = contain_in(box, "run", "-q", "--id", "rid", "--", "true")      # over now: the id is free
        assert r.returncode == 0, r.stderr
    finally:
        end_started(p, box.token)
    assert _survivors(box) == []
