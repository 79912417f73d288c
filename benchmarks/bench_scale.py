"""Thousands of runs in one process (issue 27, item 5): what each live
worker costs its owner (descriptors, threads, memory), how long it takes to
spawn N and to cancel N until every record is final, against N
`subprocess.Popen` and N `asyncio.create_subprocess_exec` of the same
`sleep`, and what the library does at RLIMIT_NOFILE 256.

    python benchmarks/bench_scale.py [--n 100 1000 [10000]] [--repeats 3]
        [--modes sync asyncio trio popen asyncio-subprocess]
        [--rlimit 256] [--json OUT] [--plot docs/scale.png]

Modes, each N `sleep 3600` workers in one process, all spawned, then all
cancelled, then all waited for:
  sync                 launcher.Supervisor: spawn each; `cancel_all()` where
                       the supervisor has one, else Worker.cancel() each; then
                       Worker.wait() each
  asyncio, trio        launcher.AsyncSupervisor under anyio: spawn each;
                       `cancel_all()` or AsyncWorker.cancel() each; then every
                       wait() together in one task group
  asyncio-open_worker, trio-open_worker (not by default)
                       the same with launcher.open_worker, every block held
                       open in one AsyncExitStack
  popen                subprocess.Popen each; kill() each; wait() each
  asyncio-subprocess   asyncio.create_subprocess_exec each; kill() each; every
                       wait() gathered
Only public names are used, so the benchmark keeps measuring when the engine
underneath changes.

Each (mode, N, repeat) runs in a fresh child process (its own descriptor,
thread and memory counts; nothing of one mode left in the next), which
reports JSON back. Per worker: descriptors (/proc/self/fd), threads
(/proc/self/task) and VmRSS, each as (all N live - before) / N, after one
untimed warm-up worker; host tasks (/proc/loadavg) the same way, for the
pid_max projection. Times: spawn-all, and cancel-all from the first cancel
until every wait returned; a launcher record is final when its state is
REAPED, EXITED or BREACHED (CONTRACT.md: UNCONFIRMED is not terminal).
Ratios are of medians over the repeats, every mode interleaved within one
run of this script, with the load average beside them.

Survivors are decided by our own /proc scan for a token put in every
worker's environment, never by asking the library: once in the child after
cancel-all, and again here after the child has exited. Cgroups left are the
runs' `containment.path` directories (and their v1 directories) still
present after cancel-all, and whatever is left under the configuration's
own cgroup base after the child exited.

--rlimit L: for each launcher mode, a child sets RLIMIT_NOFILE soft=L and
spawns until refused (at most --rlimit-cap), reports the refusal (type,
whether it is a launcher.LauncherError, errno), cancels every started run,
waits (bounded), and reports the states, the descriptors still open, the
survivors and the cgroups left.

Setting (needs root for the cgroup bases; without root the runs go where the
library puts them): a private state directory on tmpfs (/dev/shm), a private
cgroup v2 base under the cgroup2 mount of /proc/self/mountinfo
(CONTAIN_CGROUP_BASE) and a private v1 base (CONTAIN_CGROUP_V1_BASE), one of
each per configuration, all created and removed here. Children raise their
RLIMIT_NOFILE soft limit to the hard one, and as root the hard one too when
N needs it. An N that pid_max cannot hold (a walled run is at least 2 pids:
the wall's init and the worker; a thread is a pid too) is skipped with the
reason, as is one whose projection from a smaller N passes --budget. One
whose descriptors the hard RLIMIT_NOFILE cannot hold, where this process
cannot raise it (root without CAP_SYS_RESOURCE, as on some VMs), is run to
the library's refusal instead: the most runs one process holds at that
limit ("started ... of N"; its ratios are per worker started). Spawning
is also timed over the first and the last tenth of each loop: whether a
spawn slows down as the live runs grow, within one trial.
Whatever happens (an error, a hung child, Ctrl-C), every process started
here is killed by pid (identity and token re-checked through a pidfd), every
run cgroup is killed through our own base's cgroup.kill and removed, and the
state directories are deleted.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import errno
import inspect
import json
import os
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

ARGV = ["sleep", "3600"]
LAUNCHER_MODES = ("sync", "asyncio", "trio", "asyncio-open_worker", "trio-open_worker")
BASELINES = ("popen", "asyncio-subprocess")
ALL_MODES = LAUNCHER_MODES + BASELINES
DEFAULT_MODES = ("sync", "asyncio", "trio", "popen", "asyncio-subprocess")
FINAL = frozenset({"REAPED", "EXITED", "BREACHED"})     # CONTRACT.md: UNCONFIRMED is not terminal

# Issue 27's targets, at N = 1,000.
TARGET_N = 1000
TARGET_FDS = 2.0              # descriptors per live worker, at most
TARGET_THREADS = 0.01         # threads per live worker, at most: none per worker (a fixed few allowed)
TARGET_SPAWN = 3.0            # spawn-all, at most x N Popen
TARGET_CANCEL = 10.0          # cancel-all until every record is final, at most x N Popen kill + wait
PID_SHARE = 0.9               # never plan to use more of pid_max than this: the host is shared
SETTLE = 0.2                  # seconds between spawn-all and the counts (owners reach their wait)
RLIMIT_WAIT = 30.0            # seconds for every wait at the limit (a sleep's stop takes milliseconds)


# == the child: one configuration ==============================================

def _count_dir(path: str) -> int:
    return len(os.listdir(path))


def _vmrss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _host_tasks() -> int:
    """Every task (thread) on the host, the count pid_max bounds: the
    fourth field of /proc/loadavg, 'running/total'."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[1])


