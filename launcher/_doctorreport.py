"""The human report of `contain doctor`: the capabilities dict of
_doctor.py (`launcher.capabilities()`) as text. Nothing is probed here.
"""
from __future__ import annotations

from typing import Any

from ._advice import next_steps


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

    lines.append("cgroup v2")
    if not cg.get("mounts"):
        row("mount", "none")
    for m in cg.get("mounts", []):
        row("mount", f"{m['mount']} (root {m['root']}, {m['super_options']})")
    row("nsdelegate", yes(cg.get("nsdelegate")) + ("" if cg.get("nsdelegate") else
        ": a cgroup namespace does not stop a root worker from leaving"))
    row("base", f"{cg.get('base')} ({cg.get('base_cgroup')})" if cg.get("base") else f"none: {cg.get('error')}")
    if cg.get("base"):
        row("writable", yes(cg.get("writable")) + f" (cgroup.procs owned by uid {cg.get('delegated_to_uid')})")
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
    for m in caps["modes"]:
        state = m["strongest_state"] if m["available"] else "unavailable"
        lines.append(f"  {m['mode']:<26} {state}")
        if m["available"]:
            lines.append(f"  {'':<26} escapes: {m['escapes']}")
        else:
            lines.append(f"  {'':<26} why: {m['why_not']}")
    lines.append("")
    if caps["containment_possible"]:
        lines.append("containment: possible")
    else:
        lines.append("containment: IMPOSSIBLE here (only degraded mode, which never proves REAPED)")
    steps = caps.get("next_steps") or next_steps(caps)   # (a caps dict made by hand)
    lines.append("")
    lines.append("next steps")
    for step in steps:
        lines.extend(_wrap(step, "  - ", "    "))
    return "\n".join(lines) + "\n"


def _wrap(text: str, first: str, rest: str, width: int = 100) -> list[str]:
    """Wrapped, but never inside a `command` (it must stay copyable)."""
    import re
    import textwrap

    glued = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\u00a0"), text)
    return [line.replace("\u00a0", " ") for line in
            textwrap.wrap(glued, width=width, initial_indent=first, subsequent_indent=rest,
                          break_on_hyphens=False, break_long_words=False)]
