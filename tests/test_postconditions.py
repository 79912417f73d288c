"""workspace_quiescent and sockets_closed: what an empty container does not prove."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

from _proc import contain_cmd, holders, run_contain
from conftest import needs_cgroup

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
