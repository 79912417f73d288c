"""Review 19: the acceptance checker's view, driving `contain` only through
its outside contract (CONTRACT.md) with adversarial inputs; what reviews
13, 15 and 18 did not try.

Real kernel throughout: every workload carries the box's token and is
killed by it at the end; survival is decided by the test's own /proc scan;
every wait is bounded.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from _proc import end_started, holders, readline_within
from conftest import TOKEN_VAR, needs_cgroup

PY = sys.executable


def _contain(box, *args: str, env: dict[str, str] | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess[str]:
    e = dict(box.env)
    e.update(env or {})
    return subprocess.run([PY, "-m", "launcher", *args], env=e, capture_output=True, text=True, timeout=timeout)


def _survivors(box) -> list[int]:
    return sorted(holders(box.token, TOKEN_VAR))


# -- a record that says the run is over, written by the run, not its owner -------------

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
    c = _contain(box, "cancel", run_id, "--grace", "0", "--wait", "--json")
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
        ls = _contain(box, "ls")
        assert ls.returncode == 0, ls.stderr
        rows = [line.split() for line in ls.stdout.splitlines()[1:]]
        assert any(r and r[0] == "lsf" for r in rows), f"{_survivors(box)} alive, ls says: {ls.stdout!r}"
        row = next(r for r in rows if r and r[0] == "lsf")
        assert "orphaned" in " ".join(row) or "final" in " ".join(row), row
        js = _contain(box, "ls", "--json")
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
        g = _contain(box, "gc", "--json")
        assert g.returncode == 0, g.stderr
        assert "gcf" not in json.loads(g.stdout)["removed"], (g.stdout, _survivors(box))
        assert os.path.isdir(os.path.join(box.state_dir, "runs", "gcf"))
        _still_stoppable(box, "gcf")
        g = _contain(box, "gc", "--json")        # over now: gc may take it
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
        r = _contain(box, "run", "-q", "--id", "rid", "--", "true")
        assert r.returncode == 2, (r.returncode, r.stderr, _survivors(box))
        assert "live" in r.stderr and "Traceback" not in r.stderr, r.stderr
        _still_stoppable(box, "rid")
        r = _contain(box, "run", "-q", "--id", "rid", "--", "true")      # over now: the id is free
        assert r.returncode == 0, r.stderr
    finally:
        end_started(p, box.token)
    assert _survivors(box) == []


# -- --user -----------------------------------------------------------------------------

@needs_cgroup
@pytest.mark.parametrize("user", ["\u0663", "\u00b2", "\uff10"])       # ٣ ² ０
def test_user_spelled_in_non_ascii_digits_is_no_such_user_not_a_uid(box, tmp_path, user):
    """`--user ٣` (ARABIC-INDIC DIGIT THREE) ran the worker as uid 3 (sys):
    str.isdigit() and int() take every Unicode digit, where chown(1), su(1)
    and id(1) say there is no such user. `²` printed int()'s own message.
    A name that no account has is a usage error (2) before anything runs."""
    marker = tmp_path / "ran"
    p = _contain(box, "run", "-q", "--user", user, "--", "sh", "-c", f"id -u > {marker}")
    assert p.returncode == 2, (p.returncode, p.stderr, marker.read_text() if marker.exists() else None)
    assert "no such user" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not marker.exists()
    import launcher

    with pytest.raises(ValueError, match="no such user"):
        launcher.run(["sh", "-c", f"id -u > {marker}"], user=user)
    assert not marker.exists()


# -- --record through a descriptor that is not there -------------------------------------

def _sh_contain(box, redirect: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`contain ARGS` from a shell line with `redirect` (closing one of
    contain's descriptors, as a script would)."""
    import shlex

    line = " ".join(shlex.quote(a) for a in [PY, "-m", "launcher", *args]) + " " + redirect
    return subprocess.run(["sh", "-c", line], env=box.env, capture_output=True, text=True, timeout=60)


@needs_cgroup
@pytest.mark.parametrize("path, redirect", [
    ("/dev/fd/7", ""),                     # a script's `--record /dev/fd/7` without its `7>`
    ("/proc/self/fd/9", ""),
    ("/dev/stdin", "<&-"),                 # written to contain's /dev/null placeholder: exit 0, no record anywhere
    ("-", ">&-"),
])
def test_record_to_a_descriptor_that_is_not_open_is_refused_before_the_run(box, tmp_path, path, redirect):
    """--record is "refused before the run when it cannot take a record"
    (docs/api.md; `--record /no/such/dir/x` is). A record to our descriptor
    N that is not open ran CMD first and failed afterwards (125 after the
    work was done: a CI step ran twice on retry), and `--record /dev/stdin`
    with stdin closed wrote the record into contain's placeholder for the
    closed descriptor, /dev/null, and exited 0."""
    marker = tmp_path / "ran"
    p = _sh_contain(box, redirect, "run", "-q", "--record", path, "--", "touch", str(marker))
    assert p.returncode == 125, (p.returncode, p.stderr)
    assert "not open" in p.stderr or "closed" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert not marker.exists(), f"CMD ran first: {p.stderr}"


