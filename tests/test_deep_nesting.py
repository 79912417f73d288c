"""Structures nested past Python's recursion limit, made by the worker or by a
request: a deep workspace, a deep cgroup subtree, a deep run directory, a
cancel request whose `by` nests 790 levels. None crashes contain, the stop
or gc."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from _proc import holders, kill_holders, run_contain


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
    p = subprocess.Popen([*_contain_argv(), "run", "--id", "deep-by", "--", "sleep", "60"], env=env,
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


def _contain_argv() -> list[str]:
    import sys

    return [sys.executable, "-m", "launcher"]
