"""The `job-object` container against the real Win32 API (a Windows CPython).

Survival is decided by the suite's own census (_census: toolhelp plus a
handle opened by pid, checked against the creation time each helper wrote
in its mark), never by asking launcher. Where Wine differs from Windows
the test says so and skips only that assertion.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

if sys.platform != "win32":
    pytest.skip("the Windows suite: a Windows CPython runs it (tools/winlane.py)", allow_module_level=True)

import _census
from _job import CHILD, Job, child

from launcher._errors import ContainmentUnavailable, SpawnFailed
from launcher._platform import windows, winproc

WINE = _census.wine_version()
CREATE_NEW_CONSOLE = 0x00000010


@pytest.fixture
def job(helpers):  # type: ignore[no-untyped-def]
    j = Job(helpers.dir)
    try:
        yield j
    finally:
        j.close()


def test_detached_grandchild_outliving_the_worker_dies_with_the_job(job: Job) -> None:
    """The README example: the worker starts a DETACHED_PROCESS grandchild
    (no console, its own everything) and exits 0. The grandchild is still
    in the job; the kill ends it; the job is observed empty."""
    job.spawn(child("tree", job.dir, "w", "detached", "0"))
    assert job.wait_root() == 0, job.log()
    gc = _census.wait_marks(job.dir, "w-gc", 1)
    assert len(gc) == 1
    (pid, created), = gc.items()
    assert _census.alive(pid, created), "the grandchild must outlive the worker for this test to mean anything"
    assert _census.in_job(pid, job.c.job) is True
    assert job.c.placed(pid) == job.c.path
    assert job.c.populated()
    assert pid in job.c.members()
    assert job.c.kill() == "TerminateJobObject"
    assert job.wait_empty()
    assert _census.wait_gone(gc) == []


def test_breakaway_flag_cannot_leave_the_job(job: Job) -> None:
    """CREATE_BREAKAWAY_FROM_JOB without a breakaway limit on the job: refused
    (ERROR_ACCESS_DENIED), or, if created, the child is still in the job."""
    job.spawn(child("breakaway", job.dir, "b"))
    deadline = time.monotonic() + 30
    res = os.path.join(job.dir, "b.result")
    while not os.path.exists(res) and time.monotonic() < deadline:
        time.sleep(0.02)
    text = open(res).read().split()
    assert text[0] in ("refused", "created"), text
    if text[0] == "refused":
        assert text[1] == "5", text
    procs = {**_census.wait_marks(job.dir, "b", 1), **_census.marks(job.dir, "b-out")}
    for pid in procs:
        assert _census.in_job(pid, job.c.job) is True, (pid, text)
    job.c.kill()
    assert job.wait_empty()
    assert _census.wait_gone(procs) == []


def test_worker_own_breakaway_job_still_dies_with_ours(job: Job) -> None:
    """The worker makes its own job with BREAKAWAY_OK and SILENT_BREAKAWAY_OK
    (what libuv does) and joins it; its children break away from that job
    silently and explicitly. Jobs nest: breaking away from the inner job
    lands in ours, which allows neither."""
    job.spawn(child("nest", job.dir, "n"))
    res = os.path.join(job.dir, "n.result")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (os.path.exists(res) and "explicit-" in open(res).read()):
        time.sleep(0.02)
    text = open(res).read()
    assert "nested set=1 assign=1" in text, text
    want = 2 if "explicit-created" in text else 1
    inner = _census.wait_marks(job.dir, "n-in", want)
    assert len(inner) == want, text
    procs = {**_census.marks(job.dir, "n"), **inner}
    for pid in procs:
        assert _census.in_job(pid, job.c.job) is True, (pid, text)
    job.c.kill()
    assert job.wait_empty()
    assert _census.wait_gone(procs) == []


def _console_stop(helpers_dir: str, mode: str, grace: float) -> dict[str, Any]:
    """Run role console_stop in a console of its own, so CTRL_BREAK_EVENT has
    a console to travel through."""
    p = subprocess.Popen(child("console_stop", helpers_dir, mode, str(grace)), creationflags=CREATE_NEW_CONSOLE,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert p.wait(90) == 0
    with open(os.path.join(helpers_dir, "console_stop.json")) as f:
        return json.load(f)


def test_ctrl_break_ignoring_console_worker_is_killed_after_the_grace(helpers) -> None:  # type: ignore[no-untyped-def]
    out = _console_stop(helpers.dir, "ignore_break", 1.0)
    t = out["terminate"]
    assert out["marked"] == 1
    assert t["event"] == "CTRL_BREAK_EVENT"
    if WINE:
        # Wine 8 implements only CTRL_C_EVENT (server/console.c,
        # propagate_console_signal: "should support the other events"):
        # the record must say it was not delivered, and why.
        assert t["sent"] is False and t["delivered"] is False and "GenerateConsoleCtrlEvent" in t["reason"], t
    else:
        assert t["sent"] is True and t["delivered"] is True and out["reached"] >= 1, t
    assert out["exited_in_grace"] is False, out
    assert out["populated_after_kill"] is False, out
    assert out["alive_after_kill"] == [], out


def test_ctrl_break_stops_a_cooperative_console_worker(helpers) -> None:  # type: ignore[no-untyped-def]
    out = _console_stop(helpers.dir, "on_break", 5.0)
    assert out["alive_after_kill"] == [] and out["populated_after_kill"] is False, out
    if WINE:
        pytest.skip(f"Wine {WINE} does not deliver CTRL_BREAK_EVENT (server/console.c): {out['terminate']}")
    assert out["exited_in_grace"] is True and out["exit_code"] == 3 and "break" in (out["result"] or ""), out


def test_terminate_without_a_console_says_it_could_not_deliver(job: Job) -> None:
    """The suite runs without a console under Wine (stdio are pipes): the
    polite stop is recorded as not sent, never as sent."""
    job.spawn(child("sleep", job.dir, "s"))
    procs = _census.wait_marks(job.dir, "s", 1)
    via, t = job.c.terminate()
    assert t is job.c.last_terminate and "CTRL_BREAK_EVENT" in via
    assert t["event"] == "CTRL_BREAK_EVENT" and t["process_group"] == job.c.pid
    if t.get("attached_to_our_console"):
        pytest.skip("this process has a console shared with the worker: covered by the console tests")
    assert t["reached"] == 0 and t["not_reached"] >= 1 and t["sent"] is False and t["delivered"] is False, t
    assert t["reason"], t
    assert _census.alive(*next(iter(procs.items())))
    job.c.kill()
    assert job.wait_empty()


def test_supervisor_death_kills_the_tree(helpers) -> None:  # type: ignore[no-untyped-def]
    """KILL_ON_JOB_CLOSE: a supervisor killed outright (no kill(), no
    remove()) takes its tree with it when its last job handle closes."""
    p = subprocess.Popen(child("supervisor", helpers.dir, "k"), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == b"ready", line + p.stdout.read()
    tree = {**_census.marks(helpers.dir, "k"), **_census.marks(helpers.dir, "k-gc")}
    assert len(tree) == 2
    assert all(_census.alive(pid, c) for pid, c in tree.items())
    p.kill()   # TerminateProcess: a crash, as far as the job is concerned
    p.wait(30)
    assert _census.wait_gone(tree) == []


@pytest.mark.parametrize("code", [0, 42, 259, 3221225477])
def test_exit_code_passes_through(job: Job, code: int) -> None:
    """259 is STILL_ACTIVE: the handle's state decides "exited", not the code.
    3221225477 is 0xC0000005, an NTSTATUS above INT_MAX."""
    job.spawn(child("exit", str(code)))
    assert job.wait_root() == code
    assert job.wait_empty()


def test_worker_exit_code_while_its_child_lives(job: Job) -> None:
    job.spawn(child("tree", job.dir, "e", "plain", "7"))
    assert job.wait_root() == 7
    gc = _census.marks(job.dir, "e-gc")
    assert len(gc) == 1 and _census.alive(*next(iter(gc.items())))
    assert job.c.populated()
    job.c.kill()
    assert job.wait_empty()
    assert _census.wait_gone(gc) == []


def test_command_not_found_is_127(job: Job) -> None:
    with pytest.raises(SpawnFailed) as e:
        job.c.spawn(windows.Request([os.path.join(job.dir, "no-such-program.exe")]))
    assert e.value.exit_code == 127 and e.value.stage == "exec"
    assert not job.c.populated()


def test_not_an_executable_is_126(job: Job) -> None:
    fake = os.path.join(job.dir, "fake.exe")
    with open(fake, "w") as f:
        f.write("this is not a PE image\n")
    with pytest.raises(SpawnFailed) as e:
        job.c.spawn(windows.Request([fake]))
    assert e.value.exit_code == 126, e.value
    assert not job.c.populated()


def test_a_directory_is_126(job: Job) -> None:
    d = os.path.join(job.dir, "adir.exe")
    os.mkdir(d)
    with pytest.raises(SpawnFailed) as e:
        job.c.spawn(windows.Request([d]))
    assert e.value.exit_code == 126, e.value


def test_bad_working_directory_is_125(job: Job) -> None:
    with pytest.raises(SpawnFailed) as e:
        job.c.spawn(windows.Request(child("exit", "0"), cwd=os.path.join(job.dir, "missing")))
    assert e.value.stage == "chdir" and e.value.exit_code == 125, e.value


def test_seal_and_user_are_refused(job: Job) -> None:
    class Opts:
        seal = True
        user = None

    with pytest.raises(ContainmentUnavailable, match="seal"):
        job.c.prepare(windows.Request(["x"]), Opts())
    Opts.seal, Opts.user = False, "someone"   # type: ignore[assignment]
    with pytest.raises(ContainmentUnavailable, match="user"):
        job.c.prepare(windows.Request(["x"]), Opts())


def test_spawned_inside_the_job_via_the_job_list(job: Job) -> None:
    """The C harness checks the first instruction; here: the path taken is
    recorded, and the kernel places the worker in the job."""
    job.spawn(child("sleep", job.dir, "p"))
    assert job.c.spawn_via is not None and "IsProcessInJob" in job.c.spawn_via
    assert "JOB_LIST" in job.c.spawn_via, job.c.spawn_via   # Windows 10+, and Wine 8
    assert job.c.placed(job.c.pid) == job.c.path
    assert _census.in_job(job.c.pid, job.c.job) is True


def test_identity_is_pid_and_creation_time(job: Job) -> None:
    job.spawn(child("sleep", job.dir, "i"))
    procs = _census.wait_marks(job.dir, "i", 1)
    ident = job.c.worker_identity()
    assert ident["pid"] == job.c.pid
    assert procs[job.c.pid] == ident["start_time"]   # the worker's own reading of itself
    assert winproc.identity_alive(ident["pid"], ident["start_time"]) is True
    assert winproc.identity_alive(ident["pid"], ident["start_time"] + 1) is False
    h = winproc.open_identity(ident["pid"], ident["start_time"])
    assert h is not None
    from launcher._native import lib

    lib.ct_job_close_take(h)
    job.c.kill()
    assert job.wait_empty()
    # Exited, though our handle keeps its pid from being reused: not alive.
    assert winproc.identity_alive(ident["pid"], ident["start_time"]) is False
    assert winproc.open_identity(ident["pid"], ident["start_time"]) is None


def test_cpu_accounting_is_not_reported_when_implausible(job: Job) -> None:
    """A 500 ms burn. On Windows the job's total covers it; Wine leaves the
    job's times at 0 while the worker's own GetProcessTimes is real, and the
    record must then say "not a measurement", never 0."""
    job.spawn(child("spin", "500"))
    assert job.wait_root() == 0
    assert job.wait_empty()
    own = winproc.process_times(job.c.process)
    acc = job.c.accounting()["cpu"]
    if acc["observed"] is None:
        assert "not a measurement" in acc["detail"] or "not distinguishable" in acc["detail"], acc
        assert job.c.cpu_stat() is None
        if WINE:
            pytest.skip(f"Wine {WINE} does not implement job CPU times: {acc['detail']}")
        pytest.fail(f"job CPU accounting missing on Windows: {acc}")
    assert acc["detail"]["usage_usec"] >= (own["user"] + own["kernel"]) // 10 > 0
    assert job.c.cpu_stat() == {k: acc["detail"][k] for k in ("usage_usec", "user_usec", "system_usec")}


def test_peak_memory_is_not_reported_as_zero(job: Job) -> None:
    job.spawn(child("alloc", "64"))
    assert job.wait_root() == 0
    mem = job.c.accounting()["peak_memory"]
    if mem["observed"] is None:
        assert "reads 0" in mem["detail"], mem
        if WINE:
            pytest.skip(f"Wine {WINE} zero-fills PeakJobMemoryUsed: {mem['detail']}")
        pytest.fail(f"peak memory missing on Windows: {mem}")
    assert mem["detail"]["peak_job_bytes"] >= 64 << 20


def test_escape_evidence_reads_the_limits(job: Job) -> None:
    ev = job.c.escape_evidence()
    if job.c.leavable() is None:
        # The probe found no right to allow breakaway: nothing can have left.
        assert ev["observed"] is False and "no process of this token" in ev["detail"], ev
    elif WINE:
        # Wine zero-fills the limit classes: unreadable, so null, never false.
        assert ev["observed"] is None and "zero-fills" in ev["detail"], ev
    else:
        assert ev["observed"] is None and "breakaway not allowed now" in ev["detail"], ev


def test_members_lists_the_tree(job: Job) -> None:
    job.spawn(child("pair", job.dir, "m"))
    procs = {**_census.wait_marks(job.dir, "m", 1), **_census.wait_marks(job.dir, "m-gc", 1)}
    assert sorted(procs) == job.c.members()
    job.c.kill()
    assert job.wait_empty()
    assert _census.wait_gone(procs) == []


def test_job_object_only_on_windows_names_no_linux_module() -> None:
    """The Windows backend's imports pull in nothing Linux-only."""
    code = ("import sys; sys.path[:0] = [sys.argv[1]]; "
            "import launcher._platform.windows, launcher._platform.winsync, launcher._platform.winfs, "
            "launcher._native; print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.dirname(CHILD))],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    mods = set(out.stdout.split())
    bad = {"fcntl", "pyroute2", "termios", "resource", "launcher._platform.linux", "launcher._platform.posix",
           "launcher._platform.none", "launcher._run", "launcher._layout"} & mods
    assert not bad, bad


def test_extension_carries_only_windows_modules() -> None:
    from launcher._native import lib

    names = set(dir(lib))
    assert {"ct_job_spawn", "ct_job_terminate", "ct_sync_wait", "ct_sync_lock"} <= names
    assert not {n for n in names if n.startswith(("ct_spawn", "ct_procscan", "ct_cgroup", "ct_seal"))}


def test_named_job_opens_to_watch_and_kill_but_never_to_allow_breakaway() -> None:
    """A run's job is named (so an adopter can open it), and its descriptor
    grants this user only what watching and killing need: a process of the
    tree opening it by name gets query and terminate, never
    JOB_OBJECT_SET_ATTRIBUTES, WRITE_DAC or WRITE_OWNER (each refused with
    5). A second job of that name is refused (a squatter), an adopter's
    open probes the guard again, and once the last handle closes the name
    is gone (OpenJobObjectW: 2). Before: jobs had no name."""
    import ctypes
    from ctypes import wintypes as w

    from launcher._platform.winsync import job_name

    k32 = ctypes.WinDLL("kernel32", use_last_error=True)
    k32.OpenJobObjectW.restype = w.HANDLE
    k32.OpenJobObjectW.argtypes = [w.DWORD, w.BOOL, w.LPCWSTR]
    k32.CloseHandle.argtypes = [w.HANDLE]
    uid = f"t{os.getpid()}named"
    c = windows.Container.create("named", None, uid)
    try:
        assert c.path == job_name(uid) == f"Local\\contain-{uid}-job"
        for right in (0x10, 0x40000, 0x80000):        # SET_ATTRIBUTES, WRITE_DAC, WRITE_OWNER
            h = k32.OpenJobObjectW(right, False, c.path)
            err = ctypes.get_last_error()
            if h:
                k32.CloseHandle(h)
            assert not h and err == 5, (hex(right), err)
        h = k32.OpenJobObjectW(0x4 | 0x8, False, c.path)  # QUERY | TERMINATE
        assert h, ctypes.get_last_error()
        k32.CloseHandle(h)
        with pytest.raises(ContainmentUnavailable, match="exists already"):
            windows.Container.create("again", None, uid)
        # A squatter's job with the default descriptor: CreateJobObjectW
        # would hand it over (ERROR_ALREADY_EXISTS); it is refused.
        k32.CreateJobObjectW.restype = w.HANDLE
        k32.CreateJobObjectW.argtypes = [w.LPVOID, w.LPCWSTR]
        squat = k32.CreateJobObjectW(None, job_name(uid + "sq"))
        assert squat, ctypes.get_last_error()
        try:
            with pytest.raises(ContainmentUnavailable, match="exists already"):
                windows.Container.create("squat", None, uid + "sq")
        finally:
            k32.CloseHandle(squat)
        o = windows.Container.open("named", c.path)
        try:
            assert o.adopted and o.guard["obtainable"] == [] and o.leavable() is None, o.guard
            assert o.populated() is False
        finally:
            o.remove()
    finally:
        c.remove()
    with pytest.raises(OSError) as e:
        windows.Container.open("named", c.path)
    assert e.value.winerror == 2, e.value
