"""stdin/stdout/stderr as in subprocess, with no descriptor leaked."""
from __future__ import annotations

import os
import subprocess

import pytest

import launcher
from conftest import fd_count


def test_pipes_and_communicate(contained: dict) -> None:
    with launcher.spawn(["sh", "-c", "cat; echo err >&2; exit 2"], env=contained["env"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE) as w:
        out, err = w.communicate(b"hello " * 50_000, timeout=30)
        rec = w.wait(30)
    assert out == b"hello " * 50_000 and err == b"err\n"
    assert rec.exit_code == 2
    assert w.stdout is not None and w.stdout.closed


def test_stderr_to_stdout_and_devnull(contained: dict) -> None:
    with launcher.spawn(["sh", "-c", "echo a; echo b >&2; cat"], env=contained["env"], stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as w:
        out, err = w.communicate(timeout=30)
    assert out is not None and sorted(out.split()) == [b"a", b"b"]
    assert err is None


def test_file_objects_and_fds_stay_the_callers(contained: dict, tmp_path: os.PathLike) -> None:
    path = os.path.join(tmp_path, "out.txt")
    with open(path, "wb") as f:
        rec = launcher.run(["sh", "-c", "echo to-file"], env=contained["env"], stdout=f)
        assert not f.closed
        r, w = os.pipe()
        try:
            launcher.run(["sh", "-c", "echo to-fd"], env=contained["env"], stdout=w)
            os.fstat(w)                          # still open: it is ours
            assert os.read(r, 100) == b"to-fd\n"
        finally:
            os.close(r)
            os.close(w)
    assert rec.exit_code == 0
    with open(path, "rb") as f:
        assert f.read() == b"to-file\n"


def test_inherited_stdio_is_not_copied(contained: dict) -> None:
    """None means the worker writes to our own descriptor directly."""
    r, w = os.pipe()
    expected = os.readlink(f"/proc/self/fd/{w}").encode()
    saved = os.dup(1)
    try:
        os.dup2(w, 1)
        launcher.run(["sh", "-c", "readlink /proc/self/fd/1"], env=contained["env"])
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(w)
    with os.fdopen(r, "rb") as f:
        target = f.read().strip()
    assert target == expected          # our pipe itself, no copy in between


def test_run_reads_a_pipe_as_subprocess_run_does(contained: dict) -> None:
    """run() refused PIPE (nothing read it); it reads it now, as subprocess.run."""
    rec = launcher.run(["echo", "hi"], stdout=subprocess.PIPE)
    assert rec.stdout == b"hi\n" and rec.stderr is None and rec.state == "REAPED"


def test_bad_specs_are_refused_before_anything_starts(contained: dict) -> None:
    before = fd_count()
    with pytest.raises(ValueError):
        launcher.spawn(["true"], stdin=subprocess.STDOUT)
    with pytest.raises(TypeError):
        launcher.spawn(["true"], stdout="out.txt")
    with pytest.raises(ValueError):
        launcher.spawn(["true"], stdout=-7)
    assert fd_count() == before
    assert not os.path.exists(os.path.join(contained["state_dir"], "runs")) or \
        os.listdir(os.path.join(contained["state_dir"], "runs")) == []


def test_failed_spawn_closes_every_pipe(contained: dict) -> None:
    launcher.run(["true"], env=contained["env"])             # warm-up
    before = fd_count()
    for _ in range(20):
        with pytest.raises(launcher.SpawnFailed):
            launcher.spawn(["/nonexistent/x"], env=contained["env"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert fd_count() == before


def test_pipes_are_not_inherited_by_other_workers(contained: dict) -> None:
    """Close-on-exec: a second worker spawned while the first one's pipe is
    open holds only its own stdio."""
    with launcher.spawn(["sleep", "60"], env=contained["env"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE) as a:
        b = launcher.spawn(["sh", "-c", "ls /proc/self/fd"], env=contained["env"], stdout=subprocess.PIPE)
        out, _ = b.communicate(timeout=30)
        b.close()
        a.cancel()
    fds = sorted(int(x) for x in out.split())
    assert fds == [0, 1, 2, 3]           # 3 is ls's own directory fd
