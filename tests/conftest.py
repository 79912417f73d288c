"""Shared fixtures: a private state directory, a private cgroup base, and the
test's own /proc scan.

Every run a test makes goes under a cgroup base this fixture creates
(`CONTAIN_CGROUP_BASE`), and every workload carries a unique token in its
environment. Survivors are decided by scanning /proc/*/environ for that
token, never by asking the code under test; teardown kills whatever the
scan finds (by pidfd, after re-checking the token) and then the base's
subtree (`cgroup.kill` of a cgroup this fixture created), and removes it.
"""
from __future__ import annotations

import errno
import os
import pathlib
import secrets
import select
import signal
import sys
import time
from typing import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)
# Workers that start runs of their own import this tree's launcher too.
os.environ["PYTHONPATH"] = ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")

# The tests always exercise this tree's launcher/ (in this process and in
# every `python -m launcher` they start, through PYTHONPATH above), never a
# copy installed elsewhere: what is tested is what is in front of you. The
# compiled extension is built in place (pytest_configure, before any test
# module is collected) when it is missing or older than its sources; `pip
# install .` builds it only into site-packages. `import launcher` itself
# loads no extension (its names resolve on first use).
import _native_build  # noqa: E402
import _users  # noqa: E402,F401  (in the session's process, before any fork: see _users.remove_stages)
import launcher  # noqa: E402

if os.path.dirname(launcher.__file__) != os.path.join(ROOT, "launcher"):
    pytest.exit(f"tests: imported launcher from {launcher.__file__}, not this tree's {ROOT}/launcher", returncode=4)

TOKEN_VAR = "CONTAIN_TEST_TOKEN"


def pytest_configure(config: pytest.Config) -> None:
    _native_build.ensure(ROOT)      # stops the session with one line when it cannot
    config.addinivalue_line("markers", "forked: run the test in a forked process (pytest-forked)")
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout: per-test timeout (pytest-timeout is not installed)")
    _forked_reports_keep_their_nodeid()
    _default_interactive_signals()
    if os.path.isdir("/proc/self/task") and not hasattr(config, "workerinput"):
        import _watchdog

        config.pluginmanager.register(_watchdog.Plugin(config), "contain-watchdog")


def pytest_unconfigure(config: pytest.Config) -> None:
    dog = config.pluginmanager.get_plugin("contain-watchdog")
    if dog is not None:
        dog.close()


_INHERITED_IGNORED: list[str] = []


def _default_interactive_signals() -> None:
    """A suite started in the background of a non-interactive shell (`cmd &`
    in a script, some CI runners) inherits SIGINT and SIGQUIT ignored, and
    contain rightly keeps what its caller ignored (nohup semantics), so
    every test that Ctrl-Cs a contain would test that instead. The suite
    tests contain as a terminal user drives it: those two get their
    defaults back (the report header says so)."""
    import signal

    for sig in (signal.SIGINT, signal.SIGQUIT):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
            _INHERITED_IGNORED.append(sig.name)


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"launcher: {ROOT}/launcher (extension {_native_build.report})"]
    if _INHERITED_IGNORED:
        lines.append(f"signals: {', '.join(_INHERITED_IGNORED)} were ignored by the caller; restored for the tests")
    if not config.pluginmanager.hasplugin("timeout"):
        lines.append("timeout: NONE, pytest-timeout is not installed (pip install '.[test]')")
    return lines


def _forked_reports_keep_their_nodeid() -> None:
    """pytest-forked (1.7.5, the newest) sends a forked test's reports to the
    parent with marshal, copying each report's __dict__. Since pytest 9.2 a
    report keeps its node id there as a `NodeId` object (`_id`, behind the
    `nodeid` property; pytest PR 14758), which marshal cannot encode: the child
    then exits 3 and *every* `@pytest.mark.forked` test fails with "EXITED
    with status 3", whatever it does. pytest's own serializer
    (`_report_to_json`) writes the id as the plain "nodeid" string instead;
    do the same for pytest-forked. A no-op before 9.2 (no `_id` in __dict__)
    and once pytest-forked serializes through pytest's hooks."""
    try:
        import pytest_forked
    except ImportError:
        return
    original = getattr(pytest_forked, "serialize_report", None)
    if original is None or getattr(original, "_contain_nodeid_fix", False):
        return

    def serialize_report(rep: object) -> dict:
        d = original(rep)
        if "_id" in d:
            d["nodeid"] = str(d.pop("_id"))
        return d

    serialize_report._contain_nodeid_fix = True  # type: ignore[attr-defined]
    pytest_forked.serialize_report = serialize_report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A forked test's timeout must fire in the forked child, where the test
    runs: pytest-timeout's default timer wraps the whole protocol in the
    parent, where SIGALRM aborts the session with an INTERNALERROR (and the
    `thread` method os._exit()s the parent, leaving the child running). So
    forked tests time the test function only (func_only), which runs in the
    child; their fixtures' own waits are bounded instead."""
    if not config.pluginmanager.hasplugin("timeout"):
        return
    for item in items:
        if item.get_closest_marker("forked") is None:
            continue
        own = item.get_closest_marker("timeout")
        args, kwargs = (own.args, dict(own.kwargs)) if own is not None else ((), {})
        kwargs["func_only"] = True
        item.add_marker(pytest.mark.timeout(*args, **kwargs), append=False)


