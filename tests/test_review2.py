"""Adversarial review of the last commits on main (review2): failed starts,
persistence failures, the owner loop dying, the inbox, the wall's hold/go
handshake, v1 cgroups and accounting.

Each test is named after the attack and fails on the code it was written
against; survival is decided by the test's own /proc scan (a token in the
workload's environment), never by asking contain.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import launcher

from _proc import contain_cmd, holders, kill_holders, readline_within
from conftest import children_of, fd_count, needs_cgroup


def _v1_dirs() -> list[str]:
    """The `contain/` directories of the v1 memory and pids hierarchies, as
    mounted (read from mountinfo, never assumed)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = right.split()
            if len(fields) < 3 or fields[0] != "cgroup":
                continue
            opts = fields[2].split(",")
            if "memory" in opts or "pids" in opts:
                out.append(os.path.join(left.split()[4], "contain"))
    return out


def _v1_of(run_id: str) -> list[str]:
    """The v1 cgroups made for the run `run_id` (named run-<id>-<hex>)."""
    found = []
    for d in _v1_dirs():
        try:
            names = os.listdir(d)
        except OSError:
            continue
        found += [os.path.join(d, n) for n in names if n.startswith(f"run-{run_id}-")]
    return sorted(found)


def _remove_v1_of(run_id: str) -> None:
    """Clean-up: only cgroups named after this test's own run ids, and only
    when empty (rmdir fails on a cgroup with a task)."""
    for d in _v1_of(run_id):
        for sub, _dirs, _files in sorted(os.walk(d, topdown=False), key=lambda t: -len(t[0])):
            try:
                os.rmdir(sub)
            except OSError:
                pass


def _run_info(state_dir: str, run_id: str, timeout: float = 10.0) -> dict:
    """run.json, once the live record names the worker (the run is owned
    and its owner loop reads the inbox)."""
    run_dir = os.path.join(state_dir, "runs", run_id)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(os.path.join(run_dir, "record.json")) as f:
                if json.load(f).get("identity"):
                    with open(os.path.join(run_dir, "run.json")) as f2:
                        return json.load(f2)
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{run_dir}/record.json never named a worker")
        time.sleep(0.02)


