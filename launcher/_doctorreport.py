"""The human report of `contain doctor`: the capabilities dict of
_doctor.py (`launcher.capabilities()`) as text, section by section: the
container contain runs in, cgroup v2, the probes, limits and accounting,
the modes, what the container withholds, the verdict and the next steps.
Nothing is probed here.
"""
from __future__ import annotations

from typing import Any

from ._advice import CALL_NAMES, next_steps


def render(caps: dict[str, Any]) -> str:
    """The human-readable report."""
    if caps.get("platform") == "win32":
        from ._platform import windoctor

        return windoctor.render(caps)
    cg = caps["cgroup2"]
    lines = [f"contain doctor (kernel {caps['kernel']}, euid {caps['euid']})", ""]

    def yes(x: Any) -> str:
        return "yes" if x is True else "no" if x is False else "unknown"

    def row(name: str, val: str) -> None:
        lines.append(f"  {name:<26} {val}")

    def wrapped(name: str, text: str) -> None:
        lines.extend(_wrap(text, f"  {name:<26} ", " " * 29))

    lines.extend(_container_section(caps))
    sd = caps.get("state_dir")
    if sd is not None:
        lines.append("state directory")
        row("path", f"{sd.get('path') or '(none)'} ({sd.get('how')})")
        if sd.get("usable"):
            row("usable", "yes" + (f": {sd['detail']}" if sd.get("detail") else ""))
        else:
            wrapped("usable", f"NO: {sd.get('error')}")
            wrapped("fix", str(sd.get("fix")))
        lines.append("")
    lines.append("cgroup v2")
    if not cg.get("mounts"):
        row("mount", "none")
    for m in cg.get("mounts", []):
        if m.get("read_only") is None:      # (a caps dict made before the mount's own flags were read)
            row("mount", f"{m['mount']} (root {m['root']}, {m['super_options']})")
        else:
            row("mount", f"{m['mount']} (root {m['root']}, "
                f"{'READ-ONLY' if m['read_only'] else 'read-write'} mount; superblock {m['super_options']})")
    row("nsdelegate", yes(cg.get("nsdelegate")) + ("" if cg.get("nsdelegate") else
        ": a cgroup namespace does not stop a root worker from leaving"))
    row("base", f"{cg.get('base')} ({cg.get('base_cgroup')})" if cg.get("base") else f"none: {cg.get('error')}")
    if cg.get("base"):
        row("writable", yes(cg.get("writable")) + (": its mount is read-only" if cg.get("base_mount_read_only")
                                                   else f" (cgroup.procs owned by uid {cg.get('delegated_to_uid')})"))
        row("controllers", " ".join(cg.get("controllers") or []) or "(none)")
        row("subtree_control", " ".join(cg.get("subtree_control") or []) or "(none)")
        row("nobody sealed by its uid", yes(cg.get("nobody_sealed_by_uid")))
    if cg.get("cgroup1_mounts"):
        row("cgroup v1 mounts", str(len(cg["cgroup1_mounts"])) + " (hybrid host)")
    lines.append("")
    lines.append("probes")

    def probe(name: str, p: dict[str, Any], good: str = "works") -> None:
        if p.get("ok"):
            row(name, good)
        elif p.get("ok") is None:
            row(name, f"not probed: {p.get('error')}")
        else:
            row(name, f"NO: {p.get('error')}")

    sp = caps.get("spawn")
    if sp is not None:
        probe("spawn of /bin/true", sp, "works, through " + (
            f"the legacy clone ({sp['clone3_refused']})" if sp.get("via") == "clone" else "clone3"))
    probe("clone3 into a cgroup", caps["clone3_into_cgroup"])
    kb = caps["cgroup_kill_bug"]
    if kb.get("ok"):
        row("cgroup.kill fork bug", "PRESENT: " + kb["detail"] if kb.get("present") else "absent")
    else:
        probe("cgroup.kill fork bug", kb)
    probe("pidfd", caps["pidfd"])
    pc = caps["process_connector"]
    probe("process connector", pc, f"works (subscribed in {pc.get('subscribe_ms')} ms)")
    probe("PID-namespace wall", caps["pidns_wall"], "works (/bin/true ran behind one; its init said empty)")
    probe("namespace seal", caps["seal"], "works (/bin/true ran sealed in a scratch leaf)")
    if caps.get("subreaper") is not None:
        probe("child subreaper", caps["subreaper"], "works (a throwaway child set PR_SET_CHILD_SUBREAPER)")
    lines.append("")
    lines.append("limits and accounting (--memory-max, --pids-max, --cpu-max; the record's accounting)")
    ctl = caps.get("controllers") or {}
    if not ctl.get("ok"):
        row("controllers", f"unknown: {ctl.get('error')}")
    for name, r in sorted((ctl.get("routes") or {}).items()):
        row(name, f"{r['via']} ({r['mount']})" if r.get("via") and r.get("mount") else
            (r.get("via") or f"none: {r.get('reason')}"))
    lines.append("")
    lines.append("modes (strongest state each can prove)")
    width = max([26] + [len(m["mode"]) for m in caps["modes"]])
    for m in caps["modes"]:
        state = m["strongest_state"] if m["available"] else "unavailable"
        lines.append(f"  {m['mode']:<{width}} {state}")
        if m["available"]:
            lines.append(f"  {'':<{width}} escapes: {m['escapes']}")
        else:
            lines.append(f"  {'':<{width}} why: {m['why_not']}")
    w = caps.get("withheld") or {}
    if (caps.get("container") or {}).get("detected") and w:
        lines.append("")
        lines.append("what the container withholds, and the fix its owner can apply")
        for key, name in (("cgroup2", "cgroup2"), ("pidns_wall", "PID-namespace wall"), ("seal", "seal (--seal)"),
                          ("subreaper", "subreaper")):
            e = w.get(key)
            if e is None:
                continue
            if e["available"]:
                wrapped(name, "available")
            else:
                wrapped(name, "withheld: " + "; ".join(e["by"]))
                if e["fix"]:
                    wrapped("", "fix: " + "; and ".join(e["fix"]))
            if e.get("note"):
                wrapped("", e["note"])
    lines.append("")
    if caps["containment_possible"]:
        strongest = caps.get("strongest_mode")
        lines.append("containment: possible" + (f" (strongest here: {strongest})" if strongest else ""))
    elif caps.get("spawn") is not None and not caps["spawn"].get("ok"):
        lines.append("containment: IMPOSSIBLE here (nothing can be spawned)")
    elif (caps.get("state_dir") or {}).get("usable") is False:
        lines.append("containment: IMPOSSIBLE as set up (no usable state directory: every run exits 125)")
    else:
        lines.append("containment: IMPOSSIBLE here (only degraded mode, which never proves REAPED)")
    steps = caps.get("next_steps") or next_steps(caps)   # (a caps dict made by hand)
    lines.append("")
    lines.append("next steps")
    for step in steps:
        lines.extend(_wrap(step, "  - ", "    "))
    return "\n".join(lines) + "\n"


