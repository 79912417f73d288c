"""What `contain doctor` concludes from its probes (_doctor.py): the modes
this host offers, the strongest state each can prove, what withholds each
container, and what this user can do next. Pure functions of the
capabilities dict: no probe runs here.

    modes(caps)        one entry per mode, strongest first
    withheld(caps)     per container (cgroup2, the PID-namespace wall, the
                       seal, the subreaper): what withholds it here, and the
                       fix at the level of the container contain runs in
                       (_incontainer.py reads what the kernel shows of it)
    next_steps(caps)   advice this very user can follow, most useful first
"""
from __future__ import annotations

import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from ._policy import policy_env


def _user_manager() -> bool:
    """Whether this user has a systemd user manager to ask for a delegated
    scope (its private socket exists). Read from the filesystem only: the
    doctor makes no scope to find out."""
    import shutil

    xdg = policy_env("XDG_RUNTIME_DIR")
    if not xdg or shutil.which("systemd-run") is None:
        return False
    return os.path.exists(os.path.join(xdg, "systemd", "private"))


# The fixes a container's owner can apply (docker run, a Kubernetes pod).
# Docker's default seccomp profile allows clone3, unshare, mount and
# clone's namespace flags to a container that has CAP_SYS_ADMIN (moby
# profiles/seccomp/default.json, "includes": {"caps": ["CAP_SYS_ADMIN"]}).
SECCOMP_FIX = ("a seccomp profile that allows clone3, unshare, mount and clone's namespace flags (Docker "
               "`--security-opt seccomp=PROFILE.json`, Kubernetes `securityContext.seccompProfile` with "
               "`type: Localhost`)")
CAP_FIX = ("CAP_SYS_ADMIN (Docker `--cap-add SYS_ADMIN`, with which Docker's default seccomp profile allows "
           "those calls too; Kubernetes `securityContext.capabilities.add: [\"SYS_ADMIN\"]`)")
CGROUP_FIX = ("a writable cgroup of the container's own (Docker `--cgroupns=private` with a writable cgroup "
              "mount, or a cgroup delegated to the container: systemd `Delegate=yes`)")
CGROUP_HOST_FIX = "a host with cgroup v2 (the unified hierarchy), which the container runtime then mounts in"
PROC_FIX = ("an unmasked /proc (Kubernetes `securityContext.procMount: Unmasked`, Docker "
            "`--security-opt systempaths=unconfined`)")
SPAWN_FIX = "a seccomp profile that allows clone (or clone3)"
SUBREAPER_FIX = "a seccomp profile that allows prctl(PR_SET_CHILD_SUBREAPER)"
ENTRYPOINT = ("`contain` run as the container's entrypoint (PID 1): should it die, the kernel kills every process "
              "of its PID namespace, the tree with them")

CALL_NAMES = {"clone3": "clone3", "clone_namespaces": "clone with namespace flags", "unshare": "unshare",
              "mount": "mount"}


def _spawn(caps: dict[str, Any]) -> tuple[bool, str | None]:
    """Whether anything can be started here at all, else why not."""
    sp = caps.get("spawn") or {"ok": None, "error": "not probed"}
    if sp.get("ok"):
        return True, None
    return False, f"nothing can be spawned here: {sp.get('error')}"


def _cgroup_withheld(caps: dict[str, Any]) -> tuple[list[str], list[str]]:
    """What of the surrounding container withholds a cgroup, and its fix
    (both empty when the reason, if any, is not the container's)."""
    cg = caps["cgroup2"]
    ro = [m for m in cg.get("mounts") or [] if m.get("read_only")]
    if not cg.get("mounts"):
        return ["no cgroup v2 hierarchy is mounted here"], [CGROUP_HOST_FIX]
    if ro and (cg.get("base_mount_read_only") or not cg.get("base")):
        m = next((x for x in ro if x["mount"] == cg.get("base_mount")), ro[0])
        return ([f"the cgroup2 mount {m['mount']} is read-only (its own mount flag; its superblock says "
                 f"{m.get('super_options')})"], [CGROUP_FIX])
    return [], []