def _snapshot() -> dict[str, int | None]:
    """This process's descriptors, threads and VmRSS, and the host's tasks.
    At the descriptor limit (a refused spawn leaves the process there) no
    file can be opened: descriptors are then counted with fstat, and what
    needs a file reads None."""
    out: dict[str, int | None] = {}
    for key, read in (("fds", lambda: _count_dir("/proc/self/fd")), ("threads", lambda: _count_dir("/proc/self/task")),
                      ("rss_kib", _vmrss_kib), ("host_tasks", _host_tasks)):
        try:
            out[key] = read()
        except OSError:
            out[key] = None
    if out["fds"] is None:
        out["fds"] = _fds_without_opening(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    return out


def _loadavg() -> float | None:
    try:
        return C.loadavg()
    except OSError:
        return None


def _tenths(t0: float, marks: list[float]) -> dict[str, float] | None:
    """Milliseconds a spawn over the first and the last tenth of the spawn
    loop: whether spawning slows down as the live runs grow (within one
    trial, so under the same neighbours, unlike a ratio across N)."""
    k = len(marks) // 10
    if k < 1:
        return None
    first = marks[k - 1] - t0
    last = marks[-1] - marks[-k - 1]
    return {"first": round(1000 * first / k, 3), "last": round(1000 * last / k, 3)}


def _per_worker(before: dict[str, int | None], live: dict[str, int | None], k: int) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key, b in before.items():
        v = live.get(key)
        out[key] = None if b is None or v is None else round((v - b) / k, 3)
    return out


def _survivors(token: str) -> int | None:
    """Our own scan; None when this process cannot open /proc files (the
    library still holds every descriptor): the parent scans again."""
    try:
        return len(C.settle_survivors(token, 5.0))
    except OSError:
        return None


def _fds_without_opening(limit: int) -> int:
    """Open descriptors below `limit`, counted with fstat: at the descriptor
    limit, listing /proc/self/fd would itself need one."""
    n = 0
    for fd in range(limit):
        try:
            os.fstat(fd)
            n += 1
        except OSError:
            pass
    return n


def _describe(e: BaseException, at: int | None = None) -> dict[str, Any]:
    launcher = sys.modules.get("launcher")      # a baseline's child never imports it
    is_launcher = isinstance(e, launcher.LauncherError) if launcher is not None else None
    err = getattr(e, "errno", None)
    d: dict[str, Any] = {
        "type": f"{type(e).__module__}.{type(e).__qualname__}", "launcher_error": is_launcher,
        "oserror": isinstance(e, OSError), "errno": err if isinstance(err, int) else None,
        "errno_name": errno.errorcode.get(err) if isinstance(err, int) else None, "message": str(e)[:400]}
    cause = e.__cause__ or e.__context__
    if cause is not None:
        ce = getattr(cause, "errno", None)
        d["cause"] = {"type": f"{type(cause).__module__}.{type(cause).__qualname__}",
                      "errno_name": errno.errorcode.get(ce) if isinstance(ce, int) else None,
                      "message": str(cause)[:200]}
    if at is not None:
        d["at"] = at
    return d


def _cgroup_dirs(containment: dict[str, Any] | None, mnt: str | None) -> list[str]:
    """The directories a run's record names: its v2 cgroup and its v1 ones."""
    out: list[str] = []
    if not isinstance(containment, dict):
        return out
    path = containment.get("path")
    if mnt and isinstance(path, str) and path.startswith("/") and containment.get("backend") == "cgroup2":
        out.append(os.path.join(mnt, path.lstrip("/")))
    v1 = (containment.get("cgroup_v1") or {}).get("v1") or {}
    for c in v1.values():
        if isinstance(c, dict) and isinstance(c.get("dir"), str):
            out.append(c["dir"])
    return out


class Errors:
    """Exceptions of one kind of call: a count per type and the first message."""

    def __init__(self) -> None:
        self.d: dict[str, dict[str, Any]] = {}

    def add(self, e: BaseException) -> None:
        k = type(e).__name__
        if k not in self.d:
            self.d[k] = {"count": 0, "first": str(e)[:200]}
        self.d[k]["count"] += 1

    def __bool__(self) -> bool:
        return bool(self.d)


class Report:
    """The child's result, rewritten in place after every phase through a
    descriptor opened before anything else: a child killed later (hung,
    timed out) has still said how far it got, and at the descriptor limit
    no new one is needed."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self.d: dict[str, Any] = {"phase": "start", "notes": []}

    def put(self, phase: str | None = None, **kw: Any) -> None:
        if phase:
            self.d["phase"] = phase
        self.d.update(kw)
        data = json.dumps(self.d).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)


# -- modes: async in name only where they are sync, so one driver serves all --

class _Mode:
    launcher = False

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    async def setup(self) -> None:
        """Imports and one untimed worker, so the counts start from a warm process."""
        raise NotImplementedError

    async def spawn(self) -> Any:
        raise NotImplementedError

    async def cancel_all(self, ws: list[Any]) -> tuple[str, Errors]:
        """Request every stop; how, and what raised."""
        raise NotImplementedError

    async def wait_all(self, ws: list[Any], timeout: float) -> tuple[int, Errors]:
        """Until every worker has ended or `timeout` passed; how many had not."""
        raise NotImplementedError

    def final(self, w: Any) -> tuple[str, dict[str, Any] | None]:
        """The worker's state now, and its record's containment (launcher only)."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def settle(self, s: float) -> None:
        time.sleep(s)


class SyncLauncher(_Mode):
    launcher = True

    async def setup(self) -> None:
        import launcher

        with launcher.Supervisor(env=self.env) as warm:       # imports, lazy descriptors, the first run
            w = warm.spawn(ARGV)
            w.cancel()
            w.wait(timeout=60)
        self.sup = launcher.Supervisor(env=self.env)

    async def spawn(self) -> Any:
        return self.sup.spawn(ARGV)

    async def cancel_all(self, ws: list[Any]) -> tuple[str, Errors]:
        errs = Errors()
        if hasattr(self.sup, "cancel_all"):
            try:
                self.sup.cancel_all()
            except Exception as e:
                errs.add(e)
            return "Supervisor.cancel_all()", errs
        for w in ws:
            try:
                w.cancel()
            except Exception as e:
                errs.add(e)
        return "Worker.cancel() each", errs

    async def wait_all(self, ws: list[Any], timeout: float) -> tuple[int, Errors]:
        errs = Errors()
        timeouts = 0
        deadline = time.monotonic() + timeout
        for w in ws:
            try:
                w.wait(timeout=max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                timeouts += 1
            except Exception as e:
                errs.add(e)
        return timeouts, errs

    def final(self, w: Any) -> tuple[str, dict[str, Any] | None]:
        rec = w.record()
        return str(rec.state), rec.to_dict().get("containment")

    async def close(self) -> None:
        self.sup.close()


class AsyncLauncher(_Mode):
    """AsyncSupervisor, or (open_worker=True) one open_worker block per run,
    all held in an AsyncExitStack."""
    launcher = True

    def __init__(self, env: dict[str, str], open_worker: bool = False) -> None:
        super().__init__(env)
        self.open_worker = open_worker

    async def setup(self) -> None:
        import contextlib

        import launcher

        async with launcher.AsyncSupervisor() as warm:
            w = await warm.spawn(ARGV, env=self.env)
            await w.cancel()
            await w.wait()
        if self.open_worker:
            self.stack = contextlib.AsyncExitStack()
            await self.stack.__aenter__()
        else:
            self.sup = launcher.AsyncSupervisor(env=self.env)
            await self.sup.__aenter__()

    async def spawn(self) -> Any:
        import launcher

        if self.open_worker:
            return await self.stack.enter_async_context(launcher.open_worker(ARGV, env=self.env))
        return await self.sup.spawn(ARGV)

    async def cancel_all(self, ws: list[Any]) -> tuple[str, Errors]:
        errs = Errors()
        if not self.open_worker and hasattr(self.sup, "cancel_all"):
            try:
                r = self.sup.cancel_all()
                if inspect.isawaitable(r):
                    await r
            except Exception as e:
                errs.add(e)
            return "AsyncSupervisor.cancel_all()", errs
        for w in ws:
            try:
                await w.cancel()
            except Exception as e:
                errs.add(e)
        return "AsyncWorker.cancel() each", errs

    async def wait_all(self, ws: list[Any], timeout: float) -> tuple[int, Errors]:
        import anyio

        errs = Errors()

        async def one(w: Any) -> None:
            try:
                await w.wait()
            except Exception as e:
                errs.add(e)

        with anyio.move_on_after(timeout):
            async with anyio.create_task_group() as tg:
                for w in ws:
                    tg.start_soon(one, w)
        return sum(1 for w in ws if not w.done()), errs

    def final(self, w: Any) -> tuple[str, dict[str, Any] | None]:
        rec = w.record()
        return str(rec.state), rec.to_dict().get("containment")

    async def close(self) -> None:
        if self.open_worker:
            await self.stack.__aexit__(None, None, None)
        else:
            await self.sup.__aexit__(None, None, None)

    async def settle(self, s: float) -> None:
        import anyio

        await anyio.sleep(s)


class Popen(_Mode):
    async def setup(self) -> None:
        p = subprocess.Popen(ARGV, env=self.env)
        p.kill()
        p.wait()

    async def spawn(self) -> Any:
        return subprocess.Popen(ARGV, env=self.env)

    async def cancel_all(self, ws: list[Any]) -> tuple[str, Errors]:
        for p in ws:
            p.kill()
        return "Popen.kill() each", Errors()

    async def wait_all(self, ws: list[Any], timeout: float) -> tuple[int, Errors]:
        timeouts = 0
        deadline = time.monotonic() + timeout
        for p in ws:
            try:
                p.wait(timeout=max(0.001, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timeouts += 1
        return timeouts, Errors()

    def final(self, p: Any) -> tuple[str, dict[str, Any] | None]:
        rc = p.returncode
        return ("running" if rc is None else "killed" if rc == -signal.SIGKILL else f"returncode {rc}"), None

    async def close(self) -> None:
        pass


class AsyncioSubprocess(Popen):
    async def setup(self) -> None:
        import asyncio

        p = await asyncio.create_subprocess_exec(*ARGV, env=self.env)
        p.kill()
        await p.wait()

    async def spawn(self) -> Any:
        import asyncio

        return await asyncio.create_subprocess_exec(*ARGV, env=self.env)

    async def wait_all(self, ws: list[Any], timeout: float) -> tuple[int, Errors]:
        import asyncio

        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in ws)), timeout)
        except asyncio.TimeoutError:
            pass
        return sum(1 for p in ws if p.returncode is None), Errors()

    async def settle(self, s: float) -> None:
        import asyncio

        await asyncio.sleep(s)


def _make_mode(mode: str, env: dict[str, str]) -> _Mode:
    if mode == "sync":
        return SyncLauncher(env)
    if mode in ("asyncio", "trio"):
        return AsyncLauncher(env)
    if mode.endswith("-open_worker"):
        return AsyncLauncher(env, open_worker=True)
    if mode == "popen":
        return Popen(env)
    if mode == "asyncio-subprocess":
        return AsyncioSubprocess(env)
    raise ValueError(mode)


def _run_without_loop(coro: Any) -> Any:
    """Drive a coroutine that never suspends: the sync modes' methods are
    async only in name, so that one driver serves every mode."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a sync mode suspended")


def _states_and_dirs(m: _Mode, ws: list[Any], mnt: str | None) -> tuple[collections.Counter[str], list[str], list[str]]:
    states: collections.Counter[str] = collections.Counter()
    dirs: list[str] = []
    errors: list[str] = []
    for w in ws:
        try:
            st, cont = m.final(w)
        except Exception as e:
            states["record unreadable"] += 1
            errors.append(f"{type(e).__name__}: {str(e)[:120]}")
            continue
        states[st] += 1
        dirs += _cgroup_dirs(cont, mnt)
    return states, dirs, errors[:5]


async def _measure(m: _Mode, spec: dict[str, Any], rep: Report) -> None:
    n, token = spec["n"], spec["token"]
    await m.setup()
    await m.settle(SETTLE)
    before = _snapshot()
    rep.put("spawning", before=before, load_start=_loadavg())
    ws: list[Any] = []
    marks: list[float] = []
    t0 = time.perf_counter()
    try:
        for i in range(n):
            if i % 64 == 0 and _host_tasks() > spec["max_host_tasks"]:
                rep.d["notes"].append(f"spawning stopped at {i}: {_host_tasks()} tasks on the host, over "
                                      f"{spec['max_host_tasks']} ({PID_SHARE:.0%} of pid_max)")
                break
            if i % 64 == 0 and time.perf_counter() - t0 > spec["budget"]:
                rep.d["notes"].append(f"spawning stopped at {i}: over the budget of {spec['budget']:g} s")
                break
            ws.append(await m.spawn())
            marks.append(time.perf_counter())
    except Exception as e:
        rep.d["spawn_error"] = _describe(e, len(ws))
    spawn_s = time.perf_counter() - t0
    await m.settle(SETTLE)
    live = _snapshot()
    k = max(1, len(ws))
    rep.put("cancelling", started=len(ws), spawn_s=spawn_s, live=live,
            per_worker=_per_worker(before, live, k), spawn_tenths_ms=_tenths(t0, marks))
    t1 = time.perf_counter()
    via, cancel_errors = await m.cancel_all(ws)
    timeouts, wait_errors = await m.wait_all(ws, spec["wait_timeout"])
    cancel_s = time.perf_counter() - t1
    states, dirs, rec_errors = _states_and_dirs(m, ws, spec.get("cgroup_mount"))
    all_final = (not m.launcher or all(s in FINAL for s in states.elements())) and timeouts == 0
    rep.put("checking", cancel_s=cancel_s, cancel_via=via, cancel_errors=cancel_errors.d,
            wait_timeouts=timeouts, wait_errors=wait_errors.d, states=dict(states),
            record_errors=rec_errors, all_final=all_final, after=_snapshot())
    left = [d for d in dirs if os.path.isdir(d)]
    rep.put("closing", survivors_after_cancel=_survivors(token), cgroups_left_after_cancel=len(left),
            cgroups_left_sample=left[:3], load_end=_loadavg())
    if not all_final:
        # Not every run ended: the library's own exit would wait for them
        # without bound. Leave now; the parent kills what is left, by token
        # and through our own cgroup base.
        rep.put("abandoned")
        os._exit(3)
    t2 = time.perf_counter()
    await m.close()
    rep.put("done", close_s=time.perf_counter() - t2)


async def _at_limit(m: _Mode, spec: dict[str, Any], rep: Report) -> None:
    limit, token = spec["limit"], spec["token"]
    await m.setup()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    fds_start = _fds_without_opening(limit)
    rep.put("spawning", fds_at_start=fds_start)
    ws: list[Any] = []
    refusal = None
    for _ in range(spec["cap"]):
        try:
            ws.append(await m.spawn())
        except Exception as e:
            refusal = _describe(e, len(ws))
            break
    rep.put("cancelling", started=len(ws), refusal=refusal, fds_at_refusal=_fds_without_opening(limit))
    t1 = time.perf_counter()
    via, cancel_errors = await m.cancel_all(ws)
    timeouts, wait_errors = await m.wait_all(ws, spec["wait_timeout"])
    cancel_s = time.perf_counter() - t1
    states, dirs, rec_errors = _states_and_dirs(m, ws, spec.get("cgroup_mount"))
    all_final = all(s in FINAL for s in states.elements()) and timeouts == 0
    fds_after = _fds_without_opening(limit)
    # The limit is the library's test, not our scan's: lifted only now, after
    # the states above were read.
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    rep.put("checking", cancel_s=cancel_s, cancel_via=via, cancel_errors=cancel_errors.d,
            wait_timeouts=timeouts, wait_errors=wait_errors.d, states=dict(states),
            record_errors=rec_errors, all_final=all_final, fds_after_all_waited=fds_after)
    left = [d for d in dirs if os.path.isdir(d)]
    rep.put("closing", survivors_after_cancel=_survivors(token), cgroups_left_after_cancel=len(left),
            cgroups_left_sample=left[:3])
    if not all_final:
        rep.put("abandoned")
        os._exit(3)
    await m.close()
    rep.put("done")


def _raise_nofile(need: int = 0) -> dict[str, Any]:
    """RLIMIT_NOFILE: the soft limit to the hard one, and the hard one to
    `need` where it is lower and we may (root with CAP_SYS_RESOURCE: a
    container's root may lack it). The parent asks for what its largest N
    needs, so its children inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    out: dict[str, Any] = {"before": [soft, hard]}
    if hard < need:
        with open("/proc/sys/fs/nr_open") as f:
            new = min(need, int(f.read()))
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, new))
            out["hard_raised_to"] = new
        except (OSError, ValueError) as e:
            out["hard_not_raised"] = f"{e} ({'no CAP_SYS_RESOURCE' if os.geteuid() == 0 else 'not root'})"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out["after"] = list(resource.getrlimit(resource.RLIMIT_NOFILE))
    return out


