"""The run directory's Windows primitives (winfs): the owner lock and its
probe, atomic replace under Windows sharing rules, reads that never follow
a link, and the state directory."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

if sys.platform != "win32":
    pytest.skip("the Windows suite: a Windows CPython runs it (tools/winlane.py)", allow_module_level=True)

import _census
from _job import child

from launcher._platform import winfs

def _holder(path: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(child("lockhold", path), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == b"locked", line + p.stdout.read()
    return p


def test_owner_lock_is_dropped_when_its_holder_dies(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "owner.lock")
    p = _holder(path)
    try:
        assert winfs.lock_held(path) is True
        assert winfs.OwnerLock.acquire(path) is None
    finally:
        p.kill()   # TerminateProcess: nobody releases anything
        p.wait(30)
    # Windows releases a dead process's locks at handle rundown, before its
    # process object is signalled: no retry is needed after the wait.
    assert winfs.lock_held(path) is False
    lk = winfs.OwnerLock.acquire(path)
    assert lk is not None
    lk.release()


def test_probes_disturb_neither_the_holder_nor_each_other(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "owner.lock")
    lk = winfs.OwnerLock.acquire(path)
    assert lk is not None
    try:
        assert all(winfs.lock_held(path) is True for _ in range(50))
        # Still ours: another process cannot take it after all those probes.
        q = subprocess.Popen(child("lockhold", path), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
        assert q.stdout is not None
        assert q.stdout.readline().strip() == b"busy"
        q.kill()
        q.wait(30)
    finally:
        lk.release()
    # Free: many probes at once from several threads never see it held.
    seen: list[bool | None] = []

    def probe() -> None:
        for _ in range(50):
            seen.append(winfs.lock_held(path))

    ts = [threading.Thread(target=probe) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert seen and set(seen) == {False}, set(seen)


def test_lock_probe_on_a_missing_file_is_false(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert winfs.lock_held(str(tmp_path / "nope.lock")) is False


def test_held_lock_file_cannot_be_swapped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An attacker deleting or renaming owner.lock to lock a fresh file of
    that name: refused while it is held (no FILE_SHARE_DELETE)."""
    path = str(tmp_path / "owner.lock")
    lk = winfs.OwnerLock.acquire(path)
    assert lk is not None
    try:
        with pytest.raises(PermissionError):
            os.unlink(path)
        with pytest.raises(PermissionError):
            os.rename(path, path + ".old")
    finally:
        lk.release()


def test_symlinked_lock_file_is_not_followed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "elsewhere"
    target.write_text("")
    link = str(tmp_path / "owner.lock")
    try:
        os.symlink(str(target), link)
    except OSError as e:
        pytest.skip(f"cannot make a symlink here: {e}")
    if not os.path.lexists(link) or not os.path.islink(link):
        # Wine 8's CreateSymbolicLinkW reports success and makes nothing, and
        # shows a Unix symlink as the file it points to: no reparse point
        # can be made there.
        pytest.skip("symlinks are not reparse points here (Wine)")
    with pytest.raises(OSError, match="reparse point"):
        winfs.OwnerLock.acquire(link)
    assert winfs.lock_held(link) is None
    with pytest.raises(OSError, match="reparse point"):
        winfs.read_bytes(link)


def test_replace_retries_while_a_reader_holds_the_target(tmp_path) -> None:  # type: ignore[no-untyped-def]
    dst, src = str(tmp_path / "record.json"), str(tmp_path / "new")
    open(dst, "w").write("old")
    open(src, "w").write("new")
    f = open(dst)   # Python's open(): no FILE_SHARE_DELETE, as most readers
    threading.Timer(0.3, f.close).start()
    failed = winfs.replace(src, dst, timeout=10)
    assert failed > 0, "the reader did not block the rename: the test proves nothing"
    assert open(dst).read() == "new"


def test_replace_gives_up_after_its_bound(tmp_path) -> None:  # type: ignore[no-untyped-def]
    dst, src = str(tmp_path / "record.json"), str(tmp_path / "new")
    open(dst, "w").write("old")
    open(src, "w").write("new")
    with open(dst):
        t0 = time.monotonic()
        with pytest.raises(PermissionError):
            winfs.replace(src, dst, timeout=0.3)
        assert time.monotonic() - t0 >= 0.29
    assert open(dst).read() == "old" and os.path.exists(src)


