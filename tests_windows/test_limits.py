"""`--memory-max`, `--pids-max`, `--cpu-max` on a Job Object (winlimits.py),
against the real Win32 API.

Two kinds of test:
- through launcher (Container.create, `contain run`, `launcher.run`): each
  limit is written, read back and recorded, or refused with 125 and the
  reason; never a run that goes on unlimited;
- on a raw job of the test's own (the C calls alone, no read-back), what the
  kernel enforces: a second process under ActiveProcessLimit 1, a big
  allocation under JobMemoryLimit, the CPU rate class. Where Wine does not
  enforce, the test says so in its skip reason, with what it measured.

Survival is the suite's own census (_census), never launcher's word.
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
from _job import Job, child

import launcher
from launcher._errors import ContainmentUnavailable
from launcher._limits import Limits, parse_cpu_max
from launcher._platform import windows, winlimits, winproc

WINE = _census.wine_version()
HERE = os.path.dirname(os.path.abspath(__file__))
CONTAIN = [sys.executable, os.path.join(HERE, "_contain.py")]
MB = 1 << 20
ERROR_ACCESS_DENIED = 5

LIMITS = {
    "memory": Limits(memory_max=64 * MB),
    "pids": Limits(pids_max=3),
    "cpu": Limits(cpu_max=parse_cpu_max("0.5")),
}


def result(d: str, tag: str, timeout: float = 30.0) -> str:
    path = os.path.join(d, f"{tag}.result")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return text
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"no {tag}.result within {timeout} s")


# -- through launcher --------------------------------------------------------


@pytest.mark.parametrize("which", sorted(LIMITS))
def test_limit_is_read_back_or_the_job_is_refused(which: str) -> None:
    """Container.create writes the limit with its full handle, reads it back
    with the kept one, and records what holds; or refuses with the reason."""
    lim = LIMITS[which]
    try:
        c = windows.Container.create(f"lim-{which}-{os.getpid()}", lim)
    except ContainmentUnavailable as e:
        reason = e.reason
        flag = f"--{ {'memory': 'memory-max', 'pids': 'pids-max', 'cpu': 'cpu-max'}[which] }"
        assert reason.startswith(f"{flag} cannot be applied to the Job Object"), reason
        if WINE is None:
            raise AssertionError(f"Windows refused {flag}: {reason}")
        # Wine 8: the extended limits are accepted but the query reads them
        # all 0, and the CPU rate class is refused (87): refused, saying why.
        if which == "cpu":
            assert "JobObjectCpuRateControlInformation" in reason, reason
        else:
            assert "read back" in reason and "KILL_ON_JOB_CLOSE" in reason, reason
        pytest.skip(f"Wine {WINE}: {flag} refused as it must be ({reason}); the applied path needs Windows")
    try:
        assert c.job_limits is not None
        rec = c.limits_record()
        assert rec is not None and rec["asked"] == lim.asked()
        key = {"memory": "memory_max_bytes", "pids": "pids_max", "cpu": "cpu_max"}[which]
        applied = rec["applied"][key]
        assert applied["via"] == "job-object" and applied["read_back"], applied
        if which == "memory":
            assert 64 * MB - 65536 <= applied["value"] <= 64 * MB
        elif which == "pids":
            assert applied["value"] == 3 and applied["read_back"]["ActiveProcessLimit"] == 3
        else:
            assert applied["read_back"]["CpuRate"] == applied["cpu_rate"] >= 1
        # The kept handle cannot lift them (the limits guard).
        from launcher._native import lib

        assert lib.ct_job_set_limits(c.job, 0, 0) == ERROR_ACCESS_DENIED
    finally:
        c.remove()


def test_the_kept_handle_cannot_set_or_lift_a_limit() -> None:
    """A worker that steals the owner's handle (it can: same user) gets no
    more than JOB_OBJECT_SET_ATTRIBUTES-less access, so it cannot write the
    extended limits (rewriting them without JOB_MEMORY would lift a memory
    limit) nor the CPU rate: the limits are written before ct_job_restrict."""
    from launcher._native import lib

    c = windows.Container.create(f"kept-{os.getpid()}")
    try:
        assert lib.ct_job_set_limits(c.job, 0, 0) == ERROR_ACCESS_DENIED
        assert lib.ct_job_set_limits(c.job, 1 << 40, 1 << 20) == ERROR_ACCESS_DENIED
        rc = lib.ct_job_set_cpu_rate(c.job, 10000)
        # Wine refuses the class itself (87) before looking at the handle.
        assert rc == ERROR_ACCESS_DENIED or (WINE is not None and rc == 87), rc
    finally:
        c.remove()


def test_a_limit_message_on_the_port_is_counted_as_a_hit(helpers) -> None:  # type: ignore[no-untyped-def]
    """The owner's Waiter counts JOB_OBJECT_MSG_JOB_MEMORY_LIMIT (10) and
    _ACTIVE_PROCESS_LIMIT (3) packets carrying the job's key, and the record's
    `hit` says true for them; without one it says null ("not observed"),
    never false. The packets are posted by the test with the job's key, as
    the kernel posts them: Wine never does (it enforces neither limit)."""
    from launcher._native import lib

    job = Job(helpers.dir)
    try:
        job.c.waiter = job.w
        lim = Limits(memory_max=64 * MB, pids_max=2)
        none = winlimits.hits(lim, job.c.limit_messages())
        assert none["memory_max"]["observed"] is None and "not observed" in none["memory_max"]["detail"]
        assert none["pids_max"]["observed"] is None
        assert lib.ct_sync_post(job.c.port, job.c.key, 10) == 0
        assert lib.ct_sync_post(job.c.port, job.c.key, 3) == 0
        assert lib.ct_sync_post(job.c.port, job.c.key, 3) == 0
        job.w.wait(5)
        assert job.c.limit_messages() == {"job_memory_limit": 1, "job_process_limit": 2}
        got = winlimits.hits(lim, job.c.limit_messages())
        assert got["memory_max"] == {"observed": True, "via": f"{winlimits.MSG_MEMORY} on the job's completion port",
                                     "detail": {"messages": 1}}
        assert got["pids_max"]["observed"] is True and got["pids_max"]["detail"] == {"messages": 2}
        # A limit not asked for cannot have been hit.
        assert winlimits.hits(Limits(), job.c.limit_messages())["memory_max"]["observed"] is False
    finally:
        job.c.waiter = None
        job.close()


def _contain(d: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CONTAIN_STATE_DIR=os.path.join(d, "state"))
    return subprocess.run([*CONTAIN, *args], env=env, capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("flag,value", [("--memory-max", "64M"), ("--pids-max", "4"), ("--cpu-max", "0.5")])
def test_contain_run_with_a_limit_applies_it_or_exits_125(helpers, flag: str, value: str) -> None:  # type: ignore[no-untyped-def]
    rec_path = os.path.join(helpers.dir, "record.json")
    r = _contain(helpers.dir, "run", flag, value, "--record", rec_path, "--", *child("exit", "0"))
    with open(rec_path) as f:
        rec = json.load(f)
    if r.returncode == 125:
        assert rec["outcome"] == "spawn_failed", json.dumps(rec, indent=1)
        assert rec["evidence"]["root_exit"]["observed"] is False        # no worker ever ran
        assert f"{flag} cannot be applied to the Job Object" in r.stderr, r.stderr
        assert any(f"{flag} cannot be applied" in n for n in rec["notes"]), rec["notes"]
        if WINE is None:
            raise AssertionError(f"Windows refused {flag}: {r.stderr}")
        pytest.skip(f"Wine {WINE}: {flag} {value} refused with 125 as it must be (Wine does not keep the limit)")
    assert r.returncode == 0, r.stderr
    assert rec["state"] == "REAPED"
    key = {"--memory-max": "memory_max_bytes", "--pids-max": "pids_max", "--cpu-max": "cpu_max"}[flag]
    assert rec["limits"]["applied"][key]["via"] == "job-object", rec["limits"]
    assert set(rec["limits"]["hit"]) == {"oom_kill", "memory_max", "pids_max"}


def test_doctor_says_which_limits_hold_here(helpers) -> None:  # type: ignore[no-untyped-def]
    r = _contain(helpers.dir, "doctor", "--json")
    caps = json.loads(r.stdout)
    lim = caps["limits"]
    assert set(lim) == {"--memory-max", "--pids-max", "--cpu-max"}, lim
    for flag, v in lim.items():
        assert v["ok"] is True or (v["ok"] is False and v["error"].startswith(f"{flag} cannot be applied")), v
    if WINE is not None:
        # Measured: Wine keeps none of them (see the raw-job tests below).
        assert not any(v["ok"] for v in lim.values()), lim
        assert any("refused here" in s for s in caps["next_steps"]), caps["next_steps"]
    human = _contain(helpers.dir, "doctor").stdout
    assert "limits          --memory-max" in human, human


def test_library_limits_apply_or_raise() -> None:
    """launcher.run(memory_max=...) never runs unlimited: a refused limit is
    a ContainmentUnavailable (or a spawn_failed record), never a plain run."""
    try:
        rec = launcher.run([sys.executable, "-c", "pass"], memory_max=64 * MB)
    except ContainmentUnavailable as e:
        assert "--memory-max cannot be applied" in e.reason
        if WINE is None:
            raise
        pytest.skip(f"Wine {WINE}: memory_max refused as it must be ({e.reason})")
    d = rec.to_dict()
    if d["outcome"] == "spawn_failed":
        assert WINE is not None, d
        assert any("--memory-max cannot be applied" in n for n in d["notes"]), d["notes"]
        pytest.skip(f"Wine {WINE}: memory_max refused as it must be (spawn_failed record)")
    assert d["limits"]["applied"]["memory_max_bytes"]["via"] == "job-object"


# -- what the kernel enforces: a raw job of the test's own --------------------


class RawJob:
    """A job with the limits written by the C calls alone, and its full
    handle kept (test only: launcher never keeps one), so that enforcement
    is measured whatever the query says."""

    def __init__(self, d: str, *, memory: int = 0, processes: int = 0) -> None:
        from launcher._native import ffi, lib

        self.dir = d
        job = ffi.new("uintptr_t*")
        assert lib.ct_job_create(job) == 0
        self.job = int(job[0])
        port = ffi.new("uintptr_t*")
        assert lib.ct_job_port_create(self.job, port) == 0
        self.port = int(port[0])
        self.set_rc = lib.ct_job_set_limits(self.job, memory, processes)
        self.process = 0
        self._logs: list[Any] = []

    def spawn(self, argv: list[str]) -> int:
        log = open(os.path.join(self.dir, f"raw-{len(self._logs)}.log"), "w")
        self._logs.append(log)
        sp, _via = winproc.spawn_into(self.job, windows.Request(argv, stdio=(-1, log.fileno(), log.fileno())))
        self.process = sp.handle
        return sp.pid

    def wait_root(self, timeout: float = 30.0) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            running, code = winproc.status(self.process)
            if not running:
                return code
            time.sleep(0.05)
        return None

    def limit_messages(self) -> dict[str, int]:
        """Drain the port: the job's limit messages (winsync's counters)."""
        from launcher._platform import winsync

        w = winsync.Waiter(self.port, job=self.job)
        try:
            w.wait(0.2)
            return {k: w.seen[k] for k in ("job_memory_limit", "job_process_limit")}
        finally:
            w.close()           # not the port: it was given, so it stays ours

    def close(self) -> None:
        from launcher._native import ffi, lib

        lib.ct_job_terminate(self.job, 137)
        acc = ffi.new("struct ct_job_accounting*")
        deadline = time.monotonic() + 15
        while lib.ct_job_accounting(self.job, acc) == 0 and acc.active and time.monotonic() < deadline:
            time.sleep(0.05)
        for h in (self.process, self.port, self.job):
            if h:
                lib.ct_job_close_take(h)
        for log in self._logs:
            log.close()


def test_active_process_limit_stops_a_second_process(helpers) -> None:  # type: ignore[no-untyped-def]
    """ActiveProcessLimit 1: the worker is the one; its child must not be made."""
    raw = RawJob(helpers.dir, processes=1)
    gap = None
    try:
        assert raw.set_rc == 0, f"SetInformationJobObject: {raw.set_rc}"
        raw.spawn(child("try_spawn", helpers.dir, "p"))
        said = result(helpers.dir, "p")
        assert raw.wait_root() == 0
        ran = _census.wait_marks(helpers.dir, "p-child", 1, timeout=10) if said.startswith("created") else {}
        if ran:
            # The census, not the worker's word, says the child ran.
            if WINE is None:
                raise AssertionError(f"a second process was created under ActiveProcessLimit 1: {said}")
            gap = (f"Wine {WINE} does not enforce ActiveProcessLimit: under a limit of 1 the worker created a "
                   f"second process ({said}), measured; launcher refuses --pids-max there")
        else:
            # Refused by CreateProcess, or made and ended by the job before it ran a line of Python.
            assert said.startswith(("refused", "created")), said
            assert _census.marks(helpers.dir, "p-child") == {}
            # Not guaranteed to arrive; the record says observed only when it does.
            assert raw.limit_messages()["job_process_limit"] >= 0
    finally:
        raw.close()
    assert _census.wait_gone({**_census.marks(helpers.dir, "p"), **_census.marks(helpers.dir, "p-child")}) == []
    if gap:
        pytest.skip(gap)


def test_job_memory_limit_makes_a_big_allocation_fail(helpers) -> None:  # type: ignore[no-untyped-def]
    """JobMemoryLimit 96 MiB: a 256 MiB allocation in the worker must fail."""
    raw = RawJob(helpers.dir, memory=96 * MB)
    gap = None
    try:
        assert raw.set_rc == 0, f"SetInformationJobObject: {raw.set_rc}"
        raw.spawn(child("try_alloc", helpers.dir, "m", "256"))
        said = result(helpers.dir, "m", timeout=60)
        assert raw.wait_root(60) == 0
        if said.startswith("allocated"):
            if WINE is None:
                raise AssertionError(f"256 MiB allocated under a 96 MiB JobMemoryLimit: {said}")
            gap = (f"Wine {WINE} does not enforce JobMemoryLimit: the worker committed and touched 256 MiB under "
                   f"a 96 MiB limit ({said}), measured; launcher refuses --memory-max there")
        else:
            assert said == "refused MemoryError", said
            assert raw.limit_messages()["job_memory_limit"] >= 0   # not guaranteed to arrive
    finally:
        raw.close()
    assert _census.wait_gone(_census.marks(helpers.dir, "m")) == []
    if gap:
        pytest.skip(gap)


def test_cpu_rate_hard_cap_is_accepted_and_read_back(helpers) -> None:  # type: ignore[no-untyped-def]
    """JobObjectCpuRateControlInformation ENABLE|HARD_CAP: written and read
    back on Windows (8 and later); Wine refuses the class."""
    from launcher._native import ffi, lib

    raw = RawJob(helpers.dir)
    try:
        rc = lib.ct_job_set_cpu_rate(raw.job, 5000)
        if rc != 0:
            if WINE is not None:
                pytest.skip(f"Wine {WINE} refuses JobObjectCpuRateControlInformation (error {rc}), measured: "
                            "no CPU cap, so launcher refuses --cpu-max there")
            raise AssertionError(f"SetInformationJobObject(CpuRateControl) refused: {rc}")
        flags, rate = ffi.new("uint32_t*"), ffi.new("uint32_t*")
        assert lib.ct_job_read_cpu_rate(raw.job, flags, rate) == 0
        assert int(rate[0]) == 5000 and int(flags[0]) & 0x5 == 0x5
    finally:
        raw.close()