def child_main(spec: dict[str, Any]) -> int:
    rep = Report(spec["result"])
    try:
        if C.ROOT not in sys.path:
            sys.path.insert(0, C.ROOT)
        mode = spec["mode"]
        if mode in LAUNCHER_MODES:
            import launcher

            if not launcher.__file__.startswith(C.ROOT + os.sep):
                raise RuntimeError(f"launcher imported from {launcher.__file__}, not {C.ROOT}")
        rep.put(nofile=_raise_nofile())
        env = dict(os.environ, **{C.TOKEN_VAR: spec["token"]})
        m = _make_mode(mode, env)
        driver = _at_limit if spec["scenario"] == "rlimit" else _measure
        if mode in ("sync", "popen"):
            _run_without_loop(driver(m, spec, rep))
        elif mode == "asyncio-subprocess":
            import asyncio

            asyncio.run(driver(m, spec, rep))
        else:
            import anyio

            anyio.run(driver, m, spec, rep, backend=mode.split("-")[0])
    except BaseException as e:
        rep.put("failed", error=_describe(e))
        import traceback

        traceback.print_exc()
        return 2
    return 0


# == the parent: a world of our own for every configuration ===================

def _v1_mounts() -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] == "cgroup":
                out.append(left.split()[4])
    return out


def _rmdir_tree(top: str, problems: list[str]) -> int:
    """rmdir every directory under and at `top`, bottom up; how many there were."""
    n = 0
    for d, _dirs, _files in sorted(os.walk(top, topdown=False), key=lambda t: -len(t[0])):
        n += 1
        for _ in range(200):
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY:
                    problems.append(f"rmdir {d}: {e}")
                    break
                time.sleep(0.01)
        else:
            problems.append(f"rmdir {d}: still busy after 2 s")
    return n