@needs_cgroup
def test_stats_json_to_a_descriptor_that_is_not_open_is_refused_before_the_run(box, tmp_path):
    """The same for --stats-json, which refuses /dev/fd/N of an open N
    before the run (a link, not a regular file): of a closed N it ran CMD,
    then failed with 125."""
    marker = tmp_path / "ran"
    p = _sh_contain(box, "", "run", "-q", "--stats-json", "/dev/fd/7", "--", "touch", str(marker))
    assert p.returncode == 125, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "--stats-json /dev/fd/7" in p.stderr, p.stderr
    assert not marker.exists(), f"CMD ran first: {p.stderr}"


@needs_cgroup
def test_record_to_an_open_descriptor_or_stdout_is_still_written(box, tmp_path):
    """What still works: /dev/fd/N of an open descriptor, `-`, /dev/stdin
    opened read-write."""
    out = tmp_path / "rec.json"
    p = _sh_contain(box, f"7>{out}", "run", "-q", "--record", "/dev/fd/7", "--", "true")
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text())["state"] == "REAPED"
    p = _sh_contain(box, "", "run", "-q", "--record", "-", "--", "true")
    assert p.returncode == 0 and json.loads(p.stdout)["state"] == "REAPED", p.stderr
    rw = tmp_path / "rw.json"
    p = _sh_contain(box, f"0<>{rw}", "run", "-q", "--record", "/dev/stdin", "--", "true")
    assert p.returncode == 0 and json.loads(rw.read_text())["state"] == "REAPED", p.stderr


# -- numbers in Unicode digits -------------------------------------------------------

@needs_cgroup
def test_keep_runs_in_a_non_ascii_digit_is_ignored_not_a_failed_run(box, tmp_path):
    """CONTAIN_KEEP_RUNS that is not a count is ignored (the default
    applies), as `CONTAIN_KEEP_RUNS=lots` is: `²` (isdigit(), but not for
    int()) failed every run with exit 2 and int()'s own message, naming no
    variable, before anything ran."""
    marker = tmp_path / "ran"
    p = _contain(box, "run", "-q", "--", "touch", str(marker), env={"CONTAIN_KEEP_RUNS": "\u00b2"})
    assert p.returncode == 0 and marker.exists(), (p.returncode, p.stderr)
    g = _contain(box, "gc", "--keep", "\u00b2")
    assert g.returncode == 2 and "not a count" in g.stderr, (g.returncode, g.stderr)


# -- a start that the state directory could not keep ----------------------------------

_FULL_STATE_DIR = r"""set -u
mount -t tmpfs -o size=64k tmpfs {mnt} || exit 99
export CONTAIN_STATE_DIR={mnt}/state
P="{py} -m launcher"
$P run -q --id before -- true || exit 97
dd if=/dev/zero of={mnt}/fill bs=1k count=200 2>/dev/null
$P run -q --id full -- touch {marker}
echo "run=$?"
rm {mnt}/fill
$P ls --json > {out}/ls.json
$P cancel full --json > {out}/cancel.json
echo "cancel=$?"
$P gc --json > {out}/gc.json
"""


