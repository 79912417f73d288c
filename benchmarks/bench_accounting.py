"""What a whole tree cost, as contain's cgroups count it and as /usr/bin/time -v
and getrusage(RUSAGE_CHILDREN) count it, for one and the same tree in one run.

    python benchmarks/bench_accounting.py [--mode self|stop|both] [--hold 1.5] [--grace 1.5]
                                          [--big-mb 300] [--small-mb 150] [--json FILE]

The tree (every process carries a token; survivors are found by our own scan):

    /usr/bin/time -v  python worker        worker: 20 MB, a little CPU, exits at once
                          `-- (setsid) A   300 MB, burns CPU         } after the worker exits;
                          `-- (setsid) B   150 MB, sleeps            } both double-forked, never waited for

`--mode self`: A and B exit on their own after --hold seconds. `--mode stop`:
they would run for 60 s and are ended by the stop (cgroup.kill of the run,
--grace seconds after the worker exited), as `contain run` ends what a worker
leaves behind. A and B write their own CPU time and high-water RSS to a file
every 50 ms: the "tree's own report" column (a lower bound when they are
killed between two writes).

The columns for /usr/bin/time and getrusage need this process to be the
tree's parent and subreaper, so that tree is driven with the pieces the run
driver uses, exactly as it uses them: a cgroup v2 run directory made by
`launcher._platform.linux.Container`, the run's v1 cgroups by
`launcher._runcgroups.RunCgroups`, the child placed by writing "0" to the v2
leaf's and each v1 `cgroup.procs` before exec (what the C spawn's join fds
do; here a preexec function), and `launcher._accounting.final_snapshot` after
`populated 0`. The column `contain run --stats-json` is the product itself:
the same tree under `contain run --linger S --stats-json FILE` (linger: the
grandchildren get the same time to finish, or to be stopped, as above), its
numbers from the stats line. It needs root (scratch cgroups); everything it
makes is removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as B  # noqa: E402

sys.path.insert(0, B.ROOT)
from launcher import _accounting as A  # noqa: E402
from launcher import _controllers as C  # noqa: E402
from launcher import _limits as L  # noqa: E402
from launcher import _runcgroups as R  # noqa: E402
from launcher._platform import linux  # noqa: E402

WORKER = textwrap.dedent("""
    import os, sys, time
    out, hold, big, small = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

    def report(name, t0):
        tmp = f"{out}/{name}.tmp"
        with open(tmp, "w") as f:
            hwm = next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM:"))
            f.write(f"{time.process_time()} {hwm}\\n")
        os.rename(tmp, f"{out}/{name}")

    def grandchild(name, mb, burn):
        if os.fork():
            return
        os.setsid()
        if os.fork():
            os._exit(0)
        t0 = time.monotonic()
        keep = b"\\x01" * (mb << 20)                   # every page written
        last = 0.0
        while time.monotonic() - t0 < hold:
            if burn:
                for _ in range(20000):
                    pass
            else:
                time.sleep(0.01)
            if time.monotonic() - last > 0.05:
                report(name, t0)
                last = time.monotonic()
        report(name, t0)
        os._exit(0)

    grandchild("A", big, True)
    grandchild("B", small, False)
    mine = b"\\x02" * (20 << 20)
    for _ in range(200000):
        pass
    report("worker", 0)
