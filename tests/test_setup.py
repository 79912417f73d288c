"""The test suite's own set-up (tests/_native_build.py): on a fresh clone the
tree's extension is built before any test, and when it cannot be built the
session stops at once with one line that says what to run."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

import _native_build
from _proc import ROOT

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None,
                              reason="needs a C compiler")


def _copy_tree(dest) -> str:
    """What a fresh clone has: the sources, no compiled extension."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build", "_ct.c", ".pytest_cache", ".hypothesis")
    for d in ("launcher", "tests"):
        shutil.copytree(os.path.join(ROOT, d), os.path.join(dest, d), ignore=ignore)
    for f in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, f), os.path.join(dest, f))
    return str(dest)


def _pytest(root: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)           # as typed in a fresh shell
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)


def test_stale_reason_follows_the_sources(tmp_path):
    root = _copy_tree(tmp_path / "tree")
    assert _native_build.stale_reason(root) == "launcher/_native has no compiled extension"
    so = os.path.join(root, "launcher", "_native", "_ct.abi3.so")
    with open(so, "wb"):
        pass
    old = time.time() - 3600
    for d, _subdirs, files in os.walk(os.path.join(root, "launcher", "_native")):
        for f in files:
            os.utime(os.path.join(d, f), (old, old))
    os.utime(os.path.join(root, "setup.py"), (old, old))
    os.utime(so, (old + 10, old + 10))                  # built after every source
    assert _native_build.stale_reason(root) is None
    os.utime(os.path.join(root, "launcher", "_native", "spawn.c"), (old + 20, old + 20))
    assert _native_build.stale_reason(root) == "launcher/_native/_ct.abi3.so is older than launcher/_native/spawn.c"


@needs_cc
def test_a_fresh_tree_builds_its_extension_then_tests(tmp_path):
    root = _copy_tree(tmp_path / "tree")
    p = _pytest(root, "tests/test_args.py")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "extension launcher/_native has no compiled extension: built it in place" in p.stdout, p.stdout[:2000]
    assert _native_build.stale_reason(root) is None


@needs_cc
def test_an_extension_that_cannot_be_built_stops_the_session_with_one_line(tmp_path):
    root = _copy_tree(tmp_path / "tree")
    with open(os.path.join(root, "launcher", "_native", "spawn.c"), "a") as f:
        f.write("\nthis is not C;\n")
    t0 = time.monotonic()
    p = _pytest(root, "-q")
    took = time.monotonic() - t0
    assert p.returncode == 4, p.stdout[-2000:] + p.stderr[-2000:]
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "tests: " in ln]
    assert len(lines) == 1, p.stdout + p.stderr
    assert "building launcher/_native in place failed" in lines[0]
    assert f"run `python setup.py build_ext --inplace` in {root} to see why" in lines[0]
    assert " passed" not in p.stdout and " failed" not in p.stdout, "tests ran"
    assert took < 120, took                             # a hang guard: no test waited out a timeout