def _container_section(caps: dict[str, Any]) -> list[str]:
    """The report's section on the container contain runs in, as the kernel
    shows it (_incontainer.py); the hints are labelled as such."""
    ct = caps.get("container")
    if not ct:
        return []
    lines = ["container (what the kernel shows of the one contain runs in)"]

    def row(name: str, text: str) -> None:
        lines.extend(_wrap(text, f"  {name:<26} ", " " * 29))

    row("signs", ", ".join(ct["signs"]) if ct["signs"] else "none (no seccomp filter, the initial namespaces, "
        "CAP_SYS_ADMIN in the bounding set, no read-only cgroup mount, /proc unmasked)")
    sc = ct["seccomp"]
    refused = ", ".join(f"{CALL_NAMES.get(c, c)} ({e})" for c, e in sc["refuses"].items())
    if sc.get("mode") == 2:
        n = sc.get("filters")
        text = f"filter (Seccomp: 2, {n} filter{'' if n == 1 else 's'}): " + (
            f"refuses {refused}" if refused else "refuses none of clone3, clone with namespace flags, unshare, mount")
    else:
        text = f"{sc.get('mode_name') or 'unknown'} (Seccomp: {sc.get('mode')})" + (
            f", yet refused: {refused}" if refused else "")
    if sc.get("killed_by"):
        text += f"; a probe child was killed by signal {sc['killed_by']}"
    row("seccomp", text)
    c3 = caps.get("clone3") or {}
    if c3.get("usable") is False:
        row("clone3", f"refused with {c3.get('refused_with')}: spawns use the legacy clone, which cannot enter a "
            "cgroup at clone time (a worker then joins its cgroup before exec)")
    elif c3.get("usable"):
        row("clone3", "usable")
    cap = ct["capabilities"]
    if caps["euid"] != 0:
        # A user has none of them effective anyway: what tells of a
        # container is the bounding set.
        row("capabilities", f"not root (CapEff {cap['effective']}); " + (
            "the bounding set lacks " + ", ".join(cap["missing_bounding"]) if cap["missing_bounding"] else
            "the bounding set has CAP_SYS_ADMIN, CAP_NET_ADMIN and CAP_SYS_PTRACE"))
    elif cap["missing"]:
        row("capabilities", "missing " + ", ".join(cap["missing"]) + f" (CapEff {cap['effective']}, "
            f"CapBnd {cap['bounding']})")
        for name, why in cap["costs"].items():
            row("", f"without {name}: {why}")
    else:
        row("capabilities", "CAP_SYS_ADMIN, CAP_NET_ADMIN and CAP_SYS_PTRACE effective")
    cns = ct["cgroup_namespace"]
    if cns.get("own") is None:
        row("cgroup namespace", f"unknown: {cns.get('error')}")
    else:
        row("cgroup namespace", (f"its own (/proc/self/ns/cgroup is inode {cns['inode']}, not the initial "
                                 f"namespace's {cns['initial_inode']})" if cns["own"] else
                                 f"the initial one (/proc/self/ns/cgroup is inode {cns['inode']})")
            + (f"; /proc/self/cgroup says 0::{cns['cgroup']}, which alone would not tell" if cns.get("cgroup")
               else "; /proc/self/cgroup has no cgroup v2 line"))
    pns = ct["pid_namespace"]
    if pns.get("own") is None:
        row("PID namespace", f"unknown: {pns.get('error')}")
    elif pns["own"]:
        row("PID namespace", "its own; " + (
            "this process is its PID 1 (the entrypoint)" if pns.get("pid1") else
            f"this process is pid {pns.get('pid')} in it (not PID 1: the entrypoint is another program)")
            + "; no process connector outside the initial one")
    else:
        row("PID namespace", "the initial one")
    uns = ct["user_namespace"]
    if uns.get("own") is not None:
        row("user namespace", "its own (root here is not root on the host)" if uns["own"] else "the initial one")
    mnts = ct["cgroup_mounts"]
    ro = [m for m in mnts if m["read_only"]]
    if not mnts:
        row("cgroup mounts", "none")
    elif not ro:
        row("cgroup mounts", "read-write (each mount's own flag)")
    else:
        v1 = [m for m in ro if m["fstype"] == "cgroup"]
        parts = [f"{m['mount']} (cgroup2; its superblock says {m['super_options']})" for m in ro
                 if m["fstype"] == "cgroup2"] + ([f"{len(v1)} cgroup v1 mount{'' if len(v1) == 1 else 's'}"]
                                                 if v1 else [])
        row("cgroup mounts", "READ-ONLY (each mount's own flag): " + ", ".join(parts))
        if len(ro) < len(mnts):
            row("", "read-write: " + ", ".join(m["mount"] for m in mnts if not m["read_only"]))
    masked = ct["masked_proc"]
    if masked:
        kinds: dict[str, list[str]] = {}
        for m in masked:
            kinds.setdefault(m["kind"], []).append(m["path"])
        row("masked /proc", "; ".join(f"{k}: {', '.join(v)}" for k, v in kinds.items()))
    else:
        row("masked /proc", "no (nothing mounted below /proc)")
    row("hints (not proof)", ", ".join(ct["hints"]) if ct["hints"] else "none")
    lines.append("")
    return lines


def _wrap(text: str, first: str, rest: str, width: int = 100) -> list[str]:
    """Wrapped, but never inside a `command` (it must stay copyable)."""
    import re
    import textwrap

    glued = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\u00a0"), text)
    return [line.replace("\u00a0", " ") for line in
            textwrap.wrap(glued, width=width, initial_indent=first, subsequent_indent=rest,
                          break_on_hyphens=False, break_long_words=False)]
