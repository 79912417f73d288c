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
