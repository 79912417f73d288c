"""The `job-object` primitives against the Win32 API, under Wine.

Windows CPython cannot run here, so `launcher/_native/jobobject.c` and
`winproc.c` are tested as C: `tests/windows/test_jobobject.c` is built with
mingw-w64 together with them and run under wine64. The harness prints one
`CHECK <name> ok|FAIL|skip` line per check; every expected name must appear,
and `skip` is accepted only for the Wine stubs listed in WINE_GAPS (never on
Windows).

The Wine prefix is cached under the pytest cache directory: a fresh one
costs about 3.5 s and 700 MB. Everything Wine starts is ended afterwards by
`wineserver -k` for that prefix, then by pid for any Unix process that
still carries the prefix in its environment.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import sys
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "windows" / "test_jobobject.c"
NATIVE = ROOT / "launcher" / "_native"
MINGW = "x86_64-w64-mingw32-gcc"

CHECKS = [
    "limits_kill_on_close_no_breakaway",
    "first_instruction_in_job_job_list",
    "first_instruction_in_job_suspended",
    "assign_failure_discards_child",
    "assign_failure_discards_child_job_list",
    "spawn_not_found_is_reported",
    "exit_code_passthrough_0",
    "exit_code_passthrough_42",
    "exit_code_passthrough_259",
    "exit_code_passthrough_3221225477",
    "worker_exit_code_with_descendants_alive",
    "grandchildren_in_job",
    "pid_list_more_data",
    "terminate_job_empties_tree",
    "port_zero_confirmed_by_query",
    "breakaway_flag_cannot_leave",
    "nested_job_silent_breakaway_stays_in",
    "same_user_worker_can_steal_job_handle",
    "restricted_job_handle_cannot_be_stolen",
    "kill_on_job_close",
    "supervisor_death_kills_tree",
    "terminate_during_spawn_storm",
    "accounting_cpu_time",
]

# What Wine 8 does not implement (dlls/ntdll/unix/sync.c,
# NtQueryInformationJobObject): the limit classes are zero-filled and the
# accounting class carries only TotalProcesses and ActiveProcesses. And,
# rarely, a child whose creation raced TerminateJobObject stays counted in
# ActiveProcesses with no process alive; the harness accepts that only when
# the wait said "not empty" and its own toolhelp census finds nothing alive.
WINE_GAPS = {
    "limits_kill_on_close_no_breakaway": "wine_query_limits_zero_filled",
    "accounting_cpu_time": "wine_accounting_times_zero",
    "terminate_during_spawn_storm": "wine_active_count_stuck_after_kill_during_creation",
}


def _wine64() -> str | None:
    for c in (shutil.which("wine64"), "/usr/lib/wine/wine64", shutil.which("wine")):
        if c and os.access(c, os.X_OK):
            return c
    return None


def _wineserver() -> str | None:
    for c in (shutil.which("wineserver"), "/usr/lib/wine/wineserver"):
        if c and os.access(c, os.X_OK):
            return c
    return None


def _prefix_processes(prefix: str) -> list[tuple[int, str]]:
    """Unix processes started for this prefix (WINEPREFIX in their
    environment), zombies excluded: they have exited."""
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


def _end_prefix(prefix: str, env: dict[str, str]) -> list[tuple[int, str]]:
    """`wineserver -k` for our prefix only, then SIGKILL by pid whatever
    Unix process of that prefix is left. Returns what had to be killed."""
    server = _wineserver()
    if server:
        subprocess.run([server, "-k"], env=env, capture_output=True, timeout=30)
        subprocess.run([server, "-w"], env=env, capture_output=True, timeout=30)
    deadline = time.monotonic() + 5
    left = _prefix_processes(prefix)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _prefix_processes(prefix)
    for pid, _cmd in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


class HarnessRun:
    def __init__(self, lines: list[str], prefix: str, timings: dict[str, float],
                 leftovers: list[tuple[int, str]]) -> None:
        self.prefix = prefix
        self.timings = timings
        self.leftovers = leftovers
        self.platform = ""
        self.checks: dict[str, tuple[str, str]] = {}
        self.summary = ""
        for line in lines:
            if line.startswith("PLATFORM "):
                self.platform = line
            elif line.startswith("CHECK "):
                _, name, status, *rest = line.split(" ", 3) + [""]
                self.checks[name] = (status, rest[0])
            elif line.startswith("SUMMARY "):
                self.summary = line

    @property
    def wine(self) -> bool:
        return "wine=no" not in self.platform


@pytest.fixture(scope="module")
def harness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HarnessRun]:
    if shutil.which(MINGW) is None:
        pytest.skip(f"{MINGW} not installed (apt-get install gcc-mingw-w64-x86-64)")
    wine = _wine64()
    if wine is None:
        pytest.skip("wine64 not installed (apt-get install wine64)")
    work = tmp_path_factory.mktemp("jobobject")
    exe = work / "test_jobobject.exe"
    t0 = time.monotonic()
    cc = subprocess.run([MINGW, "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", f"-I{NATIVE}",
                         "-o", str(exe), str(HARNESS), str(NATIVE / "jobobject.c"),
                         str(NATIVE / "winproc.c"), "-ladvapi32"],
                        capture_output=True, text=True)
    assert cc.returncode == 0, f"mingw build failed:\n{cc.stderr}"
    t_build = time.monotonic() - t0

    try:
        cache = Path(request.config.cache.mkdir("wineprefix"))   # type: ignore[union-attr]
    except Exception:
        cache = tmp_path_factory.mktemp("wineprefix")
    prefix = cache / "prefix"
    ready = cache / "ready"
    lock = open(cache / "lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)   # one wineserver per prefix: serialise runs sharing it
    if not ready.exists() and prefix.exists():
        shutil.rmtree(prefix)           # a prefix whose first start was interrupted
    # TMPDIR: Wine's Unix side leaves a wine-XXXXXX server directory there
    # (in the test's own directory, not in /tmp).
    env = dict(os.environ, WINEPREFIX=str(prefix), WINEDEBUG="-all", WINEDLLOVERRIDES="winemenubuilder.exe=d",
               TMPDIR=str(work))
    env.pop("DISPLAY", None)
    fresh = not ready.exists()
    try:
        # A file, not a pipe: a Wine loader left blocked at the Unix level
        # (see test_nothing_outlives_the_prefix) inherits the harness's
        # stdout and would hold a pipe open for ever.
        log = work / "harness.out"
        t0 = time.monotonic()
        with open(log, "w") as out:
            run = subprocess.run([wine, str(exe)], cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, timeout=600)
        t_run = time.monotonic() - t0
        text = log.read_text(errors="replace")
        if "SUMMARY " in text:
            ready.touch()
        leftovers = _prefix_processes(str(prefix))
        harness_left = [p for p in leftovers if exe.name in p[1]]
        killed = _end_prefix(str(prefix), env)
        result = HarnessRun(text.splitlines(), str(prefix),
                            {"build_s": t_build, "run_s": t_run, "fresh_prefix": float(fresh)},
                            harness_left)
        print(f"\njob-object harness: build {t_build:.1f}s, wine run {t_run:.1f}s "
              f"({'fresh' if fresh else 'cached'} prefix); {result.summary}; "
              f"harness processes left at the Unix level before wineserver -k: {len(harness_left)}; "
              f"killed by pid after -k: {len(killed)}")
        if not result.summary:
            pytest.fail(f"harness did not finish (exit {run.returncode}):\n{text[-5000:]}")
        yield result
    finally:
        _end_prefix(str(prefix), env)
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


@pytest.mark.parametrize("name", CHECKS)
def test_check(harness: HarnessRun, name: str) -> None:
    assert name in harness.checks, f"the harness printed no CHECK {name}"
    status, detail = harness.checks[name]
    if status == "skip":
        assert harness.wine and name in WINE_GAPS and f"gap={WINE_GAPS[name]}" in detail, \
            f"unexpected skip of {name}: {detail}"
        pytest.skip(f"Wine does not implement it: {detail}")
    assert status == "ok", f"{name}: {detail}"


def test_every_check_is_known(harness: HarnessRun) -> None:
    """A check added to the harness is added here too, so it is asserted."""
    assert sorted(harness.checks) == sorted(CHECKS)


def test_nothing_outlives_the_prefix(harness: HarnessRun) -> None:
    """After `wineserver -k` (and kills by pid) no Unix process of the prefix
    runs. `harness.leftovers` lists harness processes that were still there
    before `-k`: a helper killed by TerminateJobObject while Wine was still
    starting it can stay blocked in the loader at the Unix level although
    Windows already counts it gone (docs/windows.md)."""
    assert _prefix_processes(harness.prefix) == []


# -- on every platform: the backend's Linux face -----------------------------

@pytest.mark.skipif(sys.platform == "win32", reason="the Linux face of the backend")
def test_job_object_backend_fails_125_off_windows(tmp_path: Path) -> None:
    env = dict(os.environ, CONTAIN_STATE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "launcher", "run", "--backend", "job-object", "--", "true"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 125, p.stderr
    assert "Job Objects exist only on Windows" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="the Linux face of the backend")
def test_job_object_library_raises_containment_unavailable(tmp_path: Path) -> None:
    from launcher._errors import ContainmentUnavailable
    from launcher._containers import make_container
    from launcher._options import Options

    with pytest.raises(ContainmentUnavailable, match="only on Windows"):
        make_container("x", Options(backend="job-object", state_dir=str(tmp_path)))


@pytest.mark.skipif(sys.platform == "win32", reason="the Linux build")
def test_linux_extension_carries_no_windows_module() -> None:
    """build.py compiles each platform's own modules: no Job Object stubs here."""
    from launcher._native import lib

    names = set(dir(lib))
    assert "ct_spawn" in names and "ct_procscan_read" in names
    assert not {n for n in names if n.startswith(("ct_job_", "ct_sync_", "CT_JOB_", "CT_SYNC_"))}


