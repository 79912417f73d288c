"""Where one `launcher.run(['/bin/true'])` spends its time: `perf_counter`
marks around the steps of the run path (each wrapper costs about 1 us a
call), medians over many runs in one process, printed in the order the
steps happen, with the minor page faults the supervisor took per run.

    python benchmarks/bench_timeline.py [--repeats 200] [--state-dir DIR]

Without --state-dir the state lives in a fresh directory under /dev/shm
(tmpfs: no fsync, the CPU side alone); pass a directory on disk to see
what the file system adds. Nothing here is a target: it is the map
docs/performance.md ("Where launcher.run's time goes") was drawn from.
"""
from __future__ import annotations

import argparse
import collections
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

_marks: list[tuple[str, float]] = []


def _mark(name: str) -> None:
    _marks.append((name, time.perf_counter()))


def _wrap(owner: Any, name: str, label: str | None = None) -> None:
    f = getattr(owner, name, None)
    if f is None:
        return                      # a step this version does not have
    label = label or name

    def timed(*a: Any, **k: Any) -> Any:
        _mark(label + " >")
        try:
            return f(*a, **k)
        finally:
            _mark(label + " <")

    setattr(owner, name, timed)


class _TimedLib:
    """The cffi lib with the wall's clone timed (its attributes are read-only)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def __getattr__(self, k: str) -> Any:
        return getattr(self._lib, k)

    def ct_wall_spawn(self, *a: Any) -> Any:
        _mark("clone3 of the init >")
        try:
            return self._lib.ct_wall_spawn(*a)
        finally:
            _mark("clone3 of the init <")


def instrument() -> None:
    from launcher import _containers, _escapes, _evidence, _launch, _layout, _run, _usage
    from launcher._platform import linux, pidwall, wall

    for owner, name, label in [
        (_layout.RunDir, "claim", "claim"), (_launch, "make_container", "make_container"),
        (_usage.RunUsage, "create", "v1 cgroups"), (_run.Run, "open_channels", "open_channels"),
        (_launch, "spawn_request", "spawn_request"), (_evidence.RunEvidence, "run_info", "run_info"),
        (_evidence.RunEvidence, "bind_tags", "bind_tags"), (_layout.RunDir, "write_run", "write_run"),
        (_launch, "cancelled_before_spawn", "turn before the spawn"), (_launch, "describe_wall", "describe_wall"),
        (pidwall.PidWall, "of", "PidWall.of"), (_usage.RunUsage, "spawned", "v1 placement"),
        (_evidence.RunEvidence, "spawned", "identity, placement, seal"), (_layout.RunDir, "journal", "journal"),
        (_run.Run, "publish", "publish"), (_run.Run, "turn", "turn"), (_run.Run, "finish", "finish"),
        (_usage.RunUsage, "finish", "accounting, v1 removal"), (linux.Container, "remove", "v2 removal"),
        (_escapes.EscapeWatch, "after_spawn", "escape watch"), (_containers, "make_container", None),
        (linux.Container, "cpu_stat", "cpu.stat"), (_layout.RunDir, "release_and_poke", "release, last poke"),
        (_layout.RunDir, "write_record", "write_record"),
    ]:
        _wrap(owner, name, label)
    wall.lib = _TimedLib(wall.lib)
    orig: Callable[[int], Any] = wall.read_init_events

    def events(fd: int) -> Any:
        got = orig(fd)
        if got:
            _mark("init said " + ",".join(type(e).__name__ for e in got))
        return got

    wall.read_init_events = events


def run(repeats: int = 200, state_dir: str | None = None) -> dict[str, Any]:
    if C.ROOT not in sys.path:
        sys.path.insert(0, C.ROOT)
    import launcher

    instrument()
    base = state_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    state = tempfile.mkdtemp(prefix="contain-timeline-", dir=base)
    seen: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    totals: list[float] = []
    try:
        for _ in range(20):
            launcher.run(["/bin/true"], state_dir=state)
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(repeats):
            _marks.clear()
            _mark("call")
            launcher.run(["/bin/true"], state_dir=state)
            _mark("returned")
            t0 = _marks[0][1]
            n: collections.Counter[str] = collections.Counter()
            for name, t in _marks:
                n[name] += 1
                seen[(name, n[name])].append((t - t0) * 1e3)
            totals.append((_marks[-1][1] - t0) * 1e3)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / repeats
    finally:
        shutil.rmtree(state, ignore_errors=True)
    steps = sorted(((statistics.median(v), k[0], k[1]) for k, v in seen.items() if len(v) >= repeats // 2))
    return {"repeats": repeats, "state_dir_fs": base or "default temp dir", "median_total_ms": statistics.median(totals),
            "minor_faults_per_run": faults, "steps": [{"at_ms": round(a, 3), "mark": m, "nth": i} for a, m, i in steps]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--state-dir", default=None, help="a directory to make the state directory in (default /dev/shm)")
    a = ap.parse_args()
    r = run(a.repeats, a.state_dir)
    for s in r["steps"]:
        print(f"{s['at_ms']:8.3f} ms  {s['mark']}" + (f" #{s['nth']}" if s["nth"] > 1 else ""))
    print(f"median total {r['median_total_ms']:.3f} ms; {r['minor_faults_per_run']:.0f} minor faults per run; "
          f"state under {r['state_dir_fs']}")


if __name__ == "__main__":
    main()
