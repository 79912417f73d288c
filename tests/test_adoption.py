"""Adoption acts only on what it can verify (issues 10 and 11).

An adopter (a `contain cancel` of a run whose supervisor died) must never
take where to kill from the run directory alone: a worker may have rewritten
run.json and record.json. Each test plays one attack against the real
kernel, with victim cgroups and processes this test creates, and decides
what survived by its own /proc scan (tests/_proc.py).
"""
from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from _proc import ROOT, contain_cmd, holders, kill_holders, new_token, run_contain, wait_holders
from conftest import TOKEN_VAR, needs_cgroup, remove_cgroup_tree

pytestmark = needs_cgroup
PY = sys.executable


# -- the test's own helpers (none of them use the code under test) --------------

def _mount() -> str:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                return left.split()[4]
    raise AssertionError("no cgroup2 mount")


def _identity(d: str) -> dict:
    """A cgroup's identity as the run records it, computed here by stat."""
    m = _mount()
    rel = os.path.relpath(d, m).split(os.sep)
    chain = [os.stat(os.path.join(m, *rel[: i + 1])).st_ino for i in range(len(rel))]
    st = os.stat(d)
    return {"dir": d, "cgroup": "/" + "/".join(rel), "dev": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}",
            "ino": st.st_ino, "mount": m, "mount_root": "/", "mount_ino": os.stat(m).st_ino,
            "base": os.path.dirname(d), "chain": chain}


