"""Adversarial review 6: layers and bounds that said more than was observed,
driven through the CLI exactly as the contract describes it.

Each test is named after the attack and failed on the code it was written
against. Survival is decided by the test's own /proc scan (a token in the
workload's environment), never by asking contain.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from _proc import cgroup2_mount, contain_cmd, holders, run_contain
from _users import Shared, contain_as, spare_uids, user_env, why_not
from conftest import needs_cgroup

pytestmark = needs_cgroup


@pytest.mark.timeout(60)
def test_worker_making_an_undecodable_directory_name_in_the_workspace_cannot_crash_contain(box, tmp_path):
    # The worker owns its workspace: it made a directory whose name is not
    # UTF-8. The workspace check crashed contain with a UnicodeEncodeError
    # traceback (exit 1) before the final record: the run stayed RUNNING,
    # orphaned, its cgroups left behind.
    ws = tmp_path / "ws"
    ws.mkdir()
    odd = os.fsencode(ws) + b"/\xff"
    p = run_contain(box.env, "run", "--id", "u8", "--workspace", str(ws), "--", sys.executable, "-c",
                    f"import os; os.mkdir({odd!r}); os.mkdir({odd + b'/x'!r})", cwd="/")
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 0, p.stderr
    rec = box.record("u8")
    assert rec["state"] == "REAPED" and rec["cleanup"]["container_removed"] is True, rec["cleanup"]
    assert rec["evidence"]["workspace_quiescent"]["observed"] is True, rec["evidence"]["workspace_quiescent"]
    assert box.leaves() == []


@pytest.mark.timeout(120)
def test_writer_in_a_directory_beyond_the_watched_ones_does_not_leave_the_workspace_quiescent(box, tmp_path):
    # "null means the observation could not be made ... never rewritten as
    # true": the workspace check watches at most some thousands of
    # directories. A process outside the run (holding nothing open there)
    # kept creating and removing entries in a directory past that bound, all
    # through the check's window, and the layer said observed true (and
    # redispatch_eligible true).
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(2100):
        (ws / f"d{i:04d}").mkdir()
    last = [d for d, _subdirs, _files in os.walk(ws)][-1]   # the order the check walks in
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, time
        end = time.monotonic() + 60
        while time.monotonic() < end:
            os.mkdir({last!r} + "/x"); os.rmdir({last!r} + "/x"); time.sleep(0.001)
    """)], cwd="/")
    try:
        p = run_contain(box.env, "run", "--id", "ws", "--workspace", str(ws), "--", "true", cwd="/")
        assert p.returncode == 0, p.stderr
        rec = box.record("ws")
        layer = rec["evidence"]["workspace_quiescent"]
        assert layer["observed"] is not True, layer
        assert rec["evidence"]["redispatch_eligible"]["observed"] is not True
    finally:
        writer.kill()
        writer.wait(10)


