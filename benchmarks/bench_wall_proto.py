"""Designs measured before they were built: the PID-namespace wall made
the other way round, and its first half alone (the init exec'd, which the
wall now is), against the wall `contain` has now. Root, x86_64, gcc.

    python benchmarks/bench_wall_proto.py [--repeats 300]

Contenders, alternating in this one Python process, /bin/true, no cgroup
(as bench_wall.py), medians of the whole cycle (spawn, wait, reap):
- os.posix_spawn + waitpid, for scale;
- wall+proc: the wall as launcher/_native/init.c makes it (the init is a
  fork of this process and forks the worker itself);
- proto: benchmarks/proto/ (built here into a temp directory): the init is
  started as posix_spawn starts a program (CLONE_VM|CLONE_VFORK and an exec
  of an init built without libc, init_nolibc.c) and makes its own /proc;
  the worker is spawned by this process itself into the init's namespaces
  (setns), so it is this process's child and the init only reaps;
- proto, exec'd init only: the same init, given the worker, starts it
  itself (vfork and exec, as today's init does): the exec'd init without
  the other half, so the worker is still the init's child.
It also counts this process's minor faults per cycle: the fork of the
current init write-protects every private page of the caller, which then
faults on its next write to each. The prototype is not the product: it
has no cgroup, no seal, no report socket, no signal forwarding.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "proto")
ENV = {"PATH": "/usr/bin:/bin"}


def unavailable() -> str | None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "Linux x86_64 only"
    if os.geteuid() != 0:
        return "needs root (setns of a PID namespace)"
    if shutil.which("gcc") is None:
        return "needs gcc"
    return None


def build(tmp: str) -> tuple[str, str]:
    init = os.path.join(tmp, "init_nolibc")
    lib = os.path.join(tmp, "spawn_into.so")
    subprocess.run(["gcc", "-O2", "-nostdlib", "-static", "-fno-stack-protector", "-fno-pie", "-no-pie",
                    "-o", init, os.path.join(HERE, "init_nolibc.c")], check=True)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", lib, os.path.join(HERE, "spawn_into.c")], check=True)
    return init, lib


def run(repeats: int = 300) -> dict[str, Any]:
    if C.ROOT not in sys.path:
        sys.path.insert(0, C.ROOT)
    from bench_wall import _wait_wall
    from launcher._platform import posix

    tmp = tempfile.mkdtemp(prefix="contain-proto-")
    try:
        init, lib_path = build(tmp)
        lib = ctypes.CDLL(lib_path)
        lib.proto_cycle.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        lib.proto_exec_init.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        argv = ["/bin/true"]

        def posix_spawn() -> None:
            pid = os.posix_spawn(argv[0], argv, ENV)
            os.waitpid(pid, 0)

        def wall() -> None:
            _wait_wall(posix.spawn(posix.SpawnRequest(argv, env=ENV, pidns=True, mount_proc=True)))

        def proto() -> None:
            rc = lib.proto_cycle(init.encode(), argv[0].encode())
            if rc != 0:
                raise OSError(-rc, f"proto_cycle: {os.strerror(-rc)}")

        def exec_init() -> None:
            rc = lib.proto_exec_init(init.encode(), argv[0].encode())
            if rc != 0:
                raise OSError(-rc, f"proto_exec_init: {os.strerror(-rc)}")

        contenders: dict[str, Callable[[], None]] = {
            "os.posix_spawn + waitpid": posix_spawn, "wall+proc (now)": wall, "proto": proto,
            "proto, exec'd init only": exec_init}
        times: dict[str, list[float]] = {k: [] for k in contenders}
        faults: dict[str, int] = {k: 0 for k in contenders}
        load = [C.loadavg()]
        for f in contenders.values():
            f()
        names = list(contenders)
        for i in range(repeats):
            for k in names[i % len(names):] + names[:i % len(names)]:
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                contenders[k]()
                times[k].append(time.perf_counter() - t0)
                faults[k] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    s = {k: C.summary(v) for k, v in times.items()}
    return {"repeats": repeats, "spawn_wait_reap": s,
            "minor_faults_per_cycle": {k: round(v / repeats, 1) for k, v in faults.items()},
            "loadavg_start_end": load + [C.loadavg()]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=300)
    a = ap.parse_args()
    why = unavailable()
    if why:
        print(f"skipped: {why}")
        return
    print("; ".join(C.ensure_ready()))
    try:
        r = run(a.repeats)
    except subprocess.CalledProcessError as e:
        print(f"skipped: the prototype did not build here ({e})")
        return
    except OSError as e:
        print(f"skipped: the prototype cannot run here ({e})")
        return
    for k, v in r["spawn_wait_reap"].items():
        print(f"{k:<28} {v['median_ms']:8.3f} ms  {r['minor_faults_per_cycle'][k]:7.1f} faults/cycle")
    os.makedirs(C.RESULTS, exist_ok=True)
    with open(os.path.join(C.RESULTS, "wall_proto.json"), "w") as f:
        json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
