"""What the state directory's file system costs `launcher.run`: the
operations a run makes there, timed one by one on a disk directory and on
tmpfs, and `launcher.run(['/bin/true'])` alternating with its state on the
disk, on the disk with fsync skipped (os.fsync replaced in this process, to
measure what durability costs; never how contain runs), on tmpfs, and
`posix_spawn`+`waitpid`. Medians.

    python benchmarks/bench_fs.py [--repeats 300] [--disk-dir /tmp]

With processkit-py importable (`pip install processkit-py`: a peer library,
never a dependency), its `Command("/bin/true").run()` is timed alongside
(issue 27: `launcher.run` should be faster than it on the same machine).

The inodes a run creates are counted in its run directory afterwards.
Nothing here is a target: it is why `launcher.run`'s ratio differs between
a state directory on tmpfs and one on this disk (docs/performance.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def _us(f: Callable[[], Any]) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e6


def file_ops(where: str, repeats: int) -> dict[str, float]:
    """Median microseconds of each kind of operation a run makes in its
    directory, in a fresh directory under `where`."""
    d = tempfile.mkdtemp(prefix="contain-bench-fs-", dir=where)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    ops: dict[str, list[float]] = {k: [] for k in (
        "mkdir", "create (O_EXCL)", "mkfifo", "write 7 KB", "rename", "fsync file", "fsync dir",
        "create after the fsyncs")}
    try:
        for i in range(repeats):
            ops["mkdir"].append(_us(lambda: os.mkdir(f"{d}/d{i}")))
            ops["create (O_EXCL)"].append(_us(lambda: os.close(os.open(
                f"{d}/f{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))))
            ops["mkfifo"].append(_us(lambda: os.mkfifo(f"{d}/p{i}", 0o600)))
            fd = os.open(f"{d}/t{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            ops["write 7 KB"].append(_us(lambda: os.write(fd, b"x" * 7400)))
            ops["rename"].append(_us(lambda: os.rename(f"{d}/t{i}", f"{d}/r{i}")))
            ops["fsync file"].append(_us(lambda: os.fsync(fd)))
            os.close(fd)
            ops["fsync dir"].append(_us(lambda: os.fsync(dfd)))
            ops["create after the fsyncs"].append(_us(lambda: os.close(os.open(
                f"{d}/g{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))))
    finally:
        os.close(dfd)
        shutil.rmtree(d, ignore_errors=True)
    return {k: round(statistics.median(v), 1) for k, v in ops.items()}


def _inodes(state: str) -> int:
    """Files and directories in the newest run directory, itself included."""
    runs = os.path.join(state, "runs")
    newest = max((os.path.join(runs, n) for n in os.listdir(runs) if not n.startswith(".")), key=os.path.getmtime)
    return 1 + sum(len(ds) + len(fs) for _d, ds, fs in os.walk(newest))


def run(repeats: int = 300, disk_dir: str = "/tmp") -> dict[str, Any]:
    if C.ROOT not in sys.path:
        sys.path.insert(0, C.ROOT)
    import launcher

    if not launcher.__file__.startswith(C.ROOT + os.sep):
        raise RuntimeError(f"launcher imported from {launcher.__file__}, not {C.ROOT}")
    disk = tempfile.mkdtemp(prefix="contain-bench-state-", dir=disk_dir)
    mem = tempfile.mkdtemp(prefix="contain-bench-state-", dir="/dev/shm")
    real_fsync = os.fsync

    def one(state: str) -> float:
        t = time.perf_counter()
        launcher.run(["/bin/true"], state_dir=state)
        return time.perf_counter() - t

    def unsynced() -> float:
        os.fsync = lambda fd: None      # what durability costs; restored at once
        try:
            return one(disk)
        finally:
            os.fsync = real_fsync

    def spawn() -> float:
        t = time.perf_counter()
        pid = os.posix_spawn("/bin/true", ["/bin/true"], os.environ)
        os.waitpid(pid, 0)
        return time.perf_counter() - t

    kinds: dict[str, Callable[[], float]] = {"disk": lambda: one(disk), "disk, fsync skipped": unsynced,
                                              "tmpfs": lambda: one(mem), "posix_spawn": spawn}
    try:
        import processkit  # type: ignore[import-not-found]

        def peer() -> float:
            t = time.perf_counter()
            processkit.Command("/bin/true").run()
            return time.perf_counter() - t

        kinds["processkit-py Command.run"] = peer
    except ImportError:
        pass
    times: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for _ in range(20):
            for f in kinds.values():
                f()
        inodes = _inodes(disk)
        for _ in range(repeats):
            for k, f in kinds.items():
                times[k].append(f())
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)
    base = statistics.median(times["posix_spawn"])
    return {
        "disk_dir": disk_dir,
        "file_ops_us": {"disk": file_ops(disk_dir, repeats), "tmpfs": file_ops("/dev/shm", repeats)},
        "inodes_per_run": inodes,
        "launcher_run_ms": {k: round(statistics.median(v) * 1000, 3) for k, v in times.items()},
        "ratio_vs_posix_spawn": {k: round(statistics.median(v) / base, 2) for k, v in times.items()},
        "machine": C.machine(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--disk-dir", default="/tmp", help="a directory on the disk to measure (default /tmp)")
    a = ap.parse_args()
    C.ensure_ready()
    r = run(a.repeats, a.disk_dir)
    print(f"file system operations, medians (us), {a.disk_dir} against /dev/shm:")
    for k in r["file_ops_us"]["disk"]:
        print(f"  {k:24s} {r['file_ops_us']['disk'][k]:8.1f}  {r['file_ops_us']['tmpfs'][k]:8.1f}")
    print(f"inodes a run creates in its directory: {r['inodes_per_run']}")
    print("launcher.run(['/bin/true']), alternating, medians:")
    for k, v in r["launcher_run_ms"].items():
        print(f"  {k:22s} {v:7.3f} ms  {r['ratio_vs_posix_spawn'][k]:5.2f}x posix_spawn")
    os.makedirs(C.RESULTS, exist_ok=True)
    with open(os.path.join(C.RESULTS, "fs.json"), "w") as f:
        json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
