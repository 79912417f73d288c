"""The container `contain` itself runs in (a default `docker run`, a
Kubernetes pod, a CI job's sandbox), as the kernel shows it to this
process: for `contain doctor` (_doctor.py), which concludes from these
facts what withholds each of contain's own containers (_advice.py).

Every fact is read from the kernel; none is guessed from a file name, an
environment variable or a version string:

- seccomp: the `Seccomp` and `Seccomp_filters` lines of /proc/self/status
  (proc(5)), and what a filter answers for the calls contain's containers
  need: clone3 (ct_clone3_probe), clone with namespace flags, unshare and
  mount (refusals.c asks each in a throwaway child, with arguments the
  kernel itself rejects before any permission check, so that any other
  answer is the filter's);
- capabilities: CapEff and CapBnd of /proc/self/status;
- namespaces: the inode of /proc/self/ns/<type> against the fixed inode
  the kernel gives each initial namespace (PROC_CGROUP_INIT_INO and its
  kin, include/linux/proc_ns.h; every other namespace gets one from
  PROC_DYNAMIC_FIRST, 0xF0000000, up). /proc/self/cgroup saying `0::/`
  decides nothing: a host process in the root cgroup says it too;
- each cgroup mount's own read-only flag: mountinfo field 6, the mount's
  options. The options after " - " are the superblock's, shared by every
  mount of the filesystem: a bind remounted read-only, which is what
  Docker gives a container, still says "rw" there;
- masked /proc: mounts below /proc. Docker binds /dev/null over some
  files, an empty tmpfs over some directories, and re-binds others
  read-only. The kernel then refuses a new proc mount in a user namespace
  (mount_too_revealing, fs/namespace.c), as long as a mount covers anything
  but an empty directory: binfmt_misc's mount point is one (a host has it
  there), so it does not count;
- PID 1: this process's pid in its own PID namespace.

Container hints (/.dockerenv, /run/.containerenv, KUBERNETES_SERVICE_HOST)
are names anyone can create or set: they are reported as hints and decide
nothing (this project's own build host has a /.dockerenv and is no
container).
"""
from __future__ import annotations

import errno
import os
from typing import Any

from ._procfs import mounts, read_status

# include/linux/proc_ns.h: the inodes of the initial namespaces.
INIT_INO = {"cgroup": 0xEFFFFFFB, "pid": 0xEFFFFFFC, "user": 0xEFFFFFFD}

# The capabilities a default container drops that contain would use, and
# what their absence costs it. Measured on Linux 6.18 (root with only that
# one capability dropped): the process connector's bind says EPERM without
# CAP_NET_ADMIN (as any non-root uid, there too); readlink of another uid's
# /proc/<pid>/fd/N says EACCES without CAP_SYS_PTRACE (ptrace access mode,
# proc(5)); setting a trusted.* attribute says EPERM without CAP_SYS_ADMIN.
CAPS = {
    21: ("CAP_SYS_ADMIN", "a PID namespace without a user namespace (a root supervisor's wall) and the /proc mount "
                          "in it; the trusted.* tags a later owner acts on (xattr(7))"),
    12: ("CAP_NET_ADMIN", "binding the process connector: no fork ledger"),
    19: ("CAP_SYS_PTRACE", "reading the descriptors of another uid's processes (/proc/<pid>/fd): the sockets and "
                           "locks postconditions of a --user worker"),
}

SECCOMP_MODES = {0: "disabled", 1: "strict", 2: "filter"}

# What each call answers when no filter stands in front of the kernel
# (refusals.c: the arguments are chosen so).
CALLS = {"clone_namespaces": errno.EINVAL, "unshare": errno.EINVAL, "mount": errno.EFAULT}

HINTS = ("/.dockerenv", "/run/.containerenv")


def _errname(e: int) -> str:
    return errno.errorcode.get(e, str(e))


def ask_kernel() -> dict[str, Any]:
    """What the calls of CALLS answer here, and whether a child may become a
    child subreaper (refusals.c, in a throwaway child): {"answers": {call:
    0 or errno or None}, "subreaper": 0 or errno or None, "error": why no
    child could ask, "killed_by": a signal}. Also clone3 (probed here, in
    this process: the probe has no side effect)."""
    from ._native import ffi, lib

    out: dict[str, Any] = {"answers": {}, "subreaper": None, "error": None, "killed_by": None}
    c3 = lib.ct_clone3_probe()
    out["clone3"] = -c3 if c3 < 0 else 0
    r = ffi.new("struct ct_refusals*")
    rc = lib.ct_refusals_probe(r)
    if rc < 0:
        out["error"] = f"no child to ask in: {os.strerror(-rc)}"
        return out
    got = {"clone_namespaces": r.clone_ns, "unshare": r.unshare_ns, "mount": r.mount}
    out["answers"] = {k: (None if v > 0 else -v) for k, v in got.items()}   # > 0: no answer
    out["subreaper"] = None if r.subreaper > 0 else -r.subreaper
    if r.died_signal:
        out["killed_by"] = r.died_signal
    return out


def _status() -> dict[str, str]:
    try:
        return read_status("self")
    except OSError:
        return {}


