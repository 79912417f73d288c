"""Which cgroup controllers can hold a run, and the limits put on it.

A run's numbers and limits come from controllers, and a controller lives in
exactly one place on a host: the cgroup v2 hierarchy (when the parent's
`cgroup.subtree_control` enables it) or one cgroup v1 hierarchy (a hybrid
host, cgroup-v2.rst "Mixing v1 and v2"). This module finds, per controller,
where the run can have it, makes the run's own v1 cgroups, writes the limits
and reads them back, and hands the spawn the `tasks` fds its child
writes "0" to before exec (so the whole tree is inside from its first
instruction). A limit that cannot be applied is refused, never dropped.

v1 layout (one directory per hierarchy the run joins, named like its v2 run
directory so the two are easy to pair):

    <v1 mount>/<base>/run-<id>-<hex>/          the worker's v1 cgroup
    <v1 mount>/<base>/run-<id>-<hex>/sub-*/    nested runs (below the lead's)

`<base>` is CONTAIN_CGROUP_V1_BASE (a cgroup path, the same in every
hierarchy), else `/contain` for root; a supervisor that already sits below
the base (a run started from inside a run) puts its run below its own
position, so a nested run can never leave the lead's limits. Cgroups this
module did not create are only ever read.
"""
from __future__ import annotations

import errno
import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Iterable, Mapping

from ._errors import ContainmentUnavailable
from ._limits import LIMIT_CONTROLLER, Limits
from ._policy import policy_env
from ._procfs import hierarchy_path, hierarchy_rel, mount_path, parse_mountinfo

# Controllers a run may want: for a limit, or for the accounting alone.
ACCOUNTING_CONTROLLERS = ("memory", "pids", "io")

V1_BASE_DEFAULT = "/contain"
DOCTOR_HINT = "`contain doctor` lists, per controller, where this host offers it"


# -- where the kernel offers each controller ------------------------------------

def _subsystems() -> set[str]:
    """Names the kernel knows as controllers (/proc/cgroups), to tell them
    apart from mount options such as `rw`, `xattr` or `name=systemd`."""
    try:
        with open("/proc/cgroups") as f:
            return {line.split()[0] for line in f if line.strip() and not line.startswith("#")}
    except OSError:
        return {"cpuset", "cpu", "cpuacct", "blkio", "io", "memory", "devices", "freezer", "net_cls",
                "perf_event", "net_prio", "hugetlb", "pids", "rdma", "misc"}


class V1Hierarchy:
    """One mounted cgroup v1 hierarchy (a set of co-mounted controllers)."""

    __slots__ = ("controllers", "mount", "root")

    def __init__(self, controllers: Iterable[str], mount: str, root: str) -> None:
        self.controllers = frozenset(controllers)
        self.mount = mount     # where it is mounted
        self.root = root       # the mount's root inside the hierarchy (mountinfo field 4)

    @property
    def name(self) -> str:
        """As /proc/<pid>/cgroup spells the hierarchy ("cpu,cpuacct")."""
        return ",".join(sorted(self.controllers))

    def fs_path(self, cg_path: str) -> str:
        if hierarchy_rel(cg_path, self.root).startswith(".."):
            raise ValueError(f"{cg_path} is outside the {self.name} mount at {self.mount}")
        return mount_path(cg_path, self.root, self.mount)

    def cg_path(self, fs_path: str) -> str:
        return hierarchy_path(fs_path, self.mount, self.root)

    def __repr__(self) -> str:
        return f"V1Hierarchy({self.name!r}, {self.mount!r}, root={self.root!r})"


def v1_hierarchies(mountinfo: str = "/proc/self/mountinfo") -> list[V1Hierarchy]:
    """Every cgroup v1 hierarchy mounted here, once each (a bind mount of the
    same hierarchy is skipped in favour of the mount of its root)."""
    known = _subsystems()
    found: dict[frozenset[str], V1Hierarchy] = {}
    with open(mountinfo) as f:
        text = f.read()
    for m in parse_mountinfo(text):
        if m.fstype != "cgroup":
            continue
        ctrls = frozenset(o for o in m.super_options if o in known)
        if not ctrls:
            continue                  # a named hierarchy (name=systemd): no controller
        h = V1Hierarchy(ctrls, m.point, m.root)
        old = found.get(ctrls)
        if old is None or (old.root != "/" and h.root == "/"):
            found[ctrls] = h
    return sorted(found.values(), key=lambda h: h.name)