def _wall_withheld(caps: dict[str, Any]) -> tuple[list[str], list[str]]:
    """What of the surrounding container withholds the PID-namespace wall,
    and the fix for each (each one withholds it on its own)."""
    ct = caps.get("container") or {}
    refuses = (ct.get("seccomp") or {}).get("refuses") or {}
    missing = (ct.get("capabilities") or {}).get("missing") or []
    root = caps["euid"] == 0
    by: list[str] = []
    fix: list[str] = []
    # clone3's flags sit behind a pointer, where no filter can look: one
    # that refuses clone's namespace flags but allows clone3 withholds
    # nothing (the wall is made with clone3 first). Its /proc is mounted.
    if ("clone_namespaces" in refuses and "clone3" in refuses) or "mount" in refuses:
        by.append("the seccomp filter refuses " + ", ".join(
            f"{CALL_NAMES[c]} ({refuses[c]})" for c in CALL_NAMES if c in refuses))
        fix.append(SECCOMP_FIX)
    if root and "CAP_SYS_ADMIN" in missing:
        by.append("no CAP_SYS_ADMIN, which a root supervisor's wall needs (a PID namespace made without a user "
                  "namespace)")
        fix.append(CAP_FIX)
    return by, fix


def _wall_proc_note(caps: dict[str, Any]) -> str | None:
    """A masked /proc withholds not the wall but its own /proc: the kernel
    refuses a new /proc mount in a user namespace while mounts cover part of
    /proc (mount_too_revealing, fs/namespace.c), and the wall is kept
    without one (its worker sees the outer /proc)."""
    ct = caps.get("container") or {}
    masked = ct.get("masked_proc") or []
    if masked and (caps["euid"] != 0 or (ct.get("user_namespace") or {}).get("own")):
        return (f"a masked /proc ({len(masked)} mounts below it) keeps the wall from mounting a /proc of its own: "
                f"the worker sees the outer /proc (the wall holds all the same); for its own, {PROC_FIX}")
    return None


