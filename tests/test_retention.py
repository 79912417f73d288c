"""Retention (issue 10, item 11): ended runs' directories are removed by
`contain gc` and by the automatic bound; a live, orphaned or unreadable run
never is. Runs are made with the layout directly (fast); what is left is
read from the directory listing, not from contain."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from _proc import run_contain
from _users import ROOT

UID = "0123456789abcdef"


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + ".000000Z"


def make(sd: str, rid: str, state: str | None = "REAPED", *, ended: float | None = None,
         keep_owner: bool = False, record: bytes | None = None, describe: bool = True):
    from launcher._layout import RunDir

    d = RunDir.claim(rid, sd)
    if describe:
        d.write_run({"run_id": rid, "run_uid": UID, "argv": ["true"]})
    if record is not None:
        with open(os.path.join(d.path, "record.json"), "wb") as f:
            f.write(record)
    elif state is not None:
        t = time.time() if ended is None else ended
        rec = {"run_id": rid, "run_uid": UID, "state": state, "outcome": None if state == "RUNNING" else "exited",
               "exit_code": 0, "argv": ["true"], "timings": {"spawned_at": iso(t - 1), "ended_at": iso(t)}}
        d.write_record(rec, durable=False)
    if keep_owner:
        return d
    d.release()
    return None


def names(sd: str) -> set[str]:
    return set(os.listdir(os.path.join(sd, "runs"))) - {".claim.lock"}


def test_gc_removes_only_ended_runs(tmp_path):
    sd = str(tmp_path / "state")
    env = dict(os.environ, CONTAIN_STATE_DIR=sd)
    for rid, state in (("reaped", "REAPED"), ("exited", "EXITED"), ("breached", "BREACHED")):
        make(sd, rid, state)
    make(sd, "orphan", "RUNNING")                  # owner gone, record RUNNING: `cancel` adopts it
    make(sd, "unconfirmed", "UNCONFIRMED")
    make(sd, "prerecord", None)                    # owner died before the first record
    make(sd, "unreadable", record=b'{"state": "REA')
    live = make(sd, "live", "RUNNING", keep_owner=True)
    live_ended = make(sd, "ending", "REAPED", keep_owner=True)   # record written, acks not yet settled
    make(sd, "reused", "REAPED")
    make(sd, "reused", "REAPED")                   # moves the first aside to .ended-reused-<uid>
    starting = make(sd, "newclaim", None, describe=False, keep_owner=True)   # its supervisor is starting
    make(sd, "freshdead", None, describe=False)     # claimed a moment ago, owner lock free: its supervisor is gone
    make(sd, "deadclaim", None, describe=False)
    old = time.time() - 3600
    os.utime(os.path.join(sd, "runs", "deadclaim"), (old, old))
    os.mkdir(os.path.join(sd, "runs", ".gc-leftover"))
    os.mkdir(os.path.join(sd, "runs", ".claim-x-dead"))
    os.utime(os.path.join(sd, "runs", ".claim-x-dead"), (old, old))
    assert any(n.startswith(".ended-reused-") for n in names(sd))
    try:
        p = run_contain(env, "gc", "--json")
        assert p.returncode == 0, p.stderr
        res = json.loads(p.stdout)
        left = names(sd)
        assert left == {"orphan", "unconfirmed", "prerecord", "unreadable", "live", "ending", "newclaim"}, left
        assert sorted(res["removed"]) == sorted(["reaped", "exited", "breached", "reused", "deadclaim", "freshdead"] +
                                                [n for n in res["removed"] if n.startswith(".ended-reused-")])
        assert res["unreadable"] == 1 and res["live"] == 6
    finally:
        live.release()
        live_ended.release()
        starting.release()
    # Once their owners are gone, the ended one and the claim go too; the rest still stay.
    p = run_contain(env, "gc")
    assert p.returncode == 0 and "removed 2 ended runs;" in p.stdout, p.stdout
    assert names(sd) == {"orphan", "unconfirmed", "prerecord", "unreadable", "live"}


def test_gc_keep_and_older_than(tmp_path):
    sd = str(tmp_path / "state")
    env = dict(os.environ, CONTAIN_STATE_DIR=sd)
    now = time.time()
    for i in range(6):                           # e0 ended 6 days ago ... e5 1 day ago
        make(sd, f"e{i}", "EXITED", ended=now - (6 - i) * 86400)
    p = run_contain(env, "gc", "--older-than", "3d12h")
    assert p.returncode == 0, p.stderr
    assert names(sd) == {"e3", "e4", "e5"}
    p = run_contain(env, "gc", "--keep", "1")
    assert p.returncode == 0 and names(sd) == {"e5"}, p.stdout
    p = run_contain(env, "gc", "--keep", "0", "--older-than", "2w")
    assert names(sd) == {"e5"}, "younger than two weeks: kept"


_CLAIMS = """
import os, sys, time
sys.path.insert(0, {root!r})
from launcher._layout import RunDir
sd, n = sys.argv[1], int(sys.argv[2])
for i in range(n):
    d = RunDir.claim("r%04d" % i, sd)
    d.write_run({{"run_id": "r%04d" % i, "run_uid": "0123456789abcdef", "argv": ["true"]}})
    d.write_record({{"run_id": "r%04d" % i, "run_uid": "0123456789abcdef", "state": "REAPED",
                     "outcome": "exited"}}, durable=False)
    d.release()
    t = time.time() - (n - i)
    os.utime(d.path, (t, t))
