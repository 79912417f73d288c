"""The /proc scanner: its parsers against fixtures, its scan against the kernel.

Real-kernel tests judge the scan with an independent view of /proc (a
listdir, a direct read of /proc/<pid>/stat split by hand), never with the
code under test. Every process a test starts is killed and reaped by pid.
"""
from __future__ import annotations

import errno
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import pytest

from _proc import readline_within
from launcher import _scan
from launcher._scan import ProcessInfo, members_of, parse_cgroup, parse_stat, scan_processes

DATA = pathlib.Path(__file__).parent / "data" / "proc"
native = pytest.mark.skipif(_scan._lib is None, reason=f"extension not built: {_scan._native_missing}")


def fixture(name: str) -> str:
    return (DATA / name).read_bytes().decode("utf-8", "surrogateescape")


def raw_stat_fields(pid: int) -> tuple[str, list[str]]:
    """comm and fields 3.. of /proc/<pid>/stat, split by hand (proc(5))."""
    text = pathlib.Path(f"/proc/{pid}/stat").read_bytes().decode("utf-8", "surrogateescape")
    head, _, tail = text.rpartition(")")
    return head.partition("(")[2], tail.split()


def by_pid(procs: list[ProcessInfo]) -> dict[int, ProcessInfo]:
    return {p.pid: p for p in procs}


