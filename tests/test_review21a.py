"""Review 21a: what the stop record's postconditions claim, against what the
test measures itself."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from _proc import holders, run_contain
from conftest import needs_cgroup

pytestmark = needs_cgroup


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
