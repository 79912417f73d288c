"""The state directory against other local users and the worker: a symlink
another user put above it (or raced into a missing level) is never
followed, an unprivileged run's worker cannot reach it, and a start it has
no room to keep leaves no run behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from _proc import contain_cmd, end_started, holders
from _users import Shared, python, spare_uids, why_not
from _victim import Victim
from conftest import needs_cgroup


USERS_SKIP = why_not()


needs_users = pytest.mark.skipif(USERS_SKIP is not None, reason=USERS_SKIP or "")


def _as(uid: int, *argv: str) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]


@needs_users
@pytest.mark.timeout(60)
def test_another_users_symlink_above_the_state_dir_is_not_followed(tmp_path):
    """An unprivileged user's CONTAIN_STATE_DIR goes through a symlink that
    another user owns (in a sticky shared directory) and that points, for
    now, at the victim's own directory. Only the real path was checked, so
    the victim used it; the attacker can re-point the link whenever it
    likes at another directory of the victim's, and the victim's `contain ls`
    and `cancel` then look at runs that are not the ones it started (here:
    its live run is 'no such run', exit 3)."""
    victim, attacker = spare_uids(2)
    with Shared(mode=0o1777) as sh:
        v = Victim(sh, victim)
        real = sh.sub("real", uid=victim, mode=0o700)
        other = sh.sub("other", uid=victim, mode=0o700)
        link = os.path.join(sh.path, "link")
        assert subprocess.run(_as(attacker, "ln", "-s", real, link), capture_output=True,
                              timeout=10).returncode == 0
        v.env["CONTAIN_STATE_DIR"] = os.path.join(link, "st")
        r = v.contain("run", "-q", "--backend", "pidns", "--id", "sl", "--", "true", timeout=30)
        made = os.listdir(real) + os.listdir(other)
        assert r.returncode == 125, (r.returncode, r.stderr, made)
        assert "Traceback" not in r.stderr and "not followed" in r.stderr, r.stderr
        assert made == [], f"a state directory was made through another user's link: {made}"


@needs_users
@pytest.mark.timeout(60)
def test_another_users_symlink_above_roots_state_dir_is_not_followed(box, tmp_path):
    """The same link under root: another user's symlink in the middle of
    root's CONTAIN_STATE_DIR chose the root-owned directory (a stand-in for
    /etc here) in which root created `st/runs/<id>/`."""
    attacker, = spare_uids(1)
    decoy = tmp_path / "decoy"
    decoy.mkdir(mode=0o755)
    with Shared(mode=0o1777) as sh:
        link = os.path.join(sh.path, "link")
        assert subprocess.run(_as(attacker, "ln", "-s", str(decoy), link), capture_output=True,
                              timeout=10).returncode == 0
        env = dict(box.env, CONTAIN_STATE_DIR=os.path.join(link, "st"))
        r = subprocess.run(contain_cmd("run", "-q", "--backend", "pidns", "--id", "sl", "--", "true"),
                           env=env, capture_output=True, text=True, timeout=30)
        assert os.listdir(decoy) == [], f"root made {os.listdir(decoy)} through another user's link"
        assert r.returncode == 125 and "not followed" in r.stderr, (r.returncode, r.stderr)
    assert holders(box.token) == []


_REACH_FOR_THE_STATE_DIR = r"""
import json, os
d = os.environ["CONTAIN_RUN_DIR"]
state = os.path.dirname(os.path.dirname(d))
seen = {}
for what, f in (("record", lambda: open(os.path.join(d, "record.json")).read()),
                ("tag", lambda: os.getxattr(d, "user.contain.run")),
                ("runs", lambda: os.listdir(os.path.join(state, "runs"))),
                ("write", lambda: open(os.path.join(d, "record.json"), "w").write("{}"))):
    try:
        f()
        seen[what] = "ok"
    except OSError as e:
        seen[what] = e.errno
seen["state_dir"] = os.listdir(state)
print(json.dumps(seen), flush=True)
"""


@needs_users
@pytest.mark.timeout(120)
def test_own_worker_cannot_reach_the_state_directory():
    """Behind a user namespace of the caller's own uid (the pidns backend)
    the worker is the owner of the state directory: it could rewrite its own
    record, run.json and tag, and every other run's of the same user. The
    init now mounts an empty tmpfs over the state directory in the run's
    mount namespace, which the worker (no capabilities) cannot unmount."""
    victim, = spare_uids(1)
    with Shared() as sh:
        v = Victim(sh, victim)
        p = v.start("run", "-q", "--backend", "pidns", "--id", "sd", "--", python(), "-c", _REACH_FOR_THE_STATE_DIR)
        try:
            out, err = p.communicate(timeout=60)
        finally:
            end_started(p, v.token)
        assert p.returncode == 0, err
        seen = json.loads(out)
        assert "ok" not in seen.values() and seen["state_dir"] == [], seen
        w = v.contain("wait", "sd", "--json", timeout=30)
        rec = json.loads(w.stdout)
        assert rec["state"] == "REAPED", rec["state"]
        wall, = rec["containment"]["walls"]
        assert wall["state_dir"]["hidden"] is True and wall["state_dir"]["path"] == os.path.dirname(
            os.path.dirname(v.run_dir("sd"))), wall
        # Started from inside the state directory: its working directory
        # would still name the directory under the tmpfs.
        inside = subprocess.run(_as(victim, python(), "-m", "launcher", "run", "-q", "--backend", "pidns", "--id",
                                    "cw", "--", "ls", "-A", "."), env=v.env, capture_output=True, text=True,
                                timeout=60, cwd=os.path.dirname(v.run_dir("sd")))
        assert inside.returncode == 0 and inside.stdout.split() == [], (inside.stdout, inside.stderr)
        assert holders(v.token) == []


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


PY = sys.executable


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