@pytest.fixture
def spawn():
    """Popen that kills and reaps, by pid, whatever the test started."""
    started: list[subprocess.Popen] = []

    def start(argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        for f in (p.stdin, p.stdout, p.stderr):
            if f is not None:
                f.close()


def sleeper_named(spawn, name: bytes) -> subprocess.Popen:
    """A child that sets its comm with prctl(PR_SET_NAME), says so, and sleeps."""
    code = (
        "import ctypes, sys, time\n"
        f"ctypes.CDLL(None, use_errno=True).prctl(15, {name!r}, 0, 0, 0)\n"
        "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
        "time.sleep(60)\n"
    )
    p = spawn([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and readline_within(p.stdout) == b"ready\n"
    return p


# --- pure parsers, fixtures -------------------------------------------------


def test_parse_stat_comm_with_spaces_and_parentheses():
    info = parse_stat(fixture("stat_comm_parens"))
    assert info == ProcessInfo(
        pid=4242, ppid=1, pgid=4242, sid=4242, state="S", start_time=987654,
        comm="(a) b)", cgroup=None, cgroup_error=_scan.NOT_REQUESTED,
    )


def test_parse_stat_comm_with_newline():
    info = parse_stat(fixture("stat_comm_newline"))
    assert info.comm == "x\n) y (z"
    assert (info.pid, info.ppid, info.pgid, info.sid, info.state, info.start_time) == (
        31795, 31790, 31790, 2989, "R", 73169,
    )


def test_parse_stat_zombie():
    info = parse_stat(fixture("stat_zombie"))
    assert (info.pid, info.ppid, info.state, info.comm, info.start_time) == (5151, 5150, "Z", "worker 3", 123456)


def test_parse_stat_kernel_thread_has_zero_ids():
    info = parse_stat(fixture("stat_kthread"))
    assert (info.pid, info.ppid, info.pgid, info.sid, info.comm, info.start_time) == (2, 0, 0, 0, "kthreadd", 22)


@pytest.mark.parametrize("text", ["", "12 (x", "12 x) S 1 2 3", "12 (x) S 1 2 3 4\n", "x (y) S" + " 1" * 30])
def test_parse_stat_rejects_malformed(text):
    with pytest.raises(ValueError):
        parse_stat(text)


def test_parse_cgroup_hybrid_takes_the_v2_line():
    assert parse_cgroup(fixture("cgroup_hybrid")) == "/user.slice/user-1000.slice/session-3.scope"


def test_parse_cgroup_pure_v2():
    assert parse_cgroup(fixture("cgroup_v2")) == "/system.slice/contain-run-7.scope/worker"


def test_parse_cgroup_v1_only_has_no_v2_path():
    assert parse_cgroup(fixture("cgroup_v1_only")) is None


def test_parse_cgroup_keeps_the_kernel_deleted_marker():
    assert parse_cgroup(fixture("cgroup_v2_deleted")) == "/contain/run-9 (deleted)"


def _p(pid: int, cgroup: str | None, error: str | None = None) -> ProcessInfo:
    return ProcessInfo(pid, 1, pid, pid, "S", 100, "x", cgroup, error)


def test_members_of_matches_path_and_descendants_only():
    procs = [
        _p(1, "/a"), _p(2, "/a/b"), _p(3, "/a/b/c"), _p(4, "/ab"), _p(5, "/"),
        _p(6, None, "permission denied"), _p(7, "/a (deleted)"),
    ]
    assert [p.pid for p in members_of("/a", procs)] == [1, 2, 3]
    assert [p.pid for p in members_of("/a/", procs)] == [1, 2, 3]
    assert [p.pid for p in members_of("/a/b", procs)] == [2, 3]
    assert [p.pid for p in members_of("/", procs)] == [1, 2, 3, 4, 5, 7]
    assert members_of("/zz", procs) == []


# --- the real kernel ---------------------------------------------------------


def test_scan_finds_self_with_the_kernel_ids():
    me = by_pid(scan_processes())[os.getpid()]
    comm, fields = raw_stat_fields(os.getpid())
    assert me.ppid == os.getppid()
    assert me.pgid == os.getpgid(0)
    assert me.sid == os.getsid(0)
    assert me.start_time == int(fields[19])  # field 22
    assert me.state == "R"
    assert me.comm == comm
    assert me.cgroup == parse_cgroup(pathlib.Path("/proc/self/cgroup").read_text())
    assert me.cgroup is not None and me.cgroup_error is None


def test_scan_without_cgroups_says_so():
    procs = scan_processes(cgroups=False)
    me = by_pid(procs)[os.getpid()]
    assert me.ppid == os.getppid()
    assert all(p.cgroup is None and p.cgroup_error == _scan.NOT_REQUESTED for p in procs)


def test_scan_has_no_duplicate_pids():
    procs = scan_processes()
    assert len({p.pid for p in procs}) == len(procs)


def test_pids_present_around_the_scan_are_in_the_scan():
    def listing() -> set[int]:
        return {int(n) for n in os.listdir("/proc") if n.isdigit()}

    before = listing()
    scanned = {p.pid for p in scan_processes()}
    after = listing()
    assert (before & after) - scanned == set()
    # Every scanned pid was listed at some point around the scan, or was
    # born and died during it; almost all are in a listing.
    assert len(scanned - before - after) <= 5


def test_child_appears_then_is_gone_after_reap(spawn):
    child = spawn(["sleep", "60"])
    procs = by_pid(scan_processes())
    assert child.pid in procs
    info = procs[child.pid]
    assert info.ppid == os.getpid()
    assert info.start_time == int(raw_stat_fields(child.pid)[1][19])

    child.kill()
    child.wait(10)
    # The pid may in principle be reused; the process (pid, start time) may not.
    assert all((p.pid, p.start_time) != (info.pid, info.start_time) for p in scan_processes())


def test_zombie_is_reported_until_reaped(spawn):
    child = spawn(["true"])
    deadline = time.monotonic() + 10
    while raw_stat_fields(child.pid)[1][0] != "Z":
        assert time.monotonic() < deadline, "child did not exit"
        time.sleep(0.01)
    zombie = by_pid(scan_processes())[child.pid]
    assert zombie.state == "Z"
    assert zombie.ppid == os.getpid()
    # A zombie still has a cgroup line but is in no cgroup.procs: the scan
    # must have read its file rather than the walk's map.
    assert zombie.cgroup == parse_cgroup(pathlib.Path(f"/proc/{child.pid}/cgroup").read_text())
    child.wait(10)
    assert child.pid not in by_pid(scan_processes())


@pytest.mark.parametrize("name", [b"(a) b)", b"my worker  x", b"x\n) y (z", b") 1 2 3 ("])
def test_comm_with_spaces_parentheses_and_newlines(spawn, name):
    child = sleeper_named(spawn, name)
    info = by_pid(scan_processes())[child.pid]
    assert info.comm == name.decode()
    assert info.ppid == os.getpid()
    assert info.state in ("R", "S")  # it may not have reached its sleep yet
    assert info.start_time == int(raw_stat_fields(child.pid)[1][19])


def test_comm_set_through_proc_self_comm(spawn):
    code = (
        "import sys, time\n"
        "open('/proc/self/comm', 'w').write('a (b) c)')\n"
        "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
        "time.sleep(60)\n"
    )
    child = spawn([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None and readline_within(child.stdout) == b"ready\n"
    assert by_pid(scan_processes())[child.pid].comm == "a (b) c)"


def test_undecodable_comm_round_trips_as_surrogates(spawn):
    child = sleeper_named(spawn, b"bad\xff\xfename")
    info = by_pid(scan_processes())[child.pid]
    assert info.comm.encode("utf-8", "surrogateescape") == b"bad\xff\xfename"


def test_python_reader_agrees_with_native(spawn):
    child = sleeper_named(spawn, b"agree (x)")
    native_view = by_pid(scan_processes())
    python_view = by_pid(_scan._scan_python(True))
    for pid in (os.getpid(), os.getppid(), child.pid):
        # state is the one field that may change between the two reads
        assert native_view[pid]._replace(state="") == python_view[pid]._replace(state="")


def test_scan_survives_churn(spawn):
    """Processes exit and are reaped while the scan runs: they are left out,
    never reported half-read, and the scan does not fail."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            while not stop.is_set():
                subprocess.run(["true"], check=True)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(100):
            for p in scan_processes():
                assert p.pid > 0 and len(p.state) == 1
                assert p.cgroup is not None or p.cgroup_error is not None
    finally:
        stop.set()
        t.join(30)
    assert errors == []


@native
@pytest.mark.parametrize("cgroups", [True, False])
def test_threaded_and_single_threaded_scans_agree(cgroups):
    one, many = _stats(), _stats()
    single = by_pid(_scan._scan_native(cgroups, threads=1, stats=one))
    threaded = by_pid(_scan._scan_native(cgroups, threads=4, stats=many))
    assert (one.threads, many.threads) == (1, 4)
    common = single.keys() & threaded.keys()
    assert len(common) >= 0.9 * max(len(single), len(threaded))
    for pid in common:
        assert single[pid]._replace(state="", comm="") == threaded[pid]._replace(state="", comm=""), pid
    assert os.getpid() in threaded


@native
def test_threaded_scan_survives_churn(spawn):
    """As test_scan_survives_churn, with the reads spread over threads even
    though there are few processes, so that exits land mid-chunk."""
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            subprocess.run(["true"], check=True)

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(100):
            procs = _scan._scan_native(True, threads=3)
            assert len({p.pid for p in procs}) == len(procs)
            for p in procs:
                assert p.pid > 0 and len(p.state) == 1
                assert p.cgroup is not None or p.cgroup_error is not None
    finally:
        stop.set()
        t.join(30)


# --- the C interface ---------------------------------------------------------


@native
def test_small_buffer_reports_enospc_with_a_size_hint():
    ffi, lib = _scan._ffi, _scan._lib
    buf = ffi.new("struct ct_proc[]", 2)
    n = ffi.new("int *")
    assert lib.ct_procscan_read(buf, 2, n, lib.CT_PROCSCAN_CGROUP, 0, ffi.NULL) == -errno.ENOSPC
    assert n[0] > 2


@native
def test_scan_grows_its_buffer(monkeypatch):
    monkeypatch.setattr(_scan, "_cap_hint", 1)
    procs = scan_processes()
    assert os.getpid() in by_pid(procs)
    assert _scan._cap_hint > len(procs)


@native
@pytest.mark.parametrize(
    ("flag", "err", "reason"),
    [("CT_PROC_CGROUP_DENIED", errno.EACCES, "permission denied"),
     ("CT_PROC_CGROUP_DENIED", errno.EPERM, "operation not permitted"),
     ("CT_PROC_CGROUP_UNREADABLE", errno.EIO, "input/output error")],
)
def test_unreadable_cgroup_is_kept_with_its_reason(flag, err, reason):
    ffi, lib = _scan._ffi, _scan._lib
    p = ffi.new("struct ct_proc *", {"pid": 77, "ppid": 1, "pgid": 77, "sid": 77, "state": b"S",
                                     "start_time": 5, "flags": getattr(lib, flag), "cgroup_errno": err,
                                     "comm": b"w"})
    info = _scan._odd_entry(p[0], True)
    assert info == ProcessInfo(77, 1, 77, 77, "S", 5, "w", None, reason)


@native
def test_missing_v2_line_is_reported():
    ffi, lib = _scan._ffi, _scan._lib
    p = ffi.new("struct ct_proc *", {"pid": 9, "state": b"S", "flags": lib.CT_PROC_CGROUP_ABSENT, "comm": b"w"})
    assert _scan._odd_entry(p[0], True).cgroup_error == _scan.NO_V2


@native
def test_unreadable_stat_fails_the_scan():
    ffi, lib = _scan._ffi, _scan._lib
    p = ffi.new("struct ct_proc *", {"pid": 9, "flags": lib.CT_PROC_STAT_UNREADABLE, "stat_errno": errno.EACCES})
    with pytest.raises(PermissionError, match="/proc/9/stat"):
        _scan._odd_entry(p[0], True)


@native
def test_truncated_cgroup_is_read_again_for_the_same_process():
    ffi, lib = _scan._ffi, _scan._lib
    _, fields = raw_stat_fields(os.getpid())
    start = int(fields[19])
    p = ffi.new("struct ct_proc *", {"pid": os.getpid(), "state": b"R", "start_time": start,
                                     "flags": lib.CT_PROC_CGROUP_TRUNCATED, "comm": b"py"})
    info = _scan._odd_entry(p[0], True)
    assert info.cgroup == parse_cgroup(pathlib.Path("/proc/self/cgroup").read_text())
    # Same pid, other start time: another process, so the entry is dropped.
    p.start_time = start + 1
    assert _scan._odd_entry(p[0], True) is None


@native
def test_columns_name_each_path_once_and_list_odd_entries():
    ffi, lib = _scan._ffi, _scan._lib
    rows = [(10, b"a", b"/x", 0), (11, b"b c", b"/y", 0), (12, b"", b"/x", lib.CT_PROC_CGROUP_DENIED),
            (13, b"d\xff", b"/y", lib.CT_PROC_COMM_TRUNCATED), (14, b"e", b"", 0)]
    buf = ffi.new("struct ct_proc[]", [{"pid": pid, "ppid": pid + 1, "pgid": pid + 2, "sid": pid + 3,
                                        "state": b"S", "start_time": pid * 100, "comm": comm,
                                        "cgroup": cg, "flags": flags} for pid, comm, cg, flags in rows])
    n = len(rows)
    arrays = {"ids": ffi.new("int[]", 4 * n), "start_time": ffi.new("unsigned long long[]", n),
              "state": ffi.new("char[]", n), "comm": ffi.new("char[]", n * 65),
              "cgroup": ffi.new("int[]", n), "odd": ffi.new("int[]", n)}
    cols = ffi.new("struct ct_procscan_cols *", arrays)
    assert lib.ct_procscan_pack(buf, n, lib.CT_PROC_CGROUP_DENIED, cols) == 0
    ids = ffi.unpack(arrays["ids"], 4 * n)
    assert ids[:n] == [10, 11, 12, 13, 14] and ids[n:2 * n] == [11, 12, 13, 14, 15]
    assert ids[3 * n:] == [13, 14, 15, 16, 17]
    assert ffi.unpack(arrays["start_time"], n) == [1000, 1100, 1200, 1300, 1400]
    assert ffi.unpack(arrays["comm"], cols.comm_len) == b"a\0b c\0\0d\xff\0e\0"
    assert ffi.unpack(arrays["cgroup"], n) == [0, 1, 0, 1, 4]
    assert ffi.unpack(arrays["odd"], cols.n_odd) == [2]


@native
def test_odd_entries_are_replaced_or_dropped_in_place(monkeypatch):
    """Entries with a failure flag go through _odd_entry: kept with the
    reason, or dropped when the process is gone, without shifting others."""
    ffi, lib = _scan._ffi, _scan._lib
    me, start = os.getpid(), int(raw_stat_fields(os.getpid())[1][19])
    rows = [{"pid": 1, "state": b"S", "comm": b"one", "cgroup": b"/a"},
            {"pid": me, "state": b"R", "start_time": start + 1, "comm": b"reused",
             "flags": lib.CT_PROC_CGROUP_TRUNCATED},  # same pid, other start: gone
            {"pid": 3, "state": b"S", "comm": b"three", "cgroup_errno": errno.EACCES,
             "flags": lib.CT_PROC_CGROUP_DENIED},
            {"pid": 4, "state": b"Z", "comm": b"four", "cgroup": b"/a"}]
    buf = ffi.new("struct ct_proc[]", rows)
    monkeypatch.setattr(_scan, "_read_all", lambda *a, **k: (buf, len(rows)))
    out = _scan._scan_native(True)
    assert [(p.pid, p.comm, p.cgroup, p.cgroup_error) for p in out] == [
        (1, "one", "/a", None), (3, "three", None, "permission denied"), (4, "four", "/a", None)]
    assert out[0].cgroup is out[2].cgroup


# --- a real cgroup path longer than the C buffer -------------------------------


def _v2_mount() -> pathlib.Path | None:
    for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] == "cgroup2" and left.split()[3] == "/":
            return pathlib.Path(left.split()[4])
    return None


@pytest.fixture
def long_cgroup():
    """Our own nested cgroup whose v2 path exceeds CT_PROC_CGROUP_MAX; removed after."""
    mount = _v2_mount()
    own = parse_cgroup(pathlib.Path("/proc/self/cgroup").read_text())
    if mount is None or own is None or not os.access(mount / own.lstrip("/"), os.W_OK):
        pytest.skip("no writable cgroup v2 hierarchy")
    base = mount / own.lstrip("/")
    names = [f"contain-test-scan-{os.getpid()}", "a" * 200, "b" * 200, "c" * 200]
    made: list[pathlib.Path] = []
    try:
        d = base
        for n in names:
            d = d / n
            d.mkdir()
            made.append(d)
    except OSError as e:
        for m in reversed(made):
            m.rmdir()
        pytest.skip(f"cannot create a test cgroup: {e}")
    yield d, own.rstrip("/") + "/" + "/".join(names)
    # The test has reaped its child by now; the leaf empties once the task is
    # released, which may trail the wait by a moment.
    deadline = time.monotonic() + 20
    for m in reversed(made):
        while True:
            try:
                m.rmdir()
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


def test_long_cgroup_path_is_reported_whole(long_cgroup):
    directory, path = long_cgroup
    assert len(path) > 600
    child = subprocess.Popen(["sleep", "60"])
    try:  # reaped here, before the fixture removes the cgroup it sits in
        (directory / "cgroup.procs").write_text(str(child.pid))
        procs = scan_processes()
        info = by_pid(procs)[child.pid]
        assert info.cgroup == path
        assert info.cgroup_error is None
        assert [p.pid for p in members_of(path.rsplit("/", 2)[0], procs)] == [child.pid]
    finally:
        child.kill()
        child.wait(10)


# --- cgroups from the hierarchy walk -----------------------------------------


def _stats():
    return _scan._ffi.new("struct ct_procscan_stats *")


def _cgroup_files() -> dict[int, tuple[int, str | None]]:
    """pid -> (start time, v2 path) for every process, each read by hand."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}", os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue
        try:
            stat = os.read(os.open("stat", os.O_RDONLY, dir_fd=fd), 4096).decode("utf-8", "surrogateescape")
            path = parse_cgroup(pathlib.Path(f"/proc/self/fd/{fd}/cgroup").read_text("utf-8", "surrogateescape"))
        except OSError:
            continue
        finally:
            os.close(fd)
        out[int(name)] = (int(stat.rpartition(")")[2].split()[19]), path)
    return out


@native
def test_walked_cgroups_are_what_proc_pid_cgroup_says():
    """Every process's cgroup equals its own /proc/<pid>/cgroup. A process
    that exited or moved between the reads is read again on its own."""
    before = _cgroup_files()
    st = _stats()
    procs = _scan._scan_native(True, stats=st)
    after = _cgroup_files()
    if _v2_mount() is not None:
        assert st.walked == 1 and st.cgroups_walked >= 1
        assert st.cgroup_mapped > len(procs) // 2, "the walk mapped hardly anyone: the test proves nothing"
    unsettled = []
    for p in procs:
        a, b = before.get(p.pid), after.get(p.pid)
        if a is not None and a == b and a[0] == p.start_time:
            assert p.cgroup == a[1], p
        else:
            unsettled.append(p)
    for p in unsettled:  # born, exited or moved around the scan: ask once more
        try:
            again = _scan._read_cgroup_py(p.pid, p.start_time)[0]
        except ProcessLookupError:
            continue
        assert p.cgroup == again or p.cgroup in (a[1] for a in (before.get(p.pid), after.get(p.pid)) if a), p


@native
def test_walk_and_per_process_reads_agree():
    walked = by_pid(_scan._scan_native(True))
    each = by_pid(_scan._scan_native(True, walk=False))
    for pid in walked.keys() & each.keys():
        # state and comm (kworkers rename themselves) may change between reads
        assert walked[pid]._replace(state="", comm="") == each[pid]._replace(state="", comm=""), pid


@native
def test_per_process_reads_when_asked():
    st = _stats()
    _scan._scan_native(True, walk=False, stats=st)
    assert (st.walked, st.cgroup_mapped) == (0, 0) and st.cgroup_fallback > 0


@pytest.fixture
def own_cgroup():
    """A fresh cgroup below our own: (directory, path as /proc shows it),
    plus everything the test makes under it, removed after (rmdir only:
    the test reaps its processes first)."""
    mount = _v2_mount()
    own = parse_cgroup(pathlib.Path("/proc/self/cgroup").read_text())
    if mount is None or own is None or not os.access(mount / own.lstrip("/"), os.W_OK):
        pytest.skip("no writable cgroup v2 hierarchy")
    name = f"contain-test-scan-{os.getpid()}"
    d = mount / own.lstrip("/") / name
    try:
        d.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a test cgroup: {e}")
    yield d, own.rstrip("/") + "/" + name
    deadline = time.monotonic() + 20
    for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [d]:
        while True:
            try:
                sub.rmdir()
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


@native
def test_process_in_a_nested_cgroup_is_mapped(own_cgroup, spawn):
    directory, path = own_cgroup
    (directory / "a b" / "c").mkdir(parents=True)  # a space: the path is not escaped
    child = spawn(["sleep", "60"])
    (directory / "a b" / "c" / "cgroup.procs").write_text(str(child.pid))
    time.sleep(0.03)  # older than the walk by more than a clock tick: eligible for the map
    st = _stats()
    info = by_pid(_scan._scan_native(True, stats=st))[child.pid]
    assert info.cgroup == path + "/a b/c" == parse_cgroup(pathlib.Path(f"/proc/{child.pid}/cgroup").read_text())
    assert st.cgroup_mapped > 0
    child.kill()
    child.wait(10)


@native
def test_threaded_cgroup_reports_the_leaders_cgroup(own_cgroup, spawn):
    """A threaded domain's cgroup.procs lists the processes of its threaded
    children too; /proc/<pid>/cgroup names the child. The scan must too."""
    directory, path = own_cgroup
    (directory / "t").mkdir()
    try:
        (directory / "t" / "cgroup.type").write_text("threaded")
    except OSError as e:
        pytest.skip(f"cannot make a threaded cgroup: {e}")
    child = spawn(["sleep", "60"])
    (directory / "cgroup.procs").write_text(str(child.pid))
    (directory / "t" / "cgroup.threads").write_text(str(child.pid))  # its only thread, the leader
    assert str(child.pid) in (directory / "cgroup.procs").read_text().split()
    time.sleep(0.03)
    assert by_pid(scan_processes())[child.pid].cgroup == path + "/t"
    child.kill()
    child.wait(10)


@native
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_mount_of_a_subtree_prefixes_its_root(own_cgroup, spawn, tmp_path):
    """Where cgroup2 is mounted from a subtree (mountinfo field 4 is not
    "/"), paths below the mount point are prefixed with that root. Run in a
    private mount namespace that sees only such a mount."""
    directory, path = own_cgroup
    (directory / "a" / "b").mkdir(parents=True)
    child = spawn(["sleep", "60"])
    (directory / "a" / "b" / "cgroup.procs").write_text(str(child.pid))
    time.sleep(0.03)
    mounts = [line.split()[4] for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines()
              if line.partition(" - ")[2].startswith("cgroup2 ")]
    point = tmp_path / "mnt"
    point.mkdir()
    script = (
        f"mount --bind {directory / 'a'} {point} && "
        + "".join(f"umount -l {m} && " for m in mounts)
        + f"{sys.executable} -c 'import sys; sys.path.insert(0, sys.argv[1]); "
        "from launcher import _scan; st = _scan._ffi.new(\"struct ct_procscan_stats *\"); "
        "p = {x.pid: x for x in _scan._scan_native(True, stats=st)}[int(sys.argv[2])]; "
        "print(p.cgroup, st.cgroup_mapped, sep=\"\\n\")' "
        f"{pathlib.Path(__file__).parent.parent} {child.pid}"
    )
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0 and "unshare" in r.stderr:
        pytest.skip(f"cannot make a mount namespace: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    cgroup, mapped = r.stdout.splitlines()
    assert cgroup == path + "/a/b"
    assert int(mapped) >= 1  # from the walk under the subtree mount, not a fallback
    child.kill()
    child.wait(10)
