"""The test suite's own set-up (tests/_native_build.py): on a fresh clone the
tree's extension is built before any test, and when it cannot be built the
session stops at once with one line that says what to run."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
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


# What a clone has that a build made: never part of the copy.
_GENERATED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.pyd", "_ct.c",
                                    ".pytest_cache", ".mypy_cache", ".hypothesis", "results")


def _run(argv: list[str], cwd: str) -> None:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{argv} in {cwd}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def _native_modules() -> dict[str, tuple[str, ...]]:
    # build.py's own table (it cannot be imported without building its ffi
    # for this host, which is fine: that is what the tests run against).
    sys.path.insert(0, os.path.join(ROOT, "launcher", "_native"))
    try:
        import build as native_build
    finally:
        sys.path.pop(0)
    return dict(native_build.MODULES)


@needs_cc
def test_the_sdist_builds_contain_on_any_platform_it_was_made_on(tmp_path):
    # No MANIFEST.in: setuptools put into the sdist only the C files of the
    # platform that made it (the extension's sources), without one NAME.h or
    # NAME.cdef, so build.py refused it ("modules on disk ... != listed")
    # and `pip install contain-0.1.0.tar.gz` failed on every platform. And
    # bin/contain went in only as a script of an sdist made on POSIX: one
    # made on Windows could not be installed on Linux (setup.py names it).
    tree = str(tmp_path / "tree")
    shutil.copytree(ROOT, tree, ignore=_GENERATED)
    out = str(tmp_path / "dist")
    _run([sys.executable, "setup.py", "--quiet", "sdist", "--dist-dir", out], tree)
    (sdist,) = os.listdir(out)
    with tarfile.open(os.path.join(out, sdist)) as tf:
        members = {m.name.split("/", 1)[1]: m for m in tf.getmembers() if "/" in m.name}
        if hasattr(tarfile, "data_filter"):         # 3.11.4+
            tf.extractall(tmp_path / "unpacked", filter="data")
        else:
            tf.extractall(tmp_path / "unpacked")
    for platform, mods in _native_modules().items():
        for m in mods:
            for ext in ("c", "h", "cdef"):
                assert f"launcher/_native/{m}.{ext}" in members, f"{platform}: {m}.{ext} not in {sdist}"
    assert not any(n.startswith("launcher/_native/_") and n.endswith(".c") for n in members), "generated C shipped"
    script = members.get("bin/contain")
    assert script is not None and script.mode & 0o111, f"bin/contain not in {sdist} as an executable"
    # ... and what is in it builds: the extension and the script.
    src = os.path.join(str(tmp_path / "unpacked"), sdist[:-len(".tar.gz")])
    _run([sys.executable, "setup.py", "--quiet", "build", "--build-base", str(tmp_path / "b")], src)
    built = [os.path.join(d, f) for d, _s, fs in os.walk(tmp_path / "b") for f in fs]
    assert any(os.path.basename(p).startswith("_ct.") and p.endswith(".so") for p in built), built
    scripts = [p for p in built if os.path.basename(p) == "contain" and os.sep + "scripts-" in p]
    assert scripts, built
    with open(scripts[0]) as f:
        assert f.readline() == f"#!{sys.executable}\n"


def test_an_sdist_made_on_windows_carries_bin_contain(tmp_path):
    # setup.py names bin/contain (`scripts=`) on POSIX only: an sdist made
    # where it takes its Windows branch had no bin/contain unless the
    # manifest names it, and pip could not build it on Linux ("file
    # 'bin/contain' does not exist"). Its Windows branch, taken here.
    tree = str(tmp_path / "tree")
    shutil.copytree(ROOT, tree, ignore=_GENERATED)
    with open(os.path.join(tree, "setup.py")) as f:
        text = f.read()
    assert text.count('if sys.platform == "win32":') == 1, "setup.py no longer chooses the command this way"
    with open(os.path.join(tree, "setup.py"), "w") as f:
        f.write(text.replace('if sys.platform == "win32":', "if True:"))
    out = str(tmp_path / "dist")
    _run([sys.executable, "setup.py", "--quiet", "sdist", "--dist-dir", out], tree)
    (sdist,) = os.listdir(out)
    with tarfile.open(os.path.join(out, sdist)) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert "bin/contain" in names, sorted(names)
    with open(os.path.join(tree, "contain.egg-info", "entry_points.txt")) as f:
        assert "contain = launcher._cli:console" in f.read()      # the branch was taken: Windows' console script
