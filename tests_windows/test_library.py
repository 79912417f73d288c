"""The library on Windows (`import launcher`): run, spawn and open_worker on
asyncio, through the same driver as Linux. Survival by the suite's census."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Iterator

import pytest

if sys.platform != "win32":
    pytest.skip("the Windows suite: a Windows CPython runs it (tools/winlane.py)", allow_module_level=True)

import _census
from _job import child

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# What must never be loaded on Windows: the Linux backends and spawn, the
# netlink fork ledger, pyroute2, and the POSIX-only standard modules.
LINUX_ONLY = {"fcntl", "termios", "resource", "pwd", "grp", "pyroute2", "launcher._ledger", "launcher._proccn",
              "launcher._platform.linux", "launcher._platform.posix", "launcher._platform.posixwait",
              "launcher._platform.spawnreq", "launcher._platform.none", "launcher._platform.cgroups",
              "launcher._platform.wall", "launcher._platform.pidwall", "launcher._platform.pidns",
              "launcher._platform.cgattach", "launcher._platform.sealing", "launcher._runcgroups",
              "launcher._controllers", "launcher._postconditions"}


@pytest.fixture
def state(helpers, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:  # type: ignore[no-untyped-def]
    d = os.path.join(helpers.dir, "state")
    monkeypatch.setenv("CONTAIN_STATE_DIR", d)
    yield d


def test_import_launcher_and_run_loads_nothing_linux_only(helpers) -> None:  # type: ignore[no-untyped-def]
    """`import launcher; launcher.run(...)` in a fresh interpreter: REAPED,
    and not one Linux-only module in sys.modules."""
    code = ("import json, sys; sys.path[:0] = [sys.argv[1]]; import launcher; "
            "r = launcher.run([sys.executable, '-c', 'raise SystemExit(7)']); "
            "print(json.dumps({'state': r.state, 'exit_code': r.exit_code, 'modules': sorted(sys.modules)}))")
    env = dict(os.environ, CONTAIN_STATE_DIR=os.path.join(helpers.dir, "state"))
    p = subprocess.run([sys.executable, "-c", code, ROOT], capture_output=True, text=True, timeout=120, env=env,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["state"] == "REAPED" and out["exit_code"] == 7, out
    assert not LINUX_ONLY & set(out["modules"]), LINUX_ONLY & set(out["modules"])


def test_run_returns_a_reaped_record(state: str, helpers) -> None:  # type: ignore[no-untyped-def]
    import launcher

    rec = launcher.run(child("tree", helpers.dir, "r", "detached", "3"), grace=0.3)
    tree = {**_census.marks(helpers.dir, "r"), **_census.marks(helpers.dir, "r-gc")}
    assert len(tree) == 2
    assert rec.state == "REAPED" and rec.exit_code == 3 and rec.outcome == "exited", rec.to_dict()
    assert rec.to_dict()["containment"]["backend"] == "job-object"
    assert _census.wait_gone(tree) == []


def test_spawn_cancel_and_wait(state: str, helpers) -> None:  # type: ignore[no-untyped-def]
    import launcher

    w = launcher.spawn(child("pair", helpers.dir, "s"), grace=0.3)
    try:
        tree = {**_census.wait_marks(helpers.dir, "s", 1), **_census.wait_marks(helpers.dir, "s-gc", 1)}
        assert len(tree) == 2 and w.pid in tree
        assert w.record().state == "RUNNING"
        ack = w.cancel(op_id="lib-1")
        assert ack.effect == "cancel_requested", ack.to_dict()
        rec = w.wait(60)
        assert rec.state == "REAPED" and rec.outcome == "cancelled", rec.to_dict()
        settled = w.cancel_record("lib-1")
        assert settled is not None and settled.effect == "cancelled"
        assert w.cancel(op_id="lib-1").to_dict() == settled.to_dict()   # the same op id, the same record
        assert _census.wait_gone(tree) == []
    finally:
        w.stop()


def test_spawn_with_a_pipe(state: str) -> None:
    import launcher

    with launcher.spawn([sys.executable, "-c", "import sys; sys.stdout.write(sys.stdin.read().upper())"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE) as w:
        assert w.stdin is not None and w.stdout is not None
        w.stdin.write(b"contained\n")
        w.stdin.close()
        assert w.stdout.read().strip() == b"CONTAINED"
        assert w.wait(60).state == "REAPED"


def test_communicate(state: str) -> None:
    import launcher

    w = launcher.spawn([sys.executable, "-c", "import sys; d = sys.stdin.read(); print(d[::-1]); "
                        "sys.stderr.write('err'); sys.exit(4)"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = w.communicate(b"abc", timeout=60)
    assert out is not None and out.strip() == b"cba" and err == b"err"
    rec = w.wait(60)
    assert rec.state == "REAPED" and rec.exit_code == 4
    w.close()


def test_open_worker_on_asyncio(state: str, helpers) -> None:  # type: ignore[no-untyped-def]
    import anyio

    import launcher

    seen: dict[str, Any] = {}

    async def main() -> None:
        async with launcher.open_worker([sys.executable, "-c", "raise SystemExit(5)"]) as w:
            seen["exit"] = await w.wait()
        async with launcher.open_worker(child("pair", helpers.dir, "a"), grace=0.3) as w:
            seen["tree"] = {**_census.wait_marks(helpers.dir, "a", 1), **_census.wait_marks(helpers.dir, "a-gc", 1)}
            seen["ack"] = await w.cancel(op_id="aio-1")
            seen["cancelled"] = await w.wait()
        async with launcher.open_worker([sys.executable, "-c", "print('out')"], stdout=subprocess.PIPE) as w:
            assert w.stdout is not None
            data = b""
            try:
                while True:
                    data += await w.stdout.receive()
            except anyio.EndOfStream:
                pass
            seen["piped"] = (data, await w.wait())

    anyio.run(main, backend="asyncio")
    assert seen["exit"].state == "REAPED" and seen["exit"].exit_code == 5
    assert seen["ack"].effect == "cancel_requested"
    assert seen["cancelled"].state == "REAPED" and seen["cancelled"].outcome == "cancelled"
    assert len(seen["tree"]) == 2 and _census.wait_gone(seen["tree"]) == []
    data, rec = seen["piped"]
    assert data.strip() == b"out" and rec.state == "REAPED"


def test_leaving_the_block_cancels_and_waits(state: str, helpers) -> None:  # type: ignore[no-untyped-def]
    import anyio

    import launcher

    tree: dict[int, int] = {}
    rec: list[Any] = []

    async def main() -> None:
        async with launcher.open_worker(child("pair", helpers.dir, "x"), grace=0.3) as w:
            tree.update({**_census.wait_marks(helpers.dir, "x", 1), **_census.wait_marks(helpers.dir, "x-gc", 1)})
            rec.append(w)
        rec.append(await rec[0].wait())

    anyio.run(main, backend="asyncio")
    assert rec[1].state == "REAPED" and rec[1].outcome == "cancelled", rec[1].to_dict()
    assert len(tree) == 2 and _census.wait_gone(tree) == []


def test_capabilities_are_the_windows_facts() -> None:
    import launcher

    caps = launcher.capabilities()
    assert caps["platform"] == "win32" and caps["job_object"]["ok"] is True, caps


@pytest.mark.parametrize("kw, env", [
    ({"backend": "cgroup2"}, {}), ({"backend": "pidns"}, {}), ({"backend": "subreaper"}, {}), ({"backend": "none"}, {}),
    ({}, {"CONTAIN_BACKEND": "pidns"}), ({"user": "nobody"}, {}),
], ids=["cgroup2", "pidns", "subreaper", "none", "env-pidns", "user"])
def test_linux_only_option_raises_containment_unavailable(  # type: ignore[no-untyped-def]
        state: str, helpers, monkeypatch: pytest.MonkeyPatch, kw: dict[str, Any], env: dict[str, str]) -> None:
    """The library asked for what only Linux has: ContainmentUnavailable (a
    LauncherError) with the reason, from run() and spawn() alike, before a
    run directory exists. Before: a bare AttributeError or
    ModuleNotFoundError, after the run directory was claimed."""
    import launcher

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for call in (launcher.run, launcher.spawn):
        with pytest.raises(launcher.ContainmentUnavailable) as e:
            call(child("pair", helpers.dir, "lx"), id="lx", **kw)
        assert "Windows" in str(e.value) and e.value.record is None
    assert not os.path.exists(os.path.join(state, "runs", "lx"))
    assert _census.marks(helpers.dir, "lx") == {}


def test_scan_processes_lists_this_process_tree(helpers) -> None:  # type: ignore[no-untyped-def]
    """launcher.scan_processes() on Windows (a Toolhelp snapshot): this
    process and a child of it, each with its parent and its creation time
    as the suite's own census reads it. Before: AttributeError
    (CT_PROCSCAN_CGROUP)."""
    import launcher

    p = subprocess.Popen(child("sleep", helpers.dir, "sc"), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        kid = _census.wait_marks(helpers.dir, "sc", 1)
        assert list(kid) == [p.pid]
        procs = {i.pid: i for i in launcher.scan_processes()}
        me = procs[os.getpid()]
        assert me.start_time == _census.my_creation_time() and me.state == "R", me
        assert me.comm.lower() == "python.exe" and me.cgroup is None and me.cgroup_error, me
        them = procs[p.pid]
        assert them.ppid == os.getpid() and them.start_time == kid[p.pid], them
    finally:
        p.kill()
        p.wait(timeout=60)
