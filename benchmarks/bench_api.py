"""Per-run cost of the library's paths, for /bin/true.

    python benchmarks/bench_api.py [--runs N] [--json PATH]

Paths, each timed per run from the call to the final record in hand:

    subprocess.run     no container (reference: the cost of a process)
    launcher.run       sync, the owner loop in the calling thread
    spawn().wait()     sync, the owner loop in a Worker thread
    open_worker/asyncio, open_worker/trio
                       async, the owner loop as a task of the event loop

The paths are interleaved in rounds of 10 runs, so that load from the rest
of the machine falls on all of them alike. Reported: median, p10 and p90
in ms, and the async paths' median minus the sync median (their overhead).
Runs go to a private state directory and a private cgroup base, both
removed at the end. Needs root (for the cgroup base) and cgroup v2.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import anyio  # noqa: E402

import launcher  # noqa: E402
from launcher._platform import linux  # noqa: E402

ARGV = ["/bin/true"]
BATCH = 10


def _sync_batch(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _async_batch(backend: str, n: int) -> list[float]:
    out: list[float] = []

    async def main() -> None:
        for _ in range(n):
            t = time.perf_counter()
            async with launcher.open_worker(ARGV) as w:
                rec = await w.wait()
            out.append(time.perf_counter() - t)
            assert rec.state == "REAPED"

    anyio.run(main, backend=backend)
    return out


def _check(rec: object) -> None:
    assert getattr(rec, "state") == "REAPED", rec


PATHS: dict[str, Callable[[int], list[float]]] = {
    "subprocess.run": lambda n: _sync_batch(lambda: subprocess.run(ARGV, check=True), n),
    "launcher.run": lambda n: _sync_batch(lambda: _check(launcher.run(ARGV)), n),
    "spawn().wait()": lambda n: _sync_batch(lambda: _check(launcher.spawn(ARGV).wait()), n),
    "open_worker/asyncio": lambda n: _async_batch("asyncio", n),
    "open_worker/trio": lambda n: _async_batch("trio", n),
}


def _stats(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=10)
    return {"median_ms": statistics.median(xs) * 1e3, "p10_ms": q[0] * 1e3, "p90_ms": q[-1] * 1e3,
            "mean_ms": statistics.fmean(xs) * 1e3, "n": len(xs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=500, help="runs per path (default 500)")
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "api.json"))
    args = ap.parse_args()

    hs = linux.hierarchies()
    if os.geteuid() != 0 or not hs:
        print("needs root and a cgroup v2 mount", file=sys.stderr)
        return 2
    base = os.path.join(hs[0].mount, f"contain-bench-api-{secrets.token_hex(4)}")
    os.mkdir(base)
    state = tempfile.mkdtemp(prefix="contain-bench-api-")
    os.environ.update(CONTAIN_CGROUP_BASE=base, CONTAIN_STATE_DIR=state)
    for k in ("CONTAIN_RUN_CGROUP", "CONTAIN_RUN_DIR"):
        os.environ.pop(k, None)
    times: dict[str, list[float]] = {k: [] for k in PATHS}
    try:
        for fn in PATHS.values():                    # warm-up: imports, caches, the inotify pool
            fn(3)
        rounds = max(1, args.runs // BATCH)
        for _ in range(rounds):
            for name, fn in PATHS.items():
                times[name] += fn(BATCH)
    finally:
        for d, _s, _f in sorted(os.walk(base, topdown=False), key=lambda t: -len(t[0])):
            try:
                os.rmdir(d)
            except OSError as e:
                print(f"could not remove {d}: {e}", file=sys.stderr)
        shutil.rmtree(state, ignore_errors=True)

    stats = {k: _stats(v) for k, v in times.items()}
    sync = stats["launcher.run"]["median_ms"]
    for k in ("spawn().wait()", "open_worker/asyncio", "open_worker/trio"):
        stats[k]["overhead_vs_launcher.run_ms"] = stats[k]["median_ms"] - sync
    width = max(map(len, stats))
    print(f"{'path':<{width}}  {'median':>8}  {'p10':>8}  {'p90':>8}  {'vs sync':>8}   (ms a run of /bin/true, "
          f"n={rounds * BATCH} each)")
    for k, s in stats.items():
        extra = s.get("overhead_vs_launcher.run_ms")
        vs = f"{extra:+8.3f}" if extra is not None else f"{'':>8}"
        print(f"{k:<{width}}  {s['median_ms']:8.3f}  {s['p10_ms']:8.3f}  {s['p90_ms']:8.3f}  {vs}")
    result = {
        "benchmark": "api per-run overhead, /bin/true",
        "host": {"kernel": platform.release(), "python": platform.python_version(), "cpus": os.cpu_count(),
                 "state_dir_fs": _fs_type(tempfile.gettempdir())},
        "runs_per_path": rounds * BATCH,
        "paths": stats,
        "async_overhead_vs_sync_median_ms": {
            "asyncio": stats["open_worker/asyncio"]["overhead_vs_launcher.run_ms"],
            "trio": stats["open_worker/trio"]["overhead_vs_launcher.run_ms"],
        },
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"wrote {args.json}")
    return 0


def _fs_type(path: str) -> str:
    best, fs = "", "?"
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if path.startswith(parts[1]) and len(parts[1]) > len(best):
                best, fs = parts[1], parts[2]
    return fs


if __name__ == "__main__":
    sys.exit(main())
