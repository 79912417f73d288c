"""What `contain doctor` concludes from its probes (_doctor.py): the modes
this host offers, the strongest state each can prove, and what this user
can do next. Pure functions of the capabilities dict: no probe runs here.

    modes(caps)        one entry per mode, strongest first
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


def modes(caps: dict[str, Any]) -> list[dict[str, Any]]:
    cg = caps["cgroup2"]
    spawn_ok = bool(caps["clone3_into_cgroup"].get("ok"))
    cg_ok = bool(cg.get("usable")) and spawn_ok
    wall = caps.get("pidns_wall") or {"ok": False, "error": "not probed"}
    wall_ok = bool(wall.get("ok"))
    ledger = bool(caps["process_connector"].get("ok"))
    seal_ok = cg_ok and bool(caps["seal"].get("ok"))
    nsdel = bool(cg.get("nsdelegate"))
    root = caps["euid"] == 0
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
        "why_not": None if cg_ok and wall_ok else (
            (cg.get("error") or caps["clone3_into_cgroup"].get("error")) if not cg_ok else wall.get("error")),
    }, {
        "mode": "cgroup2 (--no-pidns)", "backend": "cgroup2", "available": cg_ok,
        "strongest_state": "REAPED" if cg_ok else None,
        "escapes": (("prevented for workers whose uid cannot write a cgroup.procs above the base ("
                     + ("--user" if root else "--user, which needs a root supervisor") + "); " + leave)
                    + ("; the fork ledger detects and stops escapers (REAPED with escapes listed, or BREACHED)"
                       if ledger else "; no fork ledger: an escaper would not be seen")) if cg_ok else None,
        "why_not": None if cg_ok else (cg.get("error") or caps["clone3_into_cgroup"].get("error")),
    }, {
        "mode": "pidns (no cgroup)", "backend": "pidns", "available": wall_ok,
        "strongest_state": "REAPED" if wall_ok else None,
        "escapes": ("prevented: no process can leave a PID namespace; no limits, and CPU only from the init's "
                    "rusage (--backend pidns, or auto where no cgroup can be had)"
                    + ("" if root else "; the state directory is hidden from the worker (an empty tmpfs over it "
                       "in the run's mount namespace)")) if wall_ok else None,
        "why_not": None if wall_ok else wall.get("error"),
    }, {
        "mode": "none (degraded)", "backend": "none", "available": True,
        "strongest_state": "EXITED",
        "escapes": "no container: process group, sessions and groups led by members, ancestry, child subreaper"
                   + (", fork ledger" if ledger else " (no fork ledger)") + "; never REAPED",
        "why_not": None,
    }]


def next_steps(caps: dict[str, Any]) -> list[str]:
    """What this user, on this host, can do to get a stronger container,
    most useful first. Only advice this user can follow: nothing here tells
    a non-root user to use --seal, which is refused for them."""
    steps: list[str] = []
    root = caps["euid"] == 0
    cg = caps["cgroup2"]
    by = {m["mode"]: m for m in caps["modes"]}
    cg_ok = bool(by["cgroup2 (--no-pidns)"]["available"])
    wall_ok = bool(by["pidns (no cgroup)"]["available"])
    seal_ok = bool(by["sealed (--seal)"]["available"])
    explicit = policy_env("CONTAIN_CGROUP_BASE")
    base_error = cg.get("error") or (None if cg.get("writable", True) else "not writable")
    if not wall_ok:
        steps.append(f"no PID-namespace wall here ({(caps.get('pidns_wall') or {}).get('error')}): only the "
                     "cgroup holds the tree, and a member that leaves it is at best seen by the fork ledger")
    if not cg.get("mounts"):
        steps.append("no cgroup v2 hierarchy is mounted, so runs get no cgroup"
                     + (" (the PID-namespace wall still proves REAPED, without limits or accounting)"
                        if wall_ok else " (`--backend none`, never REAPED)") + ": "
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
                     "process connector exists only in the host's initial PID namespace"
                     + ("; --seal prevents leaving instead" if root and seal_ok else ""))
    if not steps:
        steps.append("nothing to do: this host gives the strongest container contain knows")
    return steps
