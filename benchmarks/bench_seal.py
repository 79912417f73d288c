"""What the seal adds to a spawn, and what the fork ledger adds to a run's start.

    python benchmarks/bench_seal.py [--repeats 200]

Spawn cost: `/bin/true` cloned straight into a fresh scratch leaf under the
cgroup base, timed from the clone to the exec (posix.spawn returns once the
child has exec'd), interleaved: plain, `--user nobody` (the uid seal: only
setresuid), and the namespace seal of `--seal` (new mount, cgroup and user
namespaces, cgroup2 mount replaced, capabilities dropped, no_new_privs).

Ledger cost: `Run.start()` (claim the run directory, make the container,
spawn) of `/bin/true` with CONTAIN_LEDGER=off and on, interleaved; then
`Ledger.open()` alone, and for comparison pyroute2's ProcEventSocket
(import in a fresh interpreter, bind, subscribe), which the ledger does not
use because of that import.

Needs root. Every scratch leaf is created here and removed here (in a
finally), every child is reaped by its pidfd; run directories go to a
temporary state directory that is removed at the end. Writes
benchmarks/results/seal.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "seal.json"

from launcher._platform import linux, posix  # noqa: E402


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1000, 3),
            "p10_ms": round(xs[len(xs) // 10] * 1000, 3),
            "p90_ms": round(xs[len(xs) * 9 // 10] * 1000, 3), "n": len(xs)}


def _spawn_once(base: str, **kw: Any) -> float:
    leaf = os.path.join(base, f"bench-seal-{os.getpid()}-{secrets.token_hex(3)}")
    os.mkdir(leaf)
    try:
        fd = os.open(leaf, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            req = posix.SpawnRequest(["/bin/true"], env={"PATH": "/usr/bin:/bin"}, **kw)
            t0 = time.perf_counter()
            sp = posix.spawn(req, cgroup_fd=fd)
            dt = time.perf_counter() - t0
        finally:
            os.close(fd)
        os.waitid(os.P_PIDFD, sp.pidfd, os.WEXITED)
        os.close(sp.pidfd)
        return dt
    finally:
        for _ in range(200):
            try:
                os.rmdir(leaf)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.002)


def bench_spawn(repeats: int) -> dict[str, Any]:
    _h, base = linux.resolve_base()
    cg2, v1 = linux.cgroup_mounts()
    import pwd

    nobody = pwd.getpwnam("nobody")
    kinds = {
        "plain": {},
        "uid_seal_nobody": {"uid": nobody.pw_uid, "gid": nobody.pw_gid, "groups": [nobody.pw_gid]},
        "namespace_seal": {"seal_ro_paths": v1, "seal_cg2_paths": cg2, "seal_userns": True,
                           "drop_caps": linux.SEAL_DROP_CAPS, "no_new_privs": True},
        "namespace_seal_without_userns": {"seal_ro_paths": v1, "seal_cg2_paths": cg2,
                                          "drop_caps": linux.SEAL_DROP_CAPS, "no_new_privs": True},
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for k, kw in kinds.items():       # warm-up
        _spawn_once(base, **kw)
    order = list(kinds)
    rng = random.Random(4)
    for _ in range(repeats):
        # Whatever runs first in a round is slower here (the previous leaf's
        # removal is still settling): shuffle so no kind always pays it.
        rng.shuffle(order)
        for k in order:
            times[k].append(_spawn_once(base, **kinds[k]))
    out = {k: _stats(v) for k, v in times.items()}
    for k in kinds:
        # Paired within each round (same moment, same load), then the median:
        # a shared machine's load drifts between rounds, not within one.
        diffs = [a - b for a, b in zip(times[k], times["plain"])]
        out[k]["added_vs_plain_ms"] = round(statistics.median(diffs) * 1000, 3)
    return out


def bench_ledger(repeats: int) -> dict[str, Any]:
    from launcher._ledger import Ledger
    from launcher._run import Options, Run

    state = tempfile.mkdtemp(prefix="bench-seal-state-")
    times: dict[str, list[float]] = {"off": [], "on": []}
    try:
        rng = random.Random(5)
        for i in range(repeats + 1):
            for mode in rng.sample(["off", "on"], 2):
                env = {"PATH": "/usr/bin:/bin", "CONTAIN_LEDGER": mode}
                run = Run(["/bin/true"], options=Options(state_dir=state, env=env, grace=0.0))
                t0 = time.perf_counter()
                run.start()
                dt = time.perf_counter() - t0
                run.supervise()
                if i:          # the first round warms caches
                    times[mode].append(dt)
        opens = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            led = Ledger.open()
            opens.append(time.perf_counter() - t0)
            led.close()
    finally:
        shutil.rmtree(state, ignore_errors=True)
    out: dict[str, Any] = {"run_start_ledger_off": _stats(times["off"]),
                           "run_start_ledger_on": _stats(times["on"]),
                           "ledger_open_alone": _stats(opens)}
    out["added_by_ledger_ms"] = round(statistics.median(
        [a - b for a, b in zip(times["on"], times["off"])]) * 1000, 3)
    out["pyroute2"] = _bench_pyroute2(min(repeats, 15))
    return out


_PYROUTE2 = r"""
import time
t0 = time.perf_counter()
from pyroute2.netlink.connector.cn_proc import ProcEventSocket
t1 = time.perf_counter()
s = ProcEventSocket(); s.bind(); s.control(listen=True)
t2 = time.perf_counter()
s.close()
print((t1 - t0) * 1000, (t2 - t1) * 1000)
"""


def _bench_pyroute2(repeats: int) -> dict[str, Any]:
    imp, sub = [], []
    for _ in range(repeats):
        r = subprocess.run([sys.executable, "-c", _PYROUTE2], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return {"error": r.stderr.strip().splitlines()[-1:] or r.returncode}
        a, b = map(float, r.stdout.split())
        imp.append(a / 1000)
        sub.append(b / 1000)
    return {"import": _stats(imp), "bind_and_subscribe": _stats(sub)}


def run(repeats: int = 200) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise SystemExit("bench_seal needs root (the namespace seal and the cgroup base)")
    res = {"host": {"kernel": platform.release(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
           "repeats": repeats,
           "spawn": bench_spawn(repeats),
           "ledger": bench_ledger(max(20, repeats // 4))}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    a = ap.parse_args()
    res = run(a.repeats)
    sp, led = res["spawn"], res["ledger"]
    print(f"spawn /bin/true into a leaf, median of {res['repeats']} (clone to exec):")
    for k, v in sp.items():
        print(f"  {k:<32} {v['median_ms']:8.3f} ms  (p10 {v['p10_ms']}, p90 {v['p90_ms']}; "
              f"+{v['added_vs_plain_ms']} ms)")
    print(f"Run.start() median, ledger off {led['run_start_ledger_off']['median_ms']} ms, "
          f"on {led['run_start_ledger_on']['median_ms']} ms: +{led['added_by_ledger_ms']} ms")
    print(f"Ledger.open() alone: median {led['ledger_open_alone']['median_ms']} ms")
    p = led["pyroute2"]
    if "error" not in p:
        print(f"pyroute2 ProcEventSocket: import {p['import']['median_ms']} ms, "
              f"bind+subscribe {p['bind_and_subscribe']['median_ms']} ms")
    print(f"written to {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