def modes(caps: dict[str, Any]) -> list[dict[str, Any]]:
    cg = caps["cgroup2"]
    cg_ok = bool(cg.get("usable")) and bool(caps["clone3_into_cgroup"].get("ok"))
    wall = caps.get("pidns_wall") or {"ok": False, "error": "not probed"}
    wall_ok = bool(wall.get("ok"))
    ledger = bool(caps["process_connector"].get("ok"))
    seal_ok = cg_ok and bool(caps["seal"].get("ok"))
    nsdel = bool(cg.get("nsdelegate"))
    root = caps["euid"] == 0
    can_spawn, spawn_why = _spawn(caps)
    sub = caps.get("subreaper") or {"ok": False, "error": "not probed"}
    sub_ok = can_spawn and bool(sub.get("ok"))
    pid1 = bool(((caps.get("container") or {}).get("pid_namespace") or {}).get("pid1"))
    # Why not, in the surrounding container's terms where they are its.
    cg_by, wall_by = _cgroup_withheld(caps)[0], _wall_withheld(caps)[0]
    cg_why = "; ".join(cg_by) or cg.get("error") or caps["clone3_into_cgroup"].get("error")
    wall_why = "; ".join(wall_by) + f" (the probe: {wall.get('error')})" if wall_by else wall.get("error")
    leave = ("root workers can leave the cgroup: the mount has no nsdelegate" if not nsdel else
             "a cgroup namespace binds root workers (nsdelegate)")
    return [{
        "mode": "sealed (--seal)", "backend": "cgroup2", "available": seal_ok,
        "strongest_state": "REAPED" if seal_ok else None,
        "escapes": ("prevented: root only inside a user namespace mapped to an unprivileged host uid, behind "
                    "the PID-namespace wall, no capabilities on the host, no_new_privs: it can write no cgroup "
                    "file and cannot leave the namespace") if seal_ok else None,
        "why_not": None if seal_ok else (caps["seal"].get("error") or "cgroup2 unusable"),
    }, {
        "mode": "cgroup2 + wall (default)", "backend": "cgroup2", "available": cg_ok and wall_ok,
        "strongest_state": "REAPED" if cg_ok and wall_ok else None,
        "escapes": (f"a member may leave the cgroup ({leave}; its limits and accounting then miss it) but "
                    "never the PID namespace, whose init's end proves the whole tree gone")
        if cg_ok and wall_ok else None,
        "why_not": None if cg_ok and wall_ok else (cg_why if not cg_ok else wall_why),
    }, {
        "mode": "cgroup2 (--no-pidns)", "backend": "cgroup2", "available": cg_ok,
        "strongest_state": "REAPED" if cg_ok else None,
        "escapes": (("prevented for workers whose uid cannot write a cgroup.procs above the base ("
                     + ("--user" if root else "--user, which needs a root supervisor") + "); " + leave)
                    + ("; the fork ledger detects and stops escapers (REAPED with escapes listed, or BREACHED)"
                       if ledger else "; no fork ledger: an escaper would not be seen")) if cg_ok else None,
        "why_not": None if cg_ok else cg_why,
    }, {
        "mode": "pidns (no cgroup)", "backend": "pidns", "available": wall_ok,
        "strongest_state": "REAPED" if wall_ok else None,
        "escapes": ("prevented: no process can leave a PID namespace; no limits, and whole-tree CPU unknown "
                    "(the init's rusage is only a lower bound) (--backend pidns, or auto where no cgroup can be had)"
                    + ("" if root else "; the state directory is hidden from the worker (an empty tmpfs over it "
                       "in the run's mount namespace)")) if wall_ok else None,
        "why_not": None if wall_ok else wall_why,
    }, {
        "mode": "subreaper (no cgroup, no namespace)", "backend": "subreaper", "available": sub_ok,
        "strongest_state": "REAPED" if sub_ok else None,
        "escapes": ("no process can leave the supervisor's subtree while it lives; no limits, no accounting of the "
                    "tree's CPU beyond what waitid reports; does not hold if the supervisor dies"
                    + (" (here it is PID 1: should it die, the kernel kills every process of its PID namespace)"
                       if pid1 else "") + " (--backend subreaper, or auto where no cgroup and no wall can be had)")
        if sub_ok else None,
        "why_not": None if sub_ok else (spawn_why if not can_spawn else sub.get("error")),
    }, {
        "mode": "none (degraded)", "backend": "none", "available": can_spawn,
        "strongest_state": "EXITED" if can_spawn else None,
        "escapes": "no container: process group, sessions and groups led by members, ancestry, child subreaper"
                   + (", fork ledger" if ledger else " (no fork ledger)") + "; never REAPED" if can_spawn else None,
        "why_not": None if can_spawn else spawn_why,
    }]