def _end_cli_run(p: subprocess.Popen, box, run_id: str) -> None:
    """Clean-up of a `contain run` a test gave up on: the supervisor killed,
    the orphaned run adopted by `contain cancel` (which stops it and removes
    its cgroups, v1 included), then whatever still carries the token."""
    if p.poll() is None:
        p.kill()
        p.wait(10)
        try:
            subprocess.run(contain_cmd("cancel", run_id, "--grace", "0", "--wait"), env=box.env,
                           capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:
            pass
    kill_holders(box.token)
    _remove_v1_of(run_id)


# -- 4. the inbox ---------------------------------------------------------------------

_SQUATTER = r"""
import json, os, sys, time
d = os.path.join(os.environ["CONTAIN_STATE_DIR"], "runs", sys.argv[1])
for _ in range(500):
    try:
        sup = json.load(open(os.path.join(d, "run.json")))["supervisor"]["pid"]
        break
    except Exception:
        time.sleep(0.01)
# Not requests (no run uid): each is rejected, and answered under its op id.
with open(os.path.join(d, "cancellations", "requests.ndjson"), "a") as f:
    for s in ("SIGINT", "SIGTERM", "SIGHUP"):
        f.write(json.dumps({"op_id": f"signal-{s}-{sup}"}) + "\n")
try:
    fd = os.open(os.path.join(d, "cancellations", "wake"), os.O_WRONLY | os.O_NONBLOCK)
    os.write(fd, b"x")
    os.close(fd)
except OSError:
    pass
print(sup, flush=True)
time.sleep(60)
"""


@needs_cgroup
@pytest.mark.timeout(60)
def test_worker_squatting_the_signal_op_ids_makes_contain_deaf_to_sigterm(box):
    """A same-uid worker reads the supervisor's pid from run.json and writes
    malformed inbox lines under the op ids `contain` itself uses for the
    signals it receives (`signal-SIGTERM-<pid>`). The owner answers each
    rejection under that op id and remembers it; the user's SIGTERM to
    `contain` then finds its op "already requested" and nothing is
    cancelled: contain waits for the worker's natural end."""
    p = subprocess.Popen(contain_cmd("run", "--id", "sq", "--grace", "1", "--",
                                     sys.executable, "-c", _SQUATTER, "sq"),
                         env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = readline_within(p.stdout, 30)
        assert line.strip().isdigit(), (line, p.stderr)
        ack = os.path.join(box.state_dir, "runs", "sq", "cancellations", f"signal-SIGTERM-{p.pid}.json")
        deadline = time.monotonic() + 3
        while not os.path.exists(ack) and time.monotonic() < deadline:
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("contain ignored SIGTERM: the worker squatted its signal operation ids")
        assert p.returncode == 128 + signal.SIGTERM or p.returncode == -signal.SIGTERM, p.returncode
        assert holders(box.token) == []
        assert box.record("sq")["outcome"] == "cancelled"
    finally:
        _end_cli_run(p, box, "sq")


@needs_cgroup
@pytest.mark.timeout(60)
def test_malformed_line_with_a_pending_op_id_does_not_swallow_the_real_cancel(contained):
    """A real cancel request and, right behind it in the same read, a line
    that is not a request but names the same op id (a worker watching the
    inbox appends it). The owner handles the rejections of a read before
    its requests: it answers the op `unknown` ("rejected"), and then skips
    the real request as a repeat. The cancel is lost and its requester is
    told it was rejected."""
    from launcher._layout import RunDir

    w = launcher.spawn(["sleep", "60"], id="pend", env=contained["env"], grace=0.5)
    try:
        info = _run_info(contained["state_dir"], "pend")
        layout = RunDir.find("pend", contained["state_dir"])
        real = {"op_id": "real-op", "run_uid": info["run_uid"], "requested_at": "2026-12-01T00:00:00Z",
                "by": {"pid": os.getpid()}}
        forged = {"op_id": "real-op"}      # no run uid: rejected
        path = os.path.join(layout.cancellations, "requests.ndjson")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(real) + "\n" + json.dumps(forged) + "\n").encode())
        finally:
            os.close(fd)
        layout.poke_owner()
        try:
            rec = w.wait(15)
        except TimeoutError:
            ack = layout.read_ack("real-op")
            pytest.fail(f"the real cancel was swallowed by a forged line with its op id: ack {ack}")
        assert rec.outcome == "cancelled"
        assert layout.read_ack("real-op")["effect"] == "cancelled"
        assert holders(contained["token"]) == []
    finally:
        try:
            w.cancel(op_id="cleanup", grace=0)
            w.wait(15)
        except Exception:
            pass


# -- 1. failed starts -----------------------------------------------------------------

@needs_cgroup
@pytest.mark.forked        # it lowers RLIMIT_NOFILE of the test process
@pytest.mark.timeout(240)
def test_a_start_that_runs_out_of_descriptors_leaves_no_v1_cgroup(contained):
    """EMFILE at each point of the start-up in turn. When the start fails
    after the run's v1 cgroups were made, the roll-back removes them with
    RunCgroups.remove(), which walks each with os.walk: os.walk swallows
    the EMFILE of its own scandir and yields nothing, so nothing is
    removed, and remove() returns None: the record says
    `cgroups_v1_removed: true` while memory/contain/run-<id>-* and
    pids/contain/run-<id>-* stay for ever."""
    import resource

    if not _v1_dirs():
        pytest.skip("no v1 memory or pids hierarchy mounted")
    env = contained["env"]
    launcher.run(["true"], env=env)           # warm: imports, the base, the state directory
    base_fds = fd_count()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ids = [f"emf{n}" for n in range(40)]
    left: dict[str, list[str]] = {}
    try:
        for n, rid in enumerate(ids):
            resource.setrlimit(resource.RLIMIT_NOFILE, (base_fds + n, hard))
            try:
                rec = launcher.run(["true"], id=rid, env=env)
            except (launcher.LauncherError, OSError):
                rec = None
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            if _v1_of(rid):
                left[rid] = _v1_of(rid)
            if rec is not None and rec.outcome == "exited":
                break
        assert left == {}, f"v1 cgroups left by failed starts: {left}"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for rid in ids:
            _remove_v1_of(rid)


