"""The conventions a shell user relies on: --version and --help, usage
errors and "no such run" told apart the same way by every command, zero
timeouts refused, and closed standard descriptors handled without a
traceback (and without contain reusing them behind the worker's back)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from _proc import ROOT, contain_cmd, holders, run_contain
from conftest import needs_cgroup

import launcher


def _env(tmp_path) -> dict[str, str]:
    env = dict(os.environ)
    env["CONTAIN_STATE_DIR"] = str(tmp_path / "state")
    env["PYTHONPATH"] = ROOT
    return env


def test_version_is_the_package_version(tmp_path):
    p = run_contain(_env(tmp_path), "--version", timeout=30)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"contain {launcher.__version__}"


def test_help_names_every_environment_variable_contain_reads(tmp_path):
    """Every CONTAIN_* name the code reads (grep of launcher/) is in --help."""
    names: set[str] = set()
    for d, _subdirs, files in os.walk(os.path.join(ROOT, "launcher")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f)) as fh:
                    names |= set(re.findall(r"\bCONTAIN_[A-Z_]+\b", fh.read()))
    names.discard("CONTAIN_TEST_TOKEN")
    assert {"CONTAIN_STATE_DIR", "CONTAIN_CGROUP_BASE", "CONTAIN_BACKEND", "CONTAIN_LEDGER"} <= names
    for args in (["--help"], ["run", "--help"]):
        p = run_contain(_env(tmp_path), *args, timeout=30)
        assert p.returncode == 0, p.stderr
        missing = [n for n in sorted(names) if n not in p.stdout]
        assert missing == [], f"`contain {' '.join(args)}` does not name {missing}"


@pytest.mark.parametrize("command", ["status", "wait", "cancel"])
@pytest.mark.parametrize("run_id, code", [("../etc", 2), ("-x", 2), ("a" * 101, 2), ("a b", 2), ("", 2),
                                          ("no-such-run", 3), ("x" * 100, 3)])
def test_an_invalid_id_gives_the_same_status_for_every_command(tmp_path, command, run_id, code):
    """A malformed ID is a usage error (2) and an unknown one "no such run"
    (3), whichever command is asked (cancel used to say 2 where status and
    wait said 3)."""
    args = [command, "--", run_id] if run_id.startswith("-") else [command, run_id]
    p = run_contain(_env(tmp_path), *args, timeout=30)
    assert p.returncode == code, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    assert p.stderr.startswith("contain: ") and p.stderr.count("\n") <= 2, p.stderr


@pytest.mark.parametrize("option, value", [(o, v) for o in ("--timeout", "--kill-timeout")
                                            for v in ("-1", "nan", "inf", "x", "5w", "1 m")]
                         + [("--kill-timeout", v) for v in ("0", "0.0", "-0", "0s")])
def test_zero_and_unusable_timeouts_are_usage_errors(tmp_path, option, value):
    """--kill-timeout 0 used to mean the default 10 s without a word; now it
    is refused, like any value that is not a duration. Nothing runs.
    (--timeout 0 means no timeout: the next test.)"""
    marker = tmp_path / "ran"
    p = run_contain(_env(tmp_path), "run", f"{option}={value}", "--", "touch", str(marker), timeout=30)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert option in p.stderr and "Traceback" not in p.stderr
    assert not marker.exists()


@pytest.mark.parametrize("option", ["--stats-json", "--workspace"])
def test_an_empty_path_is_a_usage_error_not_an_option_dropped(tmp_path, option):
    """`--stats-json ''` used to run with no stats written and exit 0, and
    `--workspace ''` with no workspace layer: an empty string was read as
    "option not given". Now it is refused before anything runs."""
    marker = tmp_path / "ran"
    p = run_contain(_env(tmp_path), "run", option, "", "--", "touch", str(marker), timeout=30)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert option in p.stderr and "Traceback" not in p.stderr
    assert not marker.exists()


def test_an_empty_path_is_refused_by_the_library_too(tmp_path, monkeypatch):
    monkeypatch.setenv("CONTAIN_STATE_DIR", str(tmp_path / "state"))
    marker = tmp_path / "ran"
    for kw in ("stats_json", "workspace"):
        with pytest.raises(ValueError, match=kw.replace("_", "-")):
            launcher.run(["touch", str(marker)], **{kw: ""})
    assert not marker.exists()


@needs_cgroup
@pytest.mark.parametrize("value", ["0", "0s", "0.0"])
def test_timeout_0_means_no_timeout_as_gnu_timeout(box, value):
    """CONTRACT.md: `--timeout 0` means no timeout (it used to be a usage error)."""
    p = run_contain(box.env, "run", "--id", "z", "--timeout", value, "--", "sh", "-c", "sleep 0.3; exit 7",
                    timeout=60)
    assert p.returncode == 7, p.stderr
    rec = box.record("z")
    assert rec["outcome"] == "exited" and rec["exit_code"] == 7, rec["outcome"]


@needs_cgroup
def test_durations_take_s_m_h_d_as_gnu_timeout(box):
    """`--timeout 1m` and `--grace 5s` used to be usage errors while `gc
    --older-than 15m` took suffixes; every duration takes them now."""
    p = run_contain(box.env, "run", "--id", "d", "--timeout", "1m", "--grace", "5s", "--kill-timeout", "0.5m",
                    "--linger", "0s", "--", "true", timeout=60)
    assert p.returncode == 0, p.stderr
    p = run_contain(box.env, "run", "--id", "t", "--timeout", "0.3s", "--grace", "0s", "--", "sleep", "30",
                    timeout=60)
    assert p.returncode == 124, p.stderr


@needs_cgroup
def test_contain_wait_exits_with_the_status_contain_run_gave(box):
    """CONTRACT.md: `contain wait ID` exits with the status `contain run`
    gave for the run, as bash's `wait` returns the job's (it exited 0 for
    any run that ended)."""
    import signal
    import time

    cases = {"three": (["sh", "-c", "exit 3"], 3), "killed": (["sh", "-c", "kill -9 $$"], 137),
             "slow": (["--timeout", "0.3", "--grace", "0", "--", "sleep", "30"], 124)}
    for run_id, (args, want) in cases.items():
        cmd = ["run", "-q", "--id", run_id] + (args if "--" in args else ["--", *args])
        p = run_contain(box.env, *cmd, timeout=60)
        assert p.returncode == want, (run_id, p.returncode, p.stderr)
        w = run_contain(box.env, "wait", run_id, timeout=60)
        assert w.returncode == want, (run_id, w.returncode, w.stdout, w.stderr)
    # Cancelled by `contain cancel`: 143, whatever the worker did.
    sup = subprocess.Popen(contain_cmd("run", "-q", "--id", "c", "--grace", "2", "--", "sh", "-c",
                                       "trap 'exit 0' TERM; sleep 30 & wait"), env=box.env)
    try:
        deadline = time.monotonic() + 30
        while run_contain(box.env, "status", "c", timeout=30).returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert run_contain(box.env, "cancel", "c", "--wait", timeout=60).returncode == 0
        assert sup.wait(60) == 143
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(30)
    assert run_contain(box.env, "wait", "c", timeout=60).returncode == 143
    # Cancelled by SIGHUP sent to `contain run`, which then dies by it: 128+1.
    sup = subprocess.Popen(contain_cmd("run", "-q", "--id", "h", "--grace", "0.5", "--", "sleep", "30"),
                           env=box.env)
    try:
        deadline = time.monotonic() + 30
        while run_contain(box.env, "status", "h", timeout=30).returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
        sup.send_signal(signal.SIGHUP)
        assert sup.wait(60) == -signal.SIGHUP
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait(30)
    assert run_contain(box.env, "wait", "h", timeout=60).returncode == 128 + signal.SIGHUP
    assert run_contain(box.env, "wait", "nosuchrun", timeout=60).returncode == 3
    assert holders(box.token) == []


@needs_cgroup
def test_a_small_timeout_means_what_it_says(box):
    p = run_contain(box.env, "run", "--id", "t", "--timeout", "0.3", "--grace", "0", "--", "sleep", "30",
                    timeout=60)
    assert p.returncode == 124, p.stderr
    assert box.record("t")["outcome"] == "timed_out"


@needs_cgroup
def test_closed_stdout_stays_closed_for_the_worker(box, tmp_path):
    """`contain run ... 1>&-`: no traceback, the worker's status is the
    run's, and the worker finds fd 1 closed as it would under `env` (not a
    file of contain's own that took the free slot)."""
    report = tmp_path / "fds"
    code = ("import os, sys\n"
            "def state(fd):\n"
            "    try:\n        return os.readlink(f'/proc/self/fd/{fd}')\n"
            "    except OSError:\n        return 'closed'\n"
            "seen = state(1)\n"             # before open() takes the lowest free descriptor
            f"open({str(report)!r}, 'w').write(seen)\n"
            "sys.exit(3)\n")
    p = subprocess.run(contain_cmd("run", "--id", "c", "--", sys.executable, "-c", code), env=box.env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60,
                       preexec_fn=lambda: os.close(1))
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 3, p.stderr
    assert report.read_text() == "closed"
    assert box.record("c")["exit_code"] == 3
    assert holders(box.token) == []