def seccomp(status: dict[str, str], asked: dict[str, Any]) -> dict[str, Any]:
    """The seccomp mode and what a filter refuses of contain's calls."""
    mode = _int(status.get("Seccomp"))
    out: dict[str, Any] = {"mode": mode, "mode_name": SECCOMP_MODES.get(mode) if mode is not None else None,
                           "filters": _int(status.get("Seccomp_filters")), "refuses": {}, "allows": [],
                           "unanswered": []}
    c3 = asked.get("clone3")
    if c3:
        out["refuses"]["clone3"] = _errname(c3)
    elif c3 == 0:
        out["allows"].append("clone3")
    for call, kernel in CALLS.items():
        e = asked["answers"].get(call)
        if e is None:
            out["unanswered"].append(call)
        elif e in (kernel, 0):
            out["allows"].append(call)
        else:
            out["refuses"][call] = _errname(e)
    if asked.get("killed_by"):
        out["killed_by"] = asked["killed_by"]
    if asked.get("error"):
        out["error"] = asked["error"]
    out["how"] = ("Seccomp and Seccomp_filters of /proc/self/status; each call made in a throwaway child with "
                  "arguments the kernel rejects itself (EINVAL, EFAULT) before any permission check, so another "
                  "answer is a filter's")
    return out


def _int(v: str | None, base: int = 10) -> int | None:
    try:
        return int(v, base) if v is not None else None
    except ValueError:
        return None


def capabilities(status: dict[str, str]) -> dict[str, Any]:
    """CapEff and CapBnd, and which of CAPS each lacks."""
    eff, bnd = _int(status.get("CapEff"), 16), _int(status.get("CapBnd"), 16)
    out: dict[str, Any] = {"effective": status.get("CapEff"), "bounding": status.get("CapBnd")}
    out["missing"] = [n for c, (n, _w) in CAPS.items() if eff is not None and not eff >> c & 1]
    out["missing_bounding"] = [n for c, (n, _w) in CAPS.items() if bnd is not None and not bnd >> c & 1]
    out["costs"] = {n: why for c, (n, why) in CAPS.items() if n in out["missing"]}
    return out


def namespace(kind: str) -> dict[str, Any]:
    """Whether this process is in a namespace of `kind` of its own (not the
    initial one), from the inode of /proc/self/ns/<kind>."""
    try:
        ino = os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError as e:
        return {"own": None, "inode": None, "error": f"/proc/self/ns/{kind}: {os.strerror(e.errno or 0)}"}
    init = INIT_INO[kind]
    return {"own": ino != init, "inode": ino, "initial_inode": init,
            "how": f"/proc/self/ns/{kind} is inode {ino}; the initial {kind} namespace's is {init} "
                   f"(PROC_{kind.upper()}_INIT_INO, include/linux/proc_ns.h)"}


def cgroup_mounts(ms: list[Any]) -> list[dict[str, Any]]:
    """Each visible cgroup mount (v2 and v1) with its own read-only flag. A
    mount over another at the same point hides it: the later line wins."""
    seen: dict[str, Any] = {}
    for m in ms:
        seen.pop(m.point, None)
        seen[m.point] = m
    return [{"mount": m.point, "fstype": m.fstype, "root": m.root, "read_only": "ro" in m.options,
             "options": ",".join(m.options), "super_options": ",".join(m.super_options)}
            for m in seen.values() if m.fstype in ("cgroup", "cgroup2")]


def masked_proc(ms: list[Any]) -> list[dict[str, Any]]:
    """The mounts below /proc that hide or freeze part of it."""
    out = []
    for m in ms:
        if not m.point.startswith("/proc/") or m.fstype in ("binfmt_misc", "autofs"):
            continue
        ro = "ro" in m.options
        kind = ("read-only" if ro else "bound") if m.fstype == "proc" else "masked"
        out.append({"path": m.point, "fstype": m.fstype, "root": m.root, "read_only": ro, "kind": kind})
    return out


def facts(asked: dict[str, Any]) -> dict[str, Any]:
    """Everything above, with `detected` and the kernel `signs` it was
    decided from, and the `hints` (which decide nothing)."""
    status = _status()
    out: dict[str, Any] = {"seccomp": seccomp(status, asked), "capabilities": capabilities(status)}
    for kind in ("cgroup", "pid", "user"):
        out[f"{kind}_namespace"] = namespace(kind)
    try:
        from ._procfs import cgroup_of

        out["cgroup_namespace"]["cgroup"] = cgroup_of("self")
    except OSError:
        out["cgroup_namespace"]["cgroup"] = None
    pid = os.getpid()
    out["pid_namespace"].update(pid=pid, pid1=pid == 1)
    try:
        ms = mounts()
    except OSError as e:
        ms = []
        out["mounts_error"] = f"/proc/self/mountinfo: {os.strerror(e.errno or 0)}"
    out["cgroup_mounts"] = cgroup_mounts(ms)
    out["masked_proc"] = masked_proc(ms)
    out["hints"] = [h for h in HINTS if os.path.exists(h)] + \
        (["KUBERNETES_SERVICE_HOST"] if os.environ.get("KUBERNETES_SERVICE_HOST") else [])
    signs = []
    if out["seccomp"]["mode"] == 2:
        signs.append("a seccomp filter")
    for kind in ("cgroup", "pid", "user"):
        if out[f"{kind}_namespace"]["own"]:
            signs.append(f"a {kind} namespace of its own")
    if "CAP_SYS_ADMIN" in out["capabilities"]["missing_bounding"]:
        signs.append("no CAP_SYS_ADMIN in the bounding set")
    if any(m["read_only"] for m in out["cgroup_mounts"]):
        signs.append("read-only cgroup mounts")
    if out["masked_proc"]:
        signs.append("masked /proc")
    out["signs"] = signs
    out["detected"] = bool(signs)
    return out
