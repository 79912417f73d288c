"""`contain ls` with 10,000 ended runs in the state directory (issue 10:
under 0.5 s), medians over repeats, whole process.

    python benchmarks/bench_ls.py [--runs 10000] [--repeats 9] [--checkout DIR]

One real `contain run -- /bin/true` makes a real run directory; it is copied
10,000 times (its run id and run uid rewritten, files and modes as the
layout makes them) into a temporary state directory, which is removed at
the end. Timed: `contain ls` (the table: runs not ended only, so every
record is still read to know it has ended), `ls --json` (every run, ended
ones too), `ls --all` and `ls --all --json` (every run). `--checkout` times
another checkout's `launcher` on the same directory (e.g. older code, for
a before/after).

`run()` is the entry point for a harness; it returns the result dict.
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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

TARGET_S = 0.5


def _template(state: str, env: dict[str, str]) -> dict[str, bytes]:
    p = subprocess.run([sys.executable, "-m", "launcher", "run", "--id", "template", "--", "/bin/true"],
                       env=env, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"template run failed: {p.stderr}")
    d = os.path.join(state, "runs", "template")
    files = {}
    for name in ("run.json", "record.json", "journal.ndjson", "owner.lock", "summary.json"):
        if name == "summary.json" and not os.path.exists(os.path.join(d, name)):
            continue                      # a checkout that writes none
        with open(os.path.join(d, name), "rb") as f:
            files[name] = f.read()
    shutil.rmtree(d)
    return files


def populate(state: str, n: int, files: dict[str, bytes]) -> None:
    runs = os.path.join(state, "runs")
    rec = json.loads(files["record.json"])
    info = json.loads(files["run.json"])
    summary = json.loads(files["summary.json"]) if "summary.json" in files else None
    for i in range(n):
        rid = f"20261201-{i:06d}-{os.urandom(3).hex()}"
        uid = os.urandom(8).hex()
        d = os.path.join(runs, rid)
        os.mkdir(d, 0o700)
        os.mkdir(os.path.join(d, "cancellations"), 0o700)
        rec.update(run_id=rid, run_uid=uid)
        info.update(run_id=rid, run_uid=uid)
        # As the layout writes it (launcher._runfiles.encode: compact).
        body = {"record.json": (json.dumps(rec) + "\n").encode(),
                "run.json": (json.dumps(info) + "\n").encode(),
                "journal.ndjson": files["journal.ndjson"], "owner.lock": b""}
        for name, data in body.items():
            fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, data)
            os.close(fd)
        if summary is not None:
            # As the owner writes it after each record: the listing's
            # fields, and which record.json it was made from.
            st = os.stat(os.path.join(d, "record.json"))
            summary.update(run_id=rid, run_uid=uid, of=[st.st_ino, st.st_size, st.st_mtime_ns])
            with open(os.path.join(d, "summary.json"), "wb") as f:
                f.write((json.dumps(summary) + "\n").encode())


def _time(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    # cwd: `python -m` puts the working directory first on sys.path.
    p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120, cwd=cwd)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{argv}: exit {p.returncode}: {p.stderr.decode()[-300:]}")
    return dt, len(p.stdout)


def run(runs: int = 10_000, repeats: int = 9, checkout: str | None = None) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="contain-bench-ls-")
    scratch = C.Scratch()
    try:
        state = os.path.join(tmp, "state")
        env = C.child_env(CONTAIN_STATE_DIR=state, CONTAIN_CGROUP_BASE=scratch.path)
        files = _template(state, env)
        t0 = time.perf_counter()
        populate(state, runs, files)
        made = time.perf_counter() - t0
        trees = {"this checkout": C.ROOT}
        if checkout:
            trees["--checkout"] = os.path.abspath(checkout)
        out: dict[str, Any] = {"runs": runs, "repeats": repeats, "populate_s": round(made, 2),
                               "record_bytes": len(files["record.json"]), "target_s": TARGET_S,
                               "state_dir_fs": C.fs_type(state), "machine": C.machine(), "contenders": {}}
        commands = {"ls": ["ls"], "ls --json": ["ls", "--json"], "ls --all": ["ls", "--all"],
                    "ls --all --json": ["ls", "--all", "--json"]}
        for label, root in trees.items():
            cenv = dict(env, PYTHONPATH=root)
            res: dict[str, Any] = {}
            for name, args in commands.items():
                argv = [sys.executable, "-m", "launcher", *args]
                try:
                    _time(argv, cenv, root)    # warm the page cache and bytecode
                except RuntimeError as e:
                    res[name] = {"error": str(e)}
                    continue
                xs, size = [], 0
                for _ in range(repeats):
                    dt, size = _time(argv, cenv, root)
                    xs.append(dt)
                res[name] = dict(C.summary(xs), stdout_bytes=size)
            out["contenders"][label] = res
        mine = out["contenders"]["this checkout"]
        out["within_target"] = all(v.get("median_ms", 1e9) / 1e3 < TARGET_S for v in mine.values())
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        scratch.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--checkout", help="also time this checkout's launcher (e.g. before the change)")
    a = ap.parse_args()
    C.ensure_ready()
    r = run(a.runs, a.repeats, a.checkout)
    os.makedirs(C.RESULTS, exist_ok=True)
    with open(os.path.join(C.RESULTS, "ls.json"), "w") as f:
        json.dump(r, f, indent=2)
    for label, res in r["contenders"].items():
        for name, s in res.items():
            shown = f"{s['median_ms']:8.1f} ms median ({s['min_ms']:.1f}..{s['max_ms']:.1f})" if "median_ms" in s \
                else s.get("error", "?")
            print(f"{label:>14}  {name:<16} {shown}")
    print(f"{r['runs']} ended runs ({r['record_bytes']} bytes a record) on {r['state_dir_fs']}; "
          f"target < {TARGET_S} s: {'met' if r['within_target'] else 'NOT met'}")


if __name__ == "__main__":
    main()
