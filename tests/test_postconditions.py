"""workspace_quiescent and sockets_closed: what an empty container does not prove."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from _proc import contain_cmd, holders, host_pid, run_contain, wait_holders
from _v1 import remove_v1_of
from conftest import needs_cgroup
from test_cancel import _v1_freezer
from test_signals import wait_for_file

pytestmark = needs_cgroup


def test_workspace_quiet_after_the_tree_is_gone(box, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    p = run_contain(box.env, "run", "--id", "w", "--grace", "0.2", "--workspace", str(ws), "--",
                    "sh", "-c", f"cd {ws} && (setsid sh -c 'while :; do date > f; done' &) ; sleep 0.2", cwd="/")
    assert p.returncode == 0
    rec = box.record("w")
    assert rec["state"] == "REAPED"
    assert rec["evidence"]["workspace_quiescent"]["observed"] is True, rec["evidence"]["workspace_quiescent"]
    assert holders(box.token) == []


def test_workspace_held_from_outside_is_reported(box, tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    outsider = subprocess.Popen(["sleep", "30"], cwd=ws, env=box.env)
    try:
        p = run_contain(box.env, "run", "--id", "w", "--workspace", str(ws), "--", "true", cwd="/")
        assert p.returncode == 0
        layer = box.record("w")["evidence"]["workspace_quiescent"]
        assert layer["observed"] is False
        assert outsider.pid in [h["pid"] for h in layer["detail"]["held_by"]]
    finally:
        outsider.kill()
        outsider.wait(10)


def test_socket_handed_outside_is_not_closed(box, tmp_path):
    """The worker passes its listening socket to a process outside the
    container (SCM_RIGHTS). The container empties; the socket lives on."""
    path = str(tmp_path / "handoff.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    srv.settimeout(30)           # a worker that never starts must fail the test, not hang it
    code = textwrap.dedent(f"""
        import socket, time
        tcp = socket.socket(); tcp.bind(("127.0.0.1", 0)); tcp.listen()
        u = socket.socket(socket.AF_UNIX); u.connect({path!r})
        socket.send_fds(u, [b"x"], [tcp.fileno()])
        time.sleep(300)
    """)
    proc = subprocess.Popen(contain_cmd("run", "--id", "s", "--timeout", "1", "--grace", "0.2", "--check-sockets",
                                        "--", sys.executable, "-c", code), env=box.env)
    try:
        conn, _ = srv.accept()
        conn.settimeout(30)
        _msg, fds, _flags, _addr = socket.recv_fds(conn, 16, 4)
        kept = socket.socket(fileno=fds[0])
        assert proc.wait(30) == 124
        rec = box.record("s")
        assert rec["state"] == "REAPED"
        layer = rec["evidence"]["sockets_closed"]
        assert layer["observed"] is False, layer
        assert os.fstat(kept.fileno()).st_ino in layer["detail"]["still_open"]
        kept.close()
        conn.close()
    finally:
        srv.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_sockets_closed_when_the_tree_owned_them(box):
    code = "import socket, time\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\ntime.sleep(300)\n"
    p = run_contain(box.env, "run", "--id", "s", "--timeout", "0.5", "--grace", "0.2", "--check-sockets", "--",
                    sys.executable, "-c", code)
    assert p.returncode == 124
    layer = box.record("s")["evidence"]["sockets_closed"]
    assert layer["observed"] is True and layer["detail"]["held_at_stop"] >= 1


def test_layers_absent_unless_measured(box):
    assert run_contain(box.env, "run", "--id", "n", "--", "true").returncode == 0
    ev = box.record("n")["evidence"]
    assert "workspace_quiescent" not in ev and "sockets_closed" not in ev


def _freeze_the_sleep(freezer: str, pidfile: str, token: str) -> None:
    """Put the workload's `sleep` (its pid written to `pidfile`; a process
    this test started) into the v1 freezer cgroup `freezer`, frozen."""
    sleeper = host_pid(token, int(wait_for_file(pidfile).strip()))
    assert sleeper is not None, "the sleep of this test's workload was not found"
    with open(os.path.join(freezer, "cgroup.procs"), "w") as f:
        f.write(str(sleeper))
    with open(os.path.join(freezer, "freezer.state"), "w") as f:
        f.write("FROZEN")


def _thaw_and_remove(freezer: str) -> None:
    try:
        with open(os.path.join(freezer, "freezer.state"), "w") as f:
            f.write("THAWED")
    except OSError:
        pass
    for _ in range(200):
        try:
            os.rmdir(freezer)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)


@pytest.mark.timeout(120)
@pytest.mark.skipif(_v1_freezer() is None, reason="needs a cgroup v1 freezer (hybrid host) to hold a "
                    "process through SIGKILL")
def test_worker_leaving_a_frozen_child_makes_cancel_wait_exit_1_and_no_wall_claim_empty(box, tmp_path):
    # The worker exits on its own and leaves a child the v1 freezer holds:
    # the stop after its exit cannot be confirmed (UNCONFIRMED, exit 125).
    # A retry with `cancel --wait` while the child is still frozen is not
    # confirmed either; "1: the operation did not hold (e.g. UNCONFIRMED)".
    # It exited 0 (effect not_live, state UNCONFIRMED) as if it had held.
    pidfile = tmp_path / "pid"
    freezer = os.path.join(_v1_freezer(), f"contain-review5-{os.getpid()}-{box.token}")
    os.mkdir(freezer)
    proc = subprocess.Popen(contain_cmd("run", "--id", "fz", "--grace", "0", "--kill-timeout", "0.5", "--",
                                        "sh", "-c", f"sleep 300 & echo $! > {pidfile}; read x; exit 0"),
                            env=box.env, stdin=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert len(wait_holders(box.token, 2)) >= 2, "workload did not start"
        _freeze_the_sleep(freezer, str(pidfile), box.token)
        # (not communicate(): the frozen sleep holds the stderr pipe open)
        proc.stdin.write("go\n")
        proc.stdin.flush()                     # the worker exits 0 on its own
        proc.wait(60)
        assert proc.returncode == 125
        rec = box.record("fz")
        assert rec["state"] == "UNCONFIRMED"
        assert holders(box.token), "the frozen process is still there"
        # "walls: each container ... and how it was observed empty": the
        # cgroup's entry said "via cgroup.events populated 0" while it held
        # the frozen member (container_empty false).
        cg = [w for w in rec["containment"]["walls"] if w["kind"] == "cgroup"]
        assert cg and cg[0]["observed_empty"] is not True and "populated 0" not in cg[0]["via"], cg

        p = run_contain(box.env, "cancel", "fz", "--op-id", "retry", "--wait", "--json", timeout=60)
        assert "Traceback" not in p.stderr, p.stderr
        ack = json.loads(p.stdout)
        assert holders(box.token), "the frozen process is still there"
        assert ack["state"] not in ("REAPED", "EXITED"), ack
        assert p.returncode == 1, (p.returncode, ack)

        _thaw_and_remove(freezer)
        p = run_contain(box.env, "cancel", "fz", "--op-id", "last", "--wait", "--json", timeout=60)
        assert json.loads(p.stdout)["state"] == "REAPED" and p.returncode == 0, (p.returncode, p.stdout)
        assert holders(box.token) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _thaw_and_remove(freezer)
        remove_v1_of("fz")


@pytest.mark.timeout(60)
def test_caller_shell_standing_in_the_workspace_does_not_hold_it_for_ever(box, tmp_path):
    # `cd ws && contain run --workspace . -- make`: the caller's own shell has
    # its cwd there, so workspace_quiescent (and redispatch_eligible) was
    # false for every run started that way. An open file of the caller's
    # still counts: it can write.
    ws = tmp_path / "ws"
    ws.mkdir()
    cmd = " ".join(contain_cmd("run", "--id", "{id}", "--workspace", ".", "--", "true"))
    sh = f'cd {ws} && {cmd.format(id="w1")} && exec 3>{ws}/log && {cmd.format(id="w2")}'
    p = subprocess.run(["sh", "-c", sh], env=box.env, capture_output=True, text=True, timeout=50, cwd="/")
    assert p.returncode == 0, p.stderr
    quiet = box.record("w1")["evidence"]["workspace_quiescent"]
    assert quiet["observed"] is True, quiet
    assert box.record("w1")["evidence"]["redispatch_eligible"]["observed"] is True
    held = box.record("w2")["evidence"]["workspace_quiescent"]
    assert held["observed"] is False and [h["how"] for h in held["detail"]["held_by"]] == ["fd 3"], held
    remove_v1_of("w1")
    remove_v1_of("w2")


def test_library_caller_sees_the_record_of_a_retry_that_ended_its_unconfirmed_run(box, tmp_path):
    """A library run whose stop could not be confirmed (a child the v1
    freezer holds) ends its owner loop UNCONFIRMED and lets go of the run.
    A later `w.cancel()`, once the child can die, adopts it and ends it
    REAPED (record.json says so), but `w.record()` and `w.wait()` kept
    returning the old UNCONFIRMED record for ever."""
    import launcher

    pidfile = tmp_path / "pid"
    freezer = os.path.join(_v1_freezer(), f"contain-review5-lib-{os.getpid()}-{box.token}")
    os.mkdir(freezer)
    try:
        w = launcher.spawn(["sh", "-c", f"sleep 300 & echo $! > {pidfile}; exec sleep 300"], id="lf",
                           grace=0, kill_timeout=0.5, state_dir=box.state_dir)
        _freeze_the_sleep(freezer, str(pidfile), box.token)
        w.cancel(op_id="first")
        rec = w.wait(timeout=60)
        assert rec.state == "UNCONFIRMED", rec.state
        _thaw_and_remove(freezer)
        ack = w.cancel(op_id="retry")
        assert ack.to_dict().get("state") == "REAPED" or box.record("lf")["state"] == "REAPED", ack.to_dict()
        assert holders(box.token) == []
        assert w.record().state == "REAPED" and w.wait(timeout=5).state == "REAPED", w.record().state
    finally:
        _thaw_and_remove(freezer)
        remove_v1_of("lf")


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


def _outsider_taking_a_socket(path: str) -> subprocess.Popen:
    """A process outside the run: accepts one unix connection, keeps the
    descriptor passed over it, prints its inode, and waits for stdin to close."""
    code = textwrap.dedent(f"""
        import os, socket, sys
        srv = socket.socket(socket.AF_UNIX); srv.bind({path!r}); srv.listen(); srv.settimeout(60)
        print("ready", flush=True)
        c, _ = srv.accept(); c.settimeout(60)
        _m, fds, _f, _a = socket.recv_fds(c, 16, 4)
        kept = socket.socket(fileno=fds[0])
        print(os.fstat(kept.fileno()).st_ino, flush=True)
        sys.stdin.read()
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def test_listening_socket_handed_out_before_the_stop_is_not_closed(box, tmp_path):
    """A setsid grandchild opens a listening TCP socket, hands it to a
    process outside the run and exits; the worker exits after it, so the
    container is already empty when the stop begins and no member's fds are
    looked at. The port is still bound by the outsider: sockets_closed must
    not say true, and the next attempt is not eligible."""
    path = str(tmp_path / "handoff.sock")
    outsider = _outsider_taking_a_socket(path)
    try:
        from _proc import readline_within
        assert readline_within(outsider.stdout, 30) == b"ready\n"
        give = textwrap.dedent(f"""
            import os, socket
            pid = os.fork()
            if pid == 0:
                os.setsid()
                tcp = socket.socket(); tcp.bind(("127.0.0.1", 0)); tcp.listen()
                u = socket.socket(socket.AF_UNIX); u.connect({path!r})
                socket.send_fds(u, [b"x"], [tcp.fileno()])
                os._exit(0)
            os.waitpid(pid, 0)
        """)
        p = run_contain(box.env, "run", "--id", "h", "--check-sockets", "--", sys.executable, "-c", give)
        assert p.returncode == 0, p.stderr
        kept = int(readline_within(outsider.stdout, 30))
        rec = box.record("h")
        assert rec["state"] == "REAPED"
        layer = rec["evidence"]["sockets_closed"]
        assert layer["observed"] is False, layer
        assert kept in layer["detail"]["still_open"]
        assert rec["evidence"]["redispatch_eligible"]["observed"] is False
    finally:
        outsider.kill()
        outsider.wait(10)
    assert holders(box.token) == []
