"""What the PID-namespace wall costs at the spawn level: /bin/true started,
waited for and reaped, with and without the wall, alternating, medians.

    python benchmarks/bench_wall.py [--repeats 300]

Contenders (in process, `launcher._platform.posix.spawn`, no cgroup):
- plain: clone3(CLONE_VFORK) + exec, reaped by waitid;
- wall: a PID namespace and our init at pid 1 (root: no user namespace),
  until the init reported EMPTY and was reaped;
- wall+proc: the same with a private mount namespace and a fresh /proc;
- wall+proc, forked init: the same with the init forked from this process
  (as with a user namespace, or where the image cannot be exec'd) instead
  of exec'd from its image (launcher/_native/initbin/);
- wall+userns+proc: the unprivileged shape (user namespace mapping the
  caller to itself);
- os.posix_spawn + waitpid, for scale.
The spawn alone (until posix.spawn returns: the worker exec'd) is timed
too, and what a live init costs the supervisor afterwards: copy-on-write
faults while a forked init still shares this process's memory (`cow`:
writing 32 MiB of a bytearray with and without a live forked init).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

ENV = {"PATH": "/usr/bin:/bin"}


def _wait_wall(sp: Any) -> None:
    from launcher._platform import posix

    p = select.poll()
    p.register(sp.init_pidfd, select.POLLIN)
    if not p.poll(10_000):
        raise RuntimeError("the init did not exit within 10 s")
    os.waitid(os.P_PIDFD, sp.init_pidfd, os.WEXITED)
    evs = posix.read_init_events(sp.report_fd)
    if not any(e.kind == "empty" for e in evs + sp.events):
        raise RuntimeError(f"no EMPTY from the init: {evs}")
    for fd in (sp.pidfd, sp.init_pidfd, sp.report_fd):
        os.close(fd)


def run(repeats: int = 300) -> dict[str, Any]:
    if C.ROOT not in sys.path:
        sys.path.insert(0, C.ROOT)
    from launcher._platform import posix

    argv = ["/bin/true"]
    spawn_only: dict[str, list[float]] = {}

    def plain() -> None:
        t0 = time.perf_counter()
        sp = posix.spawn(posix.SpawnRequest(argv, env=ENV))
        spawn_only.setdefault("plain", []).append(time.perf_counter() - t0)
        os.waitid(os.P_PIDFD, sp.pidfd, os.WEXITED)
        os.close(sp.pidfd)

    from launcher._platform import wall as wall_mod

    def wall(name: str, forked: bool = False, **kw: Any) -> Callable[[], None]:
        def f() -> None:
            wall_mod.EXEC_INIT = not forked
            try:
                t0 = time.perf_counter()
                sp = posix.spawn(posix.SpawnRequest(argv, env=ENV, pidns=True, **kw))
                spawn_only.setdefault(name, []).append(time.perf_counter() - t0)
                _wait_wall(sp)
            finally:
                wall_mod.EXEC_INIT = True
        return f

    def posix_spawn() -> None:
        pid = os.posix_spawn(argv[0], argv, ENV)
        os.waitpid(pid, 0)

    contenders: dict[str, Callable[[], None]] = {
        "os.posix_spawn + waitpid": posix_spawn,
        "plain": plain,
        "wall": wall("wall"),
        "wall+proc": wall("wall+proc", mount_proc=True),
        "wall+proc, forked init": wall("wall+proc, forked init", forked=True, mount_proc=True),
        "wall+userns+proc": wall("wall+userns+proc", userns="self", mount_proc=True),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    load = [C.loadavg()]
    for f in contenders.values():
        f()
    spawn_only.clear()
    names = list(contenders)
    for i in range(repeats):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            contenders[k]()
            times[k].append(time.perf_counter() - t0)
    s = {k: C.summary(v) for k, v in times.items()}
    out: dict[str, Any] = {
        "repeats": repeats,
        "spawn_wait_reap": s,
        "spawn_only": {k: C.summary(v) for k, v in spawn_only.items()},
        "ratio_vs_plain": {k: C.ratio(v, s["plain"]) for k, v in s.items()},
        "loadavg_start_end": load + [C.loadavg()],
        "cow": _cow(),
    }
    return out


def _cow(mib: int = 32) -> dict[str, Any]:
    """Supervisor-side cost of a live init: a forked one shares this
    process's pages, so the first write to each is a copy-on-write fault;
    an exec'd one shares none."""
    from launcher._platform import posix

    buf = bytearray(mib << 20)

    def touch() -> float:
        t0 = time.perf_counter()
        for i in range(0, len(buf), 4096):
            buf[i] = (buf[i] + 1) & 0xFF
        return time.perf_counter() - t0

    touch()
    alone = min(touch() for _ in range(3))
    from launcher._platform import wall as wall_mod

    def with_init(forked: bool) -> float:
        wall_mod.EXEC_INIT = not forked
        try:
            sp = posix.spawn(posix.SpawnRequest(["sleep", "30"], env=ENV, pidns=True))
        finally:
            wall_mod.EXEC_INIT = True
        try:
            return touch()
        finally:
            import signal

            signal.pidfd_send_signal(sp.init_pidfd, signal.SIGKILL)
            os.waitid(os.P_PIDFD, sp.init_pidfd, os.WEXITED)
            for fd in (sp.pidfd, sp.init_pidfd, sp.report_fd):
                os.close(fd)

    execd = with_init(False)      # first: after a fork, this process's pages stay write-protected until rewritten
    forked = with_init(True)
    return {"mib": mib, "write_each_page_ms_alone": round(alone * 1e3, 3),
            "write_each_page_ms_with_live_forked_init": round(forked * 1e3, 3),
            "write_each_page_ms_with_live_execd_init": round(execd * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=300)
    a = ap.parse_args()
    print("; ".join(C.ensure_ready()))
    if os.geteuid() != 0:
        print("note: not root; the wall without a user namespace needs CAP_SYS_ADMIN")
    r = run(a.repeats)
    print(f"{'spawn, wait, reap':<28} {'median ms':>10} {'x plain':>8}   spawn only (ms)")
    for k, v in r["spawn_wait_reap"].items():
        so = r["spawn_only"].get(k, {}).get("median_ms", "")
        print(f"{k:<28} {v['median_ms']:10.3f} {r['ratio_vs_plain'][k] or 0:8.2f}   {so}")
    print(f"copy-on-write, {r['cow']['mib']} MiB: {r['cow']['write_each_page_ms_alone']} ms alone, "
          f"{r['cow']['write_each_page_ms_with_live_forked_init']} ms with a live forked init, "
          f"{r['cow']['write_each_page_ms_with_live_execd_init']} with an exec'd one; "
          f"load {r['loadavg_start_end']}")
    os.makedirs(C.RESULTS, exist_ok=True)
    with open(os.path.join(C.RESULTS, "wall.json"), "w") as f:
        json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