class Victim:
    """A cgroup this test creates, with a `sleep` this test started inside
    it (the sleep writes its own pid into cgroup.procs before exec)."""

    def __init__(self, d: str) -> None:
        self.dir = d
        self.token = new_token()
        os.mkdir(d)
        env = dict(os.environ, **{TOKEN_VAR: self.token})
        self.proc = subprocess.Popen(["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec sleep 300'], env=env,
                                     stderr=subprocess.PIPE)
        try:
            assert wait_holders(self.token, 1) == [self.proc.pid]
            deadline = time.monotonic() + 30    # a move waits for an RCU grace period: long on a loaded host
            # In its cgroup, and past the exec (mid-exec its environ, which
            # holders() reads, can read empty for a moment).
            while ((self.cgroup() != "/" + os.path.relpath(d, _mount()) or self.comm() != "sleep")
                   and time.monotonic() < deadline and self.proc.poll() is None):
                time.sleep(0.01)
            if not self.alive():
                err = self.proc.stderr.read().decode() if self.proc.poll() is not None and self.proc.stderr else ""
                raise AssertionError(f"victim did not start in its cgroup: exit {self.proc.poll()} {err!r}, "
                                     f"in {self.cgroup()}, holders {holders(self.token)}")
            self.start = _start_time(self.proc.pid)
        except BaseException:
            self.remove()          # no child of this test is left for the next one to find
            raise

    def cgroup(self) -> str | None:
        try:
            with open(f"/proc/{self.proc.pid}/cgroup") as f:
                return next((x[3:].strip() for x in f if x.startswith("0::")), None)
        except OSError:
            return None

    def comm(self) -> str | None:
        try:
            with open(f"/proc/{self.proc.pid}/comm") as f:
                return f.read().strip()
        except OSError:
            return None

    def alive(self) -> bool:
        """Still the same process, still in its cgroup, which still exists."""
        return (holders(self.token) == [self.proc.pid] and os.path.isdir(self.dir)
                and self.cgroup() == "/" + os.path.relpath(self.dir, _mount()))

    def remove(self) -> None:
        kill_holders(self.token)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stderr:
            self.proc.stderr.close()
        remove_cgroup_tree(self.dir)


def _start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    return int(data[data.rfind(b")") + 2:].split()[19])


def _start_orphan(box, run_id: str, *extra: str, script: str, want: int = 2) -> None:
    """`contain run` of `script`, then its supervisor SIGKILLed (by the pid
    this test started): an orphaned run for `cancel` to adopt."""
    proc = subprocess.Popen(contain_cmd("run", "--id", run_id, *extra, "--", *script_argv(script)),
                            env=box.env, stderr=subprocess.DEVNULL)
    try:
        assert len(wait_holders(box.token, want + 1)) >= want + 1, "workload did not start"
        _wait_recorded(box, run_id)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


def script_argv(script: str) -> list[str]:
    return [PY, "-c", script] if script.startswith("#py") else ["sh", "-c", script]


def _wait_recorded(box, run_id: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            rec = box.record(run_id)
            if rec.get("identity"):
                return rec
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, "the run never recorded its worker"
        time.sleep(0.02)


def _cancel(box, run_id: str, *args: str, prefix: list[str] | None = None) -> tuple[int, dict]:
    argv = (prefix or []) + contain_cmd("cancel", run_id, "--json", "--wait", *args)
    p = subprocess.run(argv, env=box.env, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, (json.loads(p.stdout) if p.stdout.strip() else {})


def _run_dir(box, run_id: str) -> str:
    return os.path.join(box.state_dir, "runs", run_id)


# A worker (root, unsealed) that waits until its supervisor has described
# it, then rewrites run.json and record.json to name the victim (cgroup,
# worker identity, a seal it does not have), optionally rewrites or removes
# the run directory's tag, says so, and stays alive; the test then kills the
# supervisor (behind the PID-namespace wall the worker cannot see it to
# kill it itself: its parent is the wall's init).
FORGER = textwrap.dedent("""\
    #py
    import json, os, signal, time, subprocess
    rd = os.environ["CONTAIN_RUN_DIR"]
    victim = json.loads(os.environ["VICTIM"])
    while True:
        try:
            rec = json.load(open(os.path.join(rd, "record.json")))
            if rec.get("identity"):
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    info = json.load(open(os.path.join(rd, "run.json")))
    info.update(cgroup=victim["cgroup"]["cgroup"], cgroup_dir=victim["cgroup"]["dir"],
                cgroup_identity=victim["cgroup"], worker=victim["worker"])
    json.dump(info, open(os.path.join(rd, "run.json"), "w"))
    rec["identity"] = victim["worker"]
    rec["containment"]["sealed"] = True
    rec["containment"]["path"] = victim["cgroup"]["cgroup"]
    json.dump(rec, open(os.path.join(rd, "record.json"), "w"))
    mode = os.environ["TAG_MODE"]
    if mode == "remove":
        os.removexattr(rd, "trusted.contain.run")
    elif mode == "forge":
        tag = json.loads(os.getxattr(rd, "trusted.contain.run"))
        tag.update(cgroup=victim["cgroup"])
        os.setxattr(rd, "trusted.contain.run", json.dumps(tag).encode())
    subprocess.Popen(["setsid", "sleep", "300"])
    open(os.environ["FORGED"], "w").close()
    os.execvp("sleep", ["sleep", "300"])
""")


def _forger(box, run_id: str, victim: Victim, tag_mode: str) -> None:
    box.env["VICTIM"] = json.dumps({"cgroup": _identity(victim.dir),
                                    "worker": {"pid": victim.proc.pid, "start_time": victim.start,
                                               "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip(),
                                               "pidns": None, "pidfd_inode": None}})
    box.env["TAG_MODE"] = tag_mode
    forged = os.path.join(box.state_dir + "-forged")
    box.env["FORGED"] = forged
    proc = subprocess.Popen(contain_cmd("run", "--id", run_id, "--grace", "0.3", "--", PY, "-c", FORGER),
                            env=box.env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not os.path.exists(forged):
        assert time.monotonic() < deadline and proc.poll() is None, "the worker did not forge its run"
        time.sleep(0.02)
    os.unlink(forged)
    proc.send_signal(signal.SIGKILL)       # the supervisor this test started
    assert proc.wait(20) == -signal.SIGKILL
    assert len(wait_holders(box.token, 2)) >= 2, "the worker's tree did not outlive its supervisor"
    info = json.load(open(os.path.join(_run_dir(box, run_id), "run.json")))
    assert info["cgroup_dir"] == victim.dir, "the forgery did not happen"


def _rmdir_empty(d: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    for sub, _dirs, _files in sorted(os.walk(d, topdown=False), key=lambda t: -len(t[0])):
        while True:
            try:
                os.rmdir(sub)
                break
            except OSError:
                assert time.monotonic() < deadline, f"{sub} did not empty"
                time.sleep(0.02)


def _leaf_name(run_id: str) -> str:
    return f"run-{run_id}-{secrets.token_hex(4)}"


# -- the cgroup's identity ------------------------------------------------------

def test_cgroup_inode_is_the_kernel_cgroup_id_and_is_never_reused(box):
    """What the identity rests on: on cgroup2 a directory's inode number is
    the cgroup id name_to_handle_at gives (FILEID_KERNFS), and a cgroup made
    again under the same name gets a new one."""
    os.mkdir(box.base)
    d = os.path.join(box.base, "again")
    libc = ctypes.CDLL(None, use_errno=True)
    seen = set()
    for _ in range(3):
        os.mkdir(d)
        buf = ctypes.create_string_buffer(8 + 64)
        struct.pack_into("=Ii", buf, 0, 64, 0)
        mount_id = ctypes.c_int()
        assert libc.name_to_handle_at(-100, d.encode(), buf, ctypes.byref(mount_id), 0) == 0, ctypes.get_errno()
        nbytes, htype = struct.unpack_from("=Ii", buf, 0)
        assert (nbytes, htype) == (8, 0xFE)
        cgid = struct.unpack_from("<Q", buf, 8)[0]
        assert os.stat(d).st_ino == cgid
        seen.add(cgid)
        os.rmdir(d)
    assert len(seen) == 3


# -- a worker that rewrites its run directory ------------------------------------

def test_worker_rewriting_run_json_to_name_a_victim_cgroup_cannot_make_cancel_kill_it(box):
    os.mkdir(box.base)
    victim = Victim(os.path.join(box.base, _leaf_name("r")))     # named like the run's own leaf
    try:
        _forger(box, "r", victim, tag_mode="keep")
        rc, ack = _cancel(box, "r")
        assert victim.alive(), "the victim was signalled, killed or moved"
        assert holders(box.token) == [], "the real worker was not stopped"
        rec = box.record("r")
        # The tag, not the rewritten record, says what the run was: behind its
        # PID-namespace wall (the tag names the wall's init), the adopter
        # proves the real tree gone; the forged seal counts for nothing.
        assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled", rec["state"]
        assert rec["containment"]["path"] != victim.path if hasattr(victim, "path") else True
        assert rec["identity"]["pid"] != victim.proc.pid
        assert rec["containment"]["path"] != "/" + os.path.relpath(victim.dir, _mount())
        notes = " ".join(rec["notes"])
        assert "run.json's cgroup differs" in notes and "record.json says sealed" in notes, notes
    finally:
        victim.remove()


def test_run_directory_stripped_of_its_tag_is_not_trusted_with_a_stop(box):
    """A worker that could replace its run directory (here: remove its tag)
    leaves a directory whose run.json nobody vouches for: nothing is
    signalled and the run stays UNCONFIRMED, never REAPED or EXITED."""
    os.mkdir(box.base)
    victim = Victim(os.path.join(box.base, _leaf_name("r")))
    try:
        _forger(box, "r", victim, tag_mode="remove")
        rc, ack = _cancel(box, "r")
        assert victim.alive()
        assert len(holders(box.token)) >= 2, "something acted on an untrusted run directory"
        rec = box.record("r")
        assert rec["state"] == "UNCONFIRMED" and ack["state"] == "UNCONFIRMED" and rc != 0
        assert "not trusted" in rec["evidence"]["container_empty"]["detail"]
        assert rec["evidence"]["signal_sent"]["observed"] is not True
    finally:
        victim.remove()


def test_forged_tag_naming_a_cgroup_outside_the_base_is_refused(box):
    """Even a tag (written here by a root worker) cannot move the kill
    outside the adopter's cgroup base, whatever the victim is called."""
    os.mkdir(box.base)
    victim = Victim(os.path.join(_mount(), _leaf_name("r")))     # beside the base, named like a leaf
    try:
        _forger(box, "r", victim, tag_mode="forge")
        rc, ack = _cancel(box, "r")
        assert victim.alive()
        assert len(holders(box.token)) >= 2
        rec = box.record("r")
        assert rec["state"] == "UNCONFIRMED" and rc != 0
        assert "outside this process's cgroup base" in rec["evidence"]["container_empty"]["detail"]
    finally:
        victim.remove()


def test_forged_tag_naming_a_look_alike_cgroup_under_the_base_is_refused(box):
    """A victim under the base whose name only looks like a run leaf, or is
    another run's: refused; the run's own cgroup is then never reached."""
    os.mkdir(box.base)
    victim = Victim(os.path.join(box.base, f"run-other-{secrets.token_hex(4)}"))
    try:
        _forger(box, "r", victim, tag_mode="forge")
        rc, ack = _cancel(box, "r")
        assert victim.alive()
        rec = box.record("r")
        assert rec["state"] == "UNCONFIRMED"
        assert "named for run 'other'" in rec["evidence"]["container_empty"]["detail"]
    finally:
        victim.remove()


@pytest.mark.parametrize("name", ["run-r-1234567", "run-r-1234567g", "run-r-ABCDEF12", "run-r-12345678x",
                                  "xrun-r-12345678", "main", "run-r"])
def test_look_alike_leaf_names_are_refused_before_anything_is_read(box, name):
    from launcher._platform import cgattach

    os.mkdir(box.base)
    d = os.path.join(box.base, name)
    os.mkdir(d)
    good = os.path.join(box.base, _leaf_name("r"))
    os.mkdir(good)
    key = "1:1"      # the run directory's dev:ino, as the cgroup's tag would name it
    os.setxattr(good, "trusted.contain.cgroup", json.dumps({"run_dir": key, "run_uid": "u"}).encode())
    os.setxattr(d, "trusted.contain.cgroup", json.dumps({"run_dir": key, "run_uid": "u"}).encode())
    check = cgattach.verify(cgattach.CgroupIdentity(_identity(d)), run_id="r", base=box.base,
                            run_key=key, run_uid="u", need_tag=True)
    assert check.status == "refused", (check.status, check.reason)
    # The same checks accept the run's own, correctly named and tagged leaf.
    check = cgattach.verify(cgattach.CgroupIdentity(_identity(good)), run_id="r", base=box.base,
                            run_key=key, run_uid="u", need_tag=True)
    assert check.status == "live", check.reason
    check.close()


# -- absence is not emptiness -----------------------------------------------------

def _other_view(kind: str, view_cgroup: str) -> list[str]:
    """A command prefix running its command in another view of the
    hierarchy: a mount namespace where the cgroup2 mount is replaced by a
    bind of another subtree, or a cgroup namespace rooted elsewhere with
    cgroup2 mounted again in a mount namespace of its own."""
    m = _mount()
    if kind == "bind":
        return ["unshare", "-m", "--propagation", "private", "sh", "-c",
                f'mount --bind {view_cgroup} {m} && exec "$@"', "view"]
    # The shell this test starts moves itself (its own pid) into the view
    # cgroup the test made, then enters a new cgroup namespace there.
    return ["sh", "-c", f'echo $$ > {view_cgroup}/cgroup.procs && exec unshare -C -m --propagation private '
            f'sh -c \'umount -l {m} && mount -t cgroup2 none {m} && exec "$@"\' view "$@"', "outer"]


@pytest.mark.parametrize("kind", ["bind", "cgroupns"])
def test_adopter_in_another_mount_view_gets_unconfirmed_never_reaped(box, kind):
    view = os.path.join(_mount(), f"contain-view-{secrets.token_hex(4)}")
    os.mkdir(view)
    try:
        _start_orphan(box, "r", "--grace", "0.3", script="setsid sleep 300 & sleep 300 & wait", want=3)
        rc, ack = _cancel(box, "r", prefix=_other_view(kind, view))
        rec = box.record("r")
        assert rec["state"] == "UNCONFIRMED" and ack["state"] == "UNCONFIRMED" and rc != 0, rec["state"]
        assert "another hierarchy or another part of it" in rec["evidence"]["container_empty"]["detail"]
        assert len(holders(box.token)) >= 3, "the worker's tree must still be there, untouched"
        # A normal cancel, which sees the hierarchy as the run was made in it.
        rc, ack = _cancel(box, "r")
        rec = box.record("r")
        # Behind the PID-namespace wall the adopter proves the tree gone.
        assert rec["state"] == "REAPED" and rec["outcome"] == "cancelled"
        assert rec["evidence"]["cancel_requested"]["at"] is not None
        assert holders(box.token) == []
    finally:
        remove_cgroup_tree(view)


def test_adopter_in_another_view_proves_removal_by_cgroup_id(box):
    """Where the kernel can say it (open_by_handle_at of the recorded cgroup
    id: ESTALE), a removed cgroup is removed whatever the view; with the
    PID-namespace wall's init gone too, the run is REAPED."""
    view = os.path.join(_mount(), f"contain-view-{secrets.token_hex(4)}")
    os.mkdir(view)
    try:
        _start_orphan(box, "r", script="sleep 300", want=1)
        kill_holders(box.token)
        run_cg = json.load(open(os.path.join(_run_dir(box, "r"), "run.json")))["cgroup_dir"]
        _rmdir_empty(run_cg)      # emptied above by the test, by pid; no cgroup.kill of a cgroup it did not make
        rc, ack = _cancel(box, "r", prefix=_other_view("bind", view))
        rec = box.record("r")
        assert rec["state"] == "REAPED", rec["evidence"]["container_empty"]
        assert "ESTALE" in rec["evidence"]["container_empty"]["via"]
    finally:
        remove_cgroup_tree(view)


def test_sealed_run_adopted_by_cancel_is_reaped(box):
    """The seal, as the run's tag records it, is what lets an adopter with
    no ledger of the run's past say REAPED."""
    _start_orphan(box, "r", "--seal", "--grace", "0.3", script="setsid sleep 300 & sleep 300 & wait", want=3)
    rc, ack = _cancel(box, "r")
    assert rc == 0 and ack["effect"] == "cancelled" and ack["state"] == "REAPED", ack
    assert holders(box.token) == []


def test_orphaned_pidns_backend_run_is_stopped_by_cancel(box):
    """The `pidns` backend has no cgroup: an adopter must find the wall's
    init in the run's tag and kill it, not look for a cgroup and leave the
    orphaned tree running (UNCONFIRMED for ever)."""
    _start_orphan(box, "p", "--backend", "pidns", "--grace", "0.3",
                  script="setsid sleep 300 & sleep 300 & wait", want=3)
    assert len(holders(box.token)) >= 3, "the tree outlives its supervisor"
    rc, ack = _cancel(box, "p")
    assert holders(box.token) == [], "cancel left the orphaned tree running"
    rec = box.record("p")
    assert rc == 0 and ack["effect"] == "cancelled" and ack["state"] == "REAPED", ack
    assert rec["state"] == "REAPED" and rec["containment"]["backend"] == "pidns"
    assert rec["evidence"]["descendants_exit"]["observed"] is True


def test_orphaned_pidns_backend_run_with_a_gone_init_is_reaped_without_a_signal(box):
    """The tree ended on its own after its supervisor died: the init's
    identity (pid + start time) no longer names a process, so the
    namespace is proven empty and nothing is signalled."""
    _start_orphan(box, "g", "--backend", "pidns", script="sleep 1", want=1)
    deadline = time.monotonic() + 20
    while holders(box.token):
        assert time.monotonic() < deadline, "the workload did not end"
        time.sleep(0.05)
    rc, ack = _cancel(box, "g")
    rec = box.record("g")
    assert rc == 0 and rec["state"] == "REAPED", (rec["state"], rec["containment"])
    assert rec["evidence"]["signal_sent"]["observed"] is not True
    assert rec["containment"]["walls"][0]["observed_empty"] is True


# -- degraded mode ---------------------------------------------------------------

def test_degraded_run_adopted_after_supervisor_sigkill_is_stopped_not_declared_gone(box):
    proc = subprocess.Popen(contain_cmd("run", "--id", "d", "--backend", "none", "--grace", "0.3", "--",
                                        "sh", "-c", "setsid sleep 300 & sleep 300"),
                            env=box.env, stderr=subprocess.DEVNULL)
    try:
        assert len(wait_holders(box.token, 3)) >= 3     # supervisor, worker, the setsid daemon
        _wait_recorded(box, "d")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert len(holders(box.token)) >= 2, "the tree outlives its supervisor"
    rc, ack = _cancel(box, "d")
    rec = box.record("d")
    left = holders(box.token)
    assert rec["state"] != "REAPED"
    assert (rec["state"] == "EXITED" and left == []) or (rec["state"] == "UNCONFIRMED" and left), \
        (rec["state"], left)
    assert rec["state"] == "EXITED", f"left alive: {left}"
    assert rec["evidence"]["descendants_exit"]["observed"] is None
    assert "adopted" in rec["evidence"]["descendants_exit"]["detail"]["unprovable"]


def test_degraded_adoption_never_signals_a_forged_member(box):
    """record.json and run.json name a victim as the worker: the adopter
    takes the worker and the members from the tag, and re-reads each."""
    victim = subprocess.Popen(["sleep", "300"], env=dict(os.environ, **{TOKEN_VAR: "victim" + box.token}))
    try:
        proc = subprocess.Popen(contain_cmd("run", "--id", "d", "--backend", "none", "--grace", "0.3", "--",
                                            "sleep", "300"), env=box.env, stderr=subprocess.DEVNULL)
        try:
            assert len(wait_holders(box.token, 2)) >= 2
            _wait_recorded(box, "d")
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        rd = _run_dir(box, "d")
        forged = {"pid": victim.pid, "start_time": _start_time(victim.pid),
                  "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip()}
        for name, key in (("run.json", "worker"), ("record.json", "identity")):
            doc = json.load(open(os.path.join(rd, name)))
            doc[key] = forged
            json.dump(doc, open(os.path.join(rd, name), "w"))
        rc, ack = _cancel(box, "d")
        assert victim.poll() is None, "the victim was killed"
        assert holders(box.token) == []
        assert box.record("d")["state"] == "EXITED"
    finally:
        victim.kill()
        victim.wait(10)


# -- nested registrations -----------------------------------------------------------

def test_forged_nested_registration_cannot_make_the_lead_finish_another_run(box):
    """A lead's worker appends registrations naming an orphaned run of the
    same state directory (with a cgroup path inside the lead, and one
    outside it): the lead's end leaves that run alone, and says so."""
    os.mkdir(box.base)
    _start_orphan(box, "victim", script="sleep 300", want=1)
    before = box.record("victim")
    victim_pids = holders(box.token)
    forged = [{"id": "victim", "run_uid": before["run_uid"], "run_dir": _run_dir(box, "victim"),
               "cgroup": "/elsewhere/sub-victim-0123abcd"}]
    script = textwrap.dedent(f"""\
        import json, os
        lead_cg = os.path.relpath(os.environ["CONTAIN_RUN_CGROUP"], {_mount()!r})
        forged = json.loads({json.dumps(json.dumps(forged))})
        forged.append(dict(forged[0], cgroup="/" + lead_cg + "/sub-victim-0123abcd"))
        with open(os.path.join(os.environ["CONTAIN_RUN_DIR"], "nested.ndjson"), "a") as f:
            for r in forged:
                f.write(json.dumps(r) + "\\n")
        os.mkdir(os.path.join(os.environ["CONTAIN_RUN_CGROUP"], "sub-victim-0123abcd"))
    """)
    env = dict(box.env, **{TOKEN_VAR: "lead" + box.token})
    p = subprocess.run(contain_cmd("run", "--id", "lead", "--", PY, "-c", script), env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lead = box.record("lead")
    assert holders(box.token) == victim_pids, "the victim run was stopped by the lead"
    assert box.record("victim") == before, "the victim run's record was changed"
    notes = " ".join(lead["notes"])
    assert "not below the lead's" in notes and "does not describe the cgroup" in notes, notes


def test_status_reader_never_reads_the_cgroup_a_rewritten_run_json_names(box):
    """The live views (`ls`, `status`) read member counts and CPU from the
    cgroup: check_cgroup gives them the run's verified cgroup, not the one a
    rewritten run.json names."""
    from launcher._containers import check_cgroup

    os.mkdir(box.base)
    victim = Victim(os.path.join(box.base, _leaf_name("r")))
    proc = subprocess.Popen(contain_cmd("run", "--id", "r", "--", "sleep", "300"), env=box.env,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_recorded(box, "r")
        rd = _run_dir(box, "r")
        info = json.load(open(os.path.join(rd, "run.json")))
        real = info["cgroup_dir"]
        forged = dict(info, cgroup_dir=victim.dir, cgroup_identity=_identity(victim.dir))
        check = check_cgroup(rd, "r", forged)
        try:
            assert check.status == "live" and check.dir == real != victim.dir, (check.status, check.reason)
        finally:
            check.close()
        # And with no run tag to go by, the victim is refused: no cgroup tag names this run.
        os.removexattr(rd, "trusted.contain.run")
        check = check_cgroup(rd, "r", forged)
        assert check.status == "refused" and "not made for it" in check.reason, check.reason
        assert victim.alive()
    finally:
        proc.kill()
        proc.wait(10)
        victim.remove()


def test_nested_run_finished_by_its_lead_is_reaped_on_the_leads_proof(box):
    """A nested run whose owner died with its lead has no ledger of its own
    past, but its cgroup was inside the lead's, which the lead observed
    empty with no member able to leave unseen: the lead's REAPED is its
    proof, and its record says so."""
    script = "import launcher; launcher.spawn(['sleep', '300'], id='nested').wait()"
    proc = subprocess.Popen(contain_cmd("run", "--id", "lead", "--grace", "0.5", "--", PY, "-c", script),
                            env=box.env, stderr=subprocess.DEVNULL)
    try:
        _wait_recorded(box, "nested")
        rc, ack = _cancel(box, "lead")
    finally:
        proc.wait(30)
    lead, nested = box.record("lead"), box.record("nested")
    if lead["state"] != "REAPED":
        pytest.skip(f"the lead itself could not prove REAPED here: {lead['evidence']['descendants_exit']}")
    assert holders(box.token) == []
    # Its outcome is whichever its adopter saw first: the worker already gone
    # (exited, status unknown), or the lead's cancel.
    assert nested["state"] == "REAPED" and nested["outcome"] in ("exited", "cancelled"), nested["state"]
    assert "nested in run lead" in nested["evidence"]["descendants_exit"]["via"]
