"""`contain run` and `contain cancel` on Windows, end to end: the CLI a user
runs, a Job Object, the stop record, and the suite's own census.

Survival is decided by _census (toolhelp plus a handle opened by pid and
checked against the creation time each helper wrote in its mark), never by
asking contain. Where Wine differs from Windows the test says so and skips
only that assertion.
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
from _job import child

HERE = os.path.dirname(os.path.abspath(__file__))
CONTAIN = [sys.executable, os.path.join(HERE, "_contain.py")]
WINE = _census.wine_version()
CREATE_NEW_CONSOLE = 0x00000010
LONG = 120


class Box:
    """A state directory of this test's own, and `contain` run against it."""

    def __init__(self, d: str) -> None:
        self.dir = d
        self.state = os.path.join(d, "state")
        self.env = dict(os.environ, CONTAIN_STATE_DIR=self.state)

    def contain(self, *args: str, timeout: float = LONG, **kw: Any) -> subprocess.CompletedProcess[str]:
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run([*CONTAIN, *args], env=self.env, capture_output=True, text=True, timeout=timeout,
                              **kw)

    def start(self, *args: str, **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen([*CONTAIN, *args], env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kw)

    def record(self, run_id: str) -> dict[str, Any]:
        with open(os.path.join(self.state, "runs", run_id, "record.json")) as f:
            return json.load(f)

    def record_file(self, name: str = "record.json") -> str:
        return os.path.join(self.dir, name)


@pytest.fixture
def box(helpers) -> Box:  # type: ignore[no-untyped-def]
    return Box(helpers.dir)


def load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def steps(rec: dict[str, Any]) -> list[dict[str, Any]]:
    return ((rec["evidence"].get("signal_sent") or {}).get("detail") or {}).get("steps") or []


def assert_reaped(rec: dict[str, Any]) -> None:
    ev = rec["evidence"]
    assert rec["state"] == "REAPED", json.dumps(rec, indent=1)
    assert rec["containment"]["backend"] == "job-object"
    assert ev["container_empty"]["observed"] is True and "ActiveProcesses == 0" in ev["container_empty"]["via"]
    assert ev["descendants_exit"]["observed"] is True
    walls = rec["containment"]["walls"]
    assert walls and walls[0]["kind"] == "job" and walls[0]["unleavable"] is True, walls
    assert rec["identity"]["start_time"] > 10 ** 17    # a FILETIME (100 ns since 1601), not clock ticks


def test_readme_example_detached_grandchild_is_reaped(box: Box) -> None:
    """The README example on Windows: the worker starts a DETACHED_PROCESS
    grandchild (no console, its own everything) that outlives it, and exits
    0. contain exits 0, the record is REAPED, and the suite's own census
    finds nothing alive."""
    r = box.contain("run", "--grace", "0.5", "--record", box.record_file(), "--",
                    *child("tree", box.dir, "w", "detached", "0"))
    rec = load(box.record_file())
    tree = {**_census.marks(box.dir, "w"), **_census.marks(box.dir, "w-gc")}
    assert len(tree) == 2, (tree, r.stderr)
    assert r.returncode == 0, r.stderr
    assert_reaped(rec)
    assert rec["outcome"] == "exited" and rec["exit_code"] == 0
    # Something outlived the worker: the stop had to kill it.
    assert [s["kind"] for s in steps(rec)][-1] == "kill", steps(rec)
    assert _census.wait_gone(tree) == []
    # Whole-tree CPU from the job's accounting, where it is real; never 0.
    cpu = rec["accounting"]["cpu_usec"]
    if cpu["value"] is None:
        assert cpu["reason"], cpu
        if not WINE:
            pytest.fail(f"job CPU accounting missing on Windows: {cpu}")
    else:
        assert cpu["value"] > 0 and "QueryInformationJobObject" in cpu["source"], cpu


def test_start_b_ping_from_cmd_is_reaped(box: Box) -> None:
    """`cmd /c "start /b ping -n 1000 127.0.0.1 & exit 0"`: cmd exits at once,
    its ping goes on; REAPED with nothing left (the census looks for every
    ping.exe created since the test began)."""
    since = _census.filetime_now()
    r = box.contain("run", "--grace", "0.5", "--record", box.record_file(), "--",
                    "cmd", "/c", "start /b ping -n 1000 127.0.0.1 >NUL & exit 0")
    rec = load(box.record_file())
    assert r.returncode == 0, r.stderr
    assert_reaped(rec)
    assert rec["exit_code"] == 0 and [s["kind"] for s in steps(rec)][-1] == "kill", steps(rec)
    deadline = time.monotonic() + 15
    while _census.named_since("ping.exe", since) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _census.named_since("ping.exe", since) == {}


def test_breakaway_grandchild_stays_in_the_job(box: Box) -> None:
    """A grandchild created with CREATE_BREAKAWAY_FROM_JOB: refused (the job
    allows no breakaway), or created inside; either way gone at the end."""
    r = box.contain("run", "--timeout", "3", "--grace", "0.5", "--record", box.record_file(), "--",
                    *child("breakaway", box.dir, "b"))
    rec = load(box.record_file())
    text = open(os.path.join(box.dir, "b.result")).read().split()
    assert text[0] in ("refused", "created"), text
    if text[0] == "refused":
        assert text[1] == "5", text              # ERROR_ACCESS_DENIED
    assert r.returncode == 124, r.stderr
    assert rec["outcome"] == "timed_out"
    assert_reaped(rec)
    procs = {**_census.marks(box.dir, "b"), **_census.marks(box.dir, "b-out")}
    assert procs and _census.wait_gone(procs) == []


def test_worker_with_its_own_breakaway_job_still_ends_with_ours(box: Box) -> None:
    """The worker makes a job of its own that allows breakaway (both kinds),
    joins it (nested in ours) and starts children both ways: every one is
    still in ours, and gone at the end."""
    r = box.contain("run", "--timeout", "4", "--grace", "0.5", "--record", box.record_file(), "--",
                    *child("nest", box.dir, "n"))
    rec = load(box.record_file())
    text = open(os.path.join(box.dir, "n.result")).read()
    assert "nested set=1 assign=1" in text, text
    assert r.returncode == 124, r.stderr
    assert_reaped(rec)
    procs = {**_census.marks(box.dir, "n"), **_census.marks(box.dir, "n-in")}
    assert len(procs) >= 2 and _census.wait_gone(procs) == []


def test_ctrl_break_ignoring_console_worker_is_killed_after_the_grace(box: Box) -> None:
    """In a console of its own, so CTRL_BREAK_EVENT has somewhere to travel:
    a worker that ignores it. The record says what was sent and whether it
    could be delivered; the kill after the grace ends it; REAPED."""
    p = subprocess.Popen([*CONTAIN, "run", "--timeout", "2", "--grace", "1", "--record", box.record_file(), "--",
                          *child("ignore_break", box.dir, "cb")], env=box.env, creationflags=CREATE_NEW_CONSOLE,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert p.wait(LONG) == 124
    rec = load(box.record_file())
    assert_reaped(rec)
    term, kill = steps(rec)[0], steps(rec)[-1]
    assert term["kind"] == "term" and term["detail"]["event"] == "CTRL_BREAK_EVENT", term
    assert kill["kind"] == "kill" and kill["via"] == "TerminateJobObject", kill
    assert _census.wait_gone(_census.marks(box.dir, "cb")) == []
    d = term["detail"]
    if WINE:
        # Wine 8 implements only CTRL_C_EVENT (server/console.c): not sent,
        # and said so: never recorded as delivered.
        assert d["sent"] is False and d["delivered"] is False and d["reason"], d
        assert term["observed"] is False
        pytest.skip(f"Wine {WINE} does not deliver CTRL_BREAK_EVENT: {d['reason']}")
    assert d["sent"] is True and d["delivered"] is True and d["reached"] >= 1, d
    assert term["observed"] is True


def test_ctrl_c_to_contain_cancels_the_run(box: Box) -> None:
    """^C in contain's console: the intent is recorded, the tree stopped,
    the record written, and contain ends as a run cancelled by SIGINT
    (130: Windows has no dying by a signal, docs/windows.md)."""
    p = subprocess.Popen(child("ctrl_c_contain", box.dir, box.state, box.record_file()),
                         creationflags=CREATE_NEW_CONSOLE, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    assert p.wait(LONG) == 0
    out = load(os.path.join(box.dir, "ctrl_c.json"))
    assert out["marked"] == 1 and out["sent"][0] == 1, out
    assert out["rc"] == 130, out
    rec = load(box.record_file())
    assert_reaped(rec)
    assert rec["outcome"] == "cancelled" and rec["evidence"]["cancel_requested"]["observed"] is True
    assert "SIGINT" in json.dumps(rec["evidence"]["cancel_requested"]), rec["evidence"]["cancel_requested"]
    assert _census.wait_gone(_census.marks(box.dir, "cc")) == []


def test_the_polite_step_without_a_console_is_recorded_as_not_sent(box: Box) -> None:
    """The suite's own situation under Wine (stdio are pipes, no console):
    the record says CTRL_BREAK_EVENT was not sent, and why."""
    r = box.contain("run", "--timeout", "1", "--grace", "0.3", "--record", box.record_file(), "--",
                    *child("sleep", box.dir, "nc"))
    rec = load(box.record_file())
    assert r.returncode == 124
    term = steps(rec)[0]
    if term["detail"].get("attached_to_our_console"):
        pytest.skip("this process has a console shared with the worker: covered by the console test")
    assert term["observed"] is False and term["detail"]["sent"] is False and term["detail"]["reason"], term
    assert_reaped(rec)


def test_timeout_exits_124(box: Box) -> None:
    t0 = time.monotonic()
    r = box.contain("run", "--timeout", "1", "--grace", "0.2", "--record", box.record_file(), "--",
                    *child("sleep", box.dir, "t"))
    rec = load(box.record_file())
    assert r.returncode == 124, r.stderr
    assert rec["outcome"] == "timed_out" and rec["exit_code"] == 137   # the kill's code (windows.KILL_EXIT_CODE)
    assert_reaped(rec)
    assert time.monotonic() - t0 < 60
    assert _census.wait_gone(_census.marks(box.dir, "t")) == []


def test_cancel_from_a_second_process_twice_with_one_op_id(box: Box) -> None:
    """`contain cancel ID --wait` from another process ends a live run
    REAPED with effect `cancelled`; the same op id again returns the same
    record and applies nothing twice."""
    run = box.start("run", "--id", "cx", "--grace", "0.5", "--", *child("pair", box.dir, "c"))
    try:
        tree = {**_census.wait_marks(box.dir, "c", 1), **_census.wait_marks(box.dir, "c-gc", 1)}
        assert len(tree) == 2
        first = box.contain("cancel", "cx", "--op-id", "op-1", "--wait", "--json")
        second = box.contain("cancel", "cx", "--op-id", "op-1", "--wait", "--json")
        out, err = run.communicate(timeout=LONG)
    finally:
        if run.poll() is None:
            run.kill()
    assert first.returncode == 0, first.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["effect"] == "cancelled" and a["state"] == "REAPED", a
    assert a == b
    assert run.returncode == 143, err          # a run cancelled by another process, as on Linux
    rec = box.record("cx")
    assert_reaped(rec)
    assert rec["outcome"] == "cancelled" and rec["cancellations"] == ["op-1"]
    assert rec["evidence"]["cancel_requested"]["observed"] is True
    assert _census.wait_gone(tree) == []
    again = box.contain("cancel", "cx", "--op-id", "op-2", "--json")
    assert json.loads(again.stdout)["effect"] == "not_live"


@pytest.mark.parametrize("what,code", [("missing", 127), ("text", 126), ("directory", 126)])
def test_exec_failures(box: Box, what: str, code: int) -> None:
    target = {"missing": os.path.join(box.dir, "no-such-program.exe"),
              "text": os.path.join(box.dir, "not-a-program.txt"), "directory": box.dir}[what]
    if what == "text":
        with open(target, "w") as f:
            f.write("not a program\n")
    r = box.contain("run", "--record", box.record_file(), "--", target)
    assert r.returncode == code, (r.stdout, r.stderr)
    rec = load(box.record_file())
    assert rec["outcome"] == "spawn_failed" and rec["exit_code"] == code
    assert rec["evidence"]["container_empty"]["observed"] is True


def test_supervisor_death_kills_the_tree_and_the_next_cancel_ends_the_run(box: Box) -> None:
    """contain killed outright: KILL_ON_JOB_CLOSE ends the tree when its
    last handle closes. The next `contain cancel` adopts the run and looks
    for the job by its name: gone (no handle left anywhere), so the record
    is terminal, EXITED, with the emptiness not observed and the reason
    (or REAPED, should the name still open and the job read empty); the
    cancel exits 0, and gc removes the run. Before: UNCONFIRMED for ever,
    every cancel exiting 1, never removed, the record speaking of
    cgroup.kill and "SIGTERM by pidfd"."""
    run = box.start("run", "--id", "sd", "--", *child("pair", box.dir, "sd"))
    try:
        tree = {**_census.wait_marks(box.dir, "sd", 1), **_census.wait_marks(box.dir, "sd-gc", 1)}
        assert len(tree) == 2
    finally:
        run.kill()                   # TerminateProcess: no stop, no record
        run.communicate(timeout=LONG)
    assert _census.wait_gone(tree) == []
    c = box.contain("cancel", "sd", "--op-id", "after", "--wait", "--json")
    ack = json.loads(c.stdout)
    # The worker was found gone before the cancel was applied: the cancel
    # did not end it (not_live), and the stop it joins is final.
    assert c.returncode == 0 and ack["effect"] == "not_live" and ack["state"] in ("EXITED", "REAPED"), (ack, c.stderr)
    rec = box.record("sd")
    assert rec["state"] == ack["state"]
    assert rec["containment"]["path"].startswith("Local\\contain-") and rec["containment"]["path"].endswith("-job")
    ev = rec["evidence"]
    if rec["state"] == "EXITED":
        empty = ev["container_empty"]
        assert empty["observed"] is None and "KILL_ON_JOB_CLOSE" in str(empty["detail"]), empty
        assert ev["descendants_exit"]["observed"] is None
    # Nothing was left to signal, and nothing was said in Linux's words.
    assert ev["signal_sent"]["observed"] is not True, ev["signal_sent"]
    assert "pidfd" not in json.dumps(ev) and "cgroup.kill" not in json.dumps(ev), ev["signal_sent"]
    assert ev["cancel_requested"]["observed"] is not True and rec["cancellations"] == ["after"]
    # The worker's own identity was re-read: gone (observed), status unknown.
    assert ev["root_exit"]["observed"] is True and rec["exit_code"] is None
    ls = json.loads(box.contain("ls", "--all", "--json").stdout)
    assert [(v["id"], v["state"]) for v in ls] == [("sd", rec["state"])], ls
    g = box.contain("gc", "--json")
    assert g.returncode == 0 and json.loads(g.stdout)["removed"] == ["sd"], g.stdout + g.stderr


def _job_name_lookup(name: str) -> int:
    """OpenJobObjectW(name) by this test itself: 0 if a job of that name
    opened (closed again at once), else the Windows error."""
    import ctypes
    from ctypes import wintypes as w

    k32 = ctypes.WinDLL("kernel32", use_last_error=True)
    k32.OpenJobObjectW.restype = w.HANDLE
    k32.OpenJobObjectW.argtypes = [w.DWORD, w.BOOL, w.LPCWSTR]
    k32.CloseHandle.argtypes = [w.HANDLE]
    h = k32.OpenJobObjectW(0x4, False, name)       # JOB_OBJECT_QUERY
    if h:
        k32.CloseHandle(h)
        return 0
    return ctypes.get_last_error()


def _session() -> int:
    import ctypes
    from ctypes import wintypes as w

    k32 = ctypes.WinDLL("kernel32", use_last_error=True)
    sid = w.DWORD()
    assert k32.ProcessIdToSessionId(k32.GetCurrentProcessId(), ctypes.byref(sid)), ctypes.get_last_error()
    return int(sid.value)


def _killed_supervisor_and_gone_name(box: Box, run_id: str) -> dict[str, Any]:
    """`contain run` killed outright (no stop, no record), its tree gone by
    the census, and the job's name gone by this test's own lookup (Wine
    unlinks a name only when the object is destroyed, a moment after the
    last member died). Returns run.json."""
    run = box.start("run", "--id", run_id, "--", *child("pair", box.dir, run_id))
    try:
        tree = {**_census.wait_marks(box.dir, run_id, 1), **_census.wait_marks(box.dir, f"{run_id}-gc", 1)}
        assert len(tree) == 2
    finally:
        run.kill()                   # TerminateProcess: no stop, no record
        run.communicate(timeout=LONG)
    assert _census.wait_gone(tree) == []
    info = load(os.path.join(box.state, "runs", run_id, "run.json"))
    name = info["cgroup"]
    deadline = time.monotonic() + 30
    while (err := _job_name_lookup(name)) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert err == 2, f"{name}: OpenJobObjectW still {err} (0: it opens) 30 s after its tree died"
    return info


def test_job_name_missing_from_another_session_is_not_read_as_no_handle_left(box: Box) -> None:
    """`Local\\` is per session: from a session other than the one the job
    was made in, the run's name is another name, so its absence says
    nothing (the job may be alive and held in its own session). The owner
    records its session and the name's object directory in run.json; an
    adopter elsewhere leaves the run UNCONFIRMED with both sessions named,
    not final: nothing signalled, gc keeps it. Simulated by run.json saying
    the job was made in another session (Wine runs one session; a second
    logon is not made here). Before: EXITED, final, the cancel exiting 0,
    whatever the session."""
    info = _killed_supervisor_and_gone_name(box, "xs")
    here = _session()
    other = here + 7
    recorded = dict(info.get("job") or {})
    info["job"] = dict(recorded, session=other)
    with open(os.path.join(box.state, "runs", "xs", "run.json"), "w") as f:
        json.dump(info, f)
    c = box.contain("cancel", "xs", "--op-id", "after", "--json")
    ack = json.loads(c.stdout)
    assert c.returncode == 1 and ack["state"] == "UNCONFIRMED", (ack, c.stderr)
    rec = box.record("xs")
    ev = rec["evidence"]
    assert ev["container_empty"]["observed"] is None and ev["descendants_exit"]["observed"] is None
    assert f"made in session {other} and looked up from session {here}" in json.dumps(rec), json.dumps(rec, indent=1)
    assert ev["signal_sent"]["observed"] is not True, ev["signal_sent"]
    g = box.contain("gc", "--json")
    assert g.returncode == 0 and json.loads(g.stdout)["removed"] == [], g.stdout + g.stderr
    # What the owner recorded: the name, its session, the directory it lives in.
    assert recorded["name"] == info["cgroup"] and recorded["session"] == here, recorded
    assert recorded["directory"] == ("\\BaseNamedObjects" if here == 0 else f"\\Sessions\\{here}\\BaseNamedObjects")
    assert recorded["app_container"] is False, recorded
    # Put back as the owner wrote it, the same cancel finishes the run as
    # before: no name in its own session, EXITED, the session named.
    info["job"] = recorded
    with open(os.path.join(box.state, "runs", "xs", "run.json"), "w") as f:
        json.dump(info, f)
    c = box.contain("cancel", "xs", "--op-id", "again", "--wait", "--json")
    ack = json.loads(c.stdout)
    assert c.returncode == 0 and ack["state"] == "EXITED", (ack, c.stderr)
    empty = box.record("xs")["evidence"]["container_empty"]
    assert empty["observed"] is None and f"in session {here}" in empty["detail"], empty


def test_job_name_that_cannot_be_opened_is_never_read_as_empty(box: Box) -> None:
    """Only ERROR_FILE_NOT_FOUND reads as "no such job": a job of the run's
    name that this user may not open (here a squatter's, made after the
    run's job was gone, with a descriptor granting nobody anything: access
    denied) leaves the run UNCONFIRMED with the error, nothing signalled.
    (This held before too: a guard for the new reading of a missing name.)"""
    import ctypes
    from ctypes import wintypes as w

    info = _killed_supervisor_and_gone_name(box, "ad")
    k32 = ctypes.WinDLL("kernel32", use_last_error=True)
    adv = ctypes.WinDLL("advapi32", use_last_error=True)

    class SA(ctypes.Structure):
        _fields_ = [("nLength", w.DWORD), ("lpSecurityDescriptor", ctypes.c_void_p), ("bInheritHandle", w.BOOL)]

    sd = ctypes.c_void_p()
    adv.ConvertStringSecurityDescriptorToSecurityDescriptorW.argtypes = [
        w.LPCWSTR, w.DWORD, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    assert adv.ConvertStringSecurityDescriptorToSecurityDescriptorW("D:P", 1, ctypes.byref(sd), None)
    sa = SA(ctypes.sizeof(SA), sd, False)
    k32.CreateJobObjectW.restype = w.HANDLE
    k32.CreateJobObjectW.argtypes = [ctypes.POINTER(SA), w.LPCWSTR]
    k32.CloseHandle.argtypes = [w.HANDLE]
    squat = k32.CreateJobObjectW(ctypes.byref(sa), info["cgroup"])
    assert squat, ctypes.get_last_error()
    try:
        err = _job_name_lookup(info["cgroup"])
        if err != 5:
            pytest.skip(f"an empty DACL did not deny this token the job here (OpenJobObjectW: {err})")
        c = box.contain("cancel", "ad", "--op-id", "after", "--json")
        ack = json.loads(c.stdout)
        assert c.returncode == 1 and ack["state"] == "UNCONFIRMED", (ack, c.stderr)
        rec = box.record("ad")
        assert rec["state"] == "UNCONFIRMED" and rec["evidence"]["container_empty"]["observed"] is None, rec
        assert "could not be opened" in json.dumps(rec), json.dumps(rec, indent=1)
    finally:
        k32.CloseHandle(squat)


def test_worker_holding_a_stolen_job_handle_outlives_contain_and_cancel_reaps_it(box: Box) -> None:
    """The worker opens `contain` (its parent, the same user) with
    PROCESS_DUP_HANDLE and keeps a copy of the job handle, so the job
    outlives contain and KILL_ON_JOB_CLOSE never fires: the tree goes on.
    `contain cancel` adopts the run, opens the job by its name, terminates
    it and observes ActiveProcesses == 0: REAPED, cancelled, and the
    census finds nothing. Before: UNCONFIRMED "worker running" on every
    cancel, the tree alive for ever.

    contain's stdout and stderr are a file here: with them on a pipe, Wine 8
    ended the worker together with contain (exit code 0, the job not
    signalled, so not by KILL_ON_JOB_CLOSE: measured), which would hide the
    case this test is about."""
    out = open(os.path.join(box.dir, "contain.out"), "w")
    try:
        run = subprocess.Popen([*CONTAIN, "run", "--id", "st", "--", *child("steal", box.dir, "st")], env=box.env,
                               stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        try:
            tree = {**_census.wait_marks(box.dir, "st", 1), **_census.wait_marks(box.dir, "st-gc", 1)}
            assert len(tree) == 2
        finally:
            run.kill()
            run.wait(timeout=LONG)
    finally:
        out.close()
    with open(os.path.join(box.dir, "st.result")) as f:
        stole = f.read().split()
    assert stole[0] == "stole" and int(stole[1]) >= 1, stole
    # The stolen handle keeps the job, and so the tree, alive without contain.
    assert all(_census.alive(pid, created) for pid, created in tree.items()), tree
    try:
        c = box.contain("cancel", "st", "--op-id", "adopt", "--wait", "--json")
        ack = json.loads(c.stdout)
        assert c.returncode == 0 and ack["effect"] == "cancelled" and ack["state"] == "REAPED", (ack, c.stderr)
        assert _census.wait_gone(tree) == []
    finally:
        for pid, created in tree.items():
            _census.kill(pid, created)
    rec = box.record("st")
    assert_reaped(rec)
    assert rec["outcome"] == "cancelled" and rec["exit_code"] == 137, rec["outcome"]
    ev = rec["evidence"]
    assert ev["cancel_requested"]["observed"] is True and rec["cancellations"] == ["adopt"]
    assert rec["containment"]["walls"][0].get("opened_by"), rec["containment"]["walls"]
    # What made this possible is said where the record says what the worker could do.
    assert rec["containment"]["sealed"] is False and "job open" in rec["containment"]["sealed_reason"]
    kinds = [(s["kind"], s["observed"], s["via"]) for s in steps(rec)]
    assert kinds[-1][:2] == ("kill", True) and kinds[-1][2].startswith("TerminateJobObject"), kinds
    assert "pidfd" not in json.dumps(ev) and "cgroup.kill" not in json.dumps(ev), kinds
    g = box.contain("gc", "--json")
    assert g.returncode == 0 and json.loads(g.stdout)["removed"] == ["st"], g.stdout + g.stderr


def test_nested_run_is_a_nested_job_and_ends_with_its_lead(box: Box) -> None:
    """`contain run` inside a run: the inner worker's job nests in the
    outer one (Windows 8+), and the outer stop (a timeout) ends both trees."""
    inner = [*CONTAIN, "run", "--id", "inner", "--record", box.record_file("inner.json"), "--",
             *child("pair", box.dir, "in")]
    r = box.contain("run", "--id", "outer", "--timeout", "5", "--grace", "0.3", "--record", box.record_file(),
                    "--", *inner)
    rec = load(box.record_file())
    assert r.returncode == 124, r.stderr
    assert_reaped(rec)
    tree = {**_census.marks(box.dir, "in"), **_census.marks(box.dir, "in-gc")}
    assert len(tree) == 2, os.listdir(box.dir)
    assert _census.wait_gone(tree) == []
    info = json.load(open(os.path.join(box.state, "runs", "inner", "run.json")))
    assert info["backend"] == "job-object" and "IsProcessInJob" in info["spawn_via"], info


def test_doctor_reports_the_windows_facts(box: Box) -> None:
    r = box.contain("doctor", "--json")
    assert r.returncode == 0, r.stderr
    caps = json.loads(r.stdout)
    assert caps["platform"] == "win32"
    job = caps["job_object"]
    assert job["ok"] is True and job["observed_empty"] is True and isinstance(job["job_list"], bool), job
    assert job["guard"]["obtainable"] == [], job
    assert isinstance(caps["own_job"]["in_job"], bool)
    assert caps["modes"][0]["strongest_state"] == "REAPED"
    human = box.contain("doctor")
    assert human.returncode == 0 and "job object" in human.stdout


def test_doctor_inside_a_run_sees_the_job_it_runs_in_and_nests(box: Box) -> None:
    """A supervisor that itself runs in a job (here, a run's): doctor says
    so, and its own probe spawn nests a job inside that one."""
    r = box.contain("run", "--", *CONTAIN, "doctor", "--json")
    assert r.returncode == 0, r.stderr
    caps = json.loads(r.stdout)
    assert caps["own_job"]["in_job"] is True, caps["own_job"]
    assert caps["job_object"]["ok"] is True and caps["job_object"]["observed_empty"] is True, caps["job_object"]



def test_ls_status_wait_and_gc(box: Box) -> None:
    """The readers on Windows: a live run listed and described, `wait` until
    it ends, then `gc` removes it (and only ended runs)."""
    run = box.start("run", "--id", "rd", "--grace", "0.3", "--", *child("sleep", box.dir, "rd"))
    try:
        _census.wait_marks(box.dir, "rd", 1)
        ls = json.loads(box.contain("ls", "--json").stdout)
        assert [(v["id"], v["state"], v["owner_alive"]) for v in ls] == [("rd", "RUNNING", True)], ls
        st = box.contain("status", "rd")
        assert st.returncode == 0 and "job-object" in st.stdout and "FILETIME" in st.stdout, st.stdout
        waiter = box.start("wait", "rd", "--json")
        assert box.contain("cancel", "rd").returncode == 0
        out, _err = waiter.communicate(timeout=LONG)
        # 143: what `contain run` gives a run cancelled by `contain cancel` (contain wait's status)
        assert waiter.returncode == 143 and json.loads(out)["state"] == "REAPED", (out, _err)
        run.communicate(timeout=LONG)
    finally:
        if run.poll() is None:
            run.kill()
    g = box.contain("gc", "--json")
    assert g.returncode == 0 and json.loads(g.stdout)["removed"] == ["rd"], g.stdout + g.stderr
    assert not os.path.exists(os.path.join(box.state, "runs", "rd"))


@pytest.mark.parametrize("args, env", [
    (["--backend", "cgroup2"], {}),
    (["--backend", "pidns"], {}),
    (["--backend", "subreaper"], {}),
    (["--backend", "none"], {}),
    ([], {"CONTAIN_BACKEND": "cgroup2"}),
    ([], {"CONTAIN_BACKEND": "none"}),
    (["--user", "nobody"], {}),
], ids=["cgroup2", "pidns", "subreaper", "none", "env-cgroup2", "env-none", "user"])
def test_linux_only_option_exits_125_before_anything_is_made(box: Box, args: list[str], env: dict[str, str]) -> None:
    """A backend or option only Linux has, asked for on Windows: 125 and the
    reason on stderr, no traceback, no run directory, and the worker never
    ran (it would have marked itself). Before: a traceback (AttributeError
    CT_STAGE_CLONE, ModuleNotFoundError pwd), exit 1, and a run directory
    saying spawn_failed 125."""
    r = subprocess.run([*CONTAIN, "run", "--id", "lx", *args, "--", *child("pair", box.dir, "lx")],
                       env=dict(box.env, **env), capture_output=True, text=True, timeout=LONG,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 125, r.stderr
    assert "Traceback" not in r.stderr and "Windows" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(box.state, "runs", "lx")), os.listdir(os.path.join(box.state, "runs"))
    assert _census.marks(box.dir, "lx") == {}


def test_run_json_rewritten_to_name_an_empty_job_is_not_taken_for_the_run(box: Box) -> None:
    """A same-user worker can rewrite its run.json (Windows keeps no tags).
    Here it outlives contain (a stolen job handle) and points run.json at
    an empty job of the same descriptor under another run uid: opened and
    read empty, that job would make the adopter say REAPED while the tree
    runs. The adopter sees that the worker, still running, is not in that
    job: UNCONFIRMED with the reason, and the tree is still there (the
    census). A guard on the adoption by name (passes before it too: the
    old adopter opened nothing); it fails without the IsProcessInJob check."""
    from launcher._platform import windows
    from launcher._platform.winsync import job_name

    decoy = windows.Container.create("decoy", None, f"decoy{os.getpid()}")
    out = open(os.path.join(box.dir, "contain.out"), "w")
    tree: dict[int, int] = {}
    try:
        run = subprocess.Popen([*CONTAIN, "run", "--id", "rw", "--", *child("steal", box.dir, "rw")], env=box.env,
                               stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        try:
            tree = {**_census.wait_marks(box.dir, "rw", 1), **_census.wait_marks(box.dir, "rw-gc", 1)}
        finally:
            run.kill()
            run.wait(timeout=LONG)
        assert all(_census.alive(pid, created) for pid, created in tree.items()), tree
        path = os.path.join(box.state, "runs", "rw", "run.json")
        info = load(path)
        info.update(run_uid=f"decoy{os.getpid()}", cgroup=job_name(f"decoy{os.getpid()}"))
        with open(path, "w") as f:
            json.dump(info, f)
        c = box.contain("cancel", "rw", "--op-id", "adopt", "--wait", "--json")
        ack = json.loads(c.stdout)
        assert ack["state"] != "REAPED" and c.returncode == 1, (ack, c.stderr)
        rec = box.record("rw")
        assert rec["state"] == "UNCONFIRMED", rec["state"]
        assert any("does not hold the run's worker" in n for n in rec["notes"] + [str(rec["containment"])]), rec
        assert all(_census.alive(pid, created) for pid, created in tree.items()), tree
    finally:
        out.close()
        for pid, created in tree.items():
            _census.kill(pid, created)
        decoy.remove()


def test_job_held_after_its_worker_exited_is_killed_but_not_called_reaped(box: Box) -> None:
    """contain killed, then the worker exits while a grandchild that copied
    the job handle out of contain keeps the job (and itself) alive.
    `contain cancel` opens the job by name and kills what is in it (the
    census: the grandchild is gone), but with the worker gone nothing but
    run.json, which the tree can rewrite, says this job is the run's: the
    run ends EXITED, `descendants_exit` null with that reason, never REAPED.
    Before: UNCONFIRMED, nothing signalled, the grandchild alive."""
    out = open(os.path.join(box.dir, "contain.out"), "w")
    tree: dict[int, int] = {}
    try:
        run = subprocess.Popen([*CONTAIN, "run", "--id", "gx", "--", *child("steal_below", box.dir, "gx")],
                               env=box.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        try:
            tree = {**_census.wait_marks(box.dir, "gx", 1), **_census.wait_marks(box.dir, "gx-thief", 1),
                    **_census.wait_marks(box.dir, "gx-thief-gc", 1)}
        finally:
            run.kill()
            run.wait(timeout=LONG)
        with open(os.path.join(box.dir, "gx-thief.result")) as f:
            assert f.read().split()[:1] == ["stole"]
        worker = _census.marks(box.dir, "gx")
        open(os.path.join(box.dir, "gx.go"), "w").close()
        assert _census.wait_gone(worker) == []
        held = {**_census.marks(box.dir, "gx-thief"), **_census.marks(box.dir, "gx-thief-gc")}
        assert all(_census.alive(pid, created) for pid, created in held.items()), held
        c = box.contain("cancel", "gx", "--op-id", "adopt", "--wait", "--json")
        ack = json.loads(c.stdout)
        assert ack["state"] == "EXITED", (ack, c.stderr)
        assert _census.wait_gone(held) == []
    finally:
        out.close()
        for pid, created in tree.items():
            _census.kill(pid, created)
    rec = box.record("gx")
    ev = rec["evidence"]
    assert ev["container_empty"]["observed"] is True, ev["container_empty"]
    assert ev["descendants_exit"]["observed"] is None, ev["descendants_exit"]
    wall = rec["containment"]["walls"][0]
    assert wall["unleavable"] is False and "run.json" in str(wall["leavable_because"]), wall
    assert [s["via"] for s in steps(rec)][-1].startswith("TerminateJobObject"), steps(rec)