_probed: tuple[int, list[V1Hierarchy]] | None = None     # (pid that probed, its v1 hierarchies)


def host_v1_hierarchies(refresh: bool = False) -> list[V1Hierarchy]:
    """v1_hierarchies() of this process, probed once per process (the
    owner's decision on issue 27: /proc/cgroups and mountinfo cost 0.2 ms
    of every run) and again with `refresh`, which RunCgroups.create asks
    for when a v1 cgroup planned from it could not be made. A child of a
    fork probes for itself."""
    global _probed
    pid = os.getpid()
    if refresh or _probed is None or _probed[0] != pid:
        _probed = (pid, v1_hierarchies())
    return list(_probed[1])


def read_file(path: str) -> str | None:
    """A cgroup file's text, or None when it cannot be read. Read with
    os.read, not a text-mode open() (which adds fstat, ioctl and lseek
    calls: 45 us against 15 a read on this host, and the run path reads
    a few a run); decoded as UTF-8, bytes that are not kept by
    surrogateescape (cgroup files are ASCII; open() would have raised)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        while True:
            got = os.read(fd, 65536)
            if not got:
                break
            chunks.append(got)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "surrogateescape")


class Route:
    """Where one controller comes from for a run: "v2" (the run's cgroup v2
    directory has its files), "v1" (a v1 hierarchy of ours), or None with
    the reason."""

    __slots__ = ("controller", "kind", "hierarchy", "reason", "note")

    def __init__(self, controller: str, kind: str | None, hierarchy: V1Hierarchy | None = None,
                 reason: str | None = None, note: str | None = None) -> None:
        self.controller = controller
        self.kind = kind
        self.hierarchy = hierarchy
        self.reason = reason
        self.note = note

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"controller": self.controller, "via": None if self.kind is None else
                             ("cgroup2" if self.kind == "v2" else f"cgroup1 {self.hierarchy.name if self.hierarchy else ''}")}
        if self.hierarchy is not None:
            d["mount"] = self.hierarchy.mount
        if self.reason:
            d["reason"] = self.reason
        if self.note:
            d["note"] = self.note
        return d


def v2_offer(v2_base: str, want: Iterable[str], *, enable: bool = True) -> dict[str, Route]:
    """Controllers the run directories under `v2_base` get: those in the
    base's `cgroup.subtree_control`. One listed in the base's
    `cgroup.controllers` but not yet enabled is enabled here when `enable`:
    the base is ours and holds no process (runs live in `<run>/main`), which
    is what the no-internal-process rule asks (cgroup-v2.rst); the kernel
    says EBUSY otherwise, and that is the reason given. Nothing above the
    base is ever written."""
    out: dict[str, Route] = {}
    avail_s = read_file(os.path.join(v2_base, "cgroup.controllers"))
    enabled_s = read_file(os.path.join(v2_base, "cgroup.subtree_control"))
    if avail_s is None or enabled_s is None:
        for c in want:
            out[c] = Route(c, None, reason=f"cgroup v2 base {v2_base} has no readable cgroup.controllers")
        return out
    avail, enabled = set(avail_s.split()), set(enabled_s.split())
    for c in want:
        if c in enabled:
            out[c] = Route(c, "v2")
            continue
        if c not in avail:
            out[c] = Route(c, None, reason=(
                f"cgroup v2: {c} is not in {v2_base}/cgroup.controllers "
                f"({' '.join(sorted(avail)) or 'it is empty'}): the parent does not delegate it"))
            continue
        if not enable:
            out[c] = Route(c, None, reason=f"cgroup v2: {c} is offered to {v2_base} but not enabled in its subtree")
            continue
        try:
            fd = os.open(os.path.join(v2_base, "cgroup.subtree_control"), os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                os.write(fd, f"+{c}".encode())
            finally:
                os.close(fd)
        except OSError as e:
            why = ("the base holds processes (no internal processes, cgroup-v2.rst)"
                   if e.errno == errno.EBUSY else os.strerror(e.errno or 0))
            out[c] = Route(c, None, reason=f"cgroup v2: cannot enable {c} in {v2_base}/cgroup.subtree_control: {why}")
            continue
        out[c] = Route(c, "v2", note=f"enabled in {v2_base}/cgroup.subtree_control")
    return out


def v1_base_for(h: V1Hierarchy, env: Mapping[str, str], own: Mapping[str, str]) -> tuple[str | None, str, bool]:
    """(cgroup path under which this run's v1 cgroup goes, or None; why;
    whether that path is the base, which is created when missing)."""
    explicit = policy_env("CONTAIN_CGROUP_V1_BASE", env)
    base = os.path.normpath(explicit) if explicit else V1_BASE_DEFAULT
    if not base.startswith("/"):
        return None, f"CONTAIN_CGROUP_V1_BASE {explicit!r} is not an absolute cgroup path", False
    mine = own.get(h.name)
    if mine is not None and mine.startswith(base.rstrip("/") + "/"):
        # Inside a run already: nest below it, so the lead's limits hold.
        return mine, f"below the supervisor's own {h.name} cgroup (a nested run)", False
    if explicit or os.geteuid() == 0:
        return base, ("CONTAIN_CGROUP_V1_BASE" if explicit else "root: the contain base at the hierarchy's root"), True
    if mine is None:
        return None, f"the supervisor's {h.name} cgroup is unknown", False
    try:
        fs = h.fs_path(mine)
    except ValueError as e:
        return None, str(e), False
    if os.access(fs, os.W_OK | os.X_OK):
        return mine, f"the supervisor's own {h.name} cgroup (writable by uid {os.geteuid()})", False
    return None, f"cgroup v1 {h.name}: {mine} is not writable by uid {os.geteuid()}", False


def routes_for(want: Iterable[str], *, v2_base: str | None, env: Mapping[str, str] | None = None,
               hierarchies: list[V1Hierarchy] | None = None, enable: bool = True) -> dict[str, Route]:
    """Per controller, where a run under `v2_base` gets it: v2 first (a
    controller is bound to one hierarchy only, so v2 and v1 never both have
    it), else the v1 hierarchy that has it, else None with every reason."""
    env = os.environ if env is None else env
    want = list(dict.fromkeys(want))
    if v2_base:
        v2 = v2_offer(v2_base, [c for c in want if c != "cpuacct"], enable=enable)
    else:
        v2 = {c: Route(c, None, reason="no cgroup v2 directory for the run") for c in want}
    v1_off = (policy_env("CONTAIN_CGROUP_V1", env) or "").lower() in ("0", "off", "no", "false")
    hs = [] if v1_off else (host_v1_hierarchies() if hierarchies is None else hierarchies)
    routes: dict[str, Route] = {}
    for c in want:
        r = v2.get(c)
        if r is not None and r.kind == "v2":
            routes[c] = r
            continue
        why2 = r.reason if r is not None else "cgroup v2: not used for it"
        h = next((x for x in hs if c in x.controllers), None)
        if c == "io":
            # v1 blkio keeps blkio.throttle.* counters only for devices with a
            # throttle rule (measured here: 0 bytes for 8 MiB of O_DIRECT
            # writes until a rule was set), and never sees buffered writeback
            # (v1 has no writeback attribution): its numbers would read as "no
            # I/O". Not used.
            routes[c] = Route(c, None, reason=f"{why2}; cgroup v1 blkio is not used (it counts only "
                              "throttled devices and no buffered writeback)")
        elif h is not None:
            routes[c] = Route(c, "v1", h, note=why2)
        elif v1_off:
            routes[c] = Route(c, None, reason=f"{why2}; cgroup v1 is turned off (CONTAIN_CGROUP_V1)")
        else:
            routes[c] = Route(c, None, reason=f"{why2}; no cgroup v1 hierarchy with {c} is mounted")
    return routes


def plan(limits: Limits, *, v2_base: str | None, env: Mapping[str, str] | None = None,
         hierarchies: list[V1Hierarchy] | None = None, enable: bool = True,
         accounting: bool = True) -> dict[str, Route]:
    """Routes for what the run wants: the limits' controllers, memory, pids
    and io for the accounting, and cpuacct when there is no v2 directory for
    CPU time. Raises ContainmentUnavailable naming every asked-for limit that
    has no route (never a silent no-op); a controller wanted only for the
    accounting comes back with its reason instead.

    `accounting` False: a controller wanted only for the accounting that
    would need a v1 cgroup of the run's own (a hybrid host) is not routed:
    making, joining, reading and removing those cgroups cost about 0.85 ms
    of a run (docs/performance.md), so they are made only for a run that
    asks (a limit, --stats-json, --accounting; the owner's decision on
    issue 27) or that has no PID-namespace wall (--no-pidns: a member that
    left the v2 cgroup is found still in them, _escapes.at_empty). The v2
    directory's own files cost nothing extra."""
    want = limits.controllers() + list(ACCOUNTING_CONTROLLERS) + ([] if v2_base else ["cpuacct"])
    routes = routes_for(want, v2_base=v2_base, env=env, hierarchies=hierarchies, enable=enable)
    if not accounting:
        asked = set(limits.controllers())
        for c, r in list(routes.items()):
            if r.kind == "v1" and c not in asked:
                routes[c] = Route(c, None, reason=f"cgroup v1 {c} is made only for a run that asks for its "
                                                  "numbers (--accounting, --stats-json, or a limit)")
    missing = [(k, routes[LIMIT_CONTROLLER[k]]) for k in ("memory_max", "pids_max", "cpu_max")
               if getattr(limits, k) is not None and routes[LIMIT_CONTROLLER[k]].kind is None]
    if missing:
        raise ContainmentUnavailable(
            "; ".join(f"--{k.replace('_', '-')} cannot be applied: {r.reason}" for k, r in missing),
            doctor=DOCTOR_HINT)
    return routes


