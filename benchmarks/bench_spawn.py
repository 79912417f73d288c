"""Per-run cost of the library, in process: `launcher.run(['/bin/true'])`
(claim a run directory, make the cgroup, clone3 into it, wait, observe
`populated 0`, remove the cgroup, write the stop record) against
`os.posix_spawn` + `waitpid` and `subprocess.run`, alternating, medians.

    python benchmarks/bench_spawn.py [--repeats 200] [--state-dir DIR]

The state directory is made under DIR (default: the system temp dir, on
this host's disk); `--state-dir /dev/shm` gives the tmpfs figure.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

TARGET = 3.0   # issue 10: at most 3x posix_spawn + waitpid of /bin/true (issue 5 had asked 1.5x, before the wall,
#                the run cgroups and the verified run directory)


def run(repeats: int = 200, cgroup_base: str | None = None, state_dir: str | None = None) -> dict[str, Any]:
    if C.ROOT not in sys.path:
        sys.path.insert(0, C.ROOT)
    import launcher

    if not launcher.__file__.startswith(C.ROOT + os.sep):
        raise RuntimeError(f"launcher imported from {launcher.__file__}, not {C.ROOT}")
    state = tempfile.mkdtemp(prefix="contain-bench-state-", dir=state_dir)
    env = dict(os.environ)
    argv = ["/bin/true"]
    opts: dict[str, Any] = {"state_dir": state}
    if cgroup_base:
        opts["env"] = dict(env, CONTAIN_CGROUP_BASE=cgroup_base)
    states: dict[str, int] = {}

    def posix_spawn() -> None:
        pid = os.posix_spawn(argv[0], argv, env)
        os.waitpid(pid, 0)

    def sub_run() -> None:
        subprocess.run(argv)

    def lib_run() -> None:
        rec = launcher.run(argv, **opts)
        states[rec.state] = states.get(rec.state, 0) + 1

    def lib_run_no_wall() -> None:
        # No PID-namespace wall: a root run is REAPED through the escape
        # ledger instead (its escaper pass at the stop).
        rec = launcher.run(argv, pidns=False, **opts)
        key = "no-pidns " + rec.state
        states[key] = states.get(key, 0) + 1

    contenders: dict[str, Callable[[], None]] = {
        "os.posix_spawn + waitpid": posix_spawn,
        "subprocess.run": sub_run,
        "launcher.run (spawn, wait, observed empty, leaf removed)": lib_run,
    }
    if os.geteuid() == 0:     # a user's run without the wall has no container at all (degraded)
        contenders["launcher.run, --no-pidns (escape ledger, no wall)"] = lib_run_no_wall
    times: dict[str, list[float]] = {k: [] for k in contenders}
    load = [C.loadavg()]
    try:
        for f in contenders.values():
            f()
        states.clear()
        names = list(contenders)
        for i in range(repeats):
            for k in names[i % len(names):] + names[:i % len(names)]:
                t0 = time.perf_counter()
                contenders[k]()
                times[k].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    s = {k: C.summary(v) for k, v in times.items()}
    lib = s["launcher.run (spawn, wait, observed empty, leaf removed)"]
    out = {
        "repeats": repeats,
        "medians": s,
        "ratio_vs_posix_spawn": C.ratio(lib, s["os.posix_spawn + waitpid"]),
        "ratio_vs_subprocess": C.ratio(lib, s["subprocess.run"]),
        "target": TARGET,
        "record_states": states,
        "state_dir_under": state_dir or tempfile.gettempdir(),
        "loadavg_start_end": load + [C.loadavg()],
    }
    out["target_met"] = out["ratio_vs_posix_spawn"] is not None and out["ratio_vs_posix_spawn"] <= TARGET
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--state-dir", default=None, help="make the state directory under DIR (default: the temp dir)")
    a = ap.parse_args()
    print("; ".join(C.ensure_ready()))
    r = run(a.repeats, state_dir=a.state_dir)
    for k, v in r["medians"].items():
        print(f"{k:<60} {v['median_ms']:8.3f} ms")
    print(f"ratio vs posix_spawn {r['ratio_vs_posix_spawn']}  target <= {TARGET}; states {r['record_states']}")
    os.makedirs(C.RESULTS, exist_ok=True)
    with open(os.path.join(C.RESULTS, "spawn.json"), "w") as f:
        json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
