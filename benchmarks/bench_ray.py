"""Cost per Ray task of a contained command against plain subprocess.run.

    python benchmarks/bench_ray.py [--rounds N] [--argv CMD...] [--json PATH]

On a local one-node Ray cluster (`ray.init()`), one task at a time (submit,
`ray.get`), four kinds of task, one of each in turn, so that load from the
rest of the machine falls on all of them alike:

    empty        a task that returns at once (Ray's own cost per task)
    plain        subprocess.run(argv) in the task
    library      launcher.run(argv) in the task (what launcher.ray.run wraps)
    contained    launcher.ray.run(argv) in the task (die_with_owner on when
                 the engine has it, in both; the output says which)

Reported for each: the median (p10, p90) of the whole task (submit to
result in hand) and of the command alone (timed inside the task), and the
ratios contained/plain of the medians; the load average before and after.
Runs go to a private state directory and a private cgroup base (the Ray
workers inherit both at ray.init), removed at the end. Needs root and
cgroup v2 (as the other benchmarks), and `pip install 'ray>=2.9'`.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH = 10


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="tasks per kind / %d (default 10)" % BATCH)
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("argv", nargs="*", default=["/bin/true"], help="the command (default /bin/true)")
    args = ap.parse_args()

    import ray

    import launcher

    top = tempfile.mkdtemp(prefix="contain-bench-ray-")
    from launcher._platform import cgroups

    base = os.path.join(cgroups.hierarchies()[0].mount, f"contain-bench-ray-{secrets.token_hex(4)}")
    os.mkdir(base)
    os.environ["CONTAIN_STATE_DIR"] = os.path.join(top, "state")
    os.environ["CONTAIN_CGROUP_BASE"] = base
    os.environ["CONTAIN_KEEP_RUNS"] = "200"
    os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    try:
        launcher.run(["true"], die_with_owner=True)
        dwo = True
    except TypeError:
        dwo = False
    load_before = _loadavg()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote
        def empty() -> float:
            return 0.0

        @ray.remote
        def plain(argv: list[str]) -> float:
            t = time.perf_counter()
            subprocess.run(argv, check=True)
            return time.perf_counter() - t

        @ray.remote
        def contained(argv: list[str], dwo: bool) -> float:
            import launcher.ray as cray

            t = time.perf_counter()
            rec = cray.run(argv, die_with_owner=dwo, check=True)
            took = time.perf_counter() - t
            assert rec["state"] == "REAPED", rec["state"]
            return took

        @ray.remote
        def library(argv: list[str], dwo: bool) -> float:
            t = time.perf_counter()
            rec = launcher.run(argv, check=True, **({"die_with_owner": True} if dwo else {}))
            took = time.perf_counter() - t
            assert rec.state == "REAPED", rec.state
            return took

        kinds = {"empty": lambda: empty.remote(), "plain": lambda: plain.remote(args.argv),
                 "library": lambda: library.remote(args.argv, dwo),
                 "contained": lambda: contained.remote(args.argv, dwo)}
        for make in kinds.values():               # warm: one worker imported what each kind needs
            for _ in range(3):
                ray.get(make())
        task: dict[str, list[float]] = {k: [] for k in kinds}
        inner: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(args.rounds * BATCH):
            for k, make in kinds.items():     # one task of each kind in turn: a load spike falls on all alike
                t = time.perf_counter()
                took = ray.get(make())
                task[k].append(time.perf_counter() - t)
                inner[k].append(took)
    finally:
        ray.shutdown()
        load_after = _loadavg()
        with open(os.path.join(base, "cgroup.kill"), "w") as f:
            f.write("1")
        for d, _dirs, _files in sorted(os.walk(base, topdown=False), key=lambda t: -len(t[0])):
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except OSError:
                    time.sleep(0.01)
        shutil.rmtree(top, ignore_errors=True)

    out: dict[str, Any] = {"argv": args.argv, "die_with_owner": dwo, "tasks_per_kind": len(task["plain"]),
                           "loadavg_before": load_before, "loadavg_after": load_after, "kinds": {}}
    print(f"argv {args.argv}, {len(task['plain'])} tasks per kind, one at a time, kinds in turn; "
          f"die_with_owner {'on' if dwo else 'OFF (not in this engine yet)'}")
    print(f"load average before {load_before}, after {load_after}")
    print(f"{'kind':10} {'task median':>12} {'p10':>8} {'p90':>8} {'command median':>15}  (ms)")
    for k in kinds:
        m, mi = statistics.median(task[k]) * 1e3, statistics.median(inner[k]) * 1e3
        out["kinds"][k] = {"task_ms": {"median": m, "p10": _pct(task[k], 0.1) * 1e3, "p90": _pct(task[k], 0.9) * 1e3},
                           "command_ms": {"median": mi}}
        print(f"{k:10} {m:12.2f} {_pct(task[k], 0.1) * 1e3:8.2f} {_pct(task[k], 0.9) * 1e3:8.2f} {mi:15.2f}")
    ct, pt = out["kinds"]["contained"]["task_ms"]["median"], out["kinds"]["plain"]["task_ms"]["median"]
    cc, pc = out["kinds"]["contained"]["command_ms"]["median"], out["kinds"]["plain"]["command_ms"]["median"]
    out["ratio_task"], out["ratio_command"] = ct / pt, cc / pc
    print(f"contained/plain: per task {ct / pt:.2f}x (+{ct - pt:.2f} ms), per command {cc / pc:.2f}x (+{cc - pc:.2f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