"""


def test_automatic_bound_keeps_at_most_keep_runs(tmp_path):
    from launcher._statedir import PRUNE_SLACK

    sd = str(tmp_path / "state")
    keep = 5
    make(sd, "orphan-oldest", "RUNNING")
    old = time.time() - 86400
    os.utime(os.path.join(sd, "runs", "orphan-oldest"), (old, old))
    n = keep + PRUNE_SLACK + 10
    p = subprocess.run([sys.executable, "-c", _CLAIMS.format(root=ROOT), sd, str(n)],
                       env=dict(os.environ, CONTAIN_KEEP_RUNS=str(keep)), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    left = names(sd)
    assert "orphan-oldest" in left, "an orphan is never removed"
    assert len(left) <= keep + PRUNE_SLACK, len(left)
    assert all(f"r{i:04d}" in left for i in range(n - 5, n)), "the newest runs are kept"
    assert not any(x.startswith(".gc-") for x in left)
    # 0 turns the bound off.
    sd2 = str(tmp_path / "state2")
    p = subprocess.run([sys.executable, "-c", _CLAIMS.format(root=ROOT), sd2, str(n)],
                       env=dict(os.environ, CONTAIN_KEEP_RUNS="0"), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert len(names(sd2)) == n


_LIVE_CLAIMS = """
import os, sys
sys.path.insert(0, {root!r})
from launcher import _gc
from launcher._layout import RunDir
sd, live, more = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
passes = []
real = _gc.auto_prune
def counted(*a, **k):
    r = real(*a, **k)
    passes.append(r.left)
    return r
_gc.auto_prune = counted
held = []
for i in range(live):
    d = RunDir.claim("l%04d" % i, sd)
    d.write_run({{"run_id": "l%04d" % i, "run_uid": "0123456789abcdef", "argv": ["sleep"]}})
    held.append(d)
print(len(passes))
for d in held:
    d.write_record({{"run_id": d.id, "run_uid": "0123456789abcdef", "state": "REAPED", "outcome": "exited"}},
                   durable=False)
    d.release()
for i in range(more):
    d = RunDir.claim("m%04d" % i, sd)
    d.write_run({{"run_id": "m%04d" % i, "run_uid": "0123456789abcdef", "argv": ["true"]}})
    d.write_record({{"run_id": "m%04d" % i, "run_uid": "0123456789abcdef", "state": "REAPED",
                     "outcome": "exited"}}, durable=False)
    d.release()
print(len(passes))
"""


def test_automatic_bound_with_many_live_runs_does_not_read_them_at_every_claim(tmp_path):
    """More live runs than the bound keeps (one process with thousands of
    workers): a pass can remove none of them, and one at every claim read
    every run directory each time (spawn-all quadratic). Passes are spaced
    out then; once the runs have ended the bound still brings the count
    down."""
    from launcher._statedir import PRUNE_SLACK

    sd = str(tmp_path / "state")
    keep, live = 5, 300
    more = max(PRUNE_SLACK, live // 8) + 20
    p = subprocess.run([sys.executable, "-c", _LIVE_CLAIMS.format(root=ROOT), sd, str(live), str(more)],
                       env=dict(os.environ, CONTAIN_KEEP_RUNS=str(keep)), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    while_live, total = (int(x) for x in p.stdout.split())
    assert while_live <= 3, f"{while_live} passes while {live} runs were live (one a claim was {live - keep - PRUNE_SLACK})"
    assert total > while_live, "no pass once the live runs had ended"
    left = names(sd)
    assert len(left) <= keep + PRUNE_SLACK, len(left)
    assert not any(x.startswith(".gc-") for x in left)


@pytest.mark.parametrize("text,seconds", [("90", 90), ("90s", 90), ("15m", 900), ("2h", 7200), ("7d", 604800),
                                          ("2w", 1209600), ("1d12h", 129600), ("0.5h", 1800)])
def test_durations(text, seconds):
    from launcher._gc import parse_duration

    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "-5", "inf", "nan", "5x", "h"])
def test_bad_durations(text):
    from launcher._gc import parse_duration

    with pytest.raises(ValueError):
        parse_duration(text)


def _breached(sd: str, rid: str, pid: int, start: int) -> None:
    from launcher._identity import boot_id

    t = time.time()
    ident = {"pid": pid, "start_time": start, "boot_id": boot_id(), "pidns": None, "pidfd_inode": None}
    rec = {"run_id": rid, "run_uid": UID, "state": "BREACHED", "outcome": "exited", "exit_code": 0,
           "argv": ["true"], "timings": {"spawned_at": iso(t - 1), "ended_at": iso(t)},
           "evidence": {"escapes": {"observed": True, "at": iso(t), "via": "fork ledger (netlink process connector)",
                                    "detail": [{"pid": pid, "identity": ident, "killed": True, "gone": None,
                                                "alive_at_end": None}]}}}
    make(sd, rid, record=json.dumps(rec).encode())


def test_gc_keeps_a_breached_run_whose_escaper_lives(tmp_path):
    """A BREACHED record is the only record of a breach: gc (and the
    automatic bound, which decides through the same _gc.examine) removed it while the
    escaper it names lived on. Kept while that process (by pid and start
    time) lives; removed once it is gone, and at once for one already gone."""
    from launcher._procfs import read_stat

    sd = str(tmp_path / "state")
    env = dict(os.environ, CONTAIN_STATE_DIR=sd)
    p = subprocess.Popen(["sleep", "300"])
    try:
        st = read_stat(p.pid)
        assert st is not None
        _breached(sd, "alive", p.pid, st[4])
        _breached(sd, "gone", p.pid, st[4] + 1)        # another start time: that process is gone
        r = run_contain(env, "gc", "--json")
        assert r.returncode == 0, r.stderr
        assert names(sd) == {"alive"}, json.loads(r.stdout)
        assert json.loads(r.stdout)["live"] == 1
    finally:
        p.kill()
        p.wait(10)
    r = run_contain(env, "gc", "--json")
    assert r.returncode == 0, r.stderr
    assert names(sd) == set(), json.loads(r.stdout)