def withheld(caps: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per container (cgroup2, pidns_wall, seal, subreaper): {"available",
    "by": what withholds it here, "fix": what the surrounding container's
    owner can change, each needed (every reason withholds it on its own),
    "container": whether the reasons are that container's (a seccomp
    filter, a dropped capability, a read-only mount, a masked /proc), and
    "note"}."""
    ct = caps.get("container") or {}
    root = caps["euid"] == 0
    by_mode = {m["mode"]: m for m in caps["modes"]}
    out: dict[str, dict[str, Any]] = {}

    def entry(key: str, available: bool, by: list[str], fix: list[str], fallback: Any,
              container: bool, note: str | None = None) -> None:
        out[key] = {"available": available, "by": [] if available else (by or [str(fallback)]),
                    "fix": [] if available else list(dict.fromkeys(fix)),
                    "container": container and not available, "note": note}

    by, fix = _cgroup_withheld(caps)
    entry("cgroup2", bool(by_mode["cgroup2 (--no-pidns)"]["available"]), by, fix,
          by_mode["cgroup2 (--no-pidns)"]["why_not"], bool(by))

    wall = caps.get("pidns_wall") or {"ok": False, "error": "not probed"}
    by, fix = _wall_withheld(caps)
    entry("pidns_wall", bool(wall.get("ok")), by, fix, wall.get("error"), bool(by), _wall_proc_note(caps))
    out["pidns_wall"]["probe"] = wall.get("error")

    # The seal is the cgroup and the wall together (and a user namespace,
    # which the same filter refuses: clone's namespace flags).
    by, fix = [], []
    if not root:
        by.append("the seal needs a root supervisor")
    else:
        lacking = [(key, what) for key, what in (("cgroup2", "the cgroup"), ("pidns_wall", "the PID-namespace wall"))
                   if not out[key]["available"]]
        if lacking:
            names = " and ".join(what for _k, what in lacking)
            by.append(f"it needs {names}, withheld above")
            if any(out[k]["fix"] for k, _w in lacking):
                fix.append(f"what {names} need{'s' if len(lacking) == 1 else ''}, above")
    entry("seal", bool(by_mode["sealed (--seal)"]["available"]), by, fix, (caps.get("seal") or {}).get("error"),
          root and any(out[k]["container"] for k in ("cgroup2", "pidns_wall")))

    can_spawn, spawn_why = _spawn(caps)
    sub = caps.get("subreaper") or {"ok": False, "error": "not probed"}
    by, fix = [], []
    if not can_spawn:
        by.append(str(spawn_why))
        fix.append(SPAWN_FIX)
    if sub.get("ok") is False:             # (None: not asked, no child could be made to ask in)
        by.append(str(sub.get("error")))
        fix.append(SUBREAPER_FIX)
    pid1 = bool((ct.get("pid_namespace") or {}).get("pid1"))
    note = ("works wherever contain starts the worker itself (as the container's entrypoint, as a CI step); "
            + ("here contain is PID 1: should it die, the kernel kills every process of its PID namespace, the "
               "tree with them" if pid1 else "it stops holding if the supervisor dies, unless that is " + ENTRYPOINT))
    entry("subreaper", can_spawn and bool(sub.get("ok")), by, fix, sub.get("error"), bool(ct.get("detected")),
          note if can_spawn and sub.get("ok") else None)
    return out


def next_steps(caps: dict[str, Any]) -> list[str]:
    """What this user, on this host, can do to get a stronger container,
    most useful first. Only advice this user can follow: nothing here tells
    a non-root user to use --seal, which is refused for them."""
    steps: list[str] = []
    sd = caps.get("state_dir") or {}
    if sd.get("usable") is False:
        steps.append(f"the state directory: {sd.get('error')}: {sd.get('fix')}")
    root = caps["euid"] == 0
    cg = caps["cgroup2"]
    by = {m["mode"]: m for m in caps["modes"]}
    cg_ok = bool(by["cgroup2 (--no-pidns)"]["available"])
    wall_ok = bool(by["pidns (no cgroup)"]["available"])
    seal_ok = bool(by["sealed (--seal)"]["available"])
    sub_ok = bool(by.get("subreaper (no cgroup, no namespace)", {}).get("available"))
    explicit = policy_env("CONTAIN_CGROUP_BASE")
    base_error = cg.get("error") or (None if cg.get("writable", True) else "not writable")
    w = caps.get("withheld") or withheld(caps)
    in_container = bool((caps.get("container") or {}).get("detected"))
    # Inside a container, first what it leaves and what its owner can give:
    # the fixes are the container's (its seccomp profile, its capabilities,
    # its mounts), not this user's.
    told = {k for k, v in w.items() if in_container and v.get("container")}
    if told:
        strongest = next((m for m in caps["modes"] if m["available"] and m["strongest_state"] == "REAPED"), None)
        steps.append("inside this container " + (
            f"the strongest mode left is {strongest['mode']}, which proves REAPED" if strongest else
            "no mode can prove REAPED") + f"; for {'stronger ones' if strongest else 'one'}, the container's owner "
            "can give what follows (what withholds each: the report above, `withheld` in --json)")
        for key, what in (("subreaper", "the subreaper mode"), ("cgroup2", "a cgroup (limits, accounting)"),
                          ("pidns_wall", "the PID-namespace wall")):
            if key in told:
                steps.append(f"for {what}: " + "; and ".join(w[key]["fix"]))
    if not wall_ok and "pidns_wall" not in told:
        if cg_ok:
            steps.append(f"no PID-namespace wall here ({(caps.get('pidns_wall') or {}).get('error')}): only the "
                         "cgroup holds the tree, and a member that leaves it is at best seen by the fork ledger")
        else:
            steps.append(f"no PID-namespace wall here ({(caps.get('pidns_wall') or {}).get('error')})")
    if "cgroup2" in told and not explicit:
        pass                     # said above, with the container's fix
    elif not cg.get("mounts"):
        steps.append("no cgroup v2 hierarchy is mounted, so runs get no cgroup"
                     + (" (the PID-namespace wall still proves REAPED, without limits or accounting)"
                        if wall_ok else " (the supervisor's subtree still proves REAPED while the supervisor "
                        "lives: `--backend subreaper`)" if sub_ok else " (`--backend none`, never REAPED)") + ": "
                     + ("mount one (`mount -t cgroup2 none /sys/fs/cgroup/unified`, or boot with "
                        "systemd.unified_cgroup_hierarchy=1)" if root else
                        "ask the administrator for a cgroup v2 mount and a cgroup delegated to you"))
    elif not cg_ok:
        if explicit:
            steps.append(f"CONTAIN_CGROUP_BASE={explicit} cannot be used ({base_error or 'spawning into it failed'}):"
                         " point it at a cgroup v2 directory you can write, or unset it")
        elif root:
            steps.append(f"the cgroup v2 base cannot be used ({base_error or 'spawning into it failed'}): in a "
                         "container, run it with a writable cgroup of its own (a private cgroup namespace with "
                         "the cgroup delegated), or set CONTAIN_CGROUP_BASE to a cgroup v2 directory you can write")
        else:
            uid = caps["euid"]
            lead = ("runs get the PID-namespace wall alone (REAPED, but no limits and no accounting beyond "
                    "CPU); for a cgroup: " if wall_ok else "")
            if _user_manager():
                steps.append(lead + "run contain inside a cgroup delegated to you by systemd: "
                             "`systemd-run --user --scope -p Delegate=yes contain run -- CMD`")
                lead = "or "
            steps.append(lead + f"set CONTAIN_CGROUP_BASE to a cgroup v2 directory delegated to uid {uid} (the "
                         "directory and its cgroup.procs, cgroup.subtree_control and cgroup.threads owned by "
                         "you: cgroup-v2.rst, \"Delegation\")" + ("" if _user_manager() else
                                                                  "; an administrator can make one"))
            steps.append("or run contain as root, which makes its own base under the cgroup v2 mount")
    elif root:
        if seal_ok:
            steps.append("the worker is root on the host: it cannot leave the PID namespace, but it can leave its "
                         "cgroup (and its limits)"
                         + ("" if cg.get("nsdelegate") else ", the cgroup2 mount having no nsdelegate")
                         + ", and act as root outside the run: `contain run --seal -- CMD` makes it root only "
                         "inside, or `--user USER` runs the worker as a uid that cannot write any cgroup.procs "
                         "above it")
        else:
            steps.append(f"--seal does not work here ({caps['seal'].get('error') or 'the seal probe failed'}): "
                         "run workers with `--user USER` so that they cannot leave their cgroup")
    else:
        steps.append(f"runs go under your cgroup ({cg.get('base_cgroup')}); a worker running as you may move itself "
                     "to another cgroup you own (its limits then miss it), so its record says sealed false: making "
                     "that impossible needs a root supervisor (docs/sealing.md)")
    pc = caps["process_connector"]
    if cg_ok and not wall_ok and not pc.get("ok"):
        steps.append(f"no fork ledger ({pc.get('error')}): a process that left the cgroup would not be seen; the "
                     "process connector answers only in the host's initial PID namespace, and binding it needs "
                     "CAP_NET_ADMIN"
                     + ("; --seal prevents leaving instead" if root and seal_ok else ""))
    if not steps:
        steps.append("nothing to do: this host gives the strongest container contain knows")
    return steps
