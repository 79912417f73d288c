"""--stats-json: one documented JSON line per run, appended safely."""
from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from launcher._stats import SCHEMA, append_stats, stats_line

ACCT = {
    "taken_at": "2026-12-01T10:00:00.000000Z",
    "wall_s": {"value": 1.5, "source": "monotonic clock, spawn to container observed empty"},
    "cpu_usec": {"value": 1_250_000, "source": "cgroup2 x/cpu.stat usage_usec"},
    "cpu_user_usec": {"value": 1_000_000, "source": "cgroup2 x/cpu.stat user_usec"},
    "cpu_system_usec": {"value": 250_000, "source": "cgroup2 x/cpu.stat system_usec"},
    "memory_peak_bytes": {"value": 209_715_200, "source": "cgroup1 y/memory.max_usage_in_bytes"},
    "oom_kills": {"value": 0, "source": "cgroup1 y/memory.oom_control oom_kill"},
    "tasks_peak": {"value": 3, "source": "cgroup1 z/pids.peak"},
    "io_read_bytes": {"value": None, "reason": "no io controller"},
    "io_write_bytes": {"value": None, "reason": "no io controller"},
}


def _record(**over):
    rec = {"run_id": "r1", "state": "REAPED", "outcome": "exited", "exit_code": 0, "signal": None,
           "accounting": ACCT,
           "limits": {"asked": {}, "applied": {}, "hit": {"oom_kill": {"observed": False},
                                                          "pids_max": {"observed": None}}},
           "evidence": {"redispatch_eligible": {"observed": True}}}
    rec.update(over)
    return rec


def test_line_is_compact_flat_and_keeps_nulls_with_reasons():
    line = stats_line(_record())
    assert "\n" not in line and ", " not in line
    d = json.loads(line)
    assert d["schema"] == SCHEMA
    assert (d["wall_s"], d["cpu_s"], d["user_s"], d["sys_s"]) == (1.5, 1.25, 1.0, 0.25)
    assert d["mem_peak_bytes"] == 209_715_200 and d["tasks_peak"] == 3 and d["oom_kills"] == 0
    assert d["io_read_bytes"] is None and d["null"]["io_read_bytes"] == "no io controller"
    assert d["limit_hit"] == {"oom_kill": False, "pids_max": None}
    assert d["redispatch_eligible"] is True
    assert "cpu_s" not in d["null"]


def test_record_without_accounting_is_all_null_never_zero():
    d = json.loads(stats_line(_record(accounting=None, limits=None, evidence={})))
    for k in ("wall_s", "cpu_s", "mem_peak_bytes", "tasks_peak", "oom_kills"):
        assert d[k] is None and d["null"][k] == "no accounting in the record"
    assert d["limit_hit"] is None and d["redispatch_eligible"] is None


def test_forged_values_do_not_pass_as_numbers():
    acct = dict(ACCT, cpu_usec={"value": "9999", "source": "x"}, tasks_peak={"value": True, "source": "x"})
    d = json.loads(stats_line(_record(accounting=acct)))
    assert d["cpu_s"] is None and d["tasks_peak"] is None


def test_append_adds_one_line_per_run(tmp_path):
    p = str(tmp_path / "stats.jsonl")
    append_stats(p, stats_line(_record(run_id="a")))
    append_stats(p, stats_line(_record(run_id="b")) + "\n")
    lines = open(p).read().splitlines()
    assert [json.loads(x)["run_id"] for x in lines] == ["a", "b"]
    assert os.stat(p).st_mode & 0o777 == 0o644


def test_symlinked_stats_path_is_not_followed(tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep\n")
    link = tmp_path / "stats.jsonl"
    link.symlink_to(target)
    with pytest.raises(OSError):
        append_stats(str(link), "{}")
    assert target.read_text() == "keep\n"


def test_fifo_stats_path_is_refused_at_once_without_a_reader_and_written_with_one(tmp_path):
    """As --record writes a FIFO in place (issue 31): with nobody reading,
    ENXIO at once (no hang); with a reader, the line goes to it."""
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    with pytest.raises(OSError):                    # no reader: ENXIO at once, no hang
        append_stats(fifo, "{}")
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        append_stats(fifo, "{}")
        assert os.read(r, 10) == b"{}\n"
    finally:
        os.close(r)


def test_directory_stats_path_is_refused(tmp_path):
    with pytest.raises(OSError):
        append_stats(str(tmp_path), "{}")


def _writer(path: str, tag: str, n: int) -> None:
    for i in range(n):
        append_stats(path, stats_line(_record(run_id=f"{tag}-{i}")))


def test_concurrent_appends_never_tear_a_line(tmp_path):
    p = str(tmp_path / "stats.jsonl")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(p, t, 200)) for t in "abc"]
    for x in procs:
        x.start()
    for x in procs:
        x.join(60)
        assert x.exitcode == 0
    ids = sorted(json.loads(line)["run_id"] for line in open(p))
    assert len(ids) == 600 and len(set(ids)) == 600