class World:
    """Per configuration: a token, a state directory on tmpfs, a v2 cgroup
    base (a child of our Scratch cgroup) and a v1 base, all ours; after the
    child, the survivors and leftovers are counted and removed."""

    def __init__(self) -> None:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.state_root = tempfile.mkdtemp(prefix="contain-bench-scale-", dir=shm)
        self.state_fs = C.fs_type(self.state_root)
        self.root = os.geteuid() == 0
        self.scratch = C.Scratch() if self.root and C.cgroup2_mount() else None
        self.mnt = C.cgroup2_mount()
        self.v1_prefix = f"/contain-bench-scale-{secrets.token_hex(4)}"
        self.v1_bases: list[str] = []
        self.current: dict[str, Any] | None = None
        self.k = 0
        self.problems: list[str] = []

    def run(self, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.k += 1
        tag = f"{self.k:03d}-{spec['mode']}"
        token = secrets.token_hex(8)
        state = os.path.join(self.state_root, tag)
        os.mkdir(state, 0o700)
        base = self.scratch.sub(tag) if self.scratch else None
        v1 = f"{self.v1_prefix}-{tag}" if self.root else None
        if v1:
            self.v1_bases.append(v1)
        spec = dict(spec, token=token, result=os.path.join(self.state_root, tag + ".json"),
                    cgroup_mount=self.mnt)
        env = C.child_env(CONTAIN_STATE_DIR=state)
        for k in ("CONTAIN_RUN_CGROUP", "CONTAIN_RUN_DIR", "CONTAIN_BACKEND", "CONTAIN_CGROUP_BASE",
                  "CONTAIN_CGROUP_V1_BASE", C.TOKEN_VAR):
            env.pop(k, None)
        if base:
            env["CONTAIN_CGROUP_BASE"] = base
        if v1:
            env["CONTAIN_CGROUP_V1_BASE"] = v1
        log_path = os.path.join(self.state_root, tag + ".log")
        self.current = {"tag": tag, "token": token, "base": base, "v1": v1, "state": state, "proc": None}
        out: dict[str, Any] = {}
        with open(log_path, "wb") as log:
            # A session of its own: a Ctrl-C at the terminal reaches only
            # this process, which then kills the child and cleans up itself.
            p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                                 env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 start_new_session=True)
            self.current["proc"] = p
            try:
                out["child_exit"] = p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out["child_exit"] = p.wait()
                out["child_timed_out_after_s"] = timeout
        try:
            with open(spec["result"]) as f:
                out.update(json.load(f))
        except (OSError, ValueError) as e:
            out["result_missing"] = str(e)
        if out.get("child_exit") not in (0, 3):
            with open(log_path, "rb") as f:
                out["child_log_tail"] = f.read()[-1500:].decode(errors="replace")
        out["after_exit"] = self.clean()
        return out

    def clean(self) -> dict[str, Any]:
        """Count and remove what the configuration left: token survivors,
        run cgroups (v2 and v1), the state directory."""
        cur, self.current = self.current, None
        if cur is None:
            return {}
        res: dict[str, Any] = {}
        p = cur["proc"]
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        survivors = C.settle_survivors(cur["token"], 3.0)
        res["survivors"] = len(survivors)
        C.kill_survivors(cur["token"], survivors)
        problems: list[str] = []
        base = cur["base"]
        if base and os.path.isdir(base):
            res["cgroups_left"] = sum(1 for d in os.listdir(base) if os.path.isdir(os.path.join(base, d)))
            fd = os.open(os.path.join(base, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
            try:
                res["cgroup_base_populated"] = C.populated(fd)
                if res["cgroup_base_populated"]:
                    with open(os.path.join(base, "cgroup.kill"), "w") as f:   # our own base
                        f.write("1")
                    if not C.wait_empty(fd, 10.0):
                        problems.append(f"{base} did not empty within 10 s")
            finally:
                os.close(fd)
            _rmdir_tree(base, problems)
        if cur["v1"]:
            left = 0
            for mnt in _v1_mounts():
                top = os.path.join(mnt, cur["v1"].lstrip("/"))
                if os.path.isdir(top):
                    left += sum(1 for d in os.listdir(top) if os.path.isdir(os.path.join(top, d)))
                    _rmdir_tree(top, problems)
            res["v1_cgroups_left"] = left
        C.reap_children(2.0)
        again = C.settle_survivors(cur["token"], 2.0)
        if again:
            problems.append(f"{len(again)} token holders still alive after the kill")
        shutil.rmtree(cur["state"], ignore_errors=True)
        if problems:
            res["problems"] = problems
            self.problems += problems
        return res

    def close(self) -> list[str]:
        self.clean()
        if self.scratch:
            self.problems += self.scratch.close()
        for v1 in self.v1_bases:
            for mnt in _v1_mounts():
                top = os.path.join(mnt, v1.lstrip("/"))
                if os.path.isdir(top):
                    _rmdir_tree(top, self.problems)
        shutil.rmtree(self.state_root, ignore_errors=True)
        return self.problems


# == planning, summary, output =================================================

def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _aggregate(trials: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per 'mode@N': medians over the repeats, and the worst of the checks."""
    groups: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for t in trials:
        groups[f"{t['mode']}@{t['n']}"].append(t)
    out: dict[str, dict[str, Any]] = {}
    for key, ts in groups.items():
        ok = [t for t in ts if "spawn_s" in t]
        states: collections.Counter[str] = collections.Counter()
        for t in ts:
            states.update(t.get("states") or {})
        per = [t["per_worker"] for t in ok if "per_worker" in t]
        agg: dict[str, Any] = {
            "mode": ts[0]["mode"], "n": ts[0]["n"], "repeats": len(ts),
            "started": [t.get("started") for t in ts],
            "spawn_s": _median([t["spawn_s"] for t in ok]),
            "spawn_first_tenth_ms": _median([t["spawn_tenths_ms"]["first"] for t in ok if t.get("spawn_tenths_ms")]),
            "spawn_last_tenth_ms": _median([t["spawn_tenths_ms"]["last"] for t in ok if t.get("spawn_tenths_ms")]),
            "cancel_s": _median([t["cancel_s"] for t in ts if "cancel_s" in t]),
            "fds_per_worker": _median([p["fds"] for p in per if p.get("fds") is not None]),
            "threads_per_worker": _median([p["threads"] for p in per if p.get("threads") is not None]),
            "rss_kib_per_worker": _median([p["rss_kib"] for p in per if p.get("rss_kib") is not None]),
            "host_tasks_per_worker": _median([p["host_tasks"] for p in per if p.get("host_tasks") is not None]),
            "states": dict(states),
            "all_final": all(t.get("all_final") for t in ts),
            "survivors_after_cancel": max((t.get("survivors_after_cancel", 0) for t in ts), default=0),
            "cgroups_left_after_cancel": max((t.get("cgroups_left_after_cancel", 0) for t in ts), default=0),
            "survivors_after_exit": max(((t.get("after_exit") or {}).get("survivors", 0) for t in ts), default=0),
            "cgroups_left_after_exit": max(((t.get("after_exit") or {}).get("cgroups_left", 0) for t in ts),
                                           default=0),
            "spawn_errors": [t["spawn_error"] for t in ts if t.get("spawn_error")],
            "failures": [{k: t.get(k) for k in ("phase", "child_exit", "error", "child_timed_out_after_s")}
                         for t in ts if t.get("phase") != "done"],
            "load": [t.get("load_start") for t in ts] + [ts[-1].get("load_end")],
        }
        out[key] = agg
    for key, a in out.items():
        pop = out.get(f"popen@{a['n']}")
        aio = out.get(f"asyncio-subprocess@{a['n']}")
        for name, base in (("vs_popen", pop), ("vs_asyncio_subprocess", aio)):
            if base is None or a["mode"] in BASELINES or (base is aio and a["mode"] == "sync"):
                continue
            # Per worker started: a mode capped by the descriptor limit
            # started fewer than N (the same where both started N).
            k, kb = _median_started(a), _median_started(base)
            a[f"spawn_{name}"] = _ratio(_per(a["spawn_s"], k), _per(base["spawn_s"], kb))
            a[f"cancel_{name}"] = _ratio(_per(a["cancel_s"], k), _per(base["cancel_s"], kb))
    return out


def _median_started(a: dict[str, Any]) -> float | None:
    return _median([x for x in a["started"] if x])


def _per(t: float | None, k: float | None) -> float | None:
    return t / k if t is not None and k else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def _targets(agg: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for a in agg.values():
        if a["mode"] in BASELINES or a["n"] != TARGET_N:
            continue
        checks = [
            ("descriptors per live worker <= 2", a["fds_per_worker"], a["fds_per_worker"] is not None
             and a["fds_per_worker"] <= TARGET_FDS),
            ("no thread per live worker", a["threads_per_worker"], a["threads_per_worker"] is not None
             and a["threads_per_worker"] <= TARGET_THREADS),
            (f"spawn-all <= {TARGET_SPAWN:g}x N Popen", a.get("spawn_vs_popen"),
             a.get("spawn_vs_popen") is not None and a["spawn_vs_popen"] <= TARGET_SPAWN),
            (f"cancel-all until final <= {TARGET_CANCEL:g}x N Popen kill+wait", a.get("cancel_vs_popen"),
             a.get("cancel_vs_popen") is not None and a["cancel_vs_popen"] <= TARGET_CANCEL and a["all_final"]),
        ]
        for what, value, met in checks:
            # No baseline in this run (--modes without popen): not measured, not "NOT met".
            out.append({"mode": a["mode"], "target": what, "value": value, "met": None if value is None else bool(met)})
    return out


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _errs_str(errs: dict[str, dict[str, Any]] | None) -> str:
    if not errs:
        return "none"
    return "; ".join(f"{k} x{v['count']} ({v['first'][:90]})" for k, v in errs.items())


def _states_str(states: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(states.items(), key=lambda kv: -kv[1])) or "-"


def table(res: dict[str, Any]) -> str:
    agg = res["aggregate"]
    lines = []
    for n in res["ns"]:
        rows = [a for a in agg.values() if a["n"] == n]
        if not rows and str(n) not in res.get("skipped", {}):
            continue
        loads = [x for a in rows for x in a["load"] if x is not None]
        lines.append(f"\n## N = {n}: medians of {max((a['repeats'] for a in rows), default=0)} "
                     f"(1-min load {min(loads, default=0):.2f}-{max(loads, default=0):.2f})")
        lines.append(f"  {'mode':<20} {'fd/w':>6} {'thr/w':>6} {'KiB/w':>6} {'spawn s':>8} {'xPopen':>7} "
                     f"{'cancel s':>9} {'xPopen':>7} {'xaio':>6}  records; left after cancel / after exit")
        for m in res["modes"]:
            a = agg.get(f"{m}@{n}")
            if a is None:
                continue
            left = (f"{a['survivors_after_cancel']} proc {a['cgroups_left_after_cancel']} cg / "
                    f"{a['survivors_after_exit']} proc {a['cgroups_left_after_exit']} cg")
            lines.append(
                f"  {m:<20} {_fmt(a['fds_per_worker']):>6} {_fmt(a['threads_per_worker']):>6} "
                f"{_fmt(a['rss_kib_per_worker'], 0):>6} {_fmt(a['spawn_s'], 3):>8} "
                f"{_fmt(a.get('spawn_vs_popen')):>7} {_fmt(a['cancel_s'], 3):>9} "
                f"{_fmt(a.get('cancel_vs_popen')):>7} {_fmt(a.get('cancel_vs_asyncio_subprocess')):>6}  "
                f"{_states_str(a['states'])}; {left}")
            k = _median_started(a)
            if k is not None and k < n:
                lines.append(f"  {'':<20} started {k:g} of {n} (ratios per worker started)")
            if a.get("spawn_first_tenth_ms") is not None:
                lines.append(f"  {'':<20} ms a spawn: {_fmt(a['spawn_first_tenth_ms'])} over the first tenth, "
                             f"{_fmt(a['spawn_last_tenth_ms'])} over the last")
            for e in a["spawn_errors"][:1]:
                lines.append(f"  {'':<20} spawn refused at {e.get('at')}: {e['type']} "
                             f"{e.get('errno_name') or ''} {e['message'][:100]}")
            for f in a["failures"][:1]:
                lines.append(f"  {'':<20} child ended in phase {f['phase']!r} (exit {f['child_exit']})"
                             + (f": {f['error']['type']} {f['error']['message'][:100]}" if f.get("error") else ""))
        why = res.get("skipped", {}).get(str(n))
        for m, reason in (why or {}).items():
            lines.append(f"  {m:<20} skipped: {reason}")
        for m, reason in (res.get("capped", {}).get(str(n)) or {}).items():
            lines.append(f"  {m:<20} capped: {reason}")
    if res.get("targets"):
        lines.append(f"\n## issue 27 targets at N = {TARGET_N}")
        for t in res["targets"]:
            lines.append(f"  {t['mode']:<20} {t['target']:<50} {_fmt(t['value']):>7}  "
                         f"{'not measured' if t['met'] is None else 'met' if t['met'] else 'NOT met'}")
    for r in res.get("rlimit", []):
        lines.append(f"\n## RLIMIT_NOFILE {r['limit']}, {r['mode']} (load {_fmt(r.get('load'))})")
        ref = r.get("refusal")
        if ref:
            lines.append(f"  refused after {r.get('started')} started: {ref['type']} "
                         f"(LauncherError: {ref['launcher_error']}, errno {ref.get('errno_name')}) "
                         f"{ref['message'][:120]}")
        else:
            lines.append(f"  no refusal: {r.get('started')} started (cap {r.get('cap')}); phase {r.get('phase')}")
        lines.append(f"  descriptors open: {r.get('fds_at_start')} at start, {r.get('fds_at_refusal')} at the "
                     f"refusal, {r.get('fds_after_all_waited')} once every wait returned")
        lines.append(f"  cancel-all ({r.get('cancel_via')}) {_fmt(r.get('cancel_s'), 3)} s: records "
                     f"{_states_str(r.get('states') or {})}, {r.get('wait_timeouts')} still waited for at the "
                     f"{RLIMIT_WAIT:g} s deadline")
        lines.append(f"  cancel errors: {_errs_str(r.get('cancel_errors'))}")
        lines.append(f"  wait errors: {_errs_str(r.get('wait_errors'))}")
        ae = r.get("after_exit") or {}
        lines.append(f"  left after cancel: {r.get('survivors_after_cancel')} processes, "
                     f"{r.get('cgroups_left_after_cancel')} cgroups; after the child exited: "
                     f"{ae.get('survivors')} processes, {ae.get('cgroups_left')} cgroups "
                     f"(populated: {ae.get('cgroup_base_populated')}), {ae.get('v1_cgroups_left')} v1")
        if r.get("phase") not in ("done",):
            lines.append(f"  child ended in phase {r.get('phase')!r} (exit {r.get('child_exit')})"
                         + (f": {r['error']['type']} {r['error']['message'][:160]}" if r.get("error") else ""))
    return "\n".join(lines)


MARKERS = {"sync": "o", "asyncio": "^", "trio": "v", "asyncio-open_worker": "<", "trio-open_worker": ">",
           "popen": "s", "asyncio-subprocess": "D"}      # apart where lines overlap (12 descriptors: both async)


def plot(res: dict[str, Any], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = res["aggregate"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.4), dpi=100)
    panels = (("fds_per_worker", "descriptors per live worker", False),
              ("spawn_s", "spawn-all (s, median)", True),
              ("cancel_s", "cancel-all until every record final (s)", True))
    for ax, (key, title, logy) in zip(axes, panels):
        for i, m in enumerate(res["modes"]):
            pts = sorted((a["n"], a[key]) for a in agg.values() if a["mode"] == m and a[key] is not None)
            if not pts:
                continue
            base = m in BASELINES
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=MARKERS.get(m, "o"), markersize=7,
                    markerfacecolor="none", linestyle="--" if base else "-", alpha=0.85, color=f"C{i}", label=m)
        if key == "fds_per_worker":
            ax.axhline(TARGET_FDS, color="0.5", linewidth=0.8, linestyle=":", label="target: 2")
        ax.set_xscale("log")
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("workers in one process (N)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7.5)
    mach = res["machine"]
    loads = [x for a in agg.values() for x in a["load"] if x is not None] or [res["load_start"]]
    fig.text(0.99, 0.01, f"{mach['nproc']} CPUs, Linux {mach['kernel']}, Python {mach['python']}, "
             f"commit {res['commit'][:9]}, {res['date']}, 1-min load {min(loads):.2f}-{max(loads):.2f}",
             ha="right", fontsize=7, color="0.4")
    fig.suptitle("One process, N sleep workers: the launcher against Popen and asyncio subprocesses", fontsize=11)
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    return path


def _plan(mode: str, n: int, measured: dict[str, dict[str, Any]], machine: dict[str, Any],
          budget: float, nofile: dict[str, Any], capped: dict[str, str] | None = None) -> str | None:
    """Why N of this mode is not run here, or None. Projections are from the
    largest smaller N of this mode measured in this run. An N whose
    descriptors the hard RLIMIT_NOFILE cannot hold (and that this process
    could not raise) is run anyway, to the library's refusal: the most runs
    one process holds here, at the limit; why goes in `capped`."""
    pid_max = machine["pid_max"]
    with open("/proc/sys/kernel/threads-max") as f:
        cap = min(pid_max, int(f.read()))
    now = _host_tasks()
    floor = 2 if mode in LAUNCHER_MODES else 1     # a walled run: its init and the worker
    if now + floor * n > cap:
        return (f"impossible here: at least {floor} pids a worker x {n} + {now} tasks on the host > "
                f"pid_max {pid_max}")
    smaller = [a for a in measured.values() if a["mode"] == mode and a["n"] < n
               and a["host_tasks_per_worker"] is not None and a["spawn_s"] is not None]
    if smaller:
        a = max(smaller, key=lambda a: a["n"])
        hard = nofile["after"][1]
        fit = n
        if a["fds_per_worker"] and 64 + a["fds_per_worker"] * n > hard:
            why = f", raising it: {nofile['hard_not_raised']}" if "hard_not_raised" in nofile else ""
            fit = max(1, int((hard - 64) / a["fds_per_worker"]))
            if capped is not None:
                capped[mode] = (f"{a['fds_per_worker']:g} descriptors a worker (measured at N={a['n']}) x {n} > "
                                f"RLIMIT_NOFILE hard limit {hard}{why}: spawned until the library refused "
                                f"(about {fit})")
        need = now + a["host_tasks_per_worker"] * fit
        if need > PID_SHARE * cap:
            return (f"{a['host_tasks_per_worker']:.2f} host tasks a worker (measured at N={a['n']}) x {n} + "
                    f"{now} = {need:.0f} tasks, over {PID_SHARE:.0%} of pid_max {pid_max} (a shared host)")
        t = ((a["spawn_s"] or 0) + (a["cancel_s"] or 0)) * fit / a["n"]
        if t > budget:
            return f"projected {t:.0f} s from N={a['n']} (linear), over --budget {budget:.0f} s"
    return None


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM as Ctrl-C: the cleanup in run()'s finally runs either way."""
    raise KeyboardInterrupt


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", C.ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", C.ROOT, "status", "--porcelain", "--", "launcher"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out + ("+dirty launcher/" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def run(ns: tuple[int, ...] = (100, 1000), modes: tuple[str, ...] = DEFAULT_MODES, repeats: int = 3,
        rlimit: int | None = None, rlimit_cap: int = 1024, budget: float = 600.0,
        progress: Any = print) -> dict[str, Any]:
    machine = C.machine()
    res: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(), "machine": machine, "ns": list(ns), "modes": list(modes), "repeats": repeats,
        "argv": ARGV, "load_start": C.loadavg(), "trials": [], "skipped": {}, "capped": {}, "rlimit": [],
        "notes": []}
    if os.geteuid() != 0:
        res["notes"].append("not root: no private cgroup base, and the hard RLIMIT_NOFILE cannot be raised; "
                            "runs go where the library puts them")
    # Today's engine holds 11-12 descriptors a worker: 16 a worker is asked for.
    res["nofile"] = nofile = _raise_nofile(16 * max(ns) + 1024)
    C.set_subreaper()       # orphans of a killed child come here and are reaped (World.clean)
    world = World()
    res["state_dir_fs"] = world.state_fs
    res["cgroup_base"] = world.scratch.path if world.scratch else None
    progress(f"state under {world.state_root} ({world.state_fs}); cgroup base "
             f"{res['cgroup_base'] or '(none: not root)'}")
    prev_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for n in ns:
            agg = _aggregate(res["trials"])
            capped: dict[str, str] = {}
            skipped = {m: why for m in modes if (why := _plan(m, n, agg, machine, budget, nofile, capped))}
            if capped:
                res["capped"][str(n)] = capped
                for m, why in capped.items():
                    progress(f"N={n} {m}: {why}")
            if skipped:
                res["skipped"][str(n)] = skipped
                for m, why in skipped.items():
                    progress(f"N={n} {m}: skipped, {why}")
            todo = [m for m in modes if m not in skipped]
            reps = repeats if n <= 1000 else 1
            for r in range(reps if todo else 0):
                for m in todo[r % len(todo):] + todo[:r % len(todo)]:     # each repeat in another order
                    spec = {"scenario": "measure", "mode": m, "n": n, "budget": budget,
                            "wait_timeout": min(120 + 0.25 * n, budget),
                            "max_host_tasks": int(PID_SHARE * machine["pid_max"])}
                    t = time.monotonic()
                    out = world.run(spec, timeout=2 * budget + 120)
                    out.update(mode=m, n=n, repeat=r)
                    res["trials"].append(out)
                    progress(f"N={n} {m} #{r + 1}: spawn {_fmt(out.get('spawn_s'), 3)} s, cancel "
                             f"{_fmt(out.get('cancel_s'), 3)} s, {_states_str(out.get('states') or {})}, phase "
                             f"{out.get('phase')} ({time.monotonic() - t:.0f} s, load {C.loadavg():.2f})")
        if rlimit:
            for m in [m for m in modes if m in LAUNCHER_MODES]:
                spec = {"scenario": "rlimit", "mode": m, "limit": rlimit, "cap": rlimit_cap,
                        "wait_timeout": RLIMIT_WAIT, "n": 0, "max_host_tasks": int(PID_SHARE * machine["pid_max"])}
                out = world.run(spec, timeout=600)
                out.update(mode=m, limit=rlimit, cap=rlimit_cap, load=C.loadavg())
                res["rlimit"].append(out)
                progress(f"RLIMIT_NOFILE {rlimit} {m}: {out.get('started')} started, refusal "
                         f"{(out.get('refusal') or {}).get('type')}, {_states_str(out.get('states') or {})}")
    except KeyboardInterrupt:
        tag = (world.current or {}).get("tag")
        res["notes"].append(f"interrupted during {tag}: the results are partial; what it left: {world.clean()}")
        progress(res["notes"][-1])
    finally:
        problems = world.close()
        signal.signal(signal.SIGTERM, prev_term)
    res["cleanup_problems"] = problems
    res["load_end"] = C.loadavg()
    res["aggregate"] = _aggregate(res["trials"])
    res["targets"] = _targets(res["aggregate"])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[100, 1000], help="worker counts (default 100 1000)")
    ap.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(DEFAULT_MODES))
    ap.add_argument("--repeats", type=int, default=3, help="per mode and N up to 1,000 (one above)")
    ap.add_argument("--rlimit", type=int, metavar="L", help="also the RLIMIT_NOFILE=L scenario (issue 27: 256)")
    ap.add_argument("--rlimit-cap", type=int, default=1024, help="spawns at most, waiting for the refusal")
    ap.add_argument("--budget", type=float, default=600.0,
                    help="seconds: skip an N whose projected spawn+cancel time (from a smaller N of this run) "
                         "passes it, stop spawning and stop waiting after it, kill a child after twice it")
    ap.add_argument("--json", metavar="OUT", help="default benchmarks/results/scale.json")
    ap.add_argument("--plot", metavar="PNG", help="e.g. docs/scale.png (matplotlib, the `bench` extra)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child_main(json.loads(a.child))
    print("; ".join(C.ensure_ready()), flush=True)
    res = run(tuple(sorted(set(a.n))), tuple(a.modes), a.repeats, a.rlimit, a.rlimit_cap, a.budget,
              progress=lambda s: print(s, flush=True))
    print(table(res))
    for p in res["cleanup_problems"]:
        print(f"cleanup: {p}")
    print(f"\n{res['date']}, commit {res['commit'][:12]}, state directory on {res['state_dir_fs']}, "
          f"1-min load {res['load_start']:.2f} at start, {res['load_end']:.2f} at end")
    path = a.json or os.path.join(C.RESULTS, "scale.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    print(f"results: {path}")
    if a.plot:
        try:
            print(f"plot: {plot(res, a.plot)}")
        except ImportError:
            print("plot: matplotlib is not installed (pip install matplotlib, or the `bench` extra)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
