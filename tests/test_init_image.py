"""The wall's init exec'd from its own image (launcher/_native/initbin/),
not forked from the supervisor: what it must and must not be, against the
real kernel.

- it is exec'd (a memfd of contain's, named ct-init) and maps nothing of
  the supervisor's memory;
- nothing of the image stays open in the caller between runs;
- where the exec is refused, the init is forked as before and the wall
  still holds.
Each test kills and reaps every init it made; the ones that change process-
wide state (descriptors, a seccomp filter) run forked.
"""
from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import stat
import threading
import time
from typing import Iterator

import pytest

from launcher._native import lib
from launcher._platform import posix

ROOT = os.geteuid() == 0
needs_image = pytest.mark.skipif(not ROOT or lib.ct_init_image_len == 0,
                                 reason="needs root (a PID namespace without a user namespace) and an init image "
                                        "(built for x86_64 only)")


def walled(argv: list[str], **kw: object) -> contextlib.AbstractContextManager[posix.Spawned]:
    """test_wall's walled() with a /proc of the namespace's own."""
    from test_wall import walled as walled_spawn

    return walled_spawn(argv, mount_proc=True, **kw)


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def _image_fds() -> list[int]:
    out = []
    for n in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{n}").startswith("/memfd:ct-init"):
                out.append(int(n))
        except OSError:
            pass
    return out


@needs_image
def test_init_is_execd_from_its_image_and_maps_nothing_of_the_supervisor() -> None:
    with walled(["sleep", "30"]) as sp:
        assert "CLONE_VM|CLONE_VFORK" in sp.via and "exec of contain's init" in sp.via, sp.via
        assert os.readlink(f"/proc/{sp.init_pid}/exe").startswith("/memfd:ct-init"), "not our image"
        with open(f"/proc/{sp.init_pid}/comm") as f:
            assert f.read().strip() == "ct/init"
        maps = _maps(sp.init_pid)
        # A fork of this process would map its interpreter, its libraries
        # and its heap; the image maps itself, its arguments, a stack.
        assert ".so" not in maps and "python" not in maps and "[heap]" not in maps, maps
        with open(f"/proc/{sp.pid}/status") as f:
            nspid = [ln for ln in f if ln.startswith("NSpid:")][0].split()
        assert nspid[-1] == "2", nspid          # the worker is the init's child, pid 2 inside


