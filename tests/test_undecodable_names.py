"""Names in bytes that are not UTF-8, made by the worker or found on the host
(a directory in the workspace, a cgroup, a mount point with a space): none
crashes contain."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from _proc import cgroup2_mount, holders, run_contain
from conftest import needs_cgroup


@needs_cgroup
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


@needs_cgroup
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


@needs_cgroup
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
