"""Playing another local user: a spare uid nobody uses, commands run as it
with `setpriv`, and directories both users can reach.

Test-side only: the code under test is imported here only to see that
another uid can import it. Another uid can reach neither a clone that sits
in a private directory (root's home, `mktemp -d`) nor an interpreter
installed in one (pyenv under /root, a venv in the clone), and a test must
not fail for where those live. So what another uid runs is staged once per
session, the first time a test asks for it: a copy of this tree's
launcher/ (the extension built in place included) in a directory under
/tmp that every uid can read, and an interpreter that a spare uid was seen
to run it with (`stage`). The stage is removed when the session's process
exits, whatever the tests did.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import pwd
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAFE_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


def _uids_in_use() -> set[int]:
    used = {p.pw_uid for p in pwd.getpwall()}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        used.update(int(x) for x in line.split()[1:])
                        break
        except OSError:
            continue
    return used


def spare_uids(n: int) -> list[int]:
    """`n` distinct uids with no passwd entry and no process."""
    used = _uids_in_use()
    out: list[int] = []
    while len(out) < n:
        u = 47000 + secrets.randbelow(3000)
        if u not in used and u not in out:
            out.append(u)
    return out


# -- what another uid runs ----------------------------------------------------------

def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


# A stage is the session's, whichever process builds it: a forked test
# (pytest-forked) that asks first builds its own and ends with os._exit,
# which skips atexit. So every stage's name carries the session's pid and
# start time, taken when conftest.py imports this module (before any
# fork), and the session's process removes them all when it exits.
_SESSION = os.getpid()
_PREFIX = f"contain-users-{_SESSION}-{_start_time(_SESSION)}-"
_NAME = re.compile(r"contain-users-(\d+)-(\d+)-\w+")


# A session in another PID namespace looks gone from here: a stage not
# ours is taken for a killed session's only once it is older than any
# session runs (CI gives one an hour).
_ORPHAN_AFTER_S = 6 * 3600


def remove_stages() -> None:
    """This session's stages; and those of sessions that were killed before
    they could remove theirs (SIGKILL; timeout's SIGTERM): the process
    their name gives is gone, or is another one now."""
    if os.getpid() != _SESSION:
        return
    for name in os.listdir("/tmp"):
        m = _NAME.fullmatch(name)
        if m is None:
            continue
        path = os.path.join("/tmp", name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if not name.startswith(_PREFIX) and (_start_time(int(m[1])) == m[2]
                                             or time.time() - st.st_mtime < _ORPHAN_AFTER_S):
            continue
        shutil.rmtree(path, ignore_errors=True)


atexit.register(remove_stages)


class Stage:
    """A directory under /tmp (root's, 0755) with a copy of launcher/ in
    `lib`, and `python`, an interpreter a spare uid ran `import launcher`
    with from there (PYTHONPATH=`pythonpath`); or `why` not."""

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix=_PREFIX, dir="/tmp")
        os.chmod(self.path, 0o755)
        self.lib = os.path.join(self.path, "lib")
        self.deps = os.path.join(self.path, "deps")
        self.python: str | None = None
        self.pythonpath = self.lib
        self.why: str | None = None
        self._shared: dict[str, str] = {}

    def share(self, path: str) -> str:
        """A copy of the test-side file `path` that every uid can read."""
        if path not in self._shared:
            d = os.path.join(self.path, "files")
            os.makedirs(d, mode=0o755, exist_ok=True)
            dst = os.path.join(d, os.path.basename(path))
            shutil.copyfile(path, dst)
            os.chmod(dst, 0o644)
            self._shared[path] = dst
        return self._shared[path]


def _readable_copy(src: str, dst: str) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.part-*"))
    for d, dirs, files in os.walk(dst):
        os.chmod(d, 0o755)
        for n in files:
            p = os.path.join(d, n)
            os.chmod(p, stat.S_IMODE(os.stat(p).st_mode) | 0o444)


def _stage_cffi_backend(dest: str) -> bool:
    """The one module the extension imports at run time, copied from this
    interpreter, for an interpreter that lacks it (a system python without
    python3-cffi-backend). Its file name carries its ABI, so an interpreter
    of another version does not see it."""
    spec = importlib.util.find_spec("_cffi_backend")
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return False
    os.makedirs(dest, mode=0o755, exist_ok=True)
    shutil.copyfile(spec.origin, os.path.join(dest, os.path.basename(spec.origin)))
    os.chmod(os.path.join(dest, os.path.basename(spec.origin)), 0o755)
    libs = os.path.join(os.path.dirname(spec.origin), "cffi.libs")     # a wheel's bundled libffi
    if os.path.isdir(libs):
        _readable_copy(libs, os.path.join(dest, "cffi.libs"))
    return True


def _candidates() -> list[str]:
    """The running interpreter first (what the tests run as root), then its
    base (a venv's), then a system one of the same version, then any."""
    v = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    found = [sys.executable, getattr(sys, "_base_executable", "")]
    found += [shutil.which(n, path="/usr/local/bin:/usr/bin:/bin") or "" for n in (v, "python3")]
    out: list[str] = []
    for p in found:
        if p and p not in out:
            out.append(p)
    return out


_IDENT = "import sys; print(sys.version.split()[0], sys.base_prefix)"
_TRIAL = _IDENT + "; import launcher, launcher._native, launcher._cli; print(launcher.__file__)"


def _last_line(p: subprocess.CompletedProcess[str]) -> str:
    return ([ln for ln in p.stderr.splitlines() if ln.strip()][-1:] or [f"exit {p.returncode}"])[0].strip()


def _trial(python: str, pythonpath: str, lib: str) -> str | None:
    """Why a spare uid cannot import the staged launcher with `python`, or
    None: decided by trying, as what it may read is the kernel's to say.
    The interpreter must be the one root runs by that name: one that
    cannot read its own installation may start anyway and find another's
    (a shared libpython under /root: the loader falls back to the
    system's, which then takes its prefix and library from /usr)."""
    try:
        mine = subprocess.run([python, "-c", _IDENT], env=user_env(PYTHONPATH=""), capture_output=True,
                              text=True, timeout=60)
        uid, = spare_uids(1)
        p = as_uid(uid, [python, "-c", _TRIAL], env=user_env(PYTHONPATH=pythonpath), timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if mine.returncode != 0:
        return f"does not run as root ({_last_line(mine)})"
    ident, _, where = p.stdout.strip().partition("\n")
    if ident and ident != mine.stdout.strip():
        return f"that uid gets another Python from it ({ident}, not {mine.stdout.strip()})"
    if p.returncode != 0:
        return _last_line(p)
    if not where.startswith(lib + os.sep):
        return f"imports launcher from {where}, not the stage"
    return None


def _make_stage() -> Stage:
    s = Stage()
    if os.geteuid() != 0:
        s.why = "needs root to switch to a spare uid"
        return s
    if shutil.which("setpriv") is None:
        s.why = "setpriv not installed"
        return s
    _readable_copy(os.path.join(ROOT, "launcher"), os.path.join(s.lib, "launcher"))
    tried: list[str] = []
    with_deps: bool | None = None
    for py in _candidates():
        why = _trial(py, s.lib, s.lib)
        if why is not None and "_cffi_backend" in why:
            if with_deps is None:
                with_deps = _stage_cffi_backend(s.deps)
            if with_deps:
                path = s.lib + os.pathsep + s.deps
                why = _trial(py, path, s.lib)
                if why is None:
                    s.pythonpath = path
        if why is None:
            s.python = py
            return s
        tried.append(f"{py}: {why[:120]}")
    s.why = "no interpreter a spare uid can run this tree's launcher with (" + "; ".join(tried) + ")"
    return s


_stage: Stage | None = None


def stage() -> Stage:
    global _stage
    if _stage is None:
        _stage = _make_stage()
    return _stage


def why_not() -> str | None:
    """Why commands cannot be run as another uid here, or None."""
    return stage().why


def python() -> str:
    """The interpreter for another uid's commands (the test skips, saying
    why, where there is none)."""
    s = stage()
    if s.python is None:
        import pytest

        pytest.skip(s.why or "no interpreter for another uid")
    return s.python


def pythonpath() -> str:
    """PYTHONPATH for another uid's `python -m launcher`: the staged copy."""
    return stage().pythonpath


def share(path: str) -> str:
    """A copy of the test-side file `path` that another uid can read."""
    return stage().share(path)


def user_env(**extra: str) -> dict[str, str]:
    """A clean environment for another user's commands."""
    env = {"PATH": SAFE_PATH, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    env.update(extra)
    if "PYTHONPATH" not in env:
        env["PYTHONPATH"] = pythonpath()
    return env


def as_uid(uid: int, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 60,
           cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `argv` as `uid` (and gid `uid`, no supplementary groups)."""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv],
                          env=env if env is not None else user_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or "/")


def contain_as(uid: int, *args: str, env: dict[str, str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return as_uid(uid, [python(), "-m", "launcher", *args], env=env, timeout=timeout)


class Shared:
    """A directory under /tmp that every user can reach (0755, root's),
    removed with everything in it at the end."""

    def __init__(self, mode: int = 0o755) -> None:
        self.path = tempfile.mkdtemp(prefix="contain-shared-", dir="/tmp")
        os.chmod(self.path, mode)

    def sub(self, name: str, *, uid: int = 0, mode: int = 0o755) -> str:
        d = os.path.join(self.path, name)
        os.mkdir(d)
        os.chown(d, uid, uid)
        os.chmod(d, mode)
        return d

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> "Shared":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
