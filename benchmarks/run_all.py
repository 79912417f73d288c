"""Every benchmark, one command:

    python benchmarks/run_all.py [--quick] [--only cli,spawn,stop,scan,scale] [--no-plot]

Prints a table of medians and ratios against each target, writes
benchmarks/results/all.json (and one JSON per benchmark), and draws
docs/performance.png (stop latency against tree size; needs matplotlib,
the `bench` extra). Runs from a checkout: the cffi extension is built in
place if missing and every process imports this checkout's `launcher`.
The stop benchmark needs root (scratch cgroups); the others do not.
`scale` is bench_scale.py in its short form (100 workers in one process per
mode; run it alone for 1,000, 10,000 and the RLIMIT_NOFILE scenario).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

QUICK = {"cli": 15, "spawn": 60, "stop": {10: 3, 100: 3, 1000: 3, 5000: 1}}
FULL = {"cli": 40, "spawn": 200, "stop": {10: 7, 100: 7, 1000: 7, 5000: 3}}
SCAN = {"quick": (3000, 5), "full": (3000, 15)}
SCALE = {"quick": 1, "full": 3}      # repeats of N = 100 only


def _say(msg: str) -> None:
    print(msg, flush=True)


def _fmt(x: Any, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}" if isinstance(x, float) else f"{x}{unit}"


def table(res: dict[str, Any]) -> str:
    out: list[str] = []
    cli = res.get("cli")
    if cli:
        out.append(f"\n## cli: whole process, {cli['repeats']} alternating runs each (median ms)")
        for k, v in cli["medians"].items():
            out.append(f"  {k:<50} {v['median_ms']:9.2f}")
        out.append(f"  ratio contain (as installed) / plain call  {_fmt(cli['ratio_console_script'])}  "
                   f"(target <= {cli['target']}: {'met' if cli['target_met'] else 'NOT met'})")
        out.append(f"  ratio python -m launcher / plain   {_fmt(cli['ratio_python_m'])}")
        out.append(f"  ratio under python -S (no site hooks), contain / plain  {_fmt(cli.get('ratio_python_S'))}")
        if cli.get('ratio_pip_wrapper') is not None:
            out.append(f"  ratio pip's console-script wrapper / plain  {_fmt(cli['ratio_pip_wrapper'])} (this pip); "
                       f"{_fmt(cli.get('ratio_pip_wrapper_before_25'))} (pip < 25.0, imports re)")
        out.append(f"  1-min load average at start, end: {cli.get('loadavg_start_end')}")
    sp = res.get("spawn")
    if sp:
        out.append(f"\n## spawn: in process, {sp['repeats']} alternating runs each (median ms)")
        for k, v in sp["medians"].items():
            out.append(f"  {k:<60} {v['median_ms']:8.3f}")
        out.append(f"  ratio launcher.run / posix_spawn+waitpid  {_fmt(sp['ratio_vs_posix_spawn'])}  "
                   f"(target <= {sp['target']}: {'met' if sp['target_met'] else 'NOT met'})")
        out.append(f"  ratio launcher.run / subprocess.run       {_fmt(sp['ratio_vs_subprocess'])}")
        out.append(f"  1-min load average at start, end: {sp.get('loadavg_start_end')}")
    st = res.get("stop")
    if st and "skipped" in st:
        out.append(f"\n## stop: skipped ({st['skipped']})")
    elif st:
        sizes = list(st["table"])
        methods: list[str] = []
        for row in st["table"].values():
            methods += [m for m in row if m not in methods]
        out.append("\n## stop: SIGKILL a tree of N processes, half setsid daemons (median ms; "
                   "survivors = tree processes alive afterwards, by /proc/*/environ token)")
        out.append("  " + f"{'method':<52}" + "".join(f"{'N=' + n:>22}" for n in sizes))
        for m in methods:
            cells = []
            for n in sizes:
                v = st["table"][n].get(m)
                if v is None:
                    cells.append(f"{'-':>22}")
                    continue
                surv = v.get("survivors_max")
                tag = "" if surv is None else ("  all gone" if surv == 0 else f"  {int(v['survivors_median'])} LEFT")
                cells.append(f"{v['median_ms']:>10.1f}{tag:>12}")
            out.append(f"  {m:<52}" + "".join(cells))
        for k, t in st.get("targets", {}).items():
            out.append(f"  {k:<58} {_fmt(t['ratio'])}  (target {t['target']}: {'met' if t['met'] else 'NOT met'})")
        out.append(f"  1-min load average at start, end: {st.get('loadavg_start_end')}; "
                   f"{st.get('processes_on_host_at_start')} other processes on the host at start")
        for p in st.get("problems", []):
            out.append(f"  problem: {p}")
    sc = res.get("scan")
    if sc is not None:
        if "not available" in sc:
            out.append(f"\n## scan: not available ({sc['not available']})")
        else:
            out.append("\n## scan: scan_processes() against psutil.process_iter (median ms)")
            for k, v in (sc.get("median_ms") or {}).items():
                out.append(f"  {k:<50} {v:9.2f}")
            for k, v in (sc.get("ratio_vs_faster_psutil") or {}).items():
                met = (sc.get("target_met") or {}).get(k)
                out.append(f"  {k}: {v}x faster than psutil  (target >= {sc.get('target_ratio')}: "
                           f"{'met' if met else 'NOT met'})")
    sl = res.get("scale")
    if sl is not None:
        import bench_scale

        out.append("\n## scale: N sleep workers in one process (bench_scale.py, N = 100 only)")
        out.append(bench_scale.table(sl).strip("\n"))
    return "\n".join(out)


def plot(st: dict[str, Any], machine: dict[str, Any], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [int(n) for n in st["table"]]
    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=110)
    style = {
        "contain cancel --wait (command)": ("C0", "o", "-"),
        "contain: cancel -> observed empty (owner's record)": ("C0", "o", ":"),
        "library Worker.cancel + wait": ("C2", "s", "-"),
        "bare cgroup.kill + populated 0": ("k", "^", "-"),
        "psutil recipe": ("C3", "v", "--"),
        "os.killpg + reap root": ("C1", "D", "--"),
    }
    for m, (color, marker, ls) in style.items():
        xs, ys, left = [], [], []
        for n in sizes:
            v = st["table"][str(n)].get(m)
            if v and v.get("n"):
                xs.append(n)
                ys.append(v["median_ms"])
                left.append(v.get("survivors_median") or 0)
        if not xs:
            continue
        leaves = any(left)
        label = m + ("  (leaves half the tree alive)" if leaves else "")
        ax.plot(xs, ys, color=color, marker=marker, linestyle=ls, label=label,
                markerfacecolor="none" if leaves else color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("processes in the tree (half of them setsid daemons)")
    ax.set_ylabel("time to stop, median (ms)")
    ax.set_title("Stopping a process tree: contain against the usual recipes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left")
    fig.text(0.99, 0.01, f"{machine['nproc']} CPUs, {machine['memory_gib']} GiB, Linux {machine['kernel']}",
             ha="right", fontsize=7, color="0.4")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (about a minute)")
    ap.add_argument("--only", default="cli,spawn,stop,scan,scale", help="comma-separated subset")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args()
    only = set(a.only.split(","))
    reps = QUICK if a.quick else FULL
    t_start = time.monotonic()
    _say("; ".join(C.ensure_ready()))
    # In this process too (the library and scan benchmarks import it here),
    # `launcher` must be this checkout, not an installed copy.
    sys.path.insert(0, C.ROOT)
    import launcher

    if not launcher.__file__.startswith(C.ROOT + os.sep):
        raise SystemExit(f"launcher imported from {launcher.__file__}, not from {C.ROOT}")
    machine = C.machine()
    _say(f"machine: {machine}")
    res: dict[str, Any] = {"machine": machine, "mode": "quick" if a.quick else "full",
                           "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    os.makedirs(C.RESULTS, exist_ok=True)
    scratch = C.Scratch() if os.geteuid() == 0 else None
    try:
        base = scratch.sub("runs") if scratch else None
        if base:
            os.environ["CONTAIN_CGROUP_BASE"] = base      # every contain run under our own cgroup
        if "cli" in only:
            import bench_cli

            _say("cli ...")
            res["cli"] = bench_cli.run(reps["cli"])
        if "spawn" in only:
            import bench_spawn

            _say("spawn ...")
            res["spawn"] = bench_spawn.run(reps["spawn"], cgroup_base=base)
        if "stop" in only:
            import bench_stop

            _say("stop ...")
            res["stop"] = bench_stop.run(tuple(reps["stop"]), reps["stop"], progress=_say)
        if "scan" in only:
            if os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_scan.py")):
                import bench_scan

                _say("scan ...")
                n, r = SCAN["quick" if a.quick else "full"]
                res["scan"] = bench_scan.run(n_procs=n, repeats=r)
            else:
                res["scan"] = {"not available": "benchmarks/bench_scan.py is not in this checkout"}
        if "scale" in only:
            import bench_scale

            _say("scale ...")
            # Its own state directory and cgroup bases per configuration, not ours.
            res["scale"] = bench_scale.run(ns=(100,), repeats=SCALE["quick" if a.quick else "full"], progress=_say)
    finally:
        if scratch:
            for p in scratch.close():
                _say(f"cleanup: {p}")
            os.environ.pop("CONTAIN_CGROUP_BASE", None)
    res["seconds"] = round(time.monotonic() - t_start, 1)
    for k in ("cli", "spawn", "stop", "scale"):
        if k in res:
            with open(os.path.join(C.RESULTS, f"{k}.json"), "w") as f:
                json.dump(res[k], f, indent=2)
    with open(os.path.join(C.RESULTS, "all.json"), "w") as f:
        json.dump(res, f, indent=2)
    _say(table(res))
    if "stop" in res and "table" in res["stop"] and not a.no_plot:
        try:
            _say(f"\nplot: {plot(res['stop'], machine, os.path.join(C.ROOT, 'docs', 'performance.png'))}")
        except ImportError:
            _say("\nplot: matplotlib is not installed (pip install matplotlib, or the `bench` extra)")
    _say(f"results: {os.path.join(C.RESULTS, 'all.json')}  ({res['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