@needs_cgroup
def test_closed_stdout_with_nothing_to_write_is_no_error(box):
    p = subprocess.run(contain_cmd("run", "--", "true"), env=box.env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=60, preexec_fn=lambda: os.close(1))
    assert (p.returncode, p.stderr) == (0, "")


@pytest.mark.parametrize("args", [["ls"], ["ls", "--json"], ["--version"], ["doctor", "--json"]])
def test_output_to_a_closed_stdout_is_a_write_error(tmp_path, args):
    """`contain ls >&-` used to end in a traceback; output that cannot be
    written is one line on stderr and status 1 (gnulib's close_stdout)."""
    p = subprocess.run(contain_cmd(*args), env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True, timeout=60, preexec_fn=lambda: os.close(1))
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert p.stderr.strip().splitlines()[-1] == "contain: write error: stdout: Bad file descriptor", p.stderr
    assert "Traceback" not in p.stderr


def test_closed_stderr_changes_no_status(tmp_path):
    p = subprocess.run(contain_cmd("status", "no-such-run"), env=_env(tmp_path), capture_output=True,
                       timeout=60, preexec_fn=lambda: os.close(2))
    assert p.returncode == 3


def test_a_broken_pipe_is_a_quiet_1(tmp_path):
    """`contain ls | true`: the reader went away first; no traceback."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run(contain_cmd("ls"), env=_env(tmp_path), stdout=w, stderr=subprocess.PIPE, text=True,
                           timeout=60)
    finally:
        os.close(w)
    assert p.returncode == 1 and p.stderr == "", p.stderr


def test_ctrl_c_while_the_command_loads_dies_by_sigint_without_a_traceback(tmp_path):
    """A SIGINT that lands while bin/contain imports the CLI (a slow disk, a
    cold cache: tens of milliseconds) used to print Python's
    KeyboardInterrupt traceback. Made exact here: the `launcher` on the path
    is one whose CLI module raises KeyboardInterrupt as it is imported, the
    way a Ctrl-C in that import surfaces. The command must die by SIGINT (the
    shell stops too) and print nothing."""
    fake = tmp_path / "fake" / "launcher"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "_cli.py").write_text("raise KeyboardInterrupt\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake"), CONTAIN_STATE_DIR=str(tmp_path / "state"))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bin", "contain"), "run", "--", "true"],
                       env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == -2, (p.returncode, p.stderr)
    assert p.stderr == "" and p.stdout == "", p.stderr


@needs_cgroup
def test_a_non_ascii_command_in_an_ascii_locale_is_escaped_not_a_traceback(box):
    p = subprocess.run(contain_cmd("run", "--id", "enc", "--", "echo", "h\u00e9llo \u2603"), env=box.env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    env = dict(box.env, PYTHONIOENCODING="ascii")
    for args in (["status", "enc"], ["ls", "--all"], ["wait", "enc"]):
        q = subprocess.run(contain_cmd(*args), env=env, capture_output=True, timeout=60)
        out, err = q.stdout.decode("ascii"), q.stderr.decode("ascii")     # nothing but ASCII came out
        assert "Traceback" not in err, (args, err)
        assert q.returncode == 0, (args, q.returncode, err)
        if args[0] != "wait":
            assert "h\\xe9llo \\u2603" in out, (args, out)


def test_ls_json_lists_an_ended_run_with_its_state_and_the_table_says_it_is_hidden(tmp_path):
    """A script reading `contain ls --json` after a run must find it: the
    machine form is every run. The table keeps to the runs not ended and
    says how many it left out."""
    env = _env(tmp_path)
    assert run_contain(env, "run", "--id", "done", "--backend", "none", "-q", "--", "sh", "-c", "exit 3").returncode == 3
    js = run_contain(env, "ls", "--json")
    assert js.returncode == 0, js.stderr
    [v] = [v for v in json.loads(js.stdout) if v["id"] == "done"]
    assert (v["state"], v["outcome"], v["exit_code"]) == ("EXITED", "exited", 3), v
    live = run_contain(env, "ls", "--json", "--state", "RUNNING")
    assert json.loads(live.stdout) == [], live.stdout
    table = run_contain(env, "ls")
    assert "done" not in table.stdout.split() and "1 ended" in table.stdout, table.stdout