_SOCKETS = {
    "unbound-tcp": "socket.socket(socket.AF_INET, socket.SOCK_STREAM)",
    "unbound-udp": "socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)",
    "netlink": "socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)",
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", sorted(_SOCKETS))
def test_socket_sock_diag_cannot_list_handed_outside_is_not_called_closed(box, tmp_path, kind):
    # A member holds a socket at the stop and has handed it to a process
    # outside the run (SCM_RIGHTS). sock_diag lists only hashed TCP/UDP and
    # unix sockets: an unbound inet socket or a netlink socket is not among
    # them, so it read as closed (observed true) while the outside process
    # still held it.
    path = str(tmp_path / "handoff.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    srv.settimeout(30)
    code = textwrap.dedent(f"""
        import os, socket, time
        s = {_SOCKETS[kind]}
        u = socket.socket(socket.AF_UNIX); u.connect({path!r})
        socket.send_fds(u, [b"x"], [s.fileno()])
        u.recv(1)
        if os.fork() == 0:
            time.sleep(300)       # holds it at the stop
    """)
    proc = subprocess.Popen(contain_cmd("run", "--id", "s", "--grace", "0.2", "--check-sockets", "--",
                                        sys.executable, "-c", code), env=box.env)
    kept = None
    try:
        conn, _ = srv.accept()
        conn.settimeout(30)
        _msg, fds, _flags, _addr = socket.recv_fds(conn, 16, 4)
        kept = socket.socket(fileno=fds[0])
        conn.send(b"y")
        assert proc.wait(30) == 0
        rec = box.record("s")
        assert rec["state"] == "REAPED"
        layer = rec["evidence"]["sockets_closed"]
        assert layer["detail"]["held_at_stop"] >= 1, layer
        assert layer["observed"] is False, layer
        assert os.fstat(kept.fileno()).st_ino in layer["detail"]["still_open"]
        assert rec["evidence"]["redispatch_eligible"]["observed"] is False
        conn.close()
    finally:
        if kept is not None:
            kept.close()
        srv.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        assert holders(box.token) == []


@pytest.mark.timeout(60)
def test_background_job_lingering_past_the_timeout_is_stopped_at_the_timeout(box):
    # "--timeout SECONDS: cancel the run after this many seconds": a worker
    # that exits at once leaving a long background job, run with --timeout 1
    # --linger 20, ran for the whole 20 s linger; the timeout counted only
    # while the worker lived. The linger ends at the timeout; the outcome is
    # still the worker's (its exit came first: one result).
    t0 = time.monotonic()
    p = run_contain(box.env, "run", "--id", "lt", "--timeout", "1", "--linger", "20", "--grace", "0.5", "--",
                    "sh", "-c", "sleep 300 & exit 4")
    took = time.monotonic() - t0
    assert p.returncode == 4, p.stderr
    rec = box.record("lt")
    assert rec["state"] == "REAPED" and rec["outcome"] == "exited" and rec["exit_code"] == 4, rec["outcome"]
    assert rec["linger"]["ended_by"] == "timeout", rec["linger"]
    assert rec["linger"]["lingered_s"] < 5, rec["linger"]
    assert took < 15, took
    assert holders(box.token) == []


@pytest.mark.timeout(60)
def test_root_worker_moving_a_child_into_a_cgroup_named_in_undecodable_bytes_cannot_crash_contain(box):
    # A root worker without a wall (--no-pidns) moves a child into a cgroup
    # whose name is not UTF-8. Reading that child's /proc/<pid>/cgroup as
    # UTF-8 text raised UnicodeDecodeError in the owner loop: contain run died
    # with a traceback, the run was left RUNNING (orphaned) and the escaper
    # running.
    os.makedirs(box.base, exist_ok=True)          # the fixture removes it, and what is under it
    odd = os.path.join(os.fsencode(box.base), b"esc-\xff")
    os.mkdir(odd)
    script = (f"sh -c 'echo $$ > {os.fsdecode(odd)}/cgroup.procs; exec sleep 300 </dev/null >/dev/null 2>&1' & "
              "sleep 0.5; exit 0")
    p = run_contain(box.env, "run", "--id", "esc", "--no-pidns", "--grace", "0.5", "--", "sh", "-c", script)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    rec = box.record("esc")
    assert rec["state"] in ("REAPED", "BREACHED"), rec["state"]
    assert p.returncode == (0 if rec["state"] == "REAPED" else 125), (p.returncode, p.stderr)
    seen = "/" + os.path.relpath(os.fsdecode(odd), cgroup2_mount())
    assert [e["seen_in"] for e in rec["evidence"]["escapes"]["detail"]] == [seen], rec["evidence"]["escapes"]
    if rec["state"] == "REAPED":
        assert holders(box.token) == []


USERS_SKIP = why_not()


@pytest.mark.timeout(60)
@pytest.mark.skipif(USERS_SKIP is not None, reason=USERS_SKIP or "")
def test_refused_seal_of_an_unprivileged_caller_claims_no_reaped_namespace():
    # A caller without root asks for --seal, which the pidns backend refuses
    # before anything is spawned (exit 125). The record said
    # container_empty observed true "via the PID namespace's init was
    # reaped" (and descendants_exit on the same proof) for a namespace that
    # was never made: nothing was there to be reaped.
    uid = spare_uids(1)[0]
    with Shared() as sh:
        env = user_env(XDG_RUNTIME_DIR=sh.sub("xdg", uid=uid, mode=0o700))
        p = contain_as(uid, "run", "-q", "--id", "sl", "--seal", "--", "true", env=env)
        assert p.returncode == 125 and "Traceback" not in p.stderr, p.stderr
        with open(os.path.join(env["XDG_RUNTIME_DIR"], "contain", "runs", "sl", "record.json")) as f:
            rec = json.load(f)
        assert rec["outcome"] == "spawn_failed" and rec["containment"]["walls"] == [], rec["containment"]
        for layer in ("container_empty", "descendants_exit"):
            assert "init was reaped" not in (rec["evidence"][layer]["via"] or ""), rec["evidence"][layer]


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a mount namespace of the test's own")
def test_mount_point_named_in_undecodable_bytes_and_a_space_cannot_break_contain(box, tmp_path):
    # Whoever can mount where contain runs (root, or a root worker without a
    # wall, which shares the host's mount namespace) mounted a tmpfs at a
    # path holding a space (which mountinfo escapes as \040) and a byte that
    # is not UTF-8: every later `contain run` failed with "'utf-8' codec
    # can't encode character" (exit 2) and `contain doctor` printed a
    # traceback. The mount is made in a mount namespace of the test's own.
    odd = os.path.join(os.fsencode(tmp_path), b"a b\xff")
    os.mkdir(odd)
    script = textwrap.dedent(f"""
        mount -t tmpfs rev6 "$1" || exit 90
        {sys.executable} -m launcher run --id mnt -- true || exit 91
        {sys.executable} -m launcher doctor --json >/dev/null    # its status is doctor's verdict; no traceback
        exit 0
    """)
    p = subprocess.run([b"unshare", b"-m", b"--propagation", b"private", b"sh", b"-c", script.encode(), b"sh", odd],
                       env=box.env, capture_output=True, text=True, timeout=50)
    assert "Traceback" not in p.stderr and "codec" not in p.stderr, p.stderr[-2000:]
    assert p.returncode == 0, p.stderr
    assert box.record("mnt")["state"] == "REAPED"
