"""Make sure this tree's compiled extension exists and is current before any
test imports launcher, and that a `python -m launcher` started by a test
imports the same tree.

The README's test command is `pip install '.[test]' && python -m pytest`
from the clone's root. pip builds `launcher._native._ct` into site-packages
only, and the tests (like a developer) use the tree: without this step every
kernel test would fail after its own timeout, each `contain` subprocess
dying of an ImportError nobody shows. So: build in place when the extension
is missing or older than any of its sources (as make would), and when that
cannot be done, stop the session at once with one line that says what to run.

The new .so is built in a scratch directory and renamed over the old one,
never written in place: a process that has the old one mapped (a run still
going in another terminal) would otherwise die of SIGBUS.
"""
from __future__ import annotations

import glob
import importlib.machinery
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

BUILD = "python setup.py build_ext --inplace"


def _sources(root: str) -> list[str]:
    nat = os.path.join(root, "launcher", "_native")
    found = [os.path.join(root, "setup.py"), os.path.join(nat, "build.py")]
    for pat in ("*.c", "*.h", "*.cdef", "initbin/*.c"):
        found += [p for p in glob.glob(os.path.join(nat, pat)) if not os.path.basename(p).startswith("_")]
    return [p for p in found if os.path.exists(p)]


def extension_path(root: str) -> tuple[str, str | None]:
    """(the file `import launcher._native._ct` would load, or where a build
    puts it; None when there is none yet). The interpreter tries its suffixes
    in order, so a stale `_ct.cpython-*.so` would shadow a fresh `_ct.abi3.so`."""
    nat = os.path.join(root, "launcher", "_native")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = os.path.join(nat, "_ct" + suffix)
        if os.path.exists(p):
            return p, p
    return os.path.join(nat, "_ct.abi3.so"), None


def stale_reason(root: str) -> str | None:
    """Why the extension must be (re)built, or None when it is current."""
    _target, have = extension_path(root)
    if have is None:
        return "launcher/_native has no compiled extension"
    built = os.stat(have).st_mtime
    newer = [p for p in _sources(root) if os.stat(p).st_mtime > built]
    if newer:
        return f"{os.path.relpath(have, root)} is older than {os.path.relpath(newer[0], root)}"
    return None


def _fail(root: str, why: str) -> None:
    pytest.exit(f"tests: {why}; run `{BUILD}` in {root} to see why", returncode=4)


def build(root: str) -> float:
    """Build the extension into a scratch directory and rename it into
    place. Returns the seconds it took; stops the session on failure."""
    target, _have = extension_path(root)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="contain-native-") as tmp:
        lib, tmpdir = os.path.join(tmp, "lib"), os.path.join(tmp, "temp")
        try:
            p = subprocess.run([sys.executable, "setup.py", "--quiet", "build_ext", "--build-lib", lib,
                                "--build-temp", tmpdir], cwd=root, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            _fail(root, f"cannot build the extension in place ({e})")
        if p.returncode != 0:
            last = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
            _fail(root, f"building launcher/_native in place failed ({last[0].strip()[:200]})")
        made = glob.glob(os.path.join(lib, "launcher", "_native", "_ct*.so"))
        if len(made) != 1:
            _fail(root, f"the build made {len(made)} extension files, expected one")
        part = f"{target}.part-{os.getpid()}"
        shutil.copyfile(made[0], part)    # mtime now: newer than every source
        os.chmod(part, 0o755)
        os.replace(part, target)
    return time.monotonic() - t0


def _lock(root: str) -> int:
    """Two test sessions in one tree build one at a time (flock on the
    launcher/_native directory, released when the fd closes)."""
    import fcntl

    fd = os.open(os.path.join(root, "launcher", "_native"), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def check_subprocess_import(root: str) -> None:
    """A `python -m launcher` started by a test (PYTHONPATH=root, as the
    fixtures set it) must import this tree, extension included; otherwise
    every CLI test would wait out its timeout for a workload that never
    started. Costs one interpreter start (~30 ms)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    code = "import launcher, launcher._native; print(launcher.__file__)"
    try:
        p = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        _fail(root, f"a test's `{sys.executable} -c 'import launcher'` did not run ({e})")
    if p.returncode != 0:
        last = [ln for ln in p.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
        _fail(root, f"a test's subprocess cannot import launcher ({last[0].strip()[:200]})")
    got = os.path.dirname(p.stdout.strip())
    if os.path.realpath(got) != os.path.realpath(os.path.join(root, "launcher")):
        _fail(root, f"a test's subprocess imports launcher from {got}, not this tree")


#: What ensure() did, for the session header.
report = "current"


def ensure(root: str) -> None:
    """Called once per session from conftest.py, before `import launcher`."""
    global report
    if stale_reason(root) is not None:
        fd = _lock(root)
        try:
            why = stale_reason(root)      # another session may have built it meanwhile
            if why is not None:
                took = build(root)
                report = f"{why}: built it in place in {took:.1f} s"
        finally:
            os.close(fd)
    check_subprocess_import(root)