# -- 5. the wall's hold/go handshake ----------------------------------------------------

@needs_cgroup
@pytest.mark.forked        # it replaces the wall module's native library object
@pytest.mark.timeout(60)
def test_ctrl_c_during_the_wall_clone_leaks_no_descriptor_and_no_init(contained):
    """A KeyboardInterrupt whose signal arrived while ct_wall_spawn ran is
    raised at the first bytecode after the call returns, before the
    `try:` that guards the go handshake (launcher/_platform/wall.py
    spawn_wall). The roll-back stops the leaf, but the init's pidfd, its
    report socket and the go pipe stay open in the caller, and the killed
    init is never reaped (a zombie child of the library's process)."""
    import launcher._platform.wall as W

    env = contained["env"]
    launcher.run(["true"], env=env)           # warm
    real = W.lib

    class CtrlCDuringClone:
        def __getattr__(self, name):
            return getattr(real, name)

        def ct_wall_spawn(self, a, w, r):
            real.ct_wall_spawn(a, w, r)
            raise KeyboardInterrupt           # the signal's handler runs here

    fds, kids = fd_count(), children_of(os.getpid())
    W.lib = CtrlCDuringClone()
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.run(["sleep", "60"], id="cc", env=env)
    finally:
        W.lib = real
    try:
        deadline = time.monotonic() + 20
        while (fd_count() != fds or children_of(os.getpid()) != kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        leaked = fd_count() - fds
        new_kids = [k for k in children_of(os.getpid()) if k not in kids]
        assert leaked == 0 and new_kids == [], \
            f"{leaked} descriptors and children {new_kids} left by a Ctrl-C during the wall's clone"
        assert holders(contained["token"]) == []
    finally:
        for k in [k for k in children_of(os.getpid()) if k not in kids]:
            try:
                os.kill(k, signal.SIGKILL)       # our own child (the wall's init)
                os.waitpid(k, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


_FLOODER = r"""
import os, sys, time
path = os.path.join(os.environ["CONTAIN_STATE_DIR"], "runs", sys.argv[1], "cancellations", "requests.ndjson")
with open(path, "ab") as f:
    line = b"x" * (1 << 20) + b"\n"          # junk: each line one rejection, counted not answered
    for _ in range(32):
        f.write(line)
print("flooded", flush=True)
time.sleep(60)
"""


@needs_cgroup
@pytest.mark.timeout(90)
def test_inbox_flooded_with_junk_keeps_cancels_from_ever_being_read(box):
    """A same-uid worker appends 32 MiB of junk to its own inbox once, then
    sleeps. The owner reads at most 16 chunks of 64 KiB per turn
    (_inbox.Inbox.pending) and nothing schedules another turn while the
    backlog remains: it waits for the next wake-up. Each later cancel
    pokes the owner once, which reads 1 MiB more, never reaching the
    request at the end: `contain cancel` gets no answer, and SIGTERM to
    `contain` (its request goes to the same file) is not acted on either."""
    p = subprocess.Popen(contain_cmd("run", "--id", "fl", "--grace", "1", "--",
                                     sys.executable, "-c", _FLOODER, "fl"),
                         env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert readline_within(p.stdout, 30).strip() == b"flooded"
        c = subprocess.run(contain_cmd("cancel", "fl", "--grace", "0", "--json"), env=box.env,
                           capture_output=True, text=True, timeout=40)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a cancel behind 32 MiB of junk was never applied: {c.stdout} {c.stderr}")
        assert holders(box.token) == []
        assert box.record("fl")["outcome"] == "cancelled"
    finally:
        _end_cli_run(p, box, "fl")


# -- 7. --user --------------------------------------------------------------------------

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