@needs_image
def test_nothing_of_the_image_stays_open_in_the_caller_between_runs() -> None:
    """The image's memfd and the arguments' are made for one spawn and
    closed after it: a caller counting its descriptors across runs sees
    none of contain's."""
    before = sorted(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with walled(["true"]) as sp:
            assert "exec of contain's init" in sp.via, sp.via
            assert _image_fds() == [], "the image's descriptor outlived its spawn"
    assert sorted(os.listdir("/proc/self/fd")) == before


@needs_image
@pytest.mark.forked
def test_exec_of_the_image_refused_forks_the_init_and_the_wall_holds() -> None:
    import _seccomp

    why = _seccomp.supported()
    if why:
        pytest.skip(why)
    _seccomp.install({"execveat": errno.EACCES})
    r, w = os.pipe()
    try:
        with walled(["sh", "-c", "echo $$; exec sleep 30"], stdio=(-1, w, -1)) as sp:
            os.close(w)
            w = -1
            p = select.poll()
            p.register(r, select.POLLIN)
            assert p.poll(10_000), "the worker never said its pid"
            got = os.read(r, 64).decode().strip()
            with open(f"/proc/{sp.init_pid}/comm") as f:
                assert f.read().strip() == "ct/init"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert "CLONE_VM" not in sp.via and "init at pid 1" in sp.via, sp.via
    assert got == "2", got                  # behind the wall all the same: pid 2 of its own namespace


@needs_image
@pytest.mark.forked
@pytest.mark.parametrize("execd", [True, False], ids=["execd", "forked"])
def test_a_closed_stdin_and_stdout_of_the_supervisor_neither_wedge_the_wall_nor_reach_the_worker(tmp_path,
                                                                                                   execd) -> None:
    """A library caller with fds 0 and 1 closed: the wall's report socket
    is the first pair made after that, so the init's end is fd 1. The init needed it open
    across its own exec; the worker must still find fd 1 closed (as with a
    forked init), never holding the socket on which the init reports its
    exit (a worker could forge EXEC, EXIT or EMPTY there). Before, the
    init pointed that fd 1 at /dev/null once the worker ran, its report was
    lost, and the spawn failed after its 30 s wait ("died with status 0 and
    no report"), forked init or exec'd."""
    from launcher._platform import wall

    wall.EXEC_INIT = execd
    report = tmp_path / "fd1"
    os.close(0)
    os.close(1)
    with walled(["sh", "-c", f"if [ -e /proc/self/fd/1 ]; then readlink /proc/self/fd/1 > {report}; "
                              f"else echo closed > {report}; fi; exec sleep 30"]) as sp:
        for _ in range(500):
            if report.exists() and report.read_text().endswith("\n"):
                break
            select.select([], [], [], 0.01)
        assert ("exec of contain's init" in sp.via) == execd, sp.via
    assert report.read_text().strip() == "closed", report.read_text()


def _memfds_named(name: str = "/memfd:ct-init (") -> list[int]:
    out = []
    for n in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{n}").startswith(name):
                out.append(int(n))
    return out


def _to_its_end(sp: posix.Spawned) -> str:
    """A walled spawn waited for (10 s at most), its init killed and reaped,
    its descriptors closed; how its init was started."""
    try:
        select.select([sp.init_pidfd], [], [], 10.0)
    finally:
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(sp.init_pidfd, signal.SIGKILL)
        os.waitid(os.P_PIDFD, sp.init_pidfd, os.WEXITED)
        for fd in (sp.pidfd, sp.init_pidfd, sp.report_fd):
            os.close(fd)
    return sp.via


def _walled_true() -> str:
    """One walled /bin/true to its end; how its init was started."""
    return _to_its_end(posix.spawn(posix.SpawnRequest(["true"], pidns=True, env={"PATH": "/usr/bin:/bin"})))


@contextlib.contextmanager
def _filtered_thread(install, body):
    """`body` run in a thread of its own, under the seccomp filter that
    `install` puts there (a filter holds the thread that installs it and
    what that thread starts, never the test's own thread: pytest's capture
    truncates its files with ftruncate after each phase, and a forked
    test's only thread parked there, with nobody left to answer, hung the
    session for ever). Yields the thread and the listener, which is closed
    at the end: a call still parked then fails (ENOSYS), never waits."""
    import queue

    got: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            got.put(install())
        except BaseException as e:      # noqa: BLE001 (handed to the test's thread)
            got.put(e)
            return
        body()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    listener = got.get(timeout=10)
    if isinstance(listener, BaseException):
        raise listener
    try:
        yield t, listener
    finally:
        os.close(listener)
        t.join(10.0)


_NOTIF_RECV = 0xC0502100     # SECCOMP_IOCTL_NOTIF_RECV: struct seccomp_notif, 80 bytes


_NOTIF_SEND = 0xC0182101     # SECCOMP_IOCTL_NOTIF_SEND: struct seccomp_notif_resp, 24 bytes


_NOTIF_CONTINUE = 1


@needs_image
@pytest.mark.forked
def test_image_descriptor_swapped_by_another_thread_between_check_and_clone_is_never_execd(tmp_path) -> None:
    """The image's memfd is made (our sealed memfd, known by device, inode
    and seals) in the supervisor, then the memfd of the arguments, then the
    clone copies the descriptor table: another thread of the caller's
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
    assert _memfds_named() == [], "the image's memfd outlived its spawn"
    marker = tmp_path / "hijacked"
    script = tmp_path / "payload"
    script.write_text(f"#!/bin/sh\necho x >> {marker}\n")
    script.chmod(stat.S_IRWXU)
    evil = os.open(script, os.O_RDONLY)
    _seccomp.NR.setdefault("ftruncate", 77)
    out: dict[str, object] = {}

    def spawn() -> None:
        try:
            out["via"] = _walled_true()
        except Exception as e:      # a hijacked init dies without a report
            out["error"] = e

    with _filtered_thread(lambda: _seccomp.install({"ftruncate": _seccomp.NOTIFY}), spawn) as (t, listener):
        p = select.poll()
        p.register(listener, select.POLLIN)
        assert p.poll(10_000), "the spawn never made the memfd of its arguments"
        req = bytearray(80)
        fcntl.ioctl(listener, _NOTIF_RECV, req, True)
        notif_id, _pid, _flags, nr = struct.unpack_from("QIIi", req)
        assert nr == 77, nr
        (n,) = _memfds_named()             # this spawn's image, made just before the arguments
        os.dup2(evil, n)                # the caller's other thread takes the number
        fcntl.ioctl(listener, _NOTIF_SEND, bytearray(struct.pack("QqiI", notif_id, 0, 0, _NOTIF_CONTINUE)), True)
        t.join(30.0)
        assert not t.is_alive()
    assert not marker.exists(), f"the file put at the image's descriptor number was exec'd as the init: {out}"
    # the number no longer ours in the child: the init is forked instead
    assert "via" in out and "exec of contain's init" not in str(out["via"]), out


def _notify_on_guard_page_mprotect() -> int:
    """A seccomp filter parking mprotect(addr, 4096, PROT_NONE) for a
    listener: the guard page of the stack ct_vfork_call maps, right before
    its clone (Python and glibc here make no such call). The listener fd."""
    import ctypes
    import struct

    from _seccomp import AUDIT_ARCH_X86_64, _NR_SECCOMP, _PR_SET_NO_NEW_PRIVS, _RET_ALLOW, _RET_USER_NOTIF, _insn

    prog = [_insn(0x20, 0, 0, 4), _insn(0x15, 1, 0, AUDIT_ARCH_X86_64), _insn(0x06, 0, 0, _RET_ALLOW),
            _insn(0x20, 0, 0, 0), _insn(0x15, 0, 5, 10),          # mprotect?
            _insn(0x20, 0, 0, 24), _insn(0x15, 0, 3, 4096),       # len 4096?
            _insn(0x20, 0, 0, 32), _insn(0x15, 0, 1, 0),          # PROT_NONE?
            _insn(0x06, 0, 0, _RET_USER_NOTIF), _insn(0x06, 0, 0, _RET_ALLOW)]
    code = b"".join(prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fbuf = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf)))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    rc = libc.syscall(_NR_SECCOMP, 1, 1 << 3, fbuf)     # SET_MODE_FILTER, FLAG_NEW_LISTENER
    if rc < 0:
        raise OSError(ctypes.get_errno(), "seccomp")
    return int(rc)


@needs_image
@pytest.mark.forked
def test_arguments_descriptor_swapped_by_another_thread_before_the_clone_are_never_the_inits(tmp_path) -> None:
    """The same race for the memfd of the init's arguments (the worker's
    program, argv, environment, credentials, descriptors): another thread
    that put another file at its number before the clone had the init map
    that file and run the program it named. Parked here at the guard page
    of the clone's stack, the last call before the clone."""
    import fcntl
    import struct

    import _seccomp

    why = _seccomp.supported()
    if why:
        pytest.skip(why)
    _walled_true()
    marker = tmp_path / "hijacked"
    for name, body in (("good", "exit 0"), ("evil", f"echo x >> {marker}")):
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(stat.S_IRWXU)
    out: dict[str, object] = {}

    def spawn() -> None:
        try:
            sp = posix.spawn(posix.SpawnRequest([str(tmp_path / "good")], pidns=True, env={"PATH": "/usr/bin:/bin"}))
        except Exception as e:
            out["error"] = e
            return
        out["via"] = _to_its_end(sp)

    with _filtered_thread(_notify_on_guard_page_mprotect, spawn) as (t, listener):
        p = select.poll()
        p.register(listener, select.POLLIN)
        assert p.poll(10_000), "the spawn never reached its clone"
        deadline = time.monotonic() + 30.0
        req = bytearray(80)
        fcntl.ioctl(listener, _NOTIF_RECV, req, True)
        notif_id = struct.unpack_from("Q", req)[0]
        (n,) = _memfds_named("/memfd:ct-init-args")
        with open(f"/proc/self/fd/{n}", "rb") as f:
            data = f.read()
        assert b"/good\0" in data
        forged = os.memfd_create("forged")
        os.write(forged, data.replace(b"/good\0", b"/evil\0"))
        os.dup2(forged, n, inheritable=False)       # the caller's other thread takes the number
        fcntl.ioctl(listener, _NOTIF_SEND, bytearray(struct.pack("QqiI", notif_id, 0, 0, _NOTIF_CONTINUE)), True)
        # Any later one goes on (the init's own clone of the worker inherits the filter).
        while t.is_alive() and time.monotonic() < deadline:
            if not p.poll(50):
                continue
            with contextlib.suppress(OSError):
                req = bytearray(80)         # RECV wants it zeroed
                fcntl.ioctl(listener, _NOTIF_RECV, req, True)
                fcntl.ioctl(listener, _NOTIF_SEND, bytearray(struct.pack(
                    "QqiI", struct.unpack_from("Q", req)[0], 0, 0, _NOTIF_CONTINUE)), True)
        t.join(1.0)
        assert not t.is_alive()
    assert not marker.exists(), f"the init took its arguments from a file put at their descriptor number: {out}"
    assert "via" in out and "exec of contain's init" not in str(out["via"]), out


