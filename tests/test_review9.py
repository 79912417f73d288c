"""Review 9: what 4883d61 (bin/contain instead of a console script on
POSIX; the first final record renamed, then fsynced) left for a user who
installs contain from its source distribution.

Each test failed on the code it was written against. Real builds: the
sdist is made by setuptools from a copy of this tree and built by the
compiler, as pip would build it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from _proc import ROOT

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None,
                              reason="needs a C compiler")

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
