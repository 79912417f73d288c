"""mypy passes on the package with the project's configuration (pyproject.toml)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_passes() -> None:
    pytest.importorskip("mypy")
    p = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


# The Windows backend and the Windows suite, read as Windows code: under the
# default (Linux) platform mypy treats everything after a
# `sys.platform != "win32"` guard as unreachable and checks none of it.
WINDOWS_FILES = ["launcher/_platform/windows.py", "launcher/_platform/winsync.py", "launcher/_platform/winfs.py",
                 "launcher/_platform/winproc.py", "launcher/_platform/winacct.py", "launcher/_platform/winhost.py",
                 "launcher/_platform/winlimits.py",
                 "launcher/_platform/winlayout.py", "launcher/_platform/winstate.py",
                 "launcher/_platform/windoctor.py", "launcher/_platform/exits.py", "launcher/_platform/__init__.py",
                 "launcher/_identity.py", "launcher/_stdio.py", "launcher/_aio.py", "launcher/_native/build.py",
                 "tools/winbuild.py",
                 "tests_windows/_census.py", "tests_windows/_child.py", "tests_windows/_job.py",
                 "tests_windows/_contain.py", "tests_windows/test_job.py", "tests_windows/test_waiter.py",
                 "tests_windows/test_files.py", "tests_windows/test_run.py", "tests_windows/test_library.py",
                 "tests_windows/test_limits.py"]


def test_mypy_passes_for_windows() -> None:
    pytest.importorskip("mypy")
    env = dict(os.environ, MYPYPATH="tests_windows")
    p = subprocess.run([sys.executable, "-m", "mypy", "--platform", "win32", "--follow-imports=silent",
                        *WINDOWS_FILES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
