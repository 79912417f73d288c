"""Stopping a tree of N processes (half of them setsid daemons, see tree.py):
contain against the usual recipes, with survivors counted by our own scan.

    python benchmarks/bench_stop.py [--sizes 10,100,1000,5000] [--repeats 5]

Contenders, each on a fresh tree of the same shape, in rotating order:
- `contain cancel --wait` (whole command) on a `contain run -- tree.py N`
  started in the background; the owner's own "cancel requested -> observed
  empty" is read from the stop record as well;
- the library: `Worker.cancel()` + `Worker.wait()` in this process;
- bare `cgroup.kill` + POLLPRI wait for `populated 0` on a scratch cgroup of
  ours holding the same tree (the kernel's floor for this job);
- the psutil recipe: `children(recursive=True)`, `kill()` each, `wait_procs`;
- `os.killpg(root, SIGKILL)` + reaping the root.
All stops are SIGKILL (contain with `--grace 0`), so the mechanisms compare.

Every tree process carries a fresh token in its environment; survivors are
what /proc/*/environ still shows once the dying are dead. They are then
killed by pid (identity re-checked through a pidfd) and reaped: this process
is a child subreaper, so orphans come here and not to PID 1. Baseline trees
also sit in scratch cgroups of ours, removed at the end with anything inside.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

TREE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tree.py")
TARGET_CANCEL_VS_BARE = 1.5     # issue 5, 1,000 processes
TARGET_COMMAND_VS_PSUTIL = 0.25  # issue 5, 1,000 processes

CLI = "contain cancel --wait (command)"
CLI_OWNER = "contain: cancel -> observed empty (owner's record)"
LIB = "library Worker.cancel + wait"
BARE = "bare cgroup.kill + populated 0"
PSUTIL = "psutil recipe"
KILLPG = "os.killpg + reap root"
METHODS = (CLI, LIB, BARE, PSUTIL, KILLPG)


def _iso(s: str) -> float:
    import calendar

    base, _, frac = s.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S")) + float("0." + (frac or "0"))


class Bench:
    def __init__(self, scratch: C.Scratch, state: str, script: str) -> None:
        self.scratch = scratch
        self.state = state
        self.script = script
        self.contain_base = scratch.sub("contain")
        self.k = 0

    def _token(self) -> str:
        return os.urandom(8).hex()

    def _ready_timeout(self, n: int) -> float:
        return 30.0 + n * 0.01

    def _expect(self, token: str, n: int) -> None:
        seen = len(C.scan(token))
        if seen != n:
            raise RuntimeError(f"tree has {seen} processes, expected {n}")

    # -- the tree outside contain (baselines) ----------------------------------

    def _spawn_plain(self, n: int, token: str) -> tuple[int, int, str]:
        """The tree in a fresh scratch cgroup of ours, root a process-group
        leader and our child. Returns (pid, pidfd, cgroup dir)."""
        from launcher._platform import posix

        self.k += 1
        cg = self.scratch.sub(f"tree-{self.k}")
        r, w = os.pipe2(os.O_CLOEXEC)
        req = posix.SpawnRequest([sys.executable, TREE, str(n)], env=C.child_env(**{C.TOKEN_VAR: token}),
                                 stdio=(-1, w, -1), new_pgroup=True)
        dfd = os.open(cg, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            sp = posix.spawn(req, cgroup_fd=dfd)
        finally:
            os.close(dfd)
            os.close(w)
        try:
            line = C.wait_line(r, self._ready_timeout(n))
        finally:
            os.close(r)
        if line != f"ready {n}":
            raise RuntimeError(f"tree said {line!r}")
        self._expect(token, n)
        return sp.pid, sp.pidfd, cg

    def bare(self, n: int, token: str) -> dict[str, Any]:
        pid, pidfd, cg = self._spawn_plain(n, token)
        efd = os.open(os.path.join(cg, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
        kfd = os.open(os.path.join(cg, "cgroup.kill"), os.O_WRONLY | os.O_CLOEXEC)
        try:
            t0 = time.perf_counter()
            os.write(kfd, b"1")
            ok = C.wait_empty(efd, 60.0)
            dt = time.perf_counter() - t0
        finally:
            os.close(kfd)
            os.close(efd)
        alive = len(C.scan(token))
        os.waitpid(pid, 0)
        os.close(pidfd)
        return {"seconds": dt, "alive_at_return": alive, "observed_empty": ok}

    def psutil_recipe(self, n: int, token: str) -> dict[str, Any]:
        import psutil

        pid, pidfd, _cg = self._spawn_plain(n, token)
        t0 = time.perf_counter()
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True)
        procs.append(parent)
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        gone, still = psutil.wait_procs(procs, timeout=60)
        dt = time.perf_counter() - t0
        alive = len(C.scan(token))
        os.close(pidfd)
        return {"seconds": dt, "alive_at_return": alive, "found": len(procs), "not_gone": len(still)}

    def killpg(self, n: int, token: str) -> dict[str, Any]:
        pid, pidfd, _cg = self._spawn_plain(n, token)
        t0 = time.perf_counter()
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        dt = time.perf_counter() - t0
        alive = len(C.scan(token))
        os.close(pidfd)
        return {"seconds": dt, "alive_at_return": alive}

    # -- contain --------------------------------------------------------------

    def library(self, n: int, token: str) -> dict[str, Any]:
        import launcher

        r, w = os.pipe2(os.O_CLOEXEC)
        env = C.child_env(CONTAIN_CGROUP_BASE=self.contain_base, **{C.TOKEN_VAR: token})
        try:
            worker = launcher.spawn([sys.executable, TREE, str(n)], grace=0, state_dir=self.state,
                                    env=env, stdio=(-1, w, -1))
        finally:
            os.close(w)
        try:
            line = C.wait_line(r, self._ready_timeout(n))
        finally:
            os.close(r)
        if line != f"ready {n}":
            raise RuntimeError(f"tree said {line!r}")
        self._expect(token, n)
        t0 = time.perf_counter()
        worker.cancel(grace=0)
        rec = worker.wait(timeout=60)
        dt = time.perf_counter() - t0
        alive = len(C.scan(token))
        return {"seconds": dt, "alive_at_return": alive, "state": rec.state,
                "owner_cancel_to_empty_s": _owner_span(rec.to_dict())}

    def cli(self, n: int, token: str) -> dict[str, Any]:
        rid = f"bench-{n}-{token[:8]}"
        env = C.child_env(CONTAIN_STATE_DIR=self.state, CONTAIN_CGROUP_BASE=self.contain_base)
        # The token goes to the tree only, not to the supervisor's environment.
        argv = [self.script, "run", "--id", rid, "--grace", "0", "--", "/usr/bin/env",
                f"{C.TOKEN_VAR}={token}", sys.executable, TREE, str(n)]
        sup = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE)
        try:
            assert sup.stdout is not None
            line = C.wait_line(sup.stdout.fileno(), self._ready_timeout(n))
            if line != f"ready {n}":
                raise RuntimeError(f"tree said {line!r}")
            self._expect(token, n)
            cmd = [self.script, "cancel", rid, "--wait", "--grace", "0"]
            t0 = time.perf_counter()
            pid = os.posix_spawn(cmd[0], cmd, env,
                                 file_actions=[(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)])
            _, status = os.waitpid(pid, 0)
            dt = time.perf_counter() - t0
            alive = len(C.scan(token))
            code = os.waitstatus_to_exitcode(status)
            sup.wait(timeout=60)
        finally:
            if sup.poll() is None:
                sup.kill()          # our own child: the supervisor of this trial
                sup.wait()
            if sup.stdout is not None:
                sup.stdout.close()
        with open(os.path.join(self.state, "runs", rid, "record.json")) as f:
            rec = json.load(f)
        return {"seconds": dt, "alive_at_return": alive, "state": rec["state"], "cancel_exit": code,
                "run_exit": sup.returncode, "owner_cancel_to_empty_s": _owner_span(rec)}

    # -- one trial -------------------------------------------------------------

    def trial(self, method: str, n: int) -> dict[str, Any]:
        fn: Callable[[int, str], dict[str, Any]] = {
            CLI: self.cli, LIB: self.library, BARE: self.bare, PSUTIL: self.psutil_recipe, KILLPG: self.killpg,
        }[method]
        token = self._token()
        try:
            out = fn(n, token)
        finally:
            survivors = C.settle_survivors(token)
            out_surv = len(survivors)
            C.kill_survivors(token, survivors)
            C.reap_children()
            left = C.settle_survivors(token)
            if left:   # a survivor that outlived its SIGKILL would be news
                raise RuntimeError(f"{len(left)} tree processes still alive after cleanup")
        out.update(method=method, n=n, survivors=out_surv)
        return out


def _owner_span(rec: dict[str, Any]) -> float | None:
    """Seconds from the cancel request to the observed empty container, as
    the owner recorded them (wall-clock ISO times, microseconds)."""
    try:
        return _iso(rec["timings"]["empty_at"]) - _iso(rec["evidence"]["cancel_requested"]["at"])
    except (KeyError, TypeError, ValueError):
        return None


def run(sizes: tuple[int, ...] = (10, 100, 1000, 5000), repeats: dict[int, int] | int = 5,
        script: str | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    if os.geteuid() != 0:
        return {"skipped": "needs root: the bare baseline and the trees use scratch cgroups of ours"}
    if C.ROOT not in sys.path:
        sys.path.insert(0, C.ROOT)
    if script is None:
        from bench_cli import console_script

        script = console_script()
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    in_use = sum(1 for p in os.listdir("/proc") if p.isdigit())
    sizes = tuple(n for n in sizes if n + in_use + 1000 < pid_max)
    C.set_subreaper()
    scratch = C.Scratch()
    state = tempfile.mkdtemp(prefix="contain-bench-state-")
    trials: list[dict[str, Any]] = []
    problems: list[str] = []
    load = [C.loadavg()]
    host_procs = in_use
    try:
        b = Bench(scratch, state, script)
        for n in sizes:
            reps = repeats if isinstance(repeats, int) else repeats.get(n, 3)
            for i in range(reps):
                order = METHODS[i % len(METHODS):] + METHODS[:i % len(METHODS)]
                for m in order:
                    t = b.trial(m, n)
                    trials.append(t)
                    if progress:
                        progress(f"  n={n:<5} {m:<36} {t['seconds'] * 1e3:9.1f} ms  survivors {t['survivors']}")
    finally:
        problems.extend(scratch.close())
        shutil.rmtree(state, ignore_errors=True)
    out = summarise(trials, sizes, problems)
    out["loadavg_start_end"] = load + [C.loadavg()]
    out["processes_on_host_at_start"] = host_procs
    return out


def summarise(trials: list[dict[str, Any]], sizes: tuple[int, ...], problems: list[str]) -> dict[str, Any]:
    import statistics

    table: dict[str, dict[str, Any]] = {}
    for n in sizes:
        row: dict[str, Any] = {}
        for m in METHODS:
            ts = [t for t in trials if t["n"] == n and t["method"] == m]
            if not ts:
                continue
            s = C.summary([t["seconds"] for t in ts])
            s["survivors_median"] = statistics.median(t["survivors"] for t in ts)
            s["survivors_max"] = max(t["survivors"] for t in ts)
            s["states"] = sorted({t.get("state") for t in ts if t.get("state")})
            row[m] = s
            spans = [t["owner_cancel_to_empty_s"] for t in ts if t.get("owner_cancel_to_empty_s") is not None]
            if spans and m == CLI:
                row[CLI_OWNER] = C.summary(spans)
            if spans and m == LIB:
                row["library: cancel -> observed empty (owner's record)"] = C.summary(spans)
        table[str(n)] = row
    out: dict[str, Any] = {"table": table, "trials": trials, "problems": problems,
                           "targets": {}}
    row = table.get("1000")
    if row and BARE in row:
        bare = row[BARE]
        lib = C.ratio(row[LIB], bare) if LIB in row else None
        owner = C.ratio(row[CLI_OWNER], bare) if CLI_OWNER in row else None
        cmd = C.ratio(row[CLI], row[PSUTIL]) if CLI in row and PSUTIL in row else None
        out["targets"] = {
            "library Worker.cancel + wait / bare (1,000)": {"ratio": lib, "target": f"<= {TARGET_CANCEL_VS_BARE}",
                                                      "met": lib is not None and lib <= TARGET_CANCEL_VS_BARE},
            "contain run owner: cancel -> observed empty / bare (1,000)": {
                "ratio": owner, "target": f"<= {TARGET_CANCEL_VS_BARE}",
                "met": owner is not None and owner <= TARGET_CANCEL_VS_BARE},
            "contain cancel --wait command / psutil recipe (1,000)": {
                "ratio": cmd, "target": f"<= {TARGET_COMMAND_VS_PSUTIL}",
                "met": cmd is not None and cmd <= TARGET_COMMAND_VS_PSUTIL},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="10,100,1000,5000")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    print("; ".join(C.ensure_ready()))
    r = run(tuple(int(x) for x in a.sizes.split(",")), a.repeats, progress=print)
    print(json.dumps({k: v for k, v in r.items() if k != "trials"}, indent=2))
    os.makedirs(C.RESULTS, exist_ok=True)
    with open(os.path.join(C.RESULTS, "stop.json"), "w") as f:
        json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
