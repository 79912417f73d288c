"""A same-uid or root worker against its run's cancellation inbox: squatting
the op ids contain uses for its signals, a malformed line beside a real
request, 32 MiB of junk, its own FIFO in place of the wake FIFO, the inbox
removed. Every cancel and every SIGTERM to contain is still read and acted on."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import launcher

from _proc import contain_cmd, holders, kill_holders, readline_within, run_contain, wait_holders
from _v1 import remove_v1_of
from conftest import needs_cgroup
from test_signals import wait_for_file


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
    remove_v1_of(run_id)


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
def test_worker_squatting_the_signal_op_ids_cannot_make_contain_deaf_to_sigterm(box):
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
def test_inbox_flooded_with_junk_still_has_its_cancels_read(box):
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
def test_worker_replacing_the_wake_fifo_cannot_make_its_run_deaf_to_cancel(box):
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
        remove_v1_of("deaf")
    assert holders(box.token) == []


@needs_cgroup
@pytest.mark.timeout(90)
def test_root_worker_removing_its_cancellations_cannot_make_itself_uncancellable(box, tmp_path):
    # One `rm -rf "$CONTAIN_RUN_DIR/cancellations"` by an unsealed root worker:
    # `contain cancel` and `contain status` said "no run" (exit 3) while `ls`
    # listed it RUNNING, and the owner kept reading a directory nobody could
    # reach any more. Both while its owner lives and once it is gone.
    done = tmp_path / "removed"
    for run_id, orphan in (("rc", False), ("ro", True)):
        script = f'rm -rf "$CONTAIN_RUN_DIR/cancellations" && echo ok > {done}-{run_id}; exec sleep 300'
        p = subprocess.Popen(contain_cmd("run", "--id", run_id, "--", "sh", "-c", script),
                             env=box.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_file(f"{done}-{run_id}")
            assert wait_holders(box.token, 1), "workload did not start"
            if orphan:
                p.kill()
                p.wait(10)
            s = run_contain(box.env, "status", run_id, timeout=30)
            assert s.returncode == 0 and "Traceback" not in s.stderr, (s.returncode, s.stderr)
            c = run_contain(box.env, "cancel", run_id, "--grace", "0", "--wait", "--json", timeout=60)
            assert "Traceback" not in c.stderr, c.stderr
            assert c.returncode == 0, (run_id, c.returncode, c.stdout, c.stderr)
            assert json.loads(c.stdout)["effect"] == "cancelled"
            if not orphan:
                assert p.wait(30) == 143, p.returncode    # (the supervisor carries the token too)
            assert holders(box.token) == []
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
            remove_v1_of(run_id)
