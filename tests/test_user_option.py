"""`--user` as an administrator spells it: a uid without an account gets none
of root's names, and digits of other scripts are no uid at all."""
from __future__ import annotations

import os
import subprocess

import pytest

from _proc import contain_cmd, contain_in
from conftest import needs_cgroup


@needs_cgroup
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a worker as another uid")
def test_numeric_user_without_an_account_does_not_inherit_roots_names(box):
    """`--user 4242` (a uid with no passwd entry): the worker runs as 4242
    but keeps the caller's HOME, USER and LOGNAME (user_account returns no
    names for it, and spawn_request only overrides the names it got), so
    it is told it is root, with root's home."""
    import pwd

    uid = next(u for u in range(4242, 4300) if not _has_account(pwd, u))
    env = dict(box.env, HOME="/root", USER="root", LOGNAME="root")
    p = subprocess.run(contain_cmd("run", "-q", "--user", str(uid), "--", "sh", "-c",
                                   'echo "$(id -u) HOME=$HOME USER=$USER LOGNAME=$LOGNAME"'),
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    got = p.stdout.split()
    assert got[0] == str(uid)
    assert "USER=root" not in got and "LOGNAME=root" not in got and "HOME=/root" not in got, \
        f"uid {uid} was handed root's names: {p.stdout.strip()}"


def _has_account(pwd, uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


@needs_cgroup
@pytest.mark.parametrize("user", ["\u0663", "\u00b2", "\uff10"])       # ٣ ² ０
def test_user_spelled_in_non_ascii_digits_is_no_such_user_not_a_uid(box, tmp_path, user):
    """`--user ٣` (ARABIC-INDIC DIGIT THREE) ran the worker as uid 3 (sys):
    str.isdigit() and int() take every Unicode digit, where chown(1), su(1)
    and id(1) say there is no such user. `²` printed int()'s own message.
    A name that no account has is a usage error (2) before anything runs."""
    marker = tmp_path / "ran"
    p = contain_in(box, "run", "-q", "--user", user, "--", "sh", "-c", f"id -u > {marker}")
    assert p.returncode == 2, (p.returncode, p.stderr, marker.read_text() if marker.exists() else None)
    assert "no such user" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not marker.exists()
    import launcher

    with pytest.raises(ValueError, match="no such user"):
        launcher.run(["sh", "-c", f"id -u > {marker}"], user=user)
    assert not marker.exists()
