"""Issue 29, items 1 and 2: what die_with_owner costs a run, and how soon an
orphan is finished by `contain janitor` after its owner is SIGKILLed.

    python benchmarks/bench_janitor.py [--runs 100] [--orphans 8]

(a) `launcher.run(["/bin/true"])` with and without die_with_owner=True,
    interleaved pair by pair in one process: medians and their ratio.
(b) An orphan: `contain run [--die-with-owner] --grace 1 -- sh -c 'setsid
    sleep 300 & sleep 300 & wait'` SIGKILLed once its tree is up; the time
    from the SIGKILL until record.json is terminal, with a long-running
    `contain janitor` doing the work, against `contain cancel --wait` started
    right after the SIGKILL (no janitor running then). Rounds interleaved.
    Then the test's own /proc scan: nothing of any round may be left.

Setting: a private state directory on /dev/shm and, as root, a private
cgroup v2 base (CONTAIN_CGROUP_BASE), both removed at the end. Ratios of
medians, the load average beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
TOKEN_VAR = "CONTAIN_BENCH_TOKEN"
TREE = "setsid sleep 300 & sleep 300 & wait"


def holders(token: str) -> list[int]:
    needle = f"{TOKEN_VAR}={token}".encode()
    out = []
    for n in os.listdir("/proc"):
        if not n.isdigit():
            continue
        try:
            with open(f"/proc/{n}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(n))
        except OSError:
            pass
    return out


def terminal(state: str, run_id: str) -> bool:
    try:
        with open(os.path.join(state, "runs", run_id, "record.json")) as f:
            return json.load(f).get("state") in ("REAPED", "EXITED", "BREACHED")
    except (OSError, ValueError):
        return False


def orphan_round(env: dict[str, str], state: str, token: str, run_id: str, die: bool, by_cancel: bool) -> float:
    cmd = [sys.executable, "-m", "launcher", "run", "--id", run_id, "--grace", "1"]
    cmd += ["--die-with-owner"] if die else []
    p = subprocess.Popen(cmd + ["--", "sh", "-c", TREE], env=dict(env, **{TOKEN_VAR: token}))
    deadline = time.monotonic() + 30
    while len(holders(token)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    p.send_signal(signal.SIGKILL)
    p.wait()
    if by_cancel:
        subprocess.run([sys.executable, "-m", "launcher", "cancel", run_id, "--wait"], env=env,
                       stdout=subprocess.DEVNULL, check=False)
    while not terminal(state, run_id) and time.monotonic() - t0 < 60:
        time.sleep(0.002)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--orphans", type=int, default=8)
    args = ap.parse_args()
    state = tempfile.mkdtemp(prefix="contain-bench-janitor-", dir="/dev/shm")
    base = None
    env = dict(os.environ, CONTAIN_STATE_DIR=os.path.join(state, "s"),
               PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    if os.geteuid() == 0:
        from launcher._platform import cgroups

        base = os.path.join(cgroups.hierarchies()[0].mount, f"contain-bench-{secrets.token_hex(4)}")
        os.mkdir(base)
        env["CONTAIN_CGROUP_BASE"] = base
    os.environ.update(env)
    token = secrets.token_hex(8)
    try:
        import launcher

        plain: list[float] = []
        dying: list[float] = []
        for i in range(args.runs + 5):
            for die, out in ((False, plain), (True, dying)):
                t = time.perf_counter()
                launcher.run(["/bin/true"], die_with_owner=die)
                if i >= 5:
                    out.append(time.perf_counter() - t)
        load_a = open("/proc/loadavg").read().split()[:3]
        mp, md = statistics.median(plain), statistics.median(dying)
        print(f"(a) launcher.run(['/bin/true']) x{args.runs}, load {' '.join(load_a)}: plain {mp * 1e3:.2f} ms, "
              f"die_with_owner {md * 1e3:.2f} ms, ratio {md / mp:.3f}")

        times: dict[str, list[float]] = {"janitor die": [], "janitor plain": [], "cancel die": [], "cancel plain": []}
        jan = subprocess.Popen([sys.executable, "-m", "launcher", "janitor"], env=env, stdout=subprocess.DEVNULL)
        try:
            time.sleep(1.0)
            for i in range(args.orphans):
                for die in (True, False):
                    times[f"janitor {'die' if die else 'plain'}"].append(
                        orphan_round(env, env["CONTAIN_STATE_DIR"], token, f"j{i}{int(die)}", die, False))
        finally:
            jan.send_signal(signal.SIGTERM)
            jan.wait(60)
        for i in range(args.orphans):
            for die in (True, False):
                times[f"cancel {'die' if die else 'plain'}"].append(
                    orphan_round(env, env["CONTAIN_STATE_DIR"], token, f"c{i}{int(die)}", die, True))
        load_b = open("/proc/loadavg").read().split()[:3]
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"(b) SIGKILL of the owner -> terminal record, medians of {args.orphans}, load {' '.join(load_b)}:")
        for k, v in med.items():
            print(f"    {k:14s} {v * 1e3:8.1f} ms")
        for kind in ("die", "plain"):
            print(f"    janitor/cancel ({kind}): {med['janitor ' + kind] / med['cancel ' + kind]:.2f}")
        left = holders(token)
        print(f"left alive (own /proc scan): {len(left)}")
        return 1 if left else 0
    finally:
        for pid in holders(token):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(state, ignore_errors=True)
        if base is not None:
            for d in sorted((os.path.join(r, x) for r, ds, _ in os.walk(base) for x in ds), key=len, reverse=True):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            try:
                os.rmdir(base)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
