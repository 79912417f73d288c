"""`contain doctor`: what this host gives, measured, and what that buys.

Every answer comes from trying the thing, never from a version string: a
plain spawn of /bin/true (no cgroup) says whether anything can start at all
and through which clone; the clone3 and cgroup.kill probes spawn /bin/true
into scratch leaves created under the base for the purpose and removed
afterwards (also on failure); the namespace probes spawn /bin/true behind
the wall; a throwaway child asks what a seccomp filter refuses and whether
it may become a child subreaper (_incontainer.py, which also reads what the
kernel shows of a surrounding container); the process connector is
subscribed to and closed.
"""
from __future__ import annotations

import errno
import os
import secrets
import sys
import time
from typing import Any, Callable

from . import _incontainer
from ._advice import modes, next_steps, withheld
from ._policy import policy_env
from ._procfs import mounts

_TRUE = "/bin/true"


def _probe(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run one probe: {"ok": bool|None, ...}; an exception is its own answer."""
    try:
        out = fn()
    except Exception as e:   # a probe failing is a finding, not a crash
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return out if isinstance(out, dict) else {"ok": bool(out)}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


class _Scratch:
    """A scratch cgroup under the base, created here and always removed."""

    def __init__(self, base: str, what: str) -> None:
        self.dir = os.path.join(base, f"doctor-{what}-{os.getpid()}-{secrets.token_hex(3)}")

    def __enter__(self) -> "_Scratch":
        os.mkdir(self.dir)
        return self

    def __exit__(self, *exc: Any) -> None:
        for attempt in range(100):
            try:
                os.rmdir(self.dir)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                # populated 0 can precede the last task's exit by a moment.
                if e.errno == errno.EBUSY and attempt < 99:
                    time.sleep(0.005)
                    continue
                raise


def _spawn_true(leaf: str | None, **req_kw: Any) -> dict[str, Any]:
    """clone3 /bin/true into `leaf` (None: no cgroup, the caller's); reap
    it. {"ok": True} or why not."""
    from ._platform import posix

    req = posix.SpawnRequest([_TRUE], env={"PATH": "/usr/bin:/bin"}, stdio=(-1, -1, -1), **req_kw)
    fd = -1 if leaf is None else os.open(leaf, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sp = posix.spawn(req, cgroup_fd=fd)
    except posix.CloneUnsupported as e:
        return {"ok": False, "error": f"clone3(CLONE_INTO_CGROUP) unsupported: {e}"}
    except posix.DiedAtBirth:
        return {"ok": False, "died_at_birth": True, "error": "child SIGKILLed before it ran"}
    finally:
        if fd >= 0:
            os.close(fd)
    if sp.wall:
        # Behind the wall: the init is our child; it exits 0 once the worker did.
        try:
            info = os.waitid(os.P_PIDFD, sp.init_pidfd, os.WEXITED)
        finally:
            for f in (sp.pidfd, sp.init_pidfd, sp.report_fd):
                if f >= 0:
                    os.close(f)
    else:
        try:
            info = os.waitid(os.P_PIDFD, sp.pidfd, os.WEXITED)
        finally:
            os.close(sp.pidfd)
    code = info.si_status if info is not None else None
    return {"ok": code == 0, "exit_status": code}


def _plain_spawn() -> dict[str, Any]:
    """What every mode needs first: /bin/true spawned as a run's worker is,
    with no cgroup, and through which clone (where clone3 is refused, e.g.
    by Docker's default seccomp profile, the legacy clone: clone.c)."""
    from ._platform import posix

    r = _spawn_true(None)
    refused = posix.clone3_refused()
    r["via"] = "clone" if refused else "clone3"
    r["clone3_refused"] = refused
    return r


def _subreaper(asked: dict[str, Any]) -> dict[str, Any]:
    """Whether a child of ours may become a child subreaper, as a run's
    supervisor does for the subreaper backend (the throwaway child of
    _incontainer.ask_kernel tried PR_SET_CHILD_SUBREAPER and read it back)."""
    e = asked.get("subreaper")
    if e == 0:
        return {"ok": True}
    if e is None:
        why = asked.get("error") or (f"the child asking was killed by signal {asked['killed_by']}"
                                     if asked.get("killed_by") else "no answer")
        return {"ok": None, "error": f"prctl(PR_SET_CHILD_SUBREAPER) not asked: {why}"}
    return {"ok": False, "error": f"prctl(PR_SET_CHILD_SUBREAPER) answered {errno.errorcode.get(e, str(e))}"}


def _ask_kernel() -> dict[str, Any]:
    try:
        return _incontainer.ask_kernel()
    except Exception as e:   # a probe failing is a finding, not a crash
        return {"answers": {}, "subreaper": None, "clone3": None, "killed_by": None,
                "error": f"{type(e).__name__}: {e}"}


def _cgroup2() -> dict[str, Any]:
    from ._platform import cgroups

    out: dict[str, Any] = {"mounts": [], "base": None, "usable": False}
    try:
        hs = cgroups.hierarchies()
    except OSError as e:
        out["error"] = f"/proc/self/mountinfo: {e}"
        return out
    # The mount's own options (mountinfo field 6) say whether it is
    # read-only; the superblock's (after " - ") are every mount's of the
    # filesystem, and say "rw" for a read-only bind (a default container's).
    by_point = {m.point: m for m in mounts() if m.fstype == "cgroup2"}    # the later of two at a point wins
    out["mounts"] = []
    for h in hs:
        m = by_point.get(h.mount)
        out["mounts"].append({"mount": h.mount, "root": h.root, "nsdelegate": h.nsdelegate,
                              "super_options": ",".join(m.super_options) if m else None,
                              "options": ",".join(m.options) if m else None,
                              "read_only": "ro" in m.options if m else None})
    out["nsdelegate"] = any(h.nsdelegate for h in hs) if hs else None
    v1 = cgroups.cgroup_mounts()[1]
    out["cgroup1_mounts"] = v1
    if not hs:
        out["error"] = "no cgroup v2 hierarchy is mounted"
        return out
    try:
        h, base = cgroups.resolve_base()
    except Exception as e:
        out["error"] = getattr(e, "reason", str(e))
        return out
    out["base"] = base
    out["base_cgroup"] = h.cg_path(base)
    out["base_mount"] = h.mount
    out["base_mount_read_only"] = next((m["read_only"] for m in out["mounts"] if m["mount"] == h.mount), None)
    out["writable"] = os.access(base, os.W_OK | os.X_OK) and os.access(os.path.join(base, "cgroup.procs"), os.W_OK)
    try:
        st = os.stat(os.path.join(base, "cgroup.procs"))
        out["delegated_to_uid"] = st.st_uid
    except OSError:
        out["delegated_to_uid"] = None
    out["controllers"] = (_read(os.path.join(base, "cgroup.controllers")) or "").split()
    out["subtree_control"] = (_read(os.path.join(base, "cgroup.subtree_control")) or "").split()
    out["cgroup_kill_file"] = os.path.exists(os.path.join(base, "cgroup.kill"))
    out["cgroup_freeze_file"] = os.path.exists(os.path.join(base, "cgroup.freeze"))
    # Which uids are sealed by their uid alone: nobody is the usual worker.
    try:
        import pwd

        nobody = pwd.getpwnam("nobody")
        above = cgroups.writable_procs_above(nobody.pw_uid, [nobody.pw_gid], os.path.join(base, "run-x"))
        out["nobody_sealed_by_uid"] = above is None
    except (KeyError, OSError):
        out["nobody_sealed_by_uid"] = None
    out["usable"] = bool(out["writable"])
    return out


def _clone_into(base: str) -> dict[str, Any]:
    with _Scratch(base, "clone") as s:
        return _spawn_true(s.dir)


def _kill_bug(base: str) -> dict[str, Any]:
    """KERNEL-NOTES.md: once cgroup.kill was written, a later clone3 into
    that cgroup is SIGKILLed at birth on kernels without the upstream fix."""
    with _Scratch(base, "killbug") as s:
        with open(os.path.join(s.dir, "cgroup.kill"), "w") as f:
            f.write("1")
        r = _spawn_true(s.dir)
    if r.get("died_at_birth"):
        return {"ok": True, "present": True,
                "detail": "a clone3(CLONE_INTO_CGROUP) child of a once-killed empty leaf was SIGKILLed at birth; "
                          "contain uses one fresh leaf per launch and retries a child killed at birth"}
    if r.get("ok"):
        return {"ok": True, "present": False, "detail": "a child of a once-killed leaf ran"}
    return {"ok": False, "present": None, "detail": r.get("error"), "error": r.get("error")}


def _sealed_spawn(base: str) -> dict[str, Any]:
    """The seal as a run gets it (sealing.py), around /bin/true: behind the
    PID-namespace wall, root inside a user namespace mapped to nobody."""
    with _Scratch(base, "seal") as s:
        r = _spawn_true(s.dir, pidns=True, mount_proc=True, userns="map", uid_map="0 65534 1",
                        gid_map="0 65534 1", clear_caps=True, no_new_privs=True)
    return r


def _pidfd() -> dict[str, Any]:
    fd = os.pidfd_open(os.getpid())
    os.close(fd)
    return {"ok": True}


def _connector() -> dict[str, Any]:
    from ._ledger import Ledger
    from ._proccn import LedgerUnavailable

    t0 = time.perf_counter()
    try:
        led = Ledger.open()
    except LedgerUnavailable as e:
        return {"ok": False, "error": e.reason}
    ms = (time.perf_counter() - t0) * 1000
    led.close()
    return {"ok": True, "subscribe_ms": round(ms, 3)}


def _controllers(v2_base: str | None) -> dict[str, Any]:
    """Per controller, where a run's limits and numbers come from here (v2
    under the base, or a v1 hierarchy on hybrid hosts), or why none: read
    only (_controllers.host_report makes and enables nothing)."""
    from ._controllers import host_report

    return {"ok": True, "routes": host_report(v2_base)}


def _wall() -> dict[str, Any]:
    """A PID-namespace wall as runs get it: as root, the init alone; without
    root, inside a user namespace mapping this user to itself."""
    from ._platform import posix

    problem = posix.wall_available("self" if os.geteuid() != 0 else None, mount_proc=True)
    return {"ok": True} if problem is None else {"ok": False, "error": problem}


def _state_dir() -> dict[str, Any]:
    """Where this user's runs go, whether that can be used, and what to do
    if not (issue 31: doctor said "possible" while every run failed 125 for
    want of a state directory). Nothing is created."""
    from ._statedir import ENV, StateDir, StateDirError, location

    how = f"{ENV}" if policy_env(ENV) else "the default for this user"
    try:
        path = location()
    except (ValueError, StateDirError) as e:
        return {"path": None, "how": how, "usable": False, "error": str(e),
                "fix": f"set {ENV} to an absolute path of a directory of your own (0700)"}
    try:
        StateDir.open(path, write=True).close()
    except FileNotFoundError:
        return {"path": path, "how": how, "usable": True, "exists": False,
                "detail": "does not exist yet: the first run makes it (private, 0700; root's 0755)"}
    except StateDirError as e:
        return {"path": path, "how": how, "usable": False, "error": str(e),
                "fix": f"set {ENV} to an absolute path of a directory of your own (0700)"}
    return {"path": path, "how": how, "usable": True, "exists": True}


def capabilities() -> dict[str, Any]:
    """What `contain doctor` reports (also `launcher.capabilities()`)."""
    if sys.platform == "win32":
        from ._platform import windoctor

        return windoctor.capabilities()
    caps: dict[str, Any] = {"schema": "contain.capabilities/1", "kernel": os.uname().release,
                            "euid": os.geteuid()}
    # First what every mode needs: a spawn at all. It also finds a refused
    # clone3, so every later probe's message says which clone it used.
    caps["spawn"] = _probe(_plain_spawn)
    asked = _ask_kernel()
    caps["container"] = _incontainer.facts(asked)
    c3 = asked.get("clone3")
    caps["clone3"] = {"usable": c3 == 0 if c3 is not None else None, "errno": c3 or None,
                      "refused_with": errno.errorcode.get(c3, str(c3)) if c3 else None,
                      "how": "clone3(NULL, 0): the kernel answers EINVAL, a filter its own errno first"}
    caps["subreaper"] = _subreaper(asked)
    caps["state_dir"] = _state_dir()
    cg = _cgroup2()
    caps["cgroup2"] = cg
    base = cg.get("base") if cg.get("usable") else None
    skip = {"ok": None, "error": "no writable cgroup v2 base: " + str(cg.get("error") or "not writable")}
    caps["clone3_into_cgroup"] = _probe(lambda: _clone_into(base)) if base else skip
    caps["cgroup_kill_bug"] = _probe(lambda: _kill_bug(base)) if base and cg.get("cgroup_kill_file") else (
        skip if not base else {"ok": None, "present": None, "error": "no cgroup.kill (before 5.14)"})
    caps["pidfd"] = _probe(_pidfd)
    caps["process_connector"] = _probe(_connector)
    if base and os.geteuid() == 0:
        caps["seal"] = _probe(lambda: _sealed_spawn(base))
    else:
        caps["seal"] = {"ok": False, "error": "the namespace seal needs a root supervisor" if base else skip["error"]}
    caps["pidns_wall"] = _probe(_wall)
    caps["controllers"] = _probe(lambda: _controllers(base))
    caps["modes"] = modes(caps)
    caps["withheld"] = withheld(caps)
    # What a plain `contain run` gets: an explicit CONTAIN_CGROUP_BASE that
    # cannot be used fails every run (125) rather than falling back. Else
    # possible means: something can start, and some mode proves REAPED.
    broken_base = bool(policy_env("CONTAIN_CGROUP_BASE")) and not (cg.get("usable") and base)
    strongest = next((m for m in caps["modes"] if m["available"] and m["strongest_state"] == "REAPED"), None)
    caps["strongest_mode"] = strongest["mode"] if strongest else None
    caps["containment_possible"] = (not broken_base and bool(caps["spawn"].get("ok")) and strongest is not None
                                    and caps["state_dir"]["usable"] is not False)
    caps["next_steps"] = next_steps(caps)
    return caps