@needs_image
@pytest.mark.forked
@pytest.mark.parametrize("execd", [True, False], ids=["execd", "forked"])
def test_a_caller_ignoring_sigchld_still_gets_its_walled_workers_exit(execd) -> None:
    """A library caller that ignores SIGCHLD (for its own reasons: the
    worker never inherits it, posix.py) handed that SIG_IGN to the wall's
    init, across its fork or its exec: the kernel reaped the init's
    children itself, so a worker that exited at once was "exec check
    failed: No child processes", and a slower one's exit was never seen,
    the init never ended (`launcher.run(backend="pidns")`: "the init of a
    probe did not exit within 5 s")."""
    from launcher._platform import wall

    wall.EXEC_INIT = execd
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for script in ("exit 7", "sleep 0.2; exit 7"):
        sp = posix.spawn(posix.SpawnRequest(["sh", "-c", script], pidns=True, env={"PATH": "/usr/bin:/bin"}))
        try:
            assert ("exec of contain's init" in sp.via) == execd, sp.via
            ended = select.select([sp.init_pidfd], [], [], 10.0)[0]
            # The spawn itself may have read the EXIT already (with the EXEC,
            # for a worker that is quick): those are in sp.events.
            events = list(sp.events) + list(wall.read_init_events(sp.report_fd))
        finally:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(sp.init_pidfd, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):     # ours is ignored here: the kernel reaps it
                os.waitid(os.P_PIDFD, sp.init_pidfd, os.WEXITED)
            for fd in (sp.pidfd, sp.init_pidfd, sp.report_fd):
                os.close(fd)
        assert ended, f"{script}: the init never ended"
        exits = [e for e in events if isinstance(e, wall.InitWorkerExit)]
        assert exits and os.waitstatus_to_exitcode(exits[0].status) == 7, events


@needs_image
@pytest.mark.forked
def test_a_library_caller_ignoring_sigchld_gets_the_pidns_backend(state_dir, token) -> None:
    """The same caller through the library: the pidns backend's probe
    waited for its init, which the kernel had already reaped (SIGCHLD
    ignored: ECHILD), and the backend was refused ("unavailable") or the
    probe raised ChildProcessError out of launcher.run. The init's EMPTY
    is the word that its namespace emptied; the reaping was the kernel's."""
    import launcher
    from _proc import holders

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    rec = launcher.run(["sh", "-c", "sleep 30 & exit 7"], backend="pidns", timeout=20,
                       env={"PATH": "/usr/bin:/bin", "CONTAIN_TEST_TOKEN": token})
    assert (rec.state, rec.outcome, rec.exit_code) == ("REAPED", "exited", 7), rec
    assert holders(token) == [], "a member outlived the run"
