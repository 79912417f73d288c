"""Review 16: the wall's init exec'd from its own image (initbin/, wall.c's
spawn_execd), attacked from the supervisor's own process and from its
worker.

Real kernel throughout: every init made is killed and reaped, every wait
bounded, everything made removed. Tests that change process-wide state
(descriptors, a seccomp filter) run forked.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import stat
import threading

import pytest

from launcher._native import lib
from launcher._platform import posix

ROOT = os.geteuid() == 0
needs_image = pytest.mark.skipif(not ROOT or lib.ct_init_image_len == 0,
                                 reason="needs root (a PID namespace without a user namespace) and an init image "
                                        "(built for x86_64 only)")


def _image_fds() -> list[int]:
    out = []
    for n in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{n}").startswith("/memfd:ct-init ("):
                out.append(int(n))
    return out


def _walled_true() -> str:
    """One walled /bin/true to its end; how its init was started."""
    sp = posix.spawn(posix.SpawnRequest(["true"], pidns=True, env={"PATH": "/usr/bin:/bin"}))
    try:
        select.select([sp.init_pidfd], [], [], 10.0)
    finally:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(sp.init_pidfd, signal.SIGKILL)
        os.waitid(os.P_PIDFD, sp.init_pidfd, os.WEXITED)
        for fd in (sp.pidfd, sp.init_pidfd, sp.report_fd):
            os.close(fd)
    return sp.via


_NOTIF_RECV = 0xC0502100     # SECCOMP_IOCTL_NOTIF_RECV: struct seccomp_notif, 80 bytes
_NOTIF_SEND = 0xC0182101     # SECCOMP_IOCTL_NOTIF_SEND: struct seccomp_notif_resp, 24 bytes
_NOTIF_CONTINUE = 1


@needs_image
@pytest.mark.forked
def test_image_descriptor_swapped_by_another_thread_between_check_and_clone_is_never_execd(tmp_path) -> None:
    """The image's number is checked (our sealed memfd, by device, inode and
    seals) in the supervisor, then the memfd of the arguments is made, then
    the clone copies the descriptor table: another thread of the caller's
    that closes the number and puts another file there in between had that
    file exec'd as the init, as root, in the run's namespaces (a thread
    swapping the number back and forth hit it now and then; here the spawn
    is parked at the arguments' ftruncate by a seccomp user notification
    while the number is taken). The check belongs in the exec'ing child,
    whose copy of the table nobody else can change."""
    import fcntl
    import struct

    import _seccomp

    why = _seccomp.supported()
    if why:
        pytest.skip(why)
    _walled_true()
    (n,) = _image_fds()
    marker = tmp_path / "hijacked"
    script = tmp_path / "payload"
    script.write_text(f"#!/bin/sh\necho x >> {marker}\n")
    script.chmod(stat.S_IRWXU)
    evil = os.open(script, os.O_RDONLY)
    _seccomp.NR.setdefault("ftruncate", 77)
    listener = _seccomp.install({"ftruncate": _seccomp.NOTIFY})
    out: dict[str, object] = {}

    def spawn() -> None:
        try:
            out["via"] = _walled_true()
        except Exception as e:      # a hijacked init dies without a report
            out["error"] = e

    t = threading.Thread(target=spawn, daemon=True)
    t.start()
    p = select.poll()
    p.register(listener, select.POLLIN)
    assert p.poll(10_000), "the spawn never made the memfd of its arguments"
    req = bytearray(80)
    fcntl.ioctl(listener, _NOTIF_RECV, req, True)
    notif_id, _pid, _flags, nr = struct.unpack_from("QIIi", req)
    assert nr == 77, nr
    os.dup2(evil, n)                # the caller's other thread takes the number
    fcntl.ioctl(listener, _NOTIF_SEND, bytearray(struct.pack("QqiI", notif_id, 0, 0, _NOTIF_CONTINUE)), True)
    t.join(30.0)
    assert not t.is_alive()
    assert not marker.exists(), f"the file put at the image's descriptor number was exec'd as the init: {out}"
    # the number no longer ours in the child: the init is forked instead
    assert "via" in out and "exec of contain's init" not in str(out["via"]), out