""")


def _time_v(path: str) -> dict[str, Any]:
    """The numbers GNU time -v printed."""
    got: dict[str, Any] = {}
    for line in open(path):
        k, _, v = line.strip().rpartition(": ")
        if k == "User time (seconds)":
            got["user_s"] = float(v)
        elif k == "System time (seconds)":
            got["sys_s"] = float(v)
        elif k == "Maximum resident set size (kbytes)":
            got["maxrss_bytes"] = int(v) * 1024
        elif k.startswith("Elapsed (wall clock) time"):
            parts = [float(x) for x in v.split(":")]
            s = 0.0
            for x in parts:
                s = s * 60 + x
            got["wall_s"] = s
    return got


def _own_reports(d: str) -> dict[str, tuple[float, int]]:
    out = {}
    for name in ("worker", "A", "B"):
        try:
            cpu, hwm = open(os.path.join(d, name)).read().split()
            out[name] = (float(cpu), int(hwm) * 1024)
        except (OSError, ValueError):
            pass
    return out


def one(mode: str, hold: float, grace: float, big: int, small: int) -> dict[str, Any]:
    token = os.urandom(6).hex()
    tag = os.urandom(4).hex()
    mnt = B.cgroup2_mount()
    if mnt is None:
        raise SystemExit("no cgroup2 mount")
    v2_base = os.path.join(mnt, f"contain-bench-acct-{tag}")
    v1_base = f"/contain-bench-acct-{tag}"
    os.mkdir(v2_base)
    env = B.child_env(**{B.TOKEN_VAR: token, "CONTAIN_CGROUP_BASE": v2_base, "CONTAIN_CGROUP_V1_BASE": v1_base})
    out_dir = tempfile.mkdtemp(prefix="contain-bench-acct-")
    c = rc = None
    res: dict[str, Any] = {"mode": mode, "hold_s": hold if mode == "self" else 60.0, "grace_s": grace,
                           "big_mb": big, "small_mb": small}
    try:
        c = linux.Container.create("bench", env)
        rc = R.RunCgroups.create(os.path.basename(c.dir), None, v2_dir=c.dir, env=env)
        res["routes"] = {k: v.to_dict().get("via") for k, v in rc.routes.items()}
        fds = rc.join_fds()
        leaf = os.open(os.path.join(c.leaf, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)

        def join() -> None:
            os.write(leaf, b"0")
            for fd in fds:
                os.write(fd, b"0")

        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.monotonic()
        p = subprocess.Popen(["/usr/bin/time", "-v", "-o", os.path.join(out_dir, "time-v"), sys.executable, "-c",
                              WORKER, out_dir, str(hold if mode == "self" else 60.0), str(big), str(small)],
                             preexec_fn=join, env=env)
        os.close(leaf)
        rc.close_join_fds()
        res["placement"] = rc.verify(p.pid)["observed"]
        _pid, status, _ru = os.wait4(p.pid, 0)
        t_worker = time.monotonic()
        p.returncode = os.waitstatus_to_exitcode(status)
        after_wait = resource.getrusage(resource.RUSAGE_CHILDREN)
        if mode == "stop":
            deadline = t_worker + grace
            while c.populated() and time.monotonic() < deadline:
                c.wait_change(deadline - time.monotonic())
            if c.populated():
                c.kill()
        deadline = time.monotonic() + 60
        while c.populated():
            if time.monotonic() > deadline:
                raise TimeoutError("the tree did not empty")
            c.wait_change(1.0)
        t_empty = time.monotonic()
        snap = A.final_snapshot(rc, v2_dir=c.dir, wall_s=A.wall_time(t0, t_empty))
        B.reap_children(5.0)                       # the orphans came to us (subreaper)
        after_reap = resource.getrusage(resource.RUSAGE_CHILDREN)
        res["snapshot"] = snap
        # The record fields the driver will fill, assembled the same way, and
        # the --stats-json line made from them.
        from launcher._redispatch import redispatch_eligible
        from launcher._stats import stats_line

        rec = {"run_id": f"bench-{mode}", "state": "REAPED", "outcome": "exited",
               "exit_code": p.returncode, "signal": None, "accounting": snap,
               "limits": dict(rc.limits_record(), hit=A.limit_hits(snap)),
               "evidence": {"container_empty": {"observed": True, "at": snap["taken_at"], "via": "cgroup.events",
                                                "detail": None}}}
        rec["evidence"]["redispatch_eligible"] = redispatch_eligible(rec)
        res["stats_line"] = stats_line(rec)
        res["time_v"] = _time_v(os.path.join(out_dir, "time-v"))
        res["rusage_after_wait"] = {"user_s": after_wait.ru_utime - before.ru_utime,
                                    "sys_s": after_wait.ru_stime - before.ru_stime,
                                    "maxrss_bytes": after_wait.ru_maxrss * 1024,
                                    "wall_s": t_worker - t0}
        res["rusage_after_reap"] = {"user_s": after_reap.ru_utime - before.ru_utime,
                                    "sys_s": after_reap.ru_stime - before.ru_stime,
                                    "maxrss_bytes": after_reap.ru_maxrss * 1024}
        own = _own_reports(out_dir)
        res["own"] = {k: {"cpu_s": v[0], "hwm_bytes": v[1]} for k, v in own.items()}
        res["survivors"] = [s.pid for s in B.settle_survivors(token, 2.0)]
    finally:
        if rc is not None:
            rc.remove()
        if c is not None:
            c.remove()
        sc = B.Scratch.__new__(B.Scratch)       # reuse the safe teardown for our v2 base
        sc.path = v2_base
        res.setdefault("cleanup_problems", sc.close())
        for h in C.v1_hierarchies():
            d = h.fs_path(v1_base)
            if os.path.isdir(d):
                try:
                    os.rmdir(d)
                except OSError as e:
                    res["cleanup_problems"].append(f"rmdir {d}: {e}")
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)
    return res


def via_cli(mode: str, hold: float, grace: float, big: int, small: int) -> dict[str, Any]:
    """The same tree under `contain run` itself; its --stats-json line."""
    token = os.urandom(6).hex()
    tag = os.urandom(4).hex()
    mnt = B.cgroup2_mount()
    assert mnt is not None
    v2_base = os.path.join(mnt, f"contain-bench-acct-{tag}")
    v1_base = f"/contain-bench-acct-{tag}"
    os.mkdir(v2_base)
    out_dir = tempfile.mkdtemp(prefix="contain-bench-acct-")
    stats = os.path.join(out_dir, "stats.ndjson")
    env = B.child_env(**{B.TOKEN_VAR: token, "CONTAIN_CGROUP_BASE": v2_base, "CONTAIN_CGROUP_V1_BASE": v1_base,
                         "CONTAIN_STATE_DIR": os.path.join(out_dir, "state")})
    linger = hold + 1.0 if mode == "self" else grace
    res: dict[str, Any] = {}
    try:
        p = subprocess.run([sys.executable, "-m", "launcher", "run", "--linger", str(linger), "--stats-json", stats,
                            "--", sys.executable, "-c", WORKER, out_dir, str(hold if mode == "self" else 60.0),
                            str(big), str(small)], env=env, cwd=B.ROOT, capture_output=True, text=True, timeout=120)
        res["exit"] = p.returncode
        with open(stats) as f:
            res["stats"] = json.loads(f.readline())
        own = _own_reports(out_dir)
        res["own"] = {k: {"cpu_s": v[0], "hwm_bytes": v[1]} for k, v in own.items()}
        res["survivors"] = [s.pid for s in B.settle_survivors(token, 2.0)]
    finally:
        sc = B.Scratch.__new__(B.Scratch)
        sc.path = v2_base
        res["cleanup_problems"] = sc.close()
        for h in C.v1_hierarchies():
            d = h.fs_path(v1_base)
            if os.path.isdir(d):
                try:
                    os.rmdir(d)
                except OSError as e:
                    res["cleanup_problems"].append(f"rmdir {d}: {e}")
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)
    return res


def cost(n: int) -> dict[str, Any]:
    """What the accounting adds to one run, medians over `n` runs of /bin/true:
    the v1 cgroups made (and limits written) before the spawn, the child's
    joins, the final snapshot and the removal, against the same run with v1
    turned off (v2 leaf only). Each run is a fresh v2 container."""
    mnt = B.cgroup2_mount()
    assert mnt is not None
    tag = os.urandom(4).hex()
    v2_base = os.path.join(mnt, f"contain-bench-acct-{tag}")
    v1_base = f"/contain-bench-acct-{tag}"
    os.mkdir(v2_base)
    out: dict[str, Any] = {}
    try:
        for label, extra, limits in (("v2 leaf only (CONTAIN_CGROUP_V1=off)", {"CONTAIN_CGROUP_V1": "off"}, None),
                                     ("v2 leaf + v1 memory, pids", {}, None),
                                     ("v2 leaf + v1 memory, pids + --memory-max --pids-max", {},
                                      L.Limits(memory_max=1 << 30, pids_max=1000))):
            env = B.child_env(CONTAIN_CGROUP_BASE=v2_base, CONTAIN_CGROUP_V1_BASE=v1_base, **extra)
            t_make, t_spawn, t_snap, t_rm = [], [], [], []
            for _ in range(n):
                c = linux.Container.create("cost", env)
                t0 = time.perf_counter()
                rc = R.RunCgroups.create(os.path.basename(c.dir), limits, v2_dir=c.dir, env=env)
                t1 = time.perf_counter()
                fds = rc.join_fds()
                leaf = os.open(os.path.join(c.leaf, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
                pid = os.fork()
                if pid == 0:
                    try:
                        os.write(leaf, b"0")
                        for fd in fds:
                            os.write(fd, b"0")
                        os.execv("/bin/true", ["true"])
                    finally:
                        os._exit(127)
                os.close(leaf)
                rc.close_join_fds()
                os.waitpid(pid, 0)
                t2 = time.perf_counter()
                while c.populated():
                    c.wait_change(1.0)
                t3 = time.perf_counter()
                A.final_snapshot(rc, v2_dir=c.dir, wall_s=t3 - t1)
                t4 = time.perf_counter()
                rc.remove()
                t5 = time.perf_counter()
                c.remove()
                t_make.append(t1 - t0)
                t_spawn.append(t2 - t1)
                t_snap.append(t4 - t3)
                t_rm.append(t5 - t4)
            out[label] = {"make_and_limits": B.summary(t_make), "fork_join_exec_true_wait": B.summary(t_spawn),
                          "final_snapshot": B.summary(t_snap), "remove_v1": B.summary(t_rm)}
    finally:
        sc = B.Scratch.__new__(B.Scratch)
        sc.path = v2_base
        sc.close()
        for h in C.v1_hierarchies():
            d = h.fs_path(v1_base)
            if os.path.isdir(d):
                os.rmdir(d)
    return out


def cost_table(res: dict[str, Any]) -> str:
    cols = ("make_and_limits", "fork_join_exec_true_wait", "final_snapshot", "remove_v1")
    lines = ["per-run cost (median ms): " + ", ".join(cols)]
    for label, r in res.items():
        lines.append(f"  {label:55s} " + "  ".join(f"{r[k].get('median_ms', 0):7.3f}" for k in cols))
    return "\n".join(lines)


def _mb(x: Any) -> str:
    return "-" if x is None else f"{x / 2**20:7.0f} MiB"


def _s(x: Any) -> str:
    return "-" if x is None else f"{x:6.2f} s"


def table(res: dict[str, Any]) -> str:
    snap, tv, ra, rr, own = res["snapshot"], res["time_v"], res["rusage_after_wait"], res["rusage_after_reap"], res["own"]
    cg_cpu = snap["cpu_usec"]["value"] / 1e6 if snap["cpu_usec"]["value"] is not None else None
    cg_peak = snap["memory_peak_bytes"]["value"]
    own_cpu = sum(v["cpu_s"] for v in own.values()) if own else None
    own_concurrent = sum(own[k]["hwm_bytes"] for k in ("A", "B") if k in own) or None
    st = (res.get("cli") or {}).get("stats") or {}
    rows = [
        ("", "tree's own report", "contain (cgroups)", "contain run --stats-json", "/usr/bin/time -v",
         "getrusage after wait", "getrusage, subreaper reaped"),
        ("CPU user+sys", _s(own_cpu), _s(cg_cpu), _s(st.get("cpu_s")), _s(tv.get("user_s", 0) + tv.get("sys_s", 0)),
         _s(ra["user_s"] + ra["sys_s"]), _s(rr["user_s"] + rr["sys_s"])),
        ("peak memory", _mb(own_concurrent) + " (A+B HWM)", _mb(cg_peak), _mb(st.get("mem_peak_bytes")),
         _mb(tv.get("maxrss_bytes")) + " (RSS)", _mb(ra["maxrss_bytes"]) + " (RSS)",
         _mb(rr["maxrss_bytes"]) + " (RSS)"),
        ("wall", "-", _s(snap["wall_s"]["value"]), _s(st.get("wall_s")), _s(tv.get("wall_s")), _s(ra["wall_s"]), "-"),
        ("tasks peak", "6 (time, worker, 2 middles, A, B)", str(snap["tasks_peak"]["value"]),
         str(st.get("tasks_peak")) + " (init, no time(1))", "-", "-", "-"),
    ]
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"mode {res['mode']}: A and B live {res['hold_s']} s after the worker"
             + (f", stopped {res['grace_s']} s after it exits" if res["mode"] == "stop" else ", then exit")]
    for r in rows:
        lines.append("  ".join(x.ljust(w[i]) for i, x in enumerate(r)))
    lines.append("what each misses:")
    lines.append("  /usr/bin/time -v, getrusage after wait: the grandchildren (never waited for by anyone they"
                 " report to); RSS of one process, never the tree's")
    lines.append("  getrusage, subreaper reaped: only processes that exited and were reaped by this very process;"
                 " ru_maxrss is the largest single process (A), not A+B at once; nothing while they still run")
    lines.append("  contain (cgroups): page cache charged to the run is in the peak (memory.max_usage_in_bytes is"
                 " charged memory, not RSS); on v1 hosts no I/O bytes")
    lines.append("  tree's own report: A+B is the sum of two high-water RSS (shared pages counted twice, not"
                 " necessarily at the same moment); CPU misses time(1) and the two middle processes")
    lines.append(f"--stats-json line: {res['stats_line']}")
    lines.append(f"survivors after the run: {len(res['survivors'])}; placement verified: {res['placement']};"
                 f" cleanup problems: {res['cleanup_problems'] or 'none'}")
    cli = res.get("cli") or {}
    lines.append(f"contain run: exit {cli.get('exit')}, state {st.get('state')}, survivors"
                 f" {len(cli.get('survivors') or [])}, nulls {st.get('null') or 'none'},"
                 f" cleanup problems: {cli.get('cleanup_problems') or 'none'}")
    return "\n".join(lines)


def _in_fresh_process(mode: str, hold: float, grace: float, big: int, small: int) -> dict[str, Any]:
    """One run in a forked process of its own: RUSAGE_CHILDREN's ru_maxrss is
    a maximum over the process's whole life (no delta can be taken), so a
    run must not inherit the previous one's. The child is the tree's subreaper."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            B.set_subreaper()
            data = json.dumps(one(mode, hold, grace, big, small)).encode()
        except BaseException as e:                 # report, never return into the parent's stack
            data = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
            code = 1
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    res = json.loads(data)
    if "error" in res:
        raise SystemExit(f"mode {mode}: {res['error']}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("self", "stop", "both"), default="both")
    ap.add_argument("--hold", type=float, default=1.5)
    ap.add_argument("--grace", type=float, default=1.5)
    ap.add_argument("--big-mb", type=int, default=300)
    ap.add_argument("--small-mb", type=int, default=150)
    ap.add_argument("--cost", type=int, default=30, metavar="N",
                    help="also time what the accounting adds to a run, over N runs (0: skip)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (scratch cgroups)", file=sys.stderr)
        return 2
    if not os.access("/usr/bin/time", os.X_OK):
        print("needs GNU time at /usr/bin/time", file=sys.stderr)
        return 2
    B.ensure_ready()
    results: dict[str, Any] = {"machine": B.machine(), "runs": []}
    for mode in (("self", "stop") if a.mode == "both" else (a.mode,)):
        r = _in_fresh_process(mode, a.hold, a.grace, a.big_mb, a.small_mb)
        r["cli"] = via_cli(mode, a.hold, a.grace, a.big_mb, a.small_mb)
        results["runs"].append(r)
        print(table(r), flush=True)
        print()
    if a.cost:
        results["cost"] = cost(a.cost)
        print(cost_table(results["cost"]))
    os.makedirs(B.RESULTS, exist_ok=True)
    path = a.json or os.path.join(B.RESULTS, "accounting.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")
    return 0 if all(not r["survivors"] and not r["cli"]["survivors"] for r in results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