# -- the test's own view of processes -------------------------------------------

def pids_with_token(token: str) -> list[int]:
    """Live processes whose environment carries `token` (zombies are counted
    by `children_of` instead)."""
    from _proc import holders

    return holders(token, TOKEN_VAR)


def children_of(pid: int) -> list[int]:
    """Every process whose parent is `pid`, zombies included (/proc/*/stat)."""
    kids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if int(fields[1]) == pid:
            kids.append(int(name))
    return kids


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def warm_up(env: dict[str, str], n: int = 6) -> None:
    """Run `n` workers at once so any per-process state that grows with
    concurrency is at its size before a test counts descriptors."""
    ws = [launcher.spawn(["sleep", "60"], env=env) for _ in range(n)]   # all live at once
    for w in ws:
        w.cancel(grace=0)
    for w in ws:
        w.wait(30)


def kill_token(token: str) -> list[int]:
    """SIGKILL every process carrying `token`, each pinned by pidfd and
    re-checked first. Returns the pids found."""
    found = pids_with_token(token)
    for pid in found:
        try:
            pfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if pid in pids_with_token(token):
                signal.pidfd_send_signal(pfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pfd)
    return found


# -- fixtures -------------------------------------------------------------------

@pytest.fixture
def token() -> Iterator[str]:
    t = secrets.token_hex(8)
    yield t
    kill_token(t)


@pytest.fixture
def env(token: str) -> dict[str, str]:
    """The environment for workloads: ours plus the token."""
    e = dict(os.environ)
    e[TOKEN_VAR] = token
    return e


@pytest.fixture
def state_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> str:
    d = str(tmp_path / "state")
    monkeypatch.setenv("CONTAIN_STATE_DIR", d)
    return d


def _cgroup2_mount() -> str:
    from launcher._platform import cgroups

    hs = cgroups.hierarchies()
    if not hs:
        pytest.skip("no cgroup v2 hierarchy")
    return hs[0].mount


@pytest.fixture
def cgroup_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A cgroup of the test's own for every run it makes; emptied and
    removed at the end whatever happened."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a cgroup base")
    base = os.path.join(_cgroup2_mount(), f"contain-lib-test-{secrets.token_hex(4)}")
    os.mkdir(base)
    monkeypatch.setenv("CONTAIN_CGROUP_BASE", base)
    # A test runner started inside a run would otherwise nest every run in it.
    monkeypatch.delenv("CONTAIN_RUN_CGROUP", raising=False)
    monkeypatch.delenv("CONTAIN_RUN_DIR", raising=False)
    try:
        yield base
    finally:
        remove_cgroup_tree(base)


