"""Parsing the limits and the kernel's cgroup files (fixtures from real hosts)."""
from __future__ import annotations

import os

import pytest

from launcher import _controllers as C
from launcher import _runcgroups as R
from launcher import _limits as L
from launcher import _procfs as P

DATA = os.path.join(os.path.dirname(__file__), "data", "cgroup")


@pytest.mark.parametrize("text, want", [
    ("268435456", 268435456), ("256M", 256 << 20), ("256m", 256 << 20), ("1.5G", 3 << 29),
    ("64K", 64 << 10), ("2T", 2 << 40), ("256MiB", 256 << 20), ("100B", 100), (" 8M ", 8 << 20),
])
def test_sizes(text, want):
    assert L.parse_bytes(text) == want


@pytest.mark.parametrize("text", ["", "0", "-1", "12Q", "M", "1e9", "max", "9999999T"])
def test_bad_sizes_are_usage_errors(text):
    with pytest.raises(ValueError):
        L.parse_bytes(text)


def test_pids():
    assert L.parse_pids("64") == 64
    for bad in ("0", "-3", "x", "1.5", str(1 << 31)):
        with pytest.raises(ValueError):
            L.parse_pids(bad)


@pytest.mark.parametrize("text, quota, period", [
    ("0.5", 50_000, 100_000), ("2", 200_000, 100_000), ("150%", 150_000, 100_000),
    ("50000 100000", 50_000, 100_000), ("20000 50000", 20_000, 50_000),
])
def test_cpu_max_spellings(text, quota, period):
    cm = L.parse_cpu_max(text)
    assert (cm.quota_us, cm.period_us) == (quota, period)
    assert cm.to_dict()["spelled"] == text


@pytest.mark.parametrize("text", ["max 100000", "0", "0.001", "50000", "1 2 3", "500 100000", "1000 10",
                                  "abc", "-1"])
def test_bad_cpu_max(text):
    with pytest.raises(ValueError):
        L.parse_cpu_max(text)


def test_limits_say_what_was_asked():
    lim = L.Limits(memory_max=1 << 20, cpu_max=L.parse_cpu_max("0.5"))
    assert lim.controllers() == ["memory", "cpu"]
    assert lim.asked() == {"memory_max_bytes": 1 << 20, "cpu_max": {"quota_us": 50_000, "period_us": 100_000,
                                                                    "cpus": 0.5, "spelled": "0.5"}}
    assert not L.Limits()


def test_v1_hierarchies_from_a_hybrid_mountinfo():
    hs = C.v1_hierarchies(os.path.join(DATA, "mountinfo.hybrid"))
    by = {h.name: h for h in hs}
    assert sorted(by) == ["cpu", "cpuacct", "memory", "pids"]       # name=systemd has no controller
    assert by["memory"].mount == "/sys/fs/cgroup/memory"            # the root mount, not the bind of a subtree
    assert by["memory"].fs_path("/contain/run-a") == "/sys/fs/cgroup/memory/contain/run-a"


def test_v1_hierarchies_co_mounted_and_mounted_below_the_root():
    hs = {h.name: h for h in C.v1_hierarchies(os.path.join(DATA, "mountinfo.comounted"))}
    assert "cpu,cpuacct" in hs and hs["cpu,cpuacct"].controllers == {"cpu", "cpuacct"}
    mem = hs["memory"]
    assert mem.root == "/kubepods/pod1"
    assert mem.fs_path("/kubepods/pod1/contain/run-a") == "/sys/fs/cgroup/memory/contain/run-a"
    assert mem.cg_path("/sys/fs/cgroup/memory/contain") == "/kubepods/pod1/contain"
    with pytest.raises(ValueError):
        mem.fs_path("/elsewhere")


def test_proc_cgroup_parse():
    got = P.parse_cgroups(open(os.path.join(DATA, "proc-cgroup.hybrid")).read())
    assert got == {"pids": "/", "memory": "/process_api/0ae91150b661f5aba44cdfd931b6f95f",
                   "cpu,cpuacct": "/x", "": "/"}


def test_v1_base_nests_a_run_started_inside_a_run():
    h = C.V1Hierarchy(["memory"], "/sys/fs/cgroup/memory", "/")
    env = {"CONTAIN_CGROUP_V1_BASE": "/contain-t"}
    parent, why, is_base = C.v1_base_for(h, env, {"memory": "/contain-t/run-a-0123abcd"})
    assert (parent, is_base) == ("/contain-t/run-a-0123abcd", False) and "nested" in why
    parent, why, is_base = C.v1_base_for(h, env, {"memory": "/process_api/x"})
    assert (parent, is_base) == ("/contain-t", True)
    parent, why, _ = C.v1_base_for(h, {"CONTAIN_CGROUP_V1_BASE": "relative"}, {})
    assert parent is None and "absolute" in why


def test_run_names_are_checked():
    with pytest.raises(ValueError):
        R.RunCgroups.create("../../process_api", None, v2_dir=None, env={"CONTAIN_CGROUP_V1": "off"})