def test_every_native_module_is_built_for_a_platform() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("_build_under_test", NATIVE / "build.py")
    assert spec is not None and spec.loader is not None
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    on_disk = {p.stem for p in NATIVE.glob("*.c") if not p.name.startswith("_")}
    assert on_disk == set(b.MODULES["linux"]) | set(b.MODULES["win32"])
    assert not set(b.MODULES["linux"]) & set(b.MODULES["win32"])
    for m in on_disk:
        assert (NATIVE / f"{m}.h").is_file() and (NATIVE / f"{m}.cdef").is_file(), m


def test_windows_extension_source_is_generated_on_linux(tmp_path: Path) -> None:
    """What tools/winbuild.py cross-compiles: cffi's C for the win32 modules only."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_build_under_test", NATIVE / "build.py")
    assert spec is not None and spec.loader is not None
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    out = tmp_path / "_ct.c"
    b.make("win32").emit_c_code(str(out))
    text = out.read_text()
    assert all(f'#include "{m}.h"' in text for m in ("jobobject", "winproc", "winsync"))
    assert "ct_sync_wait" in text and "ct_job_spawn" in text
    assert '#include "spawn.h"' not in text and "ct_procscan_read" not in text


def test_windows_modules_compile_warning_free_with_mingw(tmp_path: Path) -> None:
    """The Windows C compiles as tools/winbuild.py compiles it (-Werror), so a
    break shows in the Linux suite too, not only in the Wine lane."""
    if shutil.which(MINGW) is None:
        pytest.skip(f"{MINGW} not installed (apt-get install gcc-mingw-w64-x86-64)")
    for m in ("jobobject", "winproc", "winsync"):
        cc = subprocess.run([MINGW, "-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter", f"-I{NATIVE}",
                             "-c", str(NATIVE / f"{m}.c"), "-o", str(tmp_path / f"{m}.o")],
                            capture_output=True, text=True, timeout=120)
        assert cc.returncode == 0, f"{m}.c:\n{cc.stderr}"


def test_environment_block_is_sorted_and_refuses_nul() -> None:
    from launcher._platform.windows import environment_block

    assert environment_block({"b": "2", "A": "1", "=C:": "C:\\x"}) == "=C:=C:\\x\0A=1\0b=2\0\0".encode()
    assert environment_block({}) == b"\0\0"
    with pytest.raises(ValueError):
        environment_block({"A": "x\0y"})
