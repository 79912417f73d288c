"""Adversarial review 4: an unprivileged user as the victim, and what its
own worker or another local user can make its `contain` believe.

Each test is named after the attack and failed on the code it was written
against. The victim and the attacker are spare uids (setpriv) working in
directories the test made; survival is decided by the test's own /proc scan
(a token in the workload's environment), never by asking contain.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from _proc import TOKEN_VAR, contain_cmd, end_started, holders, kill_holders, new_token, readline_within
from _users import Shared, python, spare_uids, user_env, why_not
from conftest import needs_cgroup
from test_review2 import _remove_v1_of

USERS_SKIP = why_not()
needs_users = pytest.mark.skipif(USERS_SKIP is not None, reason=USERS_SKIP or "")


def _as(uid: int, *argv: str) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]


class Victim:
    """An unprivileged user with a runtime directory of its own (made by
    the test) and a token in its workloads' environment."""

    def __init__(self, sh: Shared, uid: int) -> None:
        self.uid = uid
        self.token = new_token()
        self.env = user_env(XDG_RUNTIME_DIR=sh.sub(f"xdg-{uid}", uid=uid, mode=0o700),
                            **{TOKEN_VAR: self.token})

    def contain(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(_as(self.uid, python(), "-m", "launcher", *args), env=self.env, capture_output=True,
                              text=True, timeout=timeout, cwd="/")

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(_as(self.uid, python(), "-m", "launcher", *args), env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")

    def run_dir(self, run_id: str) -> str:
        return os.path.join(self.env["XDG_RUNTIME_DIR"], "contain", "runs", run_id)

    def forge(self, run_id: str, script: str, *args: str) -> str:
        """Run `script` as this user, outside the run (the run's own worker
        cannot reach its run directory: the init hides the state directory
        from it), with CONTAIN_RUN_DIR naming the run's directory."""
        p = subprocess.run(_as(self.uid, python(), "-c", script, *args), capture_output=True, text=True,
                           env=dict(self.env, CONTAIN_RUN_DIR=self.run_dir(run_id)), cwd="/", timeout=30)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()


# The worker of these runs: a child, and itself, alive until killed.
_LIVE = ["sh", "-c", "sleep 300 & echo up; exec sleep 300"]


_FORGE_TERMINAL = r"""
import json, os, sys
d = os.environ["CONTAIN_RUN_DIR"]
path = os.path.join(d, "record.json")
rec = json.load(open(path))
rec.update(state=sys.argv[1], outcome="exited", exit_code=0, signal=None)
tmp = os.path.join(d, ".forged.tmp")
with open(tmp, "w") as f:
    f.write(json.dumps(rec))
os.rename(tmp, path)
print("forged", flush=True)
"""

# The same, by a worker that can write its run directory (root, not
# sealed), which then goes on with a child.
_FORGE_TERMINAL_AND_STAY = _FORGE_TERMINAL + r"""
import subprocess, time
kid = subprocess.Popen(["sleep", "300"])
time.sleep(300)
"""


@needs_users
@pytest.mark.timeout(120)
@pytest.mark.parametrize("state", ["REAPED", "EXITED"])
def test_own_worker_forging_a_terminal_record_then_orphaned_is_still_stopped_by_cancel(state):
    """An unprivileged user's run (the pidns backend) whose record.json is
    rewritten, by the same uid, to say the run ended, while the tree goes
    on. Its supervisor then dies (killed here). `contain cancel --wait`
    adopted the orphan, took the forged record as the previous owner's last
    word, answered `not_live` and stopped nothing; `contain wait` then said
    REAPED, exit 0, with the whole tree alive, for ever: the run was lost.
    (The forger was the run's own worker; it can no longer reach its run
    directory, test_own_worker_cannot_reach_the_state_directory, so here it
    is the same user outside the run.)"""
    victim, = spare_uids(1)
    with Shared() as sh:
        v = Victim(sh, victim)
        p = v.start("run", "-q", "--backend", "pidns", "--id", "fg", "--", *_LIVE)
        try:
            line = readline_within(p.stdout, 30)
            assert line.strip() == b"up", (line, p.poll(), p.stderr.read() if p.poll() is not None else b"")
            assert v.forge("fg", _FORGE_TERMINAL, state) == "forged"
            assert len(holders(v.token)) >= 2
            os.kill(p.pid, signal.SIGKILL)          # the supervisor dies (an OOM kill, a lost session)
            p.wait(10)
            c = v.contain("cancel", "fg", "--grace", "0", "--wait", "--json", timeout=60)
            ack = json.loads(c.stdout) if c.stdout.strip().startswith("{") else {}
            still = holders(v.token)
            assert still == [], f"cancel said {ack.get('effect')} {ack.get('state')} (exit {c.returncode}) " \
                                f"with {still} alive"
            assert c.returncode == 0 and ack.get("effect") == "cancelled", (c.returncode, c.stdout, c.stderr)
            w = v.contain("wait", "fg", "--json", timeout=30)
            rec = json.loads(w.stdout)
            assert w.returncode == 143 and rec["state"] == "REAPED" and rec["outcome"] == "cancelled", (w.stderr, w.stdout[:300])
            assert any("record.json" in n for n in rec["notes"]), rec["notes"]
        finally:
            end_started(p, v.token)
        assert holders(v.token) == []




@needs_cgroup
@pytest.mark.timeout(120)
def test_root_worker_forging_a_reaped_record_then_orphaned_is_still_stopped_by_cancel(box):
    """The same under root on cgroup2 (a root worker, not sealed, writes its
    run directory): once the supervisor died, cancel adopted, believed the
    forged REAPED and left the populated cgroup running."""
    p = subprocess.Popen(contain_cmd("run", "-q", "--id", "rf", "--", sys.executable, "-c", _FORGE_TERMINAL_AND_STAY,
                                     "REAPED"),
                         env=box.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = readline_within(p.stdout, 30)
        assert line.strip() == b"forged", (line, p.poll())
        assert len(holders(box.token)) >= 2
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        c = subprocess.run(contain_cmd("cancel", "rf", "--grace", "0", "--wait", "--json"), env=box.env,
                           capture_output=True, text=True, timeout=60)
        still = holders(box.token)
        assert still == [], f"cancel said {c.stdout.strip()[-200:]!r} with {still} alive"
        assert c.returncode == 0 and json.loads(c.stdout)["effect"] == "cancelled", (c.stdout, c.stderr)
    finally:
        end_started(p, box.token)
        _remove_v1_of("rf")
    assert holders(box.token) == []


@needs_users
@pytest.mark.timeout(120)
def test_own_worker_forging_a_reaped_record_then_orphaned_does_not_end_contain_wait():
    """The same forgery, asked by a reader: once the supervisor is dead,
    `contain wait` took the forged REAPED as final (the owner had let go of
    its lock: it died) and exited 0 with the whole tree alive."""
    victim, = spare_uids(1)
    with Shared() as sh:
        v = Victim(sh, victim)
        p = v.start("run", "-q", "--backend", "pidns", "--id", "fw", "--", *_LIVE)
        try:
            line = readline_within(p.stdout, 30)
            assert line.strip() == b"up", (line, p.poll())
            assert v.forge("fw", _FORGE_TERMINAL, "REAPED") == "forged"
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
            w = v.contain("wait", "fw", timeout=30)
            still = holders(v.token)
            assert len(still) >= 2, still
            assert w.returncode != 0, f"contain wait said {w.stdout.strip()!r} (exit 0) with {still} alive"
            assert w.returncode == 1 and "not final" in w.stderr and "Traceback" not in w.stderr, \
                (w.returncode, w.stdout, w.stderr)
            st = v.contain("status", "fw", timeout=30)
            assert "not final" in st.stdout and "Traceback" not in st.stderr, (st.stdout, st.stderr)
            sj = json.loads(v.contain("status", "fw", "--json", timeout=30).stdout)
            assert sj["live"]["orphaned"] is True, sj["live"]
            c = v.contain("cancel", "fw", "--grace", "0", "--wait", timeout=60)
            assert c.returncode == 0, (c.stdout, c.stderr)
            assert holders(v.token) == []
            w = v.contain("wait", "fw", timeout=30)
            # 143: what `contain run` gives a run cancelled by `contain cancel` (contain wait's status)
            assert w.returncode == 143 and "REAPED" in w.stdout, (w.stdout, w.stderr)
        finally:
            end_started(p, v.token)
        assert holders(v.token) == []


# -- the state directory's path ----------------------------------------------------------

@needs_users
@pytest.mark.timeout(60)
def test_another_users_symlink_above_the_state_dir_is_not_followed(tmp_path):
    """An unprivileged user's CONTAIN_STATE_DIR goes through a symlink that
    another user owns (in a sticky shared directory) and that points, for
    now, at the victim's own directory. Only the real path was checked, so
    the victim used it; the attacker can re-point the link whenever it
    likes at another directory of the victim's, and the victim's `contain ls`
    and `cancel` then look at runs that are not the ones it started (here:
    its live run is 'no such run', exit 3)."""
    victim, attacker = spare_uids(2)
    with Shared(mode=0o1777) as sh:
        v = Victim(sh, victim)
        real = sh.sub("real", uid=victim, mode=0o700)
        other = sh.sub("other", uid=victim, mode=0o700)
        link = os.path.join(sh.path, "link")
        assert subprocess.run(_as(attacker, "ln", "-s", real, link), capture_output=True,
                              timeout=10).returncode == 0
        v.env["CONTAIN_STATE_DIR"] = os.path.join(link, "st")
        r = v.contain("run", "-q", "--backend", "pidns", "--id", "sl", "--", "true", timeout=30)
        made = os.listdir(real) + os.listdir(other)
        assert r.returncode == 125, (r.returncode, r.stderr, made)
        assert "Traceback" not in r.stderr and "not followed" in r.stderr, r.stderr
        assert made == [], f"a state directory was made through another user's link: {made}"


@needs_users
@pytest.mark.timeout(60)
def test_another_users_symlink_above_roots_state_dir_is_not_followed(box, tmp_path):
    """The same link under root: another user's symlink in the middle of
    root's CONTAIN_STATE_DIR chose the root-owned directory (a stand-in for
    /etc here) in which root created `st/runs/<id>/`."""
    attacker, = spare_uids(1)
    decoy = tmp_path / "decoy"
    decoy.mkdir(mode=0o755)
    with Shared(mode=0o1777) as sh:
        link = os.path.join(sh.path, "link")
        assert subprocess.run(_as(attacker, "ln", "-s", str(decoy), link), capture_output=True,
                              timeout=10).returncode == 0
        env = dict(box.env, CONTAIN_STATE_DIR=os.path.join(link, "st"))
        r = subprocess.run(contain_cmd("run", "-q", "--backend", "pidns", "--id", "sl", "--", "true"),
                           env=env, capture_output=True, text=True, timeout=30)
        assert os.listdir(decoy) == [], f"root made {os.listdir(decoy)} through another user's link"
        assert r.returncode == 125 and "not followed" in r.stderr, (r.returncode, r.stderr)
    assert holders(box.token) == []


# -- --seal's dynamic uids -----------------------------------------------------------------

_SEAL_IN_OWN_PASSWD = r"""
set -e
mount --bind "$1" /etc/passwd
shift
exec "$@"
"""


@needs_cgroup
@pytest.mark.timeout(90)
def test_seal_never_takes_the_uid_of_an_account_that_is_logged_out(box, tmp_path):
    """`--seal` picks a host uid from 61184-65519 that no live process has.
    A local account in that range (a user, logged out right now) was not
    excluded: the sealed worker ran as that user's uid, so it could write
    that user's files, and that user, once back, could signal or ptrace the
    'sealed' tree. Here every uid of the range but one is an account (in a
    passwd file bind-mounted in a mount namespace of the test's own): the
    run must get that one."""
    from launcher._platform.sealing import DYNAMIC_FIRST, DYNAMIC_LAST, _uids_in_use

    used = _uids_in_use()
    free = next(u for u in range(DYNAMIC_LAST, DYNAMIC_FIRST, -1) if u not in used)
    passwd = tmp_path / "passwd"
    with open("/etc/passwd") as f:
        lines = f.read().splitlines()
    lines += [f"acct{u}:x:{u}:{u}::/home/acct{u}:/bin/sh" for u in range(DYNAMIC_FIRST, DYNAMIC_LAST + 1)
              if u != free]
    passwd.write_text("\n".join(lines) + "\n")
    rec_path = tmp_path / "rec.json"
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", _SEAL_IN_OWN_PASSWD, "sh",
                        str(passwd), *contain_cmd("run", "-q", "--seal", "--id", "su", "--record", str(rec_path),
                                                  "--", "true")],
                       env=box.env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr)
    seal = json.loads(rec_path.read_text())["containment"]["seal"]
    assert seal["host_uid"] == free, f"sealed as uid {seal['host_uid']}, an account's (acct{seal['host_uid']})"
    assert holders(box.token) == []


# -- the `user.` tag an unprivileged run's worker can rewrite ----------------------------

_NAME_ANOTHER_RUNS_INIT = r"""
import os, sys, time
d = os.environ["CONTAIN_RUN_DIR"]
other = os.path.join(os.path.dirname(d), sys.argv[1])
try:
    tag = os.getxattr(other, "user.contain.run")
    import json
    mine = json.loads(os.getxattr(d, "user.contain.run"))
    mine["wall"] = json.loads(tag)["wall"]        # the other run's init: pid 1 of its namespace
    os.setxattr(d, "user.contain.run", json.dumps(mine).encode())
    print("forged", flush=True)
except OSError as e:
    print("blocked", e.errno, flush=True)
time.sleep(300)
"""


@needs_users
@pytest.mark.timeout(120)
def test_own_worker_naming_another_runs_init_in_its_tag_cannot_make_cancel_kill_that_run():
    """Two runs of one unprivileged user (pidns backend). Run A's worker,
    walled in its own PID namespace, cannot signal run B. It copied B's wall
    (its init's pid and start time, B's namespace) into A's own `user.` tag;
    A's supervisor then died. The user's `contain cancel A` adopted, took
    B's init for A's (it is pid 1 of the namespace the tag names), killed
    run B's whole tree, and said A was REAPED with A's tree alive. The
    worker can no longer reach any run directory: the init covers the state
    directory in the run's mount namespace."""
    victim, = spare_uids(1)
    with Shared() as sh:
        v = Victim(sh, victim)
        b_token = new_token()
        env_b = dict(v.env, **{TOKEN_VAR: b_token})
        b = subprocess.Popen(_as(victim, python(), "-m", "launcher", "run", "-q", "--backend", "pidns", "--id", "b",
                                 "--", "sleep", "300"), env=env_b, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd="/")
        a = None
        try:
            deadline = time.monotonic() + 30
            while not holders(b_token) and b.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if not holders(b_token):
                b.kill()
                raise AssertionError(f"run b did not start: exit {b.wait(10)}, {b.communicate(timeout=10)[1]!r}")
            a = v.start("run", "-q", "--backend", "pidns", "--id", "a", "--", python(), "-c",
                        _NAME_ANOTHER_RUNS_INIT, "b")
            line = readline_within(a.stdout, 30)
            assert line.startswith(b"blocked"), (line, a.poll())
            os.kill(a.pid, signal.SIGKILL)
            a.wait(10)
            c = v.contain("cancel", "a", "--grace", "0", "--wait", "--json", timeout=60)
            assert holders(b_token), f"cancel of run a killed run b ({c.stdout.strip()[-200:]!r})"
            assert not (c.returncode == 0 and holders(v.token)), f"cancel said {c.stdout[-200:]!r}, run a alive"
        finally:
            for p in (a, b):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(10)
            kill_holders(v.token)
            kill_holders(b_token)
        assert holders(v.token) == [] and holders(b_token) == []


# -- what ls and status print ------------------------------------------------------------

@needs_cgroup
@pytest.mark.timeout(60)
def test_newline_and_escape_in_argv_cannot_forge_ls_rows_or_reach_the_terminal(box):
    """A command with a newline (any multi-line `sh -c` script) and an
    escape sequence (here one that would set the terminal's title, or OSC 52,
    the clipboard) was printed raw by `ls` and `status`: the newline forged
    a row of its own ("fake  REAPED ...") and the escape went to the
    terminal. A worker that can write its record.json chooses this text."""
    script = "true\nfake  REAPED   exited   0\n\x1b]0;owned\x07\x1b]52;c;ZWNobyBvd25lZA==\x07"
    r = subprocess.run(contain_cmd("run", "-q", "--id", "nl", "--", "sh", "-c", script), env=box.env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    ls = subprocess.run(contain_cmd("ls", "--all"), env=box.env, capture_output=True, text=True, timeout=30)
    st = subprocess.run(contain_cmd("status", "nl"), env=box.env, capture_output=True, text=True, timeout=30)
    for out in (ls.stdout, st.stdout):
        assert "\x1b" not in out and "\x07" not in out, repr(out)
        assert not any(line.startswith("fake") for line in out.splitlines()), out
    assert len(ls.stdout.splitlines()) == 2, ls.stdout     # the header and one row
    assert "\\n" in ls.stdout and "\\x1b" in st.stdout, (ls.stdout, st.stdout)
    assert holders(box.token) == []


_FIFOS_FOR_RUN_FILES = r"""
import os, time
d = os.environ["CONTAIN_RUN_DIR"]
deadline = time.monotonic() + 20     # the first record is written a moment after the spawn
while time.monotonic() < deadline and not all(os.path.exists(os.path.join(d, n)) for n in ("run.json", "record.json")):
    time.sleep(0.05)
for name in ("run.json", "record.json"):
    os.unlink(os.path.join(d, name))
    os.mkfifo(os.path.join(d, name), 0o600)
print("replaced", flush=True)
"""


@needs_users
@pytest.mark.timeout(120)
def test_own_worker_replacing_run_json_with_a_fifo_cannot_make_its_run_deaf_to_cancel():
    """An unprivileged user's run.json and record.json replaced with FIFOs
    (by its worker then; the worker cannot reach them now, so by the same
    user outside). `contain cancel --wait` could not read the run uid, sent
    a request without one, which the owner rejected; it then waited for
    ever (the owner holds the run as long as the worker lives): the run was
    deaf to cancel and the user's cancel hung."""
    victim, = spare_uids(1)
    with Shared() as sh:
        v = Victim(sh, victim)
        p = v.start("run", "-q", "--backend", "pidns", "--id", "ff", "--", *_LIVE)
        try:
            line = readline_within(p.stdout, 30)
            assert line.strip() == b"up", (line, p.poll())
            assert v.forge("ff", _FIFOS_FOR_RUN_FILES) == "replaced"
            try:
                c = v.contain("cancel", "ff", "--grace", "0", "--wait", timeout=10)
            except subprocess.TimeoutExpired:
                pytest.fail("contain cancel --wait hung: the run did not stop")
            try:
                p.wait(30)            # the supervisor (it carries the token too) may still be exiting
            except subprocess.TimeoutExpired:
                pass
            still = holders(v.token)
            assert still == [], f"cancel exited {c.returncode} ({c.stdout.strip()} {c.stderr.strip()}) with {still} alive"
        finally:
            end_started(p, v.token)
        assert holders(v.token) == []


_REACH_FOR_THE_STATE_DIR = r"""
import json, os
d = os.environ["CONTAIN_RUN_DIR"]
state = os.path.dirname(os.path.dirname(d))
seen = {}
for what, f in (("record", lambda: open(os.path.join(d, "record.json")).read()),
                ("tag", lambda: os.getxattr(d, "user.contain.run")),
                ("runs", lambda: os.listdir(os.path.join(state, "runs"))),
                ("write", lambda: open(os.path.join(d, "record.json"), "w").write("{}"))):
    try:
        f()
        seen[what] = "ok"
    except OSError as e:
        seen[what] = e.errno
seen["state_dir"] = os.listdir(state)
print(json.dumps(seen), flush=True)
"""


@needs_users
@pytest.mark.timeout(120)
def test_own_worker_cannot_reach_the_state_directory():
    """Behind a user namespace of the caller's own uid (the pidns backend)
    the worker is the owner of the state directory: it could rewrite its own
    record, run.json and tag, and every other run's of the same user. The
    init now mounts an empty tmpfs over the state directory in the run's
    mount namespace, which the worker (no capabilities) cannot unmount."""
    victim, = spare_uids(1)
    with Shared() as sh:
        v = Victim(sh, victim)
        p = v.start("run", "-q", "--backend", "pidns", "--id", "sd", "--", python(), "-c", _REACH_FOR_THE_STATE_DIR)
        try:
            out, err = p.communicate(timeout=60)
        finally:
            end_started(p, v.token)
        assert p.returncode == 0, err
        seen = json.loads(out)
        assert "ok" not in seen.values() and seen["state_dir"] == [], seen
        w = v.contain("wait", "sd", "--json", timeout=30)
        rec = json.loads(w.stdout)
        assert rec["state"] == "REAPED", rec["state"]
        wall, = rec["containment"]["walls"]
        assert wall["state_dir"]["hidden"] is True and wall["state_dir"]["path"] == os.path.dirname(
            os.path.dirname(v.run_dir("sd"))), wall
        # Started from inside the state directory: its working directory
        # would still name the directory under the tmpfs.
        inside = subprocess.run(_as(victim, python(), "-m", "launcher", "run", "-q", "--backend", "pidns", "--id",
                                    "cw", "--", "ls", "-A", "."), env=v.env, capture_output=True, text=True,
                                timeout=60, cwd=os.path.dirname(v.run_dir("sd")))
        assert inside.returncode == 0 and inside.stdout.split() == [], (inside.stdout, inside.stderr)
        assert holders(v.token) == []