@needs_cgroup
@pytest.mark.timeout(120)
def test_a_start_the_full_state_directory_could_not_keep_leaves_no_run_to_cancel(box, tmp_path):
    """A full state directory (ENOSPC writing run.json) fails the start with
    125 before anything runs, as it should; but the roll-back could not
    write its spawn_failed record either and left the directory with the
    run's tag and nothing else. That read as "described" forever: `ls`
    listed it (UNREADABLE, "its tag says it was described"), `gc` kept it
    as live, and `contain cancel` adopted it and answered effect
    `cancelled`, state EXITED, outcome `cancelled` for a run that never
    ran anything."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a small tmpfs in a mount namespace of its own")
    mnt, out, marker = tmp_path / "mnt", tmp_path / "out", tmp_path / "ran"
    mnt.mkdir()
    out.mkdir()
    script = _FULL_STATE_DIR.format(mnt=mnt, py=PY, marker=marker, out=out)
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], env=box.env,
                       capture_output=True, text=True, timeout=100)
    if p.returncode == 99:
        pytest.skip(f"no tmpfs mount here: {p.stderr.strip()[:200]}")
    assert p.returncode == 0 and "run=125" in p.stdout, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    assert not marker.exists()
    listed = [v for v in json.loads((out / "ls.json").read_text()) if v.get("id") == "full"]
    assert all(v.get("unreadable") and "never started" in v["unreadable"] for v in listed), listed
    ack = json.loads((out / "cancel.json").read_text())      # (--json: an answer even then)
    assert ack["effect"] == "unknown" and ack.get("outcome") != "cancelled", ack
    assert "cancel=1" in p.stdout and "never started" in p.stderr, (p.stdout, p.stderr)
    assert "full" in json.loads((out / "gc.json").read_text())["removed"], (out / "gc.json").read_text()


# -- another user's file at the --record path -------------------------------------------

@pytest.mark.timeout(120)
def test_another_users_file_at_the_record_path_in_a_sticky_directory_is_refused_before_the_run(tmp_path):
    """A user's `--record /tmp/job.json`, where another user made
    /tmp/job.json first (0666, so writable: the check passed). The
    record is replaced by rename, which the sticky bit forbids over another
    user's file: the run ran, then exited 125 "Operation not permitted
    (rename)". It is refused before the run now; the other user's file is
    never written through, and a path of the user's own still works."""
    from _users import Shared, as_uid, python, spare_uids, user_env, why_not

    reason = why_not()
    if reason:
        pytest.skip(reason)
    victim, other = spare_uids(2)
    with Shared() as sh:
        shared = sh.sub("tmp", mode=0o1777)
        xdg = sh.sub("xdg", uid=victim, mode=0o700)
        planted = os.path.join(shared, "job.json")
        p = as_uid(other, ["sh", "-c", f"echo planted > {planted}; chmod 666 {planted}"])
        assert p.returncode == 0, p.stderr
        marker = os.path.join(xdg, "ran")
        run = as_uid(victim, [python(), "-m", "launcher", "run", "-q", "--record", planted, "--", "touch", marker],
                     env=user_env(XDG_RUNTIME_DIR=xdg))
        assert run.returncode == 125, (run.returncode, run.stderr)
        assert "sticky" in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert not os.path.exists(marker), f"CMD ran first: {run.stderr}"
        with open(planted) as f:
            assert f.read() == "planted\n"
        own = os.path.join(shared, "own.json")
        run = as_uid(victim, [python(), "-m", "launcher", "run", "-q", "--record", own, "--", "true"],
                     env=user_env(XDG_RUNTIME_DIR=xdg))
        assert run.returncode == 0, run.stderr
        with open(own) as f:
            assert json.load(f)["outcome"] == "exited"


# -- the library, as a CI runner calls it -------------------------------------------

@needs_cgroup
def test_library_takes_record_and_stats_paths_as_pathlib_paths(box, tmp_path):
    """`launcher.run(argv, record_file=Path(...))`, as a runner written
    with pathlib passes it (subprocess takes os.PathLike everywhere, and
    cwd= and workspace= already did): AttributeError 'PosixPath' object
    has no attribute 'startswith', from inside the spawn. A wrong type is
    a TypeError, before anything runs."""
    import pathlib

    import launcher

    rec_path, stats_path = tmp_path / "rec.json", tmp_path / "stats.ndjson"
    rec = launcher.run(["true"], record_file=rec_path, stats_json=stats_path, state_dir=pathlib.Path(box.state_dir))
    assert rec.state == "REAPED", rec.to_dict()
    assert json.loads(rec_path.read_text())["run_id"] == rec.run_id
    assert json.loads(stats_path.read_text().splitlines()[0])["run_id"] == rec.run_id
    marker = tmp_path / "ran"
    for option in ("record_file", "stats_json", "workspace", "parent_cgroup"):
        for bad in (True, -1, 1.5):
            with pytest.raises(TypeError):
                launcher.run(["touch", str(marker)], **{option: bad})
    assert not marker.exists()
    # workspace=True ran the worker and then killed the owner loop at the
    # postcondition (os.path.realpath(True)): no record was ever written,
    # and the run stayed behind as an orphan with its cgroups.
    assert [v for v in os.listdir(os.path.join(box.state_dir, "runs")) if not v.startswith(".")] == [rec.run_id]


