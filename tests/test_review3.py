"""Adversarial review 3: hostile workloads and hostile local users against
`contain run`, black-box through the contract.

Each test is named after the attack and failed on the code it was written
against; the attacker is a spare uid (setpriv) working in directories it
made; survival is decided by the test's own /proc scan (a token in the
workload's environment), never by asking contain.
"""
from __future__ import annotations

import os
import subprocess

import pytest

from _proc import contain_cmd, holders, readline_within
from _users import SYS_PY, Shared, as_uid, spare_uids, user_env, why_not
from conftest import needs_cgroup

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
                                 "--", SYS_PY, "-c", _FILL_FIFO, fifo],
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
