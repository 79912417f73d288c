"""The native spawn path against the real kernel (issue 11 item 8, issue 12
items 5 and 6): the handshake needs no EOF, a child that dies before exec is
a failed spawn, and the worker inherits exactly the signals, mask and
descriptors it is meant to.

Every process a test starts is pinned by pidfd and killed and reaped at the
end; every cgroup it makes is its own and removed. The tests look at the
worker from outside (/proc/<pid>/status, /proc/<pid>/fd, /proc/<pid>/cgroup),
never through the code under test.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

import _seccomp
from launcher._errors import SpawnFailed
from launcher._native import ffi, lib
from launcher._platform import posix

ROOT = os.geteuid() == 0
TRUE = "/bin/true"
ENV = {"PATH": "/usr/bin:/bin"}


def _reap(sp: posix.Spawned, timeout: float = 10.0) -> os.waitid_result | None:
    """Wait (bounded) for a spawned child; None if it did not exit in time."""
    p = select.poll()
    p.register(sp.pidfd, select.POLLIN)
    if not p.poll(int(timeout * 1000)):
        return None
    return os.waitid(os.P_PIDFD, sp.pidfd, os.WEXITED)


@contextlib.contextmanager
def spawned(argv: list[str], **kw: object) -> Iterator[posix.Spawned]:
    """Spawn; at the end SIGKILL (by pidfd) and reap whatever is left."""
    req_kw = {k: v for k, v in kw.items() if k not in ("cgroup_fd", "join_fds", "expect_cgroup")}
    sp_kw = {k: v for k, v in kw.items() if k in ("cgroup_fd", "join_fds", "expect_cgroup")}
    req_kw.setdefault("env", dict(ENV))
    sp = posix.spawn(posix.SpawnRequest(argv, **req_kw), **sp_kw)  # type: ignore[arg-type]
    try:
        yield sp
    finally:
        try:
            signal.pidfd_send_signal(sp.pidfd, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.waitid(os.P_PIDFD, sp.pidfd, os.WEXITED)
        except ChildProcessError:
            pass
        os.close(sp.pidfd)


def _status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def _wait_exec(pid: int, comm: str, timeout: float = 5.0) -> None:
    """posix.spawn returns once the child exec'd; comm is then the program's."""
    with open(f"/proc/{pid}/comm") as f:
        assert f.read().strip() == comm


def _children_named(comm: str) -> list[int]:
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                st = f.read()
        except OSError:
            continue
        c = st[st.index(b"(") + 1:st.rindex(b")")]
        ppid = int(st[st.rindex(b")") + 2:].split()[1])
        if ppid == me and c == comm.encode():
            found.append(int(name))
    return found


def _wait_child_named(comm: str, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = _children_named(comm)
        if kids:
            return kids[0]
        time.sleep(0.005)
    raise AssertionError(f"no child named {comm!r} appeared")


class _InThread:
    """Run posix.spawn in a thread (it blocks there while the child is in
    set-up) and keep its result or exception."""

    def __init__(self, req: posix.SpawnRequest, **kw: object) -> None:
        self.result: posix.Spawned | None = None
        self.error: BaseException | None = None
        self.t = threading.Thread(target=self._run, args=(req, kw), daemon=True)
        self.t.start()

    def _run(self, req: posix.SpawnRequest, kw: dict) -> None:
        try:
            self.result = posix.spawn(req, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def join(self, timeout: float = 10.0) -> None:
        self.t.join(timeout)
        assert not self.t.is_alive(), "spawn() did not return"


# -- the handshake -------------------------------------------------------------

@pytest.mark.forked
def test_forking_thread_does_not_block_spawn() -> None:
    """A library caller whose other thread forks all the time: every forked
    child holds a copy of every descriptor open at its fork (including any
    report pipe) for its 2 s life; no spawn may wait for them."""
    stop = threading.Event()
    forked: list[int] = []

    def forker() -> None:
        while not stop.is_set():
            pid = os.fork()
            if pid == 0:
                time.sleep(2)
                os._exit(0)
            forked.append(pid)
            time.sleep(0.005)

    t = threading.Thread(target=forker, daemon=True)
    t.start()
    slow = 0
    spawns = 0
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline or spawns < 60:
            t0 = time.monotonic()
            with spawned([TRUE]) as sp:
                took = time.monotonic() - t0
                assert _reap(sp) is not None
            spawns += 1
            slow += took > 1.0
            time.sleep(0.02)
    finally:
        stop.set()
        t.join(10)
        for pid in forked:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert len(forked) >= 20, f"the forking thread made only {len(forked)} children"
    assert slow == 0, f"{slow} of {spawns} spawns waited more than 1 s"


def _full_pipe() -> tuple[int, int]:
    """A pipe whose buffer is full: the next blocking write to it blocks."""
    r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        while True:
            os.write(w, b"x" * 65536)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    return r, w


def test_child_killed_in_set_up_is_a_failed_spawn() -> None:
    """The child blocks in a stage (writing its placement to a full pipe
    instead of a cgroup.procs) and is SIGKILLed there: a failed spawn at that
    stage, killed by signal 9, and nothing left unreaped."""
    r, w = _full_pipe()
    try:
        th = _InThread(posix.SpawnRequest([TRUE], env=dict(ENV)), join_fds=[w])
        pid = _wait_child_named("ct/spawn")
        os.kill(pid, signal.SIGKILL)
        th.join()
    finally:
        os.close(r)
        os.close(w)
    assert th.result is None
    assert isinstance(th.error, posix.KilledBeforeExec), th.error
    assert th.error.stage == "placement" and th.error.signal == signal.SIGKILL
    assert th.error.exit_code == 128 + signal.SIGKILL
    assert not os.path.exists(f"/proc/{pid}"), "the killed child was not reaped"


@pytest.mark.forked
@pytest.mark.skipif(_seccomp.supported() is not None, reason=_seccomp.supported() or "")
def test_child_killed_at_execve_entry_is_a_failed_spawn(tmp_path) -> None:
    """Killed after its last stage, at the execve system call itself (parked
    there by a seccomp user notification): not an exec. The old handshake
    read this as a successful exec (EOF after "alive")."""
    marker = tmp_path / "ran"
    listener = _seccomp.install({"execve": _seccomp.NOTIFY})
    th = _InThread(posix.SpawnRequest(["/bin/sh", "-c", f"touch {marker}"], env=dict(ENV)))
    p = select.poll()
    p.register(listener, select.POLLIN)
    assert p.poll(10_000), "the child never reached execve"
    pid = _wait_child_named("ct/spawn")
    with open(f"/proc/{pid}/syscall") as f:
        assert f.read().split()[0] == "59"          # parked at execve's entry
    os.kill(pid, signal.SIGKILL)
    th.join()
    assert isinstance(th.error, posix.KilledBeforeExec), th.error
    assert th.error.stage == "exec" and th.error.signal == signal.SIGKILL
    assert not marker.exists()


def test_exec_is_reported_once_the_program_runs() -> None:
    with spawned(["sleep", "30"]) as sp:
        _wait_exec(sp.pid, "sleep")
        assert os.waitid(os.P_PIDFD, sp.pidfd, os.WEXITED | os.WNOHANG) is None


def test_fast_exit_after_exec_is_success() -> None:
    """A worker that exec'd and exited at once (before the parent looked) is
    a success with its own status, not a failed spawn."""
    for _ in range(50):
        with spawned(["sh", "-c", "exit 7"]) as sp:
            info = _reap(sp)
            assert info is not None and info.si_code == os.CLD_EXITED and info.si_status == 7


@pytest.mark.skipif(not ROOT, reason="needs root to create and kill a cgroup")
def test_child_killed_at_birth_is_died_at_birth(cgroup_base: str) -> None:
    """The cgroup.kill fork bug (KERNEL-NOTES.md): a child cloned into a leaf
    that was once killed is SIGKILLed before it runs our code."""
    leaf = os.path.join(cgroup_base, "killed")
    os.mkdir(leaf)
    with open(os.path.join(leaf, "cgroup.kill"), "w") as f:
        f.write("1")
    fd = os.open(leaf, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            sp = posix.spawn(posix.SpawnRequest([TRUE], env=dict(ENV)), cgroup_fd=fd)
        except posix.DiedAtBirth:
            return
        _reap(sp)
        os.close(sp.pidfd)
        pytest.skip("this kernel has the fix for the cgroup.kill fork bug")
    finally:
        os.close(fd)


# -- placement by the child itself (the fallback) ------------------------------

def _v1_mount(controller: str) -> str | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            rf = right.split()
            if rf and rf[0] == "cgroup" and controller in rf[2].split(","):
                return left.split()[4]
    return None


def _v1_id(controller: str) -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            hid, ctl, _path = line.rstrip("\n").split(":", 2)
            if controller in ctl.split(","):
                return f"{hid}:{ctl}"
    raise AssertionError(controller)


def _cg_path(fs_path: str) -> str:
    from launcher._platform import linux

    h = next(x for x in linux.hierarchies() if fs_path.startswith(x.mount.rstrip("/") + "/"))
    return h.cg_path(fs_path)


@pytest.mark.skipif(not ROOT, reason="needs root to create cgroups")
def test_join_fallback_places_child_before_exec(cgroup_base: str, tmp_path) -> None:
    """No CLONE_INTO_CGROUP (cgroup_fd -1): the child writes "0" to the
    leaf's cgroup.procs and checks /proc/self/cgroup before exec."""
    leaf = os.path.join(cgroup_base, "joined")
    os.mkdir(leaf)
    procs = os.open(os.path.join(leaf, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
    out = tmp_path / "cg"
    try:
        with spawned(["sh", "-c", f"cat /proc/self/cgroup > {out}"], join_fds=[procs],
                     expect_cgroup=["0::" + _cg_path(leaf)]) as sp:
            assert _reap(sp) is not None
    finally:
        os.close(procs)
    assert f"0::{_cg_path(leaf)}\n" in out.read_text()


@pytest.mark.skipif(not ROOT, reason="needs root to create cgroups")
def test_join_into_wrong_place_fails_before_exec(cgroup_base: str, tmp_path) -> None:
    leaf = os.path.join(cgroup_base, "joined")
    os.mkdir(leaf)
    procs = os.open(os.path.join(leaf, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
    marker = tmp_path / "ran"
    try:
        with pytest.raises(SpawnFailed) as ei:
            posix.spawn(posix.SpawnRequest(["sh", "-c", f"touch {marker}"], env=dict(ENV)),
                        join_fds=[procs], expect_cgroup=["0::" + _cg_path(leaf) + "-elsewhere"])
    finally:
        os.close(procs)
    assert ei.value.stage == "placement" and ei.value.errno == errno.EXDEV
    assert ei.value.exit_code == 125
    assert not marker.exists()
    with open(os.path.join(leaf, "cgroup.events")) as f:
        assert "populated 0" in f.read()


@pytest.mark.skipif(not ROOT, reason="needs root to create cgroups")
@pytest.mark.skipif(_v1_mount("memory") is None or _v1_mount("pids") is None,
                    reason="no cgroup v1 memory and pids hierarchies")
def test_join_v1_memory_and_pids_before_exec(cgroup_base: str, tmp_path) -> None:
    """The accounting's use of the same mechanism: v1 memory and pids cgroups
    (made by the test, removed by it) joined with the v2 leaf, before exec."""
    import secrets

    name = f"contain-spawn-test-{secrets.token_hex(4)}"
    v1 = {c: os.path.join(_v1_mount(c) or "", name) for c in ("memory", "pids")}
    leaf = os.path.join(cgroup_base, "joined")
    os.mkdir(leaf)
    fds = []
    out = tmp_path / "cg"
    try:
        for d in v1.values():
            os.mkdir(d)
        fds = [os.open(os.path.join(d, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
               for d in [leaf, *v1.values()]]
        expect = ["0::" + _cg_path(leaf)] + [f"{_v1_id(c)}:/{name}" for c in v1]
        with spawned(["sh", "-c", f"cat /proc/self/cgroup > {out}"], join_fds=fds,
                     expect_cgroup=expect) as sp:
            assert _reap(sp) is not None
        text = out.read_text().splitlines()
        for line in expect:
            assert line in text
    finally:
        for fd in fds:
            os.close(fd)
        for d in v1.values():
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


@pytest.mark.skipif(not ROOT, reason="needs root to create and kill a cgroup")
def test_container_falls_back_to_join_after_birth_death(cgroup_base: str) -> None:
    """linux.Container: the leaf was killed once (so clone3 into it kills the
    child at birth); the spawn lands in a fresh leaf, joined before exec."""
    from launcher._platform import linux

    c = linux.Container.create("spawntest")
    try:
        with open(os.path.join(c.leaf, "cgroup.kill"), "w") as f:
            f.write("1")
        sp = c._spawn(posix.SpawnRequest(["sleep", "30"], env=dict(ENV)))
        try:
            assert c.placed(sp.pid) == c.hierarchy.cg_path(c.leaf)
            if "joined" not in sp.via:
                pytest.skip("this kernel has the fix for the cgroup.kill fork bug")
            assert c.leaf != os.path.join(c.dir, "main")
        finally:
            signal.pidfd_send_signal(sp.pidfd, signal.SIGKILL)
            os.waitid(os.P_PIDFD, sp.pidfd, os.WEXITED)
            os.close(sp.pidfd)
    finally:
        c.kill()
        for _ in range(200):
            if not c.populated():
                break
            time.sleep(0.01)
        c.remove()


# -- signals -------------------------------------------------------------------

def _mask_of(field: str) -> set[int]:
    m = int(field, 16)
    return {s for s in range(1, 65) if m >> (s - 1) & 1}


@pytest.mark.forked
def test_worker_signal_mask_is_empty_when_caller_blocks_signals() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGCHLD})
    with spawned(["sleep", "30"]) as sp:
        st = _status(sp.pid)
        assert _mask_of(st["SigBlk"]) == set()
    # the caller's own mask is as it was
    assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set())


@pytest.mark.forked
def test_ignored_sighup_kept_sigpipe_restored_sigchld_not_handed_on() -> None:
    """nohup's rule: what the caller ignored stays ignored; Python's own
    SIGPIPE/SIGXFSZ ignores are restored; an ignored SIGCHLD is not handed
    on; a caught signal is default again."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, lambda *_: None)
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN      # Python's own
    assert {signal.SIGHUP, signal.SIGCHLD, signal.SIGPIPE} <= posix.ignored_signals()
    assert posix.keep_ignored_now() == {signal.SIGHUP}
    with spawned(["sleep", "30"]) as sp:
        st = _status(sp.pid)
        assert _mask_of(st["SigIgn"]) == {signal.SIGHUP}
        assert _mask_of(st["SigCgt"]) == set()
    with spawned(["sleep", "30"], keep_ignored=()) as sp:
        assert _mask_of(_status(sp.pid)["SigIgn"]) == set()


def test_keep_ignored_never_keeps_pipe_xfsz_chld() -> None:
    req = posix.SpawnRequest([TRUE], keep_ignored={signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD,
                                                   signal.SIGQUIT})
    assert req.keep_ignored == {signal.SIGQUIT}


# -- descriptors ---------------------------------------------------------------

class _Fds:
    """Descriptors of every kind contain itself holds, made by the test."""

    def __init__(self, tmp_path) -> None:
        self.child = subprocess.Popen(["sleep", "30"])
        self.fds: dict[str, int] = {}
        self.fds["pidfd"] = os.pidfd_open(self.child.pid)
        r, w = os.pipe()                       # close-on-exec (PEP 446)
        self.fds["pipe_r"], self.fds["pipe_w"] = r, w
        r2, w2 = os.pipe()
        os.set_inheritable(r2, True)           # inheritable, but not passed: must not leak
        self.fds["inheritable_pipe"], self.fds["pipe2_w"] = r2, w2
        lock = os.open(str(tmp_path / "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        self.fds["flock"] = lock
        self.nl = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)  # NETLINK_ROUTE
        self.fds["netlink"] = self.nl.fileno()
        self.ep = select.epoll()
        self.fds["epoll"] = self.ep.fileno()
        self.fds["passed_cloexec"] = os.open("/etc/hostname", os.O_RDONLY | os.O_CLOEXEC)
        self.fds["passed_inheritable"] = os.open("/etc/passwd", os.O_RDONLY)
        os.set_inheritable(self.fds["passed_inheritable"], True)

    def passed(self) -> list[int]:
        return [self.fds["passed_cloexec"], self.fds["passed_inheritable"]]

    def close(self) -> None:
        self.nl.close()
        self.ep.close()
        for k, fd in self.fds.items():
            if k not in ("netlink", "epoll"):
                os.close(fd)
        self.child.kill()
        self.child.wait(10)


def _asleep(pid: int, timeout: float = 10.0) -> None:
    """Wait until `sleep` sits in nanosleep: past its own start-up (which
    may open locale files for a moment), so its descriptors are what it
    inherited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/wchan") as f:
                if "nanosleep" in f.read():
                    return
        except OSError:
            return
        time.sleep(0.005)


def _fd_links(pid: int) -> dict[int, str]:
    d = f"/proc/{pid}/fd"
    return {int(n): os.readlink(os.path.join(d, n)) for n in os.listdir(d)}


def _check_worker_fds(fds: _Fds, **kw: object) -> None:
    with spawned(["sleep", "30"], pass_fds=fds.passed(), **kw) as sp:
        _asleep(sp.pid)
        links = _fd_links(sp.pid)
    assert sorted(links) == sorted({0, 1, 2, *fds.passed()}), links
    for fd in fds.passed():
        assert links[fd] == os.readlink(f"/proc/self/fd/{fd}")
    # the parent's descriptors are as they were
    assert not os.get_inheritable(fds.fds["passed_cloexec"])


@pytest.mark.forked
def test_only_pass_fds_reach_the_worker(tmp_path) -> None:
    fds = _Fds(tmp_path)
    try:
        _check_worker_fds(fds)
    finally:
        fds.close()


@pytest.mark.forked
@pytest.mark.skipif(_seccomp.supported() is not None, reason=_seccomp.supported() or "")
@pytest.mark.parametrize("err", [errno.EINVAL, errno.ENOSYS], ids=["before-5.11", "before-5.9"])
def test_only_pass_fds_reach_the_worker_without_close_range_cloexec(tmp_path, err: int) -> None:
    """close_range(CLOSE_RANGE_CLOEXEC) fails as on an older kernel (seccomp
    makes it): the /proc/self/fd scan must give the same result."""
    fds = _Fds(tmp_path)
    try:
        _seccomp.install({"close_range": err})
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(_seccomp.NR["close_range"], 1 << 20, 1 << 20, 4) == -1
        assert ctypes.get_errno() == err
        _check_worker_fds(fds)
    finally:
        fds.close()


@pytest.mark.forked
@pytest.mark.parametrize("how", [1, 2], ids=["scan", "loop"])
def test_cloexec_fallbacks_directly(tmp_path, how: int) -> None:
    """Each fallback of ct_fds_cloexec_except on its own, in a forked child
    that then execs: only the kept descriptors survive."""
    fds = _Fds(tmp_path)
    try:
        keep = sorted(fds.passed())
        pid = os.fork()
        if pid == 0:
            try:
                arr = ffi.new("int[]", keep)
                rc = lib.ct_fds_cloexec_except(arr, len(keep), how)
                if rc == 0:
                    os.execv("/bin/sleep", ["sleep", "30"])
            finally:
                os._exit(99)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "sleep":
                        break
                time.sleep(0.005)
            _asleep(pid)
            links = _fd_links(pid)
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert sorted(k for k in links if k > 2) == keep, links
    finally:
        fds.close()


@pytest.mark.forked
def test_inherited_fds_lists_what_the_caller_passed() -> None:
    r, w = os.pipe()
    os.set_inheritable(r, True)
    try:
        fds = posix.inherited_fds()
        assert r in fds and w not in fds
        assert all(fd > 2 for fd in fds)
    finally:
        os.close(r)
        os.close(w)


def test_process_substitution_reaches_the_worker_through_the_cli(tmp_path) -> None:
    """The shape of `contain run -- cat <(echo hi)` at the spawn level: a
    descriptor given without close-on-exec and passed on by number."""
    r, w = os.pipe()
    os.write(w, b"hi\n")
    os.close(w)
    out_r, out_w = os.pipe()
    try:
        with spawned(["cat", f"/dev/fd/{r}"], pass_fds=[r], stdio=(-1, out_w, -1)) as sp:
            os.close(out_w)
            out_w = -1
            assert _reap(sp) is not None
            assert os.read(out_r, 100) == b"hi\n"
    finally:
        os.close(r)
        os.close(out_r)
        if out_w >= 0:
            os.close(out_w)


# -- exec like execvp ----------------------------------------------------------

def test_script_without_shebang_runs_under_sh(tmp_path) -> None:
    script = tmp_path / "noshebang"
    script.write_text('echo "ran $0 $#:$1:$2"\n')
    script.chmod(0o755)
    r, w = os.pipe()
    try:
        with spawned([str(script), "a b", "c"], stdio=(-1, w, -1)) as sp:
            os.close(w)
            w = -1
            assert _reap(sp) is not None
            assert os.read(r, 200).decode() == f"ran {script} 2:a b:c\n"
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_script_without_shebang_found_on_path(tmp_path) -> None:
    script = tmp_path / "noshebang-cmd"
    script.write_text("exit 5\n")
    script.chmod(0o755)
    env = {"PATH": f"/nonexistent:{tmp_path}:/usr/bin:/bin"}
    with spawned(["noshebang-cmd"], env=env) as sp:
        info = _reap(sp)
        assert info is not None and info.si_status == 5


def test_missing_interpreter_says_bad_interpreter(tmp_path) -> None:
    script = tmp_path / "badinterp"
    script.write_text("#!/nonexistent/interpreter -x\necho never\n")
    script.chmod(0o755)
    with pytest.raises(SpawnFailed) as ei:
        posix.spawn(posix.SpawnRequest([str(script)], env=dict(ENV)))
    assert str(ei.value) == f"{script}: /nonexistent/interpreter: bad interpreter: No such file or directory"
    assert ei.value.exit_code == 126
    # and found by PATH search, after a directory that does not have it
    env = {"PATH": f"/nonexistent:{tmp_path}"}
    with pytest.raises(SpawnFailed) as ei:
        posix.spawn(posix.SpawnRequest(["badinterp"], env=env))
    assert "bad interpreter" in str(ei.value) and ei.value.exit_code == 126


def test_command_not_found_is_127() -> None:
    with pytest.raises(SpawnFailed) as ei:
        posix.spawn(posix.SpawnRequest(["no-such-command-xyz"], env=dict(ENV)))
    assert str(ei.value) == "no-such-command-xyz: command not found"
    assert ei.value.exit_code == 127


def test_not_executable_is_126(tmp_path) -> None:
    f = tmp_path / "plain"
    f.write_text("echo\n")
    f.chmod(0o644)
    with pytest.raises(SpawnFailed) as ei:
        posix.spawn(posix.SpawnRequest([str(f)], env=dict(ENV)))
    assert ei.value.exit_code == 126 and ei.value.errno == errno.EACCES


def test_later_candidate_runs_after_eacces(tmp_path) -> None:
    """execvp: EACCES on one PATH entry, a runnable file on a later one."""
    a = tmp_path / "a"
    b = tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "tool").write_text("exit 1\n")
    (a / "tool").chmod(0o644)
    (b / "tool").write_text("#!/bin/sh\nexit 4\n")
    (b / "tool").chmod(0o755)
    with spawned(["tool"], env={"PATH": f"{a}:{b}"}) as sp:
        info = _reap(sp)
        assert info is not None and info.si_status == 4


def test_cli_reports_bad_interpreter(tmp_path) -> None:
    """`contain run` with --backend none (no cgroup needed): message and 126."""
    script = tmp_path / "badinterp"
    script.write_text("#!/nonexistent/interp\n")
    script.chmod(0o755)
    env = dict(os.environ, CONTAIN_STATE_DIR=str(tmp_path / "state"),
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-m", "launcher", "run", "--backend", "none", "--", str(script)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 126, p.stderr
    assert "bad interpreter" in p.stderr