def host_report(v2_base: str | None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """For `contain doctor`: per controller a limit or the accounting uses,
    where this host offers it to runs under `v2_base`, or why not.
    Read-only: nothing is enabled or created."""
    want = ["memory", "pids", "cpu", "io"] + ([] if v2_base else ["cpuacct"])
    env = os.environ if env is None else env
    routes = routes_for(want, v2_base=v2_base, env=env, enable=False)
    # A v1 hierarchy is offered only where this user's runs may make their
    # cgroup in it (RunCgroups._make_v1 asks the same v1_base_for): a
    # non-root user whose own v1 cgroup is not writable gets none there.
    from ._procfs import cgroups_of

    try:
        own = cgroups_of("self")
    except OSError:
        own = {}
    for c, r in routes.items():
        if r.kind == "v1" and r.hierarchy is not None:
            parent, why, _is_base = v1_base_for(r.hierarchy, env, own)
            if parent is None:
                routes[c] = Route(c, None, reason=f"{r.note}; {why}" if r.note else why)
            elif _read_only(r.hierarchy.mount):
                # A default container's cgroup mounts are read-only binds:
                # no run can make its cgroup there, whoever it is.
                why = f"cgroup v1 {r.hierarchy.name} is mounted read-only at {r.hierarchy.mount}"
                routes[c] = Route(c, None, reason=f"{r.note}; {why}" if r.note else why)
    return {c: r.to_dict() for c, r in sorted(routes.items())}


def _read_only(mount: str) -> bool:
    """The mount's own read-only flag (statvfs's ST_RDONLY carries the
    mount's flags as well as the superblock's: statfs(2))."""
    try:
        return bool(os.statvfs(mount).f_flag & os.ST_RDONLY)
    except OSError:
        return False
