"""The pure parts of the Job Object limits (launcher/_platform/winlimits.py):
the cpu.max -> CpuRate conversion and the shape of `limits.hit`. What the
kernel does with them is tests_windows/test_limits.py's (under Wine)."""
from __future__ import annotations

import pytest

from launcher._limits import CpuMax, Limits, parse_cpu_max
from launcher._platform import winlimits as W


@pytest.mark.parametrize("spelled,ncpus,rate", [
    ("0.5", 2, 2500),            # half a CPU of two: a quarter of the machine
    ("1", 1, 10000),
    ("2", 2, 10000),             # all of them: exact, no note
    ("0.01", 2, 50),             # the smallest --cpu-max
    ("50000 100000", 4, 1250),   # cpu.max's own syntax: the period only scales the quota
    ("33333 100000", 3, 1111),   # 1111.1: rounded down, never looser than asked
    ("150%", 8, 1875),
])
def test_cpu_rate_is_the_share_of_all_processors(spelled: str, ncpus: int, rate: int) -> None:
    got, note = W.cpu_rate(parse_cpu_max(spelled), ncpus)
    assert got == rate and note is None
    cm = parse_cpu_max(spelled)
    assert got * ncpus / 10000 <= cm.cpus + 1e-9    # the effective cap is at most what was asked


def test_cpu_rate_beyond_the_machine_caps_nothing_and_says_so() -> None:
    got, note = W.cpu_rate(parse_cpu_max("3"), 2)
    assert got == 10000 and note is not None and "caps nothing" in note


def test_cpu_rate_below_the_smallest_rate_is_one_and_says_so() -> None:
    got, note = W.cpu_rate(CpuMax(1000, 1_000_000), 64)    # 0.001 CPU of 64: 0.16 of a rate unit
    assert got == 1 and note is not None and "CpuRate 1" in note


def test_cpu_rate_needs_a_processor() -> None:
    with pytest.raises(ValueError):
        W.cpu_rate(parse_cpu_max("1"), 0)


def test_hits_never_say_false_for_a_limit_that_was_asked() -> None:
    lim = Limits(memory_max=1 << 26, pids_max=4)
    h = W.hits(lim, {"job_memory_limit": 0, "job_process_limit": 0})
    assert set(h) == {"oom_kill", "memory_max", "pids_max"}          # _accounting.limit_hits' keys
    assert h["memory_max"]["observed"] is None and "not observed" in h["memory_max"]["detail"]
    assert h["pids_max"]["observed"] is None and "not observed" in h["pids_max"]["detail"]
    assert h["oom_kill"]["observed"] is None
    h = W.hits(lim, {"job_memory_limit": 2, "job_process_limit": 1})
    assert h["memory_max"] == {"observed": True, "via": "JOB_OBJECT_MSG_JOB_MEMORY_LIMIT on the job's completion port",
                               "detail": {"messages": 2}}
    assert h["pids_max"]["observed"] is True


def test_a_limit_not_asked_cannot_have_been_hit() -> None:
    h = W.hits(Limits(pids_max=4), {"job_memory_limit": 0, "job_process_limit": 0})
    assert h["memory_max"]["observed"] is False and h["memory_max"]["via"] == "no limit on the job"