@needs_cgroup
def test_worker_cancel_after_its_run_ended_and_was_collected_is_not_live(box, tmp_path):
    """A runner's clean-up cancels every Worker it started, ended or not
    ("w.cancel(...) -> effect cancel_requested | not_live"). Once `contain
    gc` had removed an ended run's directory, `w.cancel()` raised
    RunNotFound, even with the op id it had answered `not_live` before;
    and once another run had the id, it answered `unknown` ("refused").
    The Worker saw its run end: the answer is `not_live`, and the other
    run of the id is left alone."""
    import launcher

    w = launcher.spawn(["true"], id="gone")
    assert w.wait(30).state == "REAPED"
    assert w.cancel(op_id="first").effect == "not_live"
    g = _contain(box, "gc", "--keep", "0", "--json")
    assert "gone" in json.loads(g.stdout)["removed"], g.stdout
    for op in ("first", "later"):
        ack = w.cancel(op_id=op)
        assert ack.effect == "not_live" and ack.state == "REAPED" and ack.op_id == op, ack.to_dict()
    other = launcher.spawn(["sleep", "60"], id="gone")
    try:
        ack = w.cancel(op_id="third")
        assert ack.effect == "not_live" and ack.run_uid == w.run_uid, ack.to_dict()
        assert other.record().state == "RUNNING" and not other.done()
    finally:
        other.cancel(grace=0)
        other.wait(30)
    assert _survivors(box) == []


# -- an interrupt in the middle of the start ---------------------------------------

def _v1_dirs_under(base: str) -> list[str]:
    from conftest import v1_mounts

    found = []
    for mnt in v1_mounts():
        top = os.path.join(mnt, base.lstrip("/"))
        if os.path.isdir(top):
            found += [os.path.join(top, d) for d in os.listdir(top) if os.path.isdir(os.path.join(top, d))]
    return found


@needs_cgroup
@pytest.mark.forked
@pytest.mark.timeout(60)
def test_ctrl_c_just_after_a_v1_cgroup_is_made_leaves_no_cgroup(box, monkeypatch):
    """A Supervisor Ctrl-C'd while it spawns (seen here: 2 of 26 random
    interrupts) recorded the run `spawn_failed`, `cgroup_v1: null`,
    "container_removed: true", and left its v1 `pids` cgroup behind for
    ever: the interrupt came after the mkdir and before the cgroup was
    noted as made, so the roll-back did not know it. The interrupt is
    raised here right after that mkdir (in this forked test process)."""
    if not _v1_dirs_under("/") and not [m for m in __import__("conftest").v1_mounts()]:
        pytest.skip("no cgroup v1 hierarchy here")
    import launcher
    from launcher import _runcgroups

    real = _runcgroups.mkdir_under
    calls = []

    def interrupted(*a, **k):
        out = real(*a, **k)
        calls.append(a[1])
        raise KeyboardInterrupt
    monkeypatch.setattr(_runcgroups, "mkdir_under", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launcher.run(["true"], id="kiv1", accounting=True)     # v1 cgroups are made only when asked
    assert calls, "no v1 cgroup was made for the run (no v1 hierarchy to test)"
    left = [d for d in _v1_dirs_under(box.v1_base) if "kiv1" in d]
    assert left == [], f"left behind: {left}"
    assert _survivors(box) == []


@needs_cgroup
@pytest.mark.forked
@pytest.mark.timeout(60)
def test_supervisor_interrupted_as_its_workers_thread_starts_still_stops_the_run_before_it_returns(box, monkeypatch):
    """"On exit, on an exception and on KeyboardInterrupt, a supervisor
    requests every stop first, then waits for each container to be observed
    empty." A Ctrl-C that lands while a Worker starts its owner thread (or
    just after, before the Supervisor has the Worker) left a run that
    close() only asked to stop, without waiting: the process then exited
    with the stop under way (seen in 2 of 36 random interrupts: a tree
    left running, orphaned, or one killed with its record still RUNNING).
    The interrupt is raised here right after the owner thread starts (in
    this forked test process)."""
    import threading

    import launcher

    real_start = threading.Thread.start

    def start_then_interrupt(self, *a, **k):
        real_start(self, *a, **k)
        if self.name.startswith("contain-"):
            raise KeyboardInterrupt
    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        with launcher.Supervisor(grace=5.0) as sup:
            sup.spawn(["sh", "-c", "trap '' TERM INT; setsid sleep 60 & sleep 60"], id="kith")
    rec = box.record("kith")                      # read at once: close() has returned
    assert rec["state"] in ("REAPED", "EXITED"), (rec["state"], rec.get("notes"))
    assert _survivors(box) == []