def test_readers_see_whole_versions_while_a_writer_replaces(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Our readers (read_bytes) hold the file only while they read; the
    writer's bounded retry absorbs the collisions. Every write lands and
    every read is one complete version. (A reader that re-opens the file
    back to back can starve the writer past its bound: readers are woken
    by pokes, they do not spin.)"""
    path = str(tmp_path / "record.json")
    winfs.write_bytes_atomic(path, b"0" * 4096)
    stop = threading.Event()
    bad: list[bytes] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            data = winfs.read_bytes(path)
            reads[0] += 1
            if len(data) != 4096 or len(set(data)) != 1:
                bad.append(data[:16])
            time.sleep(0.001)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(50):
            winfs.write_bytes_atomic(path, str(i % 10).encode() * 4096, timeout=10)
    finally:
        stop.set()
        t.join(30)
    assert bad == [] and reads[0] > 0
    assert winfs.read_bytes(path) == b"9" * 4096


def test_concurrent_appenders_never_overwrite_each_other(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The cancel inbox: four processes append 100 lines each at once."""
    path = str(tmp_path / "requests.ndjson")
    ps = [subprocess.Popen(child("append", path, f"p{i}", "100"), stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(4)]
    assert [p.wait(120) for p in ps] == [0, 0, 0, 0]
    lines = winfs.read_bytes(path).decode().splitlines()
    assert len(lines) == 400
    for i in range(4):
        mine = [int(x.split()[1]) for x in lines if x.startswith(f"p{i} ")]
        assert mine == list(range(100)), i
    assert all(x.endswith("x" * 200) for x in lines)


def test_append_line_with_fsync_and_no_link_followed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "journal.ndjson")
    winfs.append_line(path, b"one\n", fsync=True)
    winfs.append_line(path, b"two\n")
    assert winfs.read_bytes(path) == b"one\ntwo\n"


def test_lock_wait_blocks_until_the_holder_dies(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / ".claim.lock")
    p = _holder(path)
    threading.Timer(0.5, p.kill).start()
    lk = winfs.OwnerLock.acquire(path, wait=True)
    assert lk is not None and p.wait(30) is not None
    lk.release()


def test_write_bytes_atomic_leaves_only_the_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "record.json")
    winfs.write_bytes_atomic(path, b"one", fsync=True)
    winfs.write_bytes_atomic(path, b"two")
    assert winfs.read_bytes(path) == b"two"
    assert sorted(os.listdir(tmp_path)) == ["record.json"]


def test_state_dir_is_under_localappdata() -> None:
    assert winfs.state_dir({"LOCALAPPDATA": "C:\\Users\\u\\AppData\\Local"}) == "C:\\Users\\u\\AppData\\Local\\contain"
    assert winfs.state_dir({"CONTAIN_STATE_DIR": "D:\\s", "LOCALAPPDATA": "x"}) == "D:\\s"
    assert winfs.state_dir({"USERPROFILE": "C:\\Users\\u"}) == "C:\\Users\\u\\AppData\\Local\\contain"
    assert winfs.state_dir().lower().endswith("\\appdata\\local\\contain")
    with pytest.raises(OSError):
        winfs.state_dir({})


def test_private_dir_is_created_and_verified(tmp_path) -> None:  # type: ignore[no-untyped-def]
    d = str(tmp_path / "contain")
    try:
        winfs.ensure_private_dir(d)
    except OSError as e:
        if "owner cannot be read" in str(e) and _census.wine_version():
            pytest.skip(f"Wine keeps no owner for this directory: {e}")
        raise
    assert os.path.isdir(d)
    winfs.ensure_private_dir(d)   # again: it exists, and it is ours


def test_junction_as_state_dir_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import _winapi

    target = tmp_path / "target"
    target.mkdir()
    link = str(tmp_path / "contain")
    try:
        _winapi.CreateJunction(str(target), link)
    except OSError as e:
        pytest.skip(f"cannot make a junction here: {e}")
    with pytest.raises(OSError, match="reparse point"):
        winfs.ensure_private_dir(link)
