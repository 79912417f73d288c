"""Where `--record` and `--stats-json` write: a FIFO held full or a directory
linked by another user is refused before the run, a descriptor not open or
the caller's stdin or a /dev/tty without a terminal are never taken, while
an open descriptor, stdout, the caller's own links and pathlib paths still
work, and a record file whose supervisor died is written by the adopter."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _proc import contain_cmd, holders, readline_within, run_contain
from _users import Shared, as_uid, python, spare_uids, user_env, why_not
from conftest import TOKEN_VAR, needs_cgroup


USERS_SKIP = why_not()


needs_users = pytest.mark.skipif(USERS_SKIP is not None, reason=USERS_SKIP or "")


_FILL_FIFO = r"""
import os, sys, time
os.mkfifo(sys.argv[1], 0o666)
# Both ends: the FIFO has a reader (so contain's open succeeds), and the
# pipe buffer is filled so that any further write blocks.
fd = os.open(sys.argv[1], os.O_RDWR | os.O_NONBLOCK)
try:
    while True:
        os.write(fd, b"x" * 4096)
except BlockingIOError:
    pass
print("full", flush=True)
time.sleep(120)
"""


@needs_users
@needs_cgroup
@pytest.mark.timeout(90)
def test_fifo_held_full_by_another_user_at_the_record_path_does_not_hang_contain(box):
    """Another user makes a FIFO where root's --record points, keeps it
    open for reading and fills its buffer. The run ends, and then `contain`
    blocked for ever in the final write of the record: the caller never got
    its exit status, for as long as the attacker liked."""
    attacker, = spare_uids(1)
    with Shared(mode=0o1777) as sh:
        fifo = os.path.join(sh.path, "rec.json")
        hold = subprocess.Popen(["setpriv", f"--reuid={attacker}", f"--regid={attacker}", "--clear-groups",
                                 "--", python(), "-c", _FILL_FIFO, fifo],
                                env=user_env(), stdout=subprocess.PIPE, cwd="/")
        try:
            assert readline_within(hold.stdout, 30).strip() == b"full"
            p = subprocess.Popen(contain_cmd("run", "--id", "ff", "--record", fifo, "--", "true"),
                                 env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                _out, err = p.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate(timeout=10)
                pytest.fail("contain hung writing --record into another user's full FIFO")
            assert p.returncode == 125, (p.returncode, err)
            assert "Traceback" not in err and "rec.json" in err, err
        finally:
            hold.kill()
            hold.wait(10)
    assert holders(box.token) == []


@needs_users
@needs_cgroup
@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--record", "--stats-json"])
def test_another_users_symlinked_directory_in_the_output_path_is_not_followed(box, tmp_path, flag):
    """Another user owns a directory in the middle of root's --record (or
    --stats-json) path and makes it a symlink to a directory of root's
    choosing (here a stand-in for /etc). The last component's link rule
    (followed only when it belongs to root or to us) was not applied to the
    directories above it: root created its file in the attacker's target."""
    attacker, = spare_uids(1)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    with Shared() as sh:
        theirs = sh.sub("theirs", uid=attacker)
        link = os.path.join(theirs, "out")
        assert as_uid(attacker, ["ln", "-s", str(victim), link]).returncode == 0
        target = os.path.join(link, "made-by-root")
        p = subprocess.run(contain_cmd("run", "-q", "--id", "sd", flag, target, "--", "true"), env=box.env,
                           capture_output=True, text=True, timeout=30)
        assert os.listdir(victim) == [], f"root wrote through another user's symlink: {os.listdir(victim)}"
        assert p.returncode == 125, (p.returncode, p.stderr)
        assert "Traceback" not in p.stderr and "not followed" in p.stderr, p.stderr
    assert holders(box.token) == []