def remove_cgroup_tree(base: str, timeout: float = 10.0) -> None:
    """cgroup.kill the subtree we created, wait for populated 0, rmdir it."""
    if not os.path.isdir(base):
        return
    try:
        with open(os.path.join(base, "cgroup.kill"), "w") as f:
            f.write("1")
    except OSError:
        pass
    fd = os.open(os.path.join(base, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
    try:
        deadline = time.monotonic() + timeout
        while b"populated 1" in os.pread(fd, 4096, 0) and time.monotonic() < deadline:
            p = select.poll()
            p.register(fd, select.POLLPRI)
            p.poll(100)
    finally:
        os.close(fd)
    for d, _subdirs, _files in sorted(os.walk(base, topdown=False), key=lambda t: -len(t[0])):
        for _ in range(100):
            try:
                os.rmdir(d)
                break
            except OSError as e:
                if e.errno != errno.EBUSY:
                    break
                time.sleep(0.01)


@pytest.fixture
def contained(state_dir: str, cgroup_base: str, token: str, env: dict[str, str]) -> dict[str, object]:
    """Everything a test that makes runs needs, in one place."""
    return {"state_dir": state_dir, "cgroup_base": cgroup_base, "token": token, "env": env}


def assert_graces_overlap(records: list) -> None:
    """Stops requested together overlap: every worker that needed a SIGTERM
    got it before any worker's grace ran out (read from the records' own
    signal steps, not from a wall clock)."""
    terms, kills = [], []
    for rec in records:
        detail = rec.to_dict()["evidence"]["signal_sent"]["detail"]
        steps = detail.get("steps", []) if isinstance(detail, dict) else []
        terms += [s["at"] for s in steps if s["kind"] == "term"]
        kills += [s["at"] for s in steps if s["kind"] == "kill"]
    assert terms, "no worker was sent SIGTERM"
    if kills:
        assert max(terms) < min(kills), (terms, kills)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- black-box fixtures (tests/test_run_cli.py, test_cancel.py, ...) ------------

import json  # noqa: E402

from _proc import cgroup2_mount, kill_holders, new_token  # noqa: E402


def _cgroup_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (CI runs as root) to create cgroups under the cgroup2 mount"
    mnt = cgroup2_mount()
    if mnt is None:
        return "no cgroup v2 hierarchy mounted"
    if not os.access(mnt, os.W_OK):
        return f"{mnt} is not writable"
    return None


CGROUP_SKIP = _cgroup_reason()
needs_cgroup = pytest.mark.skipif(CGROUP_SKIP is not None, reason=CGROUP_SKIP or "")


def v1_mounts() -> list[str]:
    """Where each cgroup v1 hierarchy is mounted here (mountinfo)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] == "cgroup":
                out.append(left.split()[4])
    return out


def remove_v1_tree(cg_path: str, timeout: float = 10.0) -> None:
    """rmdir, bottom up, the v1 cgroup `cg_path` (a base this test made) in
    every v1 hierarchy; its members were the test's, killed already."""
    for mnt in v1_mounts():
        top = os.path.join(mnt, cg_path.lstrip("/"))
        if not os.path.isdir(top):
            continue
        for d, _subdirs, _files in sorted(os.walk(top, topdown=False), key=lambda t: -len(t[0])):
            deadline = time.monotonic() + timeout
            while True:
                try:
                    os.rmdir(d)
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)


class Box:
    """One test's world: its own state dir, its own cgroup base in v2 and in
    every v1 hierarchy (created and removed by the test), and a token in
    every workload's environment."""

    def __init__(self, tmp_path) -> None:
        self.token = new_token()
        self.state_dir = str(tmp_path / "state")
        mnt = cgroup2_mount()
        tag = secrets.token_hex(4)
        self.base = os.path.join(mnt, f"contain-test-{tag}") if mnt else None
        # The run's own v1 cgroups (memory, pids on a hybrid host) under a
        # base of this test's too, not root's shared /contain: a run the
        # test leaves to an adopter that rightly refuses to remove them (a
        # forged description) would leave them there for ever.
        self.v1_base = f"/contain-test-{tag}"
        self.env = dict(os.environ)
        self.env.update({
            "CONTAIN_STATE_DIR": self.state_dir,
            TOKEN_VAR: self.token,
            "PYTHONPATH": ROOT + os.pathsep + self.env.get("PYTHONPATH", ""),
            "CONTAIN_CGROUP_V1_BASE": self.v1_base,
        })
        if self.base:
            self.env["CONTAIN_CGROUP_BASE"] = self.base
        self.env.pop("CONTAIN_BACKEND", None)
        self.env.pop("CONTAIN_RUN_CGROUP", None)

    def record(self, run_id: str) -> dict:
        with open(os.path.join(self.state_dir, "runs", run_id, "record.json")) as f:
            return json.load(f)

    def ack(self, run_id: str, op: str) -> dict:
        with open(os.path.join(self.state_dir, "runs", run_id, "cancellations", f"{op}.json")) as f:
            return json.load(f)

    def leaves(self) -> list[str]:
        if not self.base or not os.path.isdir(self.base):
            return []
        return sorted(d for d in os.listdir(self.base) if os.path.isdir(os.path.join(self.base, d)))


@pytest.fixture
def box(tmp_path, monkeypatch):
    b = Box(tmp_path)
    # The library under test reads these from the environment too.
    monkeypatch.setenv("CONTAIN_STATE_DIR", b.state_dir)
    monkeypatch.setenv(TOKEN_VAR, b.token)
    monkeypatch.setenv("CONTAIN_CGROUP_V1_BASE", b.v1_base)
    if b.base:
        monkeypatch.setenv("CONTAIN_CGROUP_BASE", b.base)
    monkeypatch.delenv("CONTAIN_BACKEND", raising=False)
    monkeypatch.delenv("CONTAIN_RUN_CGROUP", raising=False)
    try:
        yield b
    finally:
        kill_holders(b.token)
        if b.base:
            remove_cgroup_tree(b.base)
        remove_v1_tree(b.v1_base)


@pytest.fixture
def contain_runs(tmp_path):
    """A factory of `_survivors.Contain` drivers (one token each); every one
    made is cleaned up at the end, whatever happened."""
    from _survivors import Contain, new_token as _new_token

    made: list = []

    def make():
        c = Contain(str(tmp_path), _new_token())
        made.append(c)
        return c

    yield make
    for c in made:
        c.cleanup()
