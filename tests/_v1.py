"""The v1 cgroups (memory, pids) a test's runs made: where they are mounted,
which belong to a run, and their clean-up by the test's own run ids."""
from __future__ import annotations

import os


def v1_dirs() -> list[str]:
    """The `contain/` directories of the v1 memory and pids hierarchies, as
    mounted (read from mountinfo, never assumed)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = right.split()
            if len(fields) < 3 or fields[0] != "cgroup":
                continue
            opts = fields[2].split(",")
            if "memory" in opts or "pids" in opts:
                out.append(os.path.join(left.split()[4], "contain"))
    return out


def v1_of(run_id: str) -> list[str]:
    """The v1 cgroups made for the run `run_id` (named run-<id>-<hex>)."""
    found = []
    for d in v1_dirs():
        try:
            names = os.listdir(d)
        except OSError:
            continue
        found += [os.path.join(d, n) for n in names if n.startswith(f"run-{run_id}-")]
    return sorted(found)


def remove_v1_of(run_id: str) -> None:
    """Clean-up: only cgroups named after this test's own run ids, and only
    when empty (rmdir fails on a cgroup with a task)."""
    for d in v1_of(run_id):
        for sub, _dirs, _files in sorted(os.walk(d, topdown=False), key=lambda t: -len(t[0])):
            try:
                os.rmdir(sub)
            except OSError:
                pass