@needs_cgroup
@pytest.mark.timeout(60)
def test_own_symlinked_directory_in_the_record_path_is_still_followed(box, tmp_path):
    """The rule above refuses only links another user made: a link of our
    own in the path still works (the record lands where it points)."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "via").symlink_to(real)
    p = subprocess.run(contain_cmd("run", "-q", "--id", "own", "--record", str(tmp_path / "via" / "r.json"),
                                   "--", "true"), env=box.env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert os.listdir(real) == ["r.json"]


PY = sys.executable


def _survivors(box) -> list[int]:
    return sorted(holders(box.token, TOKEN_VAR))


@needs_cgroup
@pytest.mark.parametrize("name", ["/dev/stdin", "/dev/fd/0", "/proc/self/fd/0"])
def test_record_to_stdin_however_named_never_replaces_the_callers_input_file(box, tmp_path, name):
    """`--record /dev/fd/0` with stdin redirected from a file is refused
    ("our descriptor 0, open only for reading"); `/dev/stdin` is the same
    descriptor by another name (a root-owned link to /proc/self/fd/0) and
    must get the same answer, not the atomic replace of a regular file:
    that deleted the caller's input (`contain run --record /dev/stdin --
    cat < data` left `data` holding the record)."""
    data = tmp_path / "input.txt"
    data.write_bytes(b"the caller's data\n")
    with open(data, "rb") as stdin:
        p = subprocess.run([PY, "-m", "launcher", "run", "--record", name, "--", "true"], env=box.env,
                           stdin=stdin, capture_output=True, timeout=60)
    assert data.read_bytes() == b"the caller's data\n"
    assert p.returncode == 125, (p.returncode, p.stderr)
    lines = p.stderr.decode().splitlines()
    assert len(lines) == 1 and "descriptor 0" in lines[0], p.stderr
    assert _survivors(box) == []


@needs_cgroup
def test_record_to_dev_tty_without_a_terminal_is_not_called_a_fifo(box):
    """`--record /dev/tty` from a process with no controlling terminal (cron,
    a CI job) fails to open with ENXIO, as a FIFO with no reader does; the
    one line must say what is wrong with a terminal device, not send the
    user looking for a FIFO reader."""
    p = subprocess.run([PY, "-m", "launcher", "run", "--record", "/dev/tty", "--", "true"], env=box.env,
                       capture_output=True, timeout=60, start_new_session=True)
    assert p.returncode == 125, p.stderr
    lines = p.stderr.decode().splitlines()
    assert len(lines) == 1 and "/dev/tty" in lines[0], p.stderr
    assert "FIFO" not in lines[0], lines[0]


def _sh_contain(box, redirect: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`contain ARGS` from a shell line with `redirect` (closing one of
    contain's descriptors, as a script would)."""
    import shlex

    line = " ".join(shlex.quote(a) for a in [PY, "-m", "launcher", *args]) + " " + redirect
    return subprocess.run(["sh", "-c", line], env=box.env, capture_output=True, text=True, timeout=60)


@needs_cgroup
@pytest.mark.parametrize("path, redirect", [
    ("/dev/fd/7", ""),                     # a script's `--record /dev/fd/7` without its `7>`
    ("/proc/self/fd/9", ""),
    ("/dev/stdin", "<&-"),                 # written to contain's /dev/null placeholder: exit 0, no record anywhere
    ("-", ">&-"),
])
def test_record_to_a_descriptor_that_is_not_open_is_refused_before_the_run(box, tmp_path, path, redirect):
    """--record is "refused before the run when it cannot take a record"
    (docs/api.md; `--record /no/such/dir/x` is). A record to our descriptor
    N that is not open ran CMD first and failed afterwards (125 after the
    work was done: a CI step ran twice on retry), and `--record /dev/stdin`
    with stdin closed wrote the record into contain's placeholder for the
    closed descriptor, /dev/null, and exited 0."""
    marker = tmp_path / "ran"
    p = _sh_contain(box, redirect, "run", "-q", "--record", path, "--", "touch", str(marker))
    assert p.returncode == 125, (p.returncode, p.stderr)
    assert "not open" in p.stderr or "closed" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert not marker.exists(), f"CMD ran first: {p.stderr}"


@needs_cgroup
def test_stats_json_to_a_descriptor_that_is_not_open_is_refused_before_the_run(box, tmp_path):
    """The same for --stats-json, which refuses /dev/fd/N of an open N
    before the run (a link, not a regular file): of a closed N it ran CMD,
    then failed with 125."""
    marker = tmp_path / "ran"
    p = _sh_contain(box, "", "run", "-q", "--stats-json", "/dev/fd/7", "--", "touch", str(marker))
    assert p.returncode == 125, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "--stats-json /dev/fd/7" in p.stderr, p.stderr
    assert not marker.exists(), f"CMD ran first: {p.stderr}"


@needs_cgroup
def test_record_to_an_open_descriptor_or_stdout_is_still_written(box, tmp_path):
    """What still works: /dev/fd/N of an open descriptor, `-`, /dev/stdin
    opened read-write."""
    out = tmp_path / "rec.json"
    p = _sh_contain(box, f"7>{out}", "run", "-q", "--record", "/dev/fd/7", "--", "true")
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text())["state"] == "REAPED"
    p = _sh_contain(box, "", "run", "-q", "--record", "-", "--", "true")
    assert p.returncode == 0 and json.loads(p.stdout)["state"] == "REAPED", p.stderr
    rw = tmp_path / "rw.json"
    p = _sh_contain(box, f"0<>{rw}", "run", "-q", "--record", "/dev/stdin", "--", "true")
    assert p.returncode == 0 and json.loads(rw.read_text())["state"] == "REAPED", p.stderr


@pytest.mark.timeout(120)
def test_another_users_file_at_the_record_path_in_a_sticky_directory_is_refused_before_the_run(tmp_path):
    """A user's `--record /tmp/job.json`, where another user made
    /tmp/job.json first (0666, so writable: the check passed). The
    record is replaced by rename, which the sticky bit forbids over another
    user's file: the run ran, then exited 125 "Operation not permitted
    (rename)". It is refused before the run now; the other user's file is
    never written through, and a path of the user's own still works."""
    from _users import Shared, as_uid, python, spare_uids, user_env, why_not

    reason = why_not()
    if reason:
        pytest.skip(reason)
    victim, other = spare_uids(2)
    with Shared() as sh:
        shared = sh.sub("tmp", mode=0o1777)
        xdg = sh.sub("xdg", uid=victim, mode=0o700)
        planted = os.path.join(shared, "job.json")
        p = as_uid(other, ["sh", "-c", f"echo planted > {planted}; chmod 666 {planted}"])
        assert p.returncode == 0, p.stderr
        marker = os.path.join(xdg, "ran")
        run = as_uid(victim, [python(), "-m", "launcher", "run", "-q", "--record", planted, "--", "touch", marker],
                     env=user_env(XDG_RUNTIME_DIR=xdg))
        assert run.returncode == 125, (run.returncode, run.stderr)
        assert "sticky" in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert not os.path.exists(marker), f"CMD ran first: {run.stderr}"
        with open(planted) as f:
            assert f.read() == "planted\n"
        own = os.path.join(shared, "own.json")
        run = as_uid(victim, [python(), "-m", "launcher", "run", "-q", "--record", own, "--", "true"],
                     env=user_env(XDG_RUNTIME_DIR=xdg))
        assert run.returncode == 0, run.stderr
        with open(own) as f:
            assert json.load(f)["outcome"] == "exited"


@needs_cgroup
def test_library_takes_record_and_stats_paths_as_pathlib_paths(box, tmp_path):
    """`launcher.run(argv, record_file=Path(...))`, as a runner written
    with pathlib passes it (subprocess takes os.PathLike everywhere, and
    cwd= and workspace= already did): AttributeError 'PosixPath' object
    has no attribute 'startswith', from inside the spawn. A wrong type is
    a TypeError, before anything runs."""
    import pathlib

    import launcher

    rec_path, stats_path = tmp_path / "rec.json", tmp_path / "stats.ndjson"
    rec = launcher.run(["true"], record_file=rec_path, stats_json=stats_path, state_dir=pathlib.Path(box.state_dir))
    assert rec.state == "REAPED", rec.to_dict()
    assert json.loads(rec_path.read_text())["run_id"] == rec.run_id
    assert json.loads(stats_path.read_text().splitlines()[0])["run_id"] == rec.run_id
    marker = tmp_path / "ran"
    for option in ("record_file", "stats_json", "workspace", "parent_cgroup"):
        for bad in (True, -1, 1.5):
            with pytest.raises(TypeError):
                launcher.run(["touch", str(marker)], **{option: bad})
    assert not marker.exists()
    # workspace=True ran the worker and then killed the owner loop at the
    # postcondition (os.path.realpath(True)): no record was ever written,
    # and the run stayed behind as an orphan with its cgroups.
    assert [v for v in os.listdir(os.path.join(box.state_dir, "runs")) if not v.startswith(".")] == [rec.run_id]


@needs_cgroup
def test_supervisor_killed_before_writing_its_record_file_still_gets_it_written_by_the_adopter(box, tmp_path):
    """`contain run --record FILE` whose supervisor is SIGKILLed (an OOM
    kill, a lost session): `contain cancel` adopted and stopped the run and
    record.json said REAPED, but FILE never appeared ("also to --record FILE
    when given"). The adopter now writes it, under --record's rules."""
    from test_adoption import _start_orphan

    out = tmp_path / "out.json"
    _start_orphan(box, "rf", "--record", str(out), script="setsid sleep 300 & sleep 300")
    assert not out.exists(), "the test is void: the supervisor wrote it"
    c = run_contain(box.env, "cancel", "rf", "--grace", "0", "--wait", timeout=60)
    assert c.returncode == 0, (c.stdout, c.stderr)
    assert holders(box.token) == []
    rec = json.loads(out.read_text())
    assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled" and rec["run_id"] == "rf", rec["state"]
    assert rec == box.record("rf")
