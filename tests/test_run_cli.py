"""`contain run` driven as a user would, against the real kernel.

Each escape scenario is named after the escape it tries. Whether anything
survived is decided by the test's own /proc scan (tests/_proc.py), never by
the launcher's record alone.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from _proc import contain_cmd, holders, run_contain, wait_holders
from conftest import needs_cgroup

pytestmark = needs_cgroup

PY = sys.executable


def assert_reaped_and_clean(box, run_id: str, rec: dict | None = None) -> dict:
    rec = rec or box.record(run_id)
    assert holders(box.token) == [], "a process of the tree survived"
    assert rec["state"] == "REAPED", rec
    ce = rec["evidence"]["container_empty"]
    assert ce["observed"] is True and ce["via"].startswith("cgroup.events"), ce
    assert rec["containment"]["backend"] == "cgroup2"
    assert box.leaves() == [], f"leaf left behind: {box.leaves()}"
    return rec


# -- exit status passes through ------------------------------------------------

@pytest.mark.parametrize("script, code", [("exit 0", 0), ("exit 7", 7), ("exit 255", 255)])
def test_exit_code_passes_through(box, script, code):
    p = run_contain(box.env, "run", "--id", "x", "--", "sh", "-c", script)
    assert p.returncode == code, p.stderr
    rec = assert_reaped_and_clean(box, "x")
    assert rec["outcome"] == "exited" and rec["exit_code"] == code and rec["signal"] is None
    assert rec["evidence"]["root_exit"]["observed"] is True


def test_death_by_signal_is_128_plus_n(box):
    p = run_contain(box.env, "run", "--id", "x", "--", "sh", "-c", "kill -USR1 $$")
    assert p.returncode == 128 + signal.SIGUSR1
    rec = assert_reaped_and_clean(box, "x")
    assert rec["outcome"] == "signaled" and rec["signal"] == signal.SIGUSR1


def test_identity_is_recorded(box):
    p = run_contain(box.env, "run", "--id", "x", "--", "true")
    assert p.returncode == 0
    rec = box.record("x")
    ident = rec["identity"]
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert ident["boot_id"] == f.read().strip()
    # Behind a PID-namespace wall the worker's namespace is the wall's own.
    walls = [w for w in rec["containment"]["walls"] if w["kind"] == "pidns"]
    expected_ns = walls[0]["inode"] if walls else os.stat("/proc/self/ns/pid").st_ino
    assert ident["pid"] > 0 and ident["start_time"] > 0 and ident["pidns"] == expected_ns
    assert ident["pidfd_inode"]


@pytest.mark.parametrize("mode", [[], ["--no-pidns"]], ids=["wall", "no-pidns"])
def test_identity_of_a_worker_gone_at_once_still_names_its_pid_namespace(box, mode):
    """`true` may exit (its ns links go at exit) before its identity is
    read: the namespace is then the wall's, read while the init waited, or
    ours without a wall; never null (seen once in CI)."""
    own = os.stat("/proc/self/ns/pid").st_ino
    for i in range(15):
        p = run_contain(box.env, "run", "--id", f"g{i}", *mode, "--", "true")
        assert p.returncode == 0, p.stderr
        rec = box.record(f"g{i}")
        walls = [w for w in rec["containment"]["walls"] if w["kind"] == "pidns"]
        assert rec["identity"]["pidns"] == (walls[0]["inode"] if walls else own), rec["identity"]


def test_placement_is_verified_in_the_leaf(box):
    p = run_contain(box.env, "run", "--id", "x", "--", "sh", "-c", "cat /proc/self/cgroup")
    assert p.returncode == 0
    rec = box.record("x")
    line = [x for x in p.stdout.splitlines() if x.startswith("0::")][0]
    assert line[3:] == rec["containment"]["placement"]
    assert rec["containment"]["placement"] == rec["containment"]["path"] + "/main"


# -- exec failures ---------------------------------------------------------------

def test_missing_command_is_127_and_leaves_no_leaf(box):
    p = run_contain(box.env, "run", "--id", "x", "--", "/no/such/command")
    assert p.returncode == 127
    assert "not found" in p.stderr and "Traceback" not in p.stderr
    rec = assert_reaped_and_clean(box, "x")
    assert rec["outcome"] == "spawn_failed"
    # Both walls held the failed start: the cgroup, and the PID namespace
    # whose init reported the failure and was reaped (it was left out).
    walls = rec["containment"]["walls"]
    assert [w["kind"] for w in walls] == ["cgroup", "pidns"], walls
    assert all(w["observed_empty"] is True for w in walls), walls


def test_missing_command_on_path_is_127(box):
    p = run_contain(box.env, "run", "--", "no-such-command-anywhere")
    assert p.returncode == 127
    assert box.leaves() == []


def test_empty_command_name_is_127_not_a_path_directory(box, tmp_path):
    """`contain run -- ''` used to try every PATH directory itself as the
    program ("/usr/bin/" + "") and exit 126 naming one of them (Permission
    denied); execvp(3) finds nothing for an empty name (ENOENT), as bash,
    env and timeout say: 127, command not found."""
    p = run_contain(dict(box.env, PATH=f"{tmp_path}:/usr/bin:/bin"), "run", "--id", "x", "--", "")
    assert p.returncode == 127, p.stderr
    assert "not found" in p.stderr and str(tmp_path) not in p.stderr and "Traceback" not in p.stderr
    rec = assert_reaped_and_clean(box, "x")
    assert rec["outcome"] == "spawn_failed"


@pytest.mark.skipif(os.geteuid() != 0, reason="--user needs root")
@pytest.mark.parametrize("how", [["--user", "nobody"], ["--seal"]])
def test_missing_command_behind_a_path_directory_the_worker_cannot_search_is_127(box, tmp_path, how):
    """root's PATH often starts with directories only root may search
    (/root/.local/bin, /root/.cargo/bin). As `--user nobody` or under --seal,
    `contain run -- no-such-command` exited 126 with "/root/.../no-such-command:
    Permission denied", naming a file that does not exist: a PATH search
    treats a candidate the user cannot even see as not there, as bash and dash
    do (127). A file it can see but not run is still 126."""
    import shutil
    import tempfile

    top = tempfile.mkdtemp(prefix="contain-path-")     # (tmp_path sits in a 0700 directory of root's)
    try:
        os.chmod(top, 0o755)
        private, visible = os.path.join(top, "private-bin"), os.path.join(top, "bin")
        os.mkdir(private, 0o700)
        os.mkdir(visible, 0o755)
        with open(os.path.join(visible, "not-a-program"), "w") as f:
            f.write("data\n")
        os.chmod(os.path.join(visible, "not-a-program"), 0o644)
        env = dict(box.env, PATH=f"{private}:{visible}:/usr/bin:/bin")
        p = run_contain(env, "run", "--id", "m", *how, "--", "no-such-command-anywhere")
        assert p.returncode == 127 and "command not found" in p.stderr and private not in p.stderr, p.stderr
        p = run_contain(env, "run", "--id", "n", *how, "--", "not-a-program")
        assert p.returncode == 126 and "Permission denied" in p.stderr, p.stderr
    finally:
        shutil.rmtree(top)


@pytest.mark.parametrize("target", ["a-file-without-x", "/tmp"])
def test_not_executable_is_126_and_leaves_no_leaf(box, target, tmp_path):
    if not target.startswith("/"):
        # A file the test makes 0644 (a system file's mode is the host's:
        # /etc/hostname is 0755 on some, and then execvp runs it with sh).
        path = tmp_path / target
        path.write_text("not a program\n")
        path.chmod(0o644)
        target = str(path)
    p = run_contain(box.env, "run", "--id", "x", "--", target)
    assert p.returncode == 126, p.stderr
    assert "Traceback" not in p.stderr
    assert_reaped_and_clean(box, "x")


# -- usage -----------------------------------------------------------------------

@pytest.mark.parametrize("args", [
    ["run"], ["run", "--"], ["run", "--grace", "soon", "--", "true"], ["run", "--grace", "-1", "--", "true"],
    ["run", "--backend", "docker", "--", "true"], ["frobnicate"], ["run", "--id", "../x", "--", "true"],
    ["status"], ["cancel"],
])
def test_usage_errors_are_2_without_traceback(box, args):
    p = run_contain(box.env, *args)
    assert p.returncode == 2, (args, p.stderr)
    assert "Traceback" not in p.stderr and p.stderr.strip()


def test_bad_backend_env_is_usage_error(box):
    env = dict(box.env, CONTAIN_BACKEND="bogus")
    p = run_contain(env, "run", "--", "true")
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_an_explicit_backend_auto_is_not_overridden_by_contain_backend_in_the_environment(box):
    """CONTAIN_BACKEND is the default of --backend: `--backend auto` given on
    the command line chose auto. CONTAIN_BACKEND=none used to turn it into
    the degraded mode anyway (process group and /proc scan, never REAPED)."""
    env = dict(box.env, CONTAIN_BACKEND="none")
    p = run_contain(env, "run", "--id", "explicit", "--backend", "auto", "--", "true")
    assert p.returncode == 0, p.stderr
    rec = box.record("explicit")
    assert rec["containment"]["backend"] != "none" and rec["state"] == "REAPED", rec["containment"]
    p = run_contain(env, "run", "--id", "default", "--", "true")       # not given: the environment's default
    assert p.returncode == 0, p.stderr
    assert box.record("default")["containment"]["backend"] == "none"


def test_help_exits_0(box):
    p = run_contain(box.env, "run", "--help")
    assert p.returncode == 0 and "--grace" in p.stdout


# -- stdio is inherited, not copied ------------------------------------------------

def test_stdio_is_inherited(box):
    p = subprocess.run(contain_cmd("run", "--", "sh", "-c", "cat; echo err >&2"), env=box.env,
                       input="hello\n", capture_output=True, text=True, timeout=30)
    assert p.returncode == 0
    assert p.stdout == "hello\n" and p.stderr == "err\n"


def test_worker_stdout_is_the_callers_fd(box, tmp_path):
    # If the supervisor copied output, the worker's fd 1 would be a pipe of ours.
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        p = subprocess.run(contain_cmd("run", "--", "sh", "-c", "readlink /proc/self/fd/1"), env=box.env,
                           stdout=f, timeout=30)
    assert p.returncode == 0
    assert out.read_text().strip() == str(out)


# -- escapes: whatever the tree did, nothing survives ------------------------------

def test_orphaned_setsid_daemon(box):
    p = run_contain(box.env, "run", "--id", "x", "--grace", "1", "--",
                    "sh", "-c", "setsid sleep 300 & exit 0")
    assert p.returncode == 0
    rec = assert_reaped_and_clean(box, "x")
    assert rec["evidence"]["signal_sent"]["observed"] is True


def test_double_fork(box):
    p = run_contain(box.env, "run", "--id", "x", "--grace", "1", "--",
                    "sh", "-c", "(sh -c 'sleep 300 &' &); exit 0")
    assert p.returncode == 0
    assert_reaped_and_clean(box, "x")


def test_term_ignoring_orphan(box):
    code = textwrap.dedent("""
        import os, signal, sys, time
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.setsid()
            sys.stdout.write("up\\n"); sys.stdout.flush()
            while True:
                time.sleep(1)
        sys.stdin.readline() if False else time.sleep(0.3)
    """)
    t0 = time.monotonic()
    p = run_contain(box.env, "run", "--id", "x", "--grace", "0.5", "--", PY, "-c", code)
    assert p.returncode == 0, p.stderr
    rec = assert_reaped_and_clean(box, "x")
    steps = rec["evidence"]["signal_sent"]["detail"]["steps"]
    assert [s["kind"] for s in steps] == ["term", "kill"], steps
    assert time.monotonic() - t0 < 60   # hang guard


def test_sigstopped_orphan(box):
    p = run_contain(box.env, "run", "--id", "x", "--grace", "2", "--",
                    "sh", "-c", "sleep 300 & kill -STOP $!; exit 0")
    assert p.returncode == 0
    rec = assert_reaped_and_clean(box, "x")
    # SIGCONT went with SIGTERM, so the stopped sleep could act on it: no kill needed.
    assert [s["kind"] for s in rec["evidence"]["signal_sent"]["detail"]["steps"]] == ["term"]


def test_process_group_change(box):
    code = "import os, time\nif os.fork() == 0:\n    os.setpgid(0, 0)\n    time.sleep(300)\n"
    p = run_contain(box.env, "run", "--id", "x", "--grace", "1", "--", PY, "-c", code)
    assert p.returncode == 0
    assert_reaped_and_clean(box, "x")


def test_fork_storm_1000(box):
    code = textwrap.dedent("""
        import os, signal, sys
        for i in range(1000):
            if os.fork() == 0:
                if i % 2: os.setsid()
                signal.pause()
                os._exit(0)
        os._exit(0)
    """)
    p = run_contain(box.env, "run", "--id", "x", "--grace", "0", "--", PY, "-c", code, timeout=120)
    assert p.returncode == 0, p.stderr
    rec = assert_reaped_and_clean(box, "x")
    assert rec["evidence"]["signal_sent"]["via"] == "cgroup.kill"


def test_chain_300_deep(box):
    code = textwrap.dedent("""
        import os, time
        for depth in range(300):
            pid = os.fork()
            if pid:
                os.waitpid(pid, 0)
                os._exit(0)
        time.sleep(300)
    """)
    with subprocess.Popen(contain_cmd("run", "--id", "x", "--grace", "0.2", "--", PY, "-c", code),
                          env=box.env, stderr=subprocess.PIPE, text=True) as proc:
        assert len(wait_holders(box.token, 301, timeout=60)) >= 301
        proc.send_signal(signal.SIGTERM)
        # contain dies by the signal that cancelled the run (issue 12; was 128 + SIGTERM).
        assert proc.wait(60) == -signal.SIGTERM
    rec = assert_reaped_and_clean(box, "x")
    assert rec["outcome"] == "cancelled"


# -- stopping from outside ----------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_to_contain_cancels(box, sig):
    with subprocess.Popen(contain_cmd("run", "--id", "x", "--grace", "1", "--",
                                      "sh", "-c", "setsid sleep 300 & sleep 300"),
                          env=box.env, stderr=subprocess.PIPE, text=True) as proc:
        assert len(wait_holders(box.token, 3)) >= 3
        proc.send_signal(sig)
        rc = proc.wait(30)
    rec = assert_reaped_and_clean(box, "x")
    # contain dies by that signal (issue 12; it used to exit 128 + SIGTERM,
    # the worker's own fate, which is still in the record), and the tree
    # was sent that same signal first.
    assert rc == -sig
    steps = rec["evidence"]["signal_sent"]["detail"]["steps"]
    assert steps[0]["kind"] == "term" and steps[0]["detail"]["signal"] == signal.Signals(sig).name, steps
    assert rec["signal"] in (sig, signal.SIGKILL)
    assert rec["outcome"] == "cancelled"
    assert rec["evidence"]["cancel_requested"]["observed"] is True
    prefix = f"signal-{signal.Signals(sig).name}-{proc.pid}-"
    ops = [o for o in rec["cancellations"] if o.startswith(prefix)]
    assert len(ops) == 1, rec["cancellations"]
    op = ops[0]
    assert box.ack("x", op)["effect"] == "cancelled"


def test_timeout_is_124(box):
    t0 = time.monotonic()
    p = run_contain(box.env, "run", "--id", "x", "--timeout", "0.5", "--grace", "0.5", "--",
                    "sh", "-c", "trap '' TERM; setsid sleep 300 & sleep 300")
    assert p.returncode == 124
    assert time.monotonic() - t0 < 60   # hang guard
    rec = assert_reaped_and_clean(box, "x")
    assert rec["outcome"] == "timed_out"


def test_record_file_is_written(box, tmp_path):
    out = tmp_path / "rec.json"
    p = run_contain(box.env, "run", "--id", "x", "--record", str(out), "--", "true")
    assert p.returncode == 0
    assert json.loads(out.read_text()) == box.record("x")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a symlink owned by another uid)")
def test_record_follows_another_users_link_only_where_nobody_else_can_repoint_it(box, tmp_path):
    """A service user's link in a directory of root's that nobody else may
    write (/var/lib/app -> ...) cannot be re-pointed by that user: followed.
    The same link in a world-writable sticky directory could be: refused."""
    target = tmp_path / "target"
    target.mkdir()
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o755)
    (safe / "app").symlink_to(target)
    os.lchown(safe / "app", 4243, 4243)
    p = run_contain(box.env, "run", "--id", "x", "--record", str(safe / "app" / "rec.json"), "--", "true")
    assert p.returncode == 0, p.stderr
    assert json.loads((target / "rec.json").read_text())["state"] == "REAPED"
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "app").symlink_to(target)
    os.lchown(shared / "app", 4243, 4243)
    p = run_contain(box.env, "run", "--id", "y", "--record", str(shared / "app" / "rec2.json"), "--", "true")
    assert p.returncode == 125 and "not followed" in p.stderr, p.stderr
    assert not (target / "rec2.json").exists()


def test_live_id_cannot_be_taken(box):
    with subprocess.Popen(contain_cmd("run", "--id", "x", "--", "sleep", "300"), env=box.env) as proc:
        # Two holders: the supervisor carries the token before it has claimed
        # the id; the worker exists only after the claim.
        assert len(wait_holders(box.token, 2)) >= 2
        p = run_contain(box.env, "run", "--id", "x", "--", "true")
        assert p.returncode == 2 and "live run" in p.stderr
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert_reaped_and_clean(box, "x")


def test_ended_id_is_reused_with_a_new_run_uid(box):
    assert run_contain(box.env, "run", "--id", "x", "--", "true").returncode == 0
    first = box.record("x")["run_uid"]
    assert run_contain(box.env, "run", "--id", "x", "--", "true").returncode == 0
    assert box.record("x")["run_uid"] != first


def test_cpu_of_the_whole_tree_is_accounted(box):
    code = "import os\nfor _ in range(2):\n    os.fork()\nx = sum(range(3_000_000))\n"
    p = run_contain(box.env, "run", "--id", "x", "--", PY, "-c", code)
    assert p.returncode == 0
    cpu = box.record("x")["cpu"]
    assert cpu and cpu["usage_usec"] > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="--user needs root")
def test_user_gets_the_accounts_home_names_and_groups(box):
    """--user NAME runs with the account's HOME, USER and LOGNAME (as su(1)
    sets them, not the caller's /root) and its supplementary groups."""
    import pwd

    pw = pwd.getpwnam("nobody")
    p = run_contain(box.env, "run", "--user", "nobody", "--", "sh", "-c", 'echo "$HOME:$USER:$LOGNAME"; id -u; id -G')
    assert p.returncode == 0, p.stderr
    names, uid, groups = p.stdout.splitlines()
    assert names == f"{pw.pw_dir}:nobody:nobody"
    assert int(uid) == pw.pw_uid
    assert sorted(map(int, groups.split())) == sorted(set(os.getgrouplist("nobody", pw.pw_gid)))
