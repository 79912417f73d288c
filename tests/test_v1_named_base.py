"""A named v1 base (CONTAIN_CGROUP_V1_BASE) shared by overlapping runs: the run
that made it removes it when the last one is out, an adopter removes it for
an orphan that made it, a base someone else made stays, and a run starting
while another ends under it always gets its limit."""
from __future__ import annotations

import os
import secrets
import subprocess
import threading
import time

import pytest

from launcher import _controllers as C, _limits as L, _runcgroups as R

from _cgworld import remove_v1_base
from _proc import holders, kill_holders, new_token, wait_holders
from conftest import TOKEN_VAR


needs_root_v1 = pytest.mark.skipif(
    os.geteuid() != 0 or not any("pids" in h.controllers for h in C.v1_hierarchies()),
    reason="needs root and a cgroup v1 pids hierarchy (a hybrid host)")


def _name() -> str:
    return f"run-rev12{secrets.token_hex(3)}-{secrets.token_hex(4)}"


@pytest.fixture
def base():
    b = f"/contain-rev12-{secrets.token_hex(4)}"
    try:
        yield b
    finally:
        remove_v1_base(b)


def _tops(b: str) -> list[str]:
    """The base in every v1 hierarchy (a run uses those of memory, pids and
    cpuacct; remove_v1_base cleans them all)."""
    return [h.fs_path(b) for h in C.v1_hierarchies()]


def _env(b: str, token: str = "") -> dict[str, str]:
    env = dict(os.environ, CONTAIN_CGROUP_V1_BASE=b, **({TOKEN_VAR: token} if token else {}))
    env.pop("CONTAIN_CGROUP_V1", None)
    return env


def _made(rc) -> list[str]:
    """The named bases this run made itself."""
    return [b for b, made in rc.bases if made]


def _create(b: str) -> R.RunCgroups:
    return R.RunCgroups.create(_name(), L.Limits(pids_max=10), v2_dir=None, env=_env(b))


def _sleeper_in(rc: R.RunCgroups, token: str) -> subprocess.Popen[bytes]:
    """A sleep of this test's own, in every v1 cgroup of `rc` from before its
    exec (the join-fd protocol)."""
    fds = rc.join_fds()

    def join() -> None:
        for fd in fds:
            os.write(fd, b"0")

    try:
        return subprocess.Popen(["/bin/sleep", "60"], preexec_fn=join, env=_env("/", token))
    finally:
        rc.close_join_fds()


@needs_root_v1
def test_overlapping_runs_under_a_named_base_the_last_one_out_removes_it(base):
    """A makes the base, B starts under it, A ends while B still runs (the
    base stays: B is in it), B ends: the base is empty and was made by a
    run, so it must go. It stayed for ever: B never made it."""
    token = new_token()
    p = None
    a = _create(base)
    b = None
    try:
        assert _made(a), "the run did not make the base it was named"
        b = _create(base)
        assert not _made(b)
        p = _sleeper_in(b, token)
        assert wait_holders(token, 1, timeout=10)
        with open(os.path.join(b.v1["pids"], "cgroup.procs")) as f:
            assert str(p.pid) in f.read().split(), "B's worker is not in B's cgroup"
        tops = [os.path.dirname(d) for d in b.v1.values()]
        assert a.remove() is None
        assert all(os.path.isdir(t) for t in tops), "A removed the base while B was in it"
        with open(os.path.join(b.v1["pids"], "pids.max")) as f:
            assert f.read().strip() == "10", "B's limit is gone with A"
        p.kill()
        p.wait(10)
        assert holders(token) == []
        assert b.remove() is None
        b = None
        left = [t for t in tops if os.path.exists(t)]
        assert left == [], f"the base a run made outlived every run in it: {left}"
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(10)
        kill_holders(token)
        for rc in (a, b):
            if rc is not None:
                rc.remove()


@needs_root_v1
def test_a_base_that_was_there_before_stays_when_runs_overlap_in_it(base):
    """The other half: a base the runs found (someone's, made before any
    run) stays, whichever run ends last."""
    tops = _tops(base)
    for t in tops:
        os.mkdir(t)
    a = _create(base)
    b = _create(base)
    assert not _made(a) and not _made(b)
    assert a.remove() is None
    assert b.remove() is None
    assert all(os.path.isdir(t) for t in tops), "a base that was there before the runs was removed"
    assert not [n for t in tops for n in os.listdir(t) if n.startswith("run-")], "a run's cgroup was left"


@needs_root_v1
def test_an_adopter_removes_the_named_base_of_the_orphaned_run_that_made_it(base):
    """`contain cancel` of an orphan takes the run's cgroups over from its
    run info (RunCgroups.attach) and removes them: the base the dead run
    made must go with them, not stay for ever."""
    a = _create(base)
    assert _made(a)
    desc = a.describe()
    adopter = R.RunCgroups.attach(desc, v2_dir=None)
    tops = _tops(base)
    assert adopter.remove() is None
    assert not any(os.path.exists(d) for d in a.v1.values())
    left = [t for t in tops if os.path.exists(t)]
    assert left == [], f"the orphan's base outlived its adoption: {left}"


@needs_root_v1
def test_an_adopter_never_removes_a_base_no_run_made(base):
    """An adopter removes a base only if a run made it: one that was there
    before (or an outer run's cgroup, for a nested run) stays."""
    tops = _tops(base)
    for t in tops:
        os.mkdir(t)
    a = _create(base)
    adopter = R.RunCgroups.attach(a.describe(), v2_dir=None)
    assert adopter.remove() is None
    assert all(os.path.isdir(t) for t in tops), "an adopter removed a base no run made"


@needs_root_v1
def test_runs_starting_while_others_end_under_one_named_base_always_get_their_limit(base):
    """Two threads start and end runs under one named base for a while, so a
    start falls between another run's removal of the base and its own two
    mkdirs: every start must succeed with its cgroup there and its limit
    applied; at the end the base is gone."""
    errors: list[str] = []
    stop = time.monotonic() + 3.0

    def churn() -> None:
        n = 0
        while time.monotonic() < stop and not errors and n < 2000:
            n += 1
            try:
                rc = _create(base)
            except Exception as e:             # noqa: BLE001 - the failure is the finding
                errors.append(f"create: {e!r}")
                return
            try:
                with open(os.path.join(rc.v1["pids"], "pids.max")) as f:
                    if f.read().strip() != "10":
                        errors.append("limit not applied")
            except OSError as e:
                errors.append(f"cgroup lost: {e!r}")
            finally:
                why = rc.remove()
                if why is not None:
                    errors.append(f"remove: {why}")

    ts = [threading.Thread(target=churn, daemon=True) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts), "a churning thread did not finish"
    assert errors == []
    assert [t for t in _tops(base) if os.path.exists(t)] == []
