"""Which cgroup controllers can hold a run, and the limits put on it.

A run's numbers and limits come from controllers, and a controller lives in
exactly one place on a host: the cgroup v2 hierarchy (when the parent's
`cgroup.subtree_control` enables it) or one cgroup v1 hierarchy (a hybrid
host, cgroup-v2.rst "Mixing v1 and v2"). This module finds, per controller,
where the run can have it, makes the run's own v1 cgroups, writes the limits
and reads them back, and hands the spawn the `cgroup.procs` fds its child
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
import re
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Iterable, Mapping

from ._errors import ContainmentUnavailable

# Controllers a run may want: for a limit, or for the accounting alone.
LIMIT_CONTROLLER = {"memory_max": "memory", "pids_max": "pids", "cpu_max": "cpu"}
ACCOUNTING_CONTROLLERS = ("memory", "pids", "io")

V1_BASE_DEFAULT = "/contain"
_RUN_NAME = re.compile(r"^(run|sub)-[A-Za-z0-9._-]{1,128}-[0-9a-f]{8}$")
DOCTOR_HINT = "`contain doctor` lists, per controller, where this host offers it"


# -- parsing the limits (the CLI turns ValueError into a usage error) ---------

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """`--memory-max`: bytes, with an optional K, M, G or T suffix (powers of
    1024, as systemd's MemoryMax= and docker's --memory read them; "KiB",
    "MiB"... and a trailing "B" are accepted too)."""
    m = _BYTES.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 268435456, 256M, 1.5G)")
    value = int(float(m.group(1)) * _SUFFIX[m.group(2).upper()]) if "." in m.group(1) else \
        int(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value <= 0:
        raise ValueError("--memory-max must be more than 0 bytes")
    if value >= 1 << 62:
        raise ValueError(f"--memory-max {text!r} is larger than the kernel accepts")
    return value


def parse_pids(text: str) -> int:
    """`--pids-max`: a count of tasks (threads count, cgroup-v2.rst "PID")."""
    try:
        n = int(str(text).strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number of tasks") from None
    if n < 1 or n >= 1 << 31:
        raise ValueError("--pids-max must be between 1 and 2147483647")
    return n


class CpuMax:
    """`--cpu-max`: a bandwidth limit, kept as the kernel's (quota, period) in µs.

    Spelled either as a number of CPUs ("0.5", "2", "150%"), with the kernel's
    default period of 100 ms, or in cgroup v2's own syntax "QUOTA PERIOD"
    (both in µs, as in cpu.max). A bare integer means CPUs, never µs: "50000"
    would be fifty thousand CPUs, so anything above 4096 CPUs is refused as a
    likely mix-up."""

    __slots__ = ("quota_us", "period_us", "spelled")

    PERIOD_DEFAULT = 100_000

    def __init__(self, quota_us: int, period_us: int, spelled: str = "") -> None:
        if not 1000 <= period_us <= 1_000_000:
            raise ValueError("--cpu-max: the period must be 1000..1000000 µs")
        if quota_us < 1000:
            raise ValueError("--cpu-max: the quota must be at least 1000 µs (0.01 CPU at 100 ms)")
        self.quota_us = quota_us
        self.period_us = period_us
        self.spelled = spelled or f"{quota_us} {period_us}"

    @property
    def cpus(self) -> float:
        return round(self.quota_us / self.period_us, 6)

    def to_dict(self) -> dict[str, Any]:
        return {"quota_us": self.quota_us, "period_us": self.period_us, "cpus": self.cpus,
                "spelled": self.spelled}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuMax) and (self.quota_us, self.period_us) == (other.quota_us, other.period_us)

    def __repr__(self) -> str:
        return f"CpuMax({self.quota_us}, {self.period_us})"


def parse_cpu_max(text: str) -> CpuMax:
    s = str(text).strip()
    parts = s.split()
    if len(parts) == 2:
        if parts[0] == "max":
            raise ValueError("--cpu-max 'max ...' is no limit: leave the option out")
        try:
            return CpuMax(int(parts[0]), int(parts[1]), s)
        except ValueError as e:
            if "--cpu-max" in str(e):
                raise
            raise ValueError(f"--cpu-max {text!r}: 'QUOTA PERIOD' takes two integers (µs)") from None
    if len(parts) != 1:
        raise ValueError(f"--cpu-max {text!r}: a number of CPUs (0.5, 2, 150%) or 'QUOTA PERIOD' in µs")
    try:
        cpus = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise ValueError(f"--cpu-max {text!r}: a number of CPUs (0.5, 2, 150%) or 'QUOTA PERIOD' in µs") from None
    if not 0 < cpus <= 4096:
        raise ValueError(f"--cpu-max {text!r}: between 0.01 and 4096 CPUs")
    return CpuMax(round(cpus * CpuMax.PERIOD_DEFAULT), CpuMax.PERIOD_DEFAULT, s)


class Limits:
    """What the caller asked for. None: not asked."""

    __slots__ = ("memory_max", "pids_max", "cpu_max")

    def __init__(self, memory_max: int | None = None, pids_max: int | None = None,
                 cpu_max: CpuMax | None = None) -> None:
        self.memory_max = memory_max
        self.pids_max = pids_max
        self.cpu_max = cpu_max

    def asked(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.memory_max is not None:
            out["memory_max_bytes"] = self.memory_max
        if self.pids_max is not None:
            out["pids_max"] = self.pids_max
        if self.cpu_max is not None:
            out["cpu_max"] = self.cpu_max.to_dict()
        return out

    def controllers(self) -> list[str]:
        return [LIMIT_CONTROLLER[k] for k in ("memory_max", "pids_max", "cpu_max") if getattr(self, k) is not None]

    def __bool__(self) -> bool:
        return bool(self.controllers())


# -- where the kernel offers each controller ------------------------------------

def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (proc(5)).
    return field.encode().decode("unicode_escape") if "\\" in field else field


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
        rel = os.path.relpath(cg_path, self.root) if self.root != "/" else cg_path.lstrip("/")
        if rel.startswith(".."):
            raise ValueError(f"{cg_path} is outside the {self.name} mount at {self.mount}")
        return os.path.normpath(os.path.join(self.mount, rel)) if rel not in ("", ".") else self.mount

    def cg_path(self, fs_path: str) -> str:
        rel = os.path.relpath(fs_path, self.mount)
        if rel == ".":
            return self.root
        return os.path.normpath(os.path.join(self.root, rel))

    def __repr__(self) -> str:
        return f"V1Hierarchy({self.name!r}, {self.mount!r}, root={self.root!r})"


def v1_hierarchies(mountinfo: str = "/proc/self/mountinfo") -> list[V1Hierarchy]:
    """Every cgroup v1 hierarchy mounted here, once each (a bind mount of the
    same hierarchy is skipped in favour of the mount of its root)."""
    known = _subsystems()
    found: dict[frozenset[str], V1Hierarchy] = {}
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            rf = right.split()
            if len(rf) < 3 or rf[0] != "cgroup":
                continue
            ctrls = frozenset(o for o in rf[2].split(",") if o in known)
            if not ctrls:
                continue                  # a named hierarchy (name=systemd): no controller
            lf = left.split()
            h = V1Hierarchy(ctrls, _unescape(lf[4]), _unescape(lf[3]))
            old = found.get(ctrls)
            if old is None or (old.root != "/" and h.root == "/"):
                found[ctrls] = h
    return sorted(found.values(), key=lambda h: h.name)


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/<pid>/cgroup as {hierarchy name: path}; the v2 line is "" (its
    "0::" prefix has no controller list); named hierarchies are skipped."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if not hid.isdigit():
            continue
        if hid == "0" and ctrls == "":
            out[""] = path
        elif ctrls and not ctrls.startswith("name="):
            out[",".join(sorted(ctrls.split(",")))] = path
    return out


def proc_cgroup(pid: int | str) -> dict[str, str]:
    """parse_proc_cgroup of a live process. Raises OSError."""
    with open(f"/proc/{pid}/cgroup") as f:
        return parse_proc_cgroup(f.read())


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


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
    avail_s = _read(os.path.join(v2_base, "cgroup.controllers"))
    enabled_s = _read(os.path.join(v2_base, "cgroup.subtree_control"))
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
    explicit = env.get("CONTAIN_CGROUP_V1_BASE")
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
    v1_off = env.get("CONTAIN_CGROUP_V1", "").lower() in ("0", "off", "no", "false")
    hs = [] if v1_off else (v1_hierarchies() if hierarchies is None else hierarchies)
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
         hierarchies: list[V1Hierarchy] | None = None, enable: bool = True) -> dict[str, Route]:
    """Routes for what the run wants: the limits' controllers, memory, pids
    and io for the accounting, and cpuacct when there is no v2 directory for
    CPU time. Raises ContainmentUnavailable naming every asked-for limit that
    has no route (never a silent no-op); a controller wanted only for the
    accounting comes back with its reason instead."""
    want = limits.controllers() + list(ACCOUNTING_CONTROLLERS) + ([] if v2_base else ["cpuacct"])
    routes = routes_for(want, v2_base=v2_base, env=env, hierarchies=hierarchies, enable=enable)
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
    routes = routes_for(want, v2_base=v2_base, env=env, enable=False)
    return {c: r.to_dict() for c, r in sorted(routes.items())}


# -- one run's cgroups ------------------------------------------------------------

def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _swap_total() -> int | None:
    """SwapTotal in kB from /proc/meminfo, None if unreadable."""
    txt = _read("/proc/meminfo")
    for line in (txt or "").splitlines():
        if line.startswith("SwapTotal:"):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def _read_back(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


class RunCgroups:
    """The controllers holding one run: its cgroup v2 directory (made by the
    backend, `linux.Container`) and the v1 cgroups made here.

    Life: `create()` before the spawn (v1 cgroups made, limits written and
    read back), `join_fds()` for the spawn, `close_join_fds()` right after
    it, `verify(pid)` on the spawned pid, the accounting reads while the run
    lives and after it is empty (`_accounting`), `remove()` after the final
    snapshot."""

    def __init__(self, name: str, v2_dir: str | None, routes: dict[str, Route],
                 limits: Limits | None = None) -> None:
        self.name = name
        self.v2_dir = v2_dir
        self.routes = routes
        self.limits = limits or Limits()
        self.v1: dict[str, str] = {}          # hierarchy name -> fs dir of our cgroup
        self.v1_hier: dict[str, V1Hierarchy] = {}
        self.made: list[str] = []             # v1 dirs created here (removed by remove())
        self.applied: dict[str, Any] = {}
        self.notes: list[str] = []
        self._fds: list[int] = []

    # -- making -------------------------------------------------------------

    @classmethod
    def create(cls, name: str, limits: Limits | None = None, *, v2_dir: str | None,
               env: Mapping[str, str] | None = None, hierarchies: list[V1Hierarchy] | None = None) -> "RunCgroups":
        """Plan, make the v1 cgroups and apply the limits, all before the
        spawn. On any failure nothing made here is left behind and
        ContainmentUnavailable says why (the CLI's 125)."""
        env = os.environ if env is None else env
        limits = limits or Limits()
        if not _RUN_NAME.match(name):
            raise ValueError(f"not a run cgroup name: {name!r}")
        v2_base = os.path.dirname(v2_dir) if v2_dir else None
        routes = plan(limits, v2_base=v2_base, env=env, hierarchies=hierarchies)
        rc = cls(name, v2_dir, routes, limits)
        try:
            rc._make_v1(env)
            rc._apply()
        except BaseException:
            rc.remove()
            raise
        return rc

    def _make_v1(self, env: Mapping[str, str]) -> None:
        try:
            own = proc_cgroup("self")
        except OSError:
            own = {}
        asked = set(self.limits.controllers())
        for c, r in list(self.routes.items()):
            if r.kind != "v1" or r.hierarchy is None:
                continue
            h = r.hierarchy
            if h.name in self.v1:
                continue                       # co-mounted with one already made (cpu,cpuacct)
            parent, why, is_base = v1_base_for(h, env, own)
            problem = None
            if parent is not None:
                try:
                    pdir = h.fs_path(parent)
                    if is_base:
                        try:
                            os.mkdir(pdir, 0o755)
                        except FileExistsError:
                            pass
                    d = os.path.join(pdir, self.name)
                    os.mkdir(d, 0o755)
                except (OSError, ValueError) as e:
                    problem = f"cgroup v1 {h.name}: cannot create {self.name} under {parent}: " + (
                        os.strerror(e.errno or 0) if isinstance(e, OSError) else str(e))
                else:
                    self.made.append(d)
                    self.v1[h.name] = d
                    self.v1_hier[h.name] = h
                    mine = own.get(h.name)
                    if mine not in (None, "/") and not (parent == mine or parent.startswith(str(mine).rstrip("/") + "/")):
                        # Root puts runs at the hierarchy's contain base, beside
                        # whatever cgroup the host put the supervisor in.
                        self.notes.append(f"cgroup v1 {h.name}: the run is under {parent}, outside the supervisor's own "
                                          f"{mine}: a limit set there does not bind the run")
                    for cc in h.controllers:
                        if cc in self.routes and self.routes[cc].kind == "v1":
                            self.routes[cc].note = why
                    continue
            else:
                problem = why
            # Not made: a limit on it is refused, an accounting-only controller says why.
            for cc in h.controllers:
                if cc in self.routes:
                    self.routes[cc] = Route(cc, None, reason=problem)
            hit = asked & set(h.controllers)
            if hit:
                raise ContainmentUnavailable(
                    f"--{'-'.join(k for k in ('memory', 'pids', 'cpu') if k in hit)}-max cannot be applied: {problem}",
                    doctor=DOCTOR_HINT)

    def _dir_for(self, controller: str) -> tuple[str, str]:
        """(fs dir, how to name it) holding `controller` for this run."""
        r = self.routes[controller]
        if r.kind == "v2" and self.v2_dir:
            return self.v2_dir, "cgroup2"
        h = r.hierarchy
        assert h is not None
        return self.v1[h.name], f"cgroup1 {h.name}"

    def where(self, controller: str) -> tuple[str, str] | None:
        """(fs dir, "cgroup2" or "cgroup1 <hierarchy>") for a controller the
        run has, or None."""
        r = self.routes.get(controller)
        if r is None or r.kind is None:
            return None
        if r.kind == "v2":
            return (self.v2_dir, "cgroup2") if self.v2_dir else None
        if r.hierarchy is None or r.hierarchy.name not in self.v1:
            return None
        return self._dir_for(controller)

    def cg_path(self, fs_dir: str) -> str:
        for name, d in self.v1.items():
            if fs_dir == d:
                return self.v1_hier[name].cg_path(d)
        return fs_dir

    def _set(self, d: str, fname: str, value: str) -> str:
        path = os.path.join(d, fname)
        try:
            _write(path, value)
            return _read_back(path)
        except OSError as e:
            raise ContainmentUnavailable(f"cannot write {value!r} to {path}: {os.strerror(e.errno or 0)}",
                                         doctor=DOCTOR_HINT) from e

    def _apply(self) -> None:
        lim = self.limits
        if lim.memory_max is not None:
            d, via = self._dir_for("memory")
            files: dict[str, str] = {}
            if via == "cgroup2":
                files["memory.max"] = self._set(d, "memory.max", str(lim.memory_max))
                # RAM only, unless swap is capped too: the tree could page its
                # way past the limit (cgroup-v2.rst "memory.swap.max").
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    files["memory.swap.max"] = self._set(d, "memory.swap.max", "0")
                else:
                    self.notes.append("memory.swap.max absent (no swap accounting): swap use is not limited")
                value = int(files["memory.max"]) if files["memory.max"].isdigit() else None
            else:
                files["memory.limit_in_bytes"] = self._set(d, "memory.limit_in_bytes", str(lim.memory_max))
                # memory+swap, set after the RAM limit (memsw may not be below
                # it), only where swap exists: with both limits equal the
                # memsw counter takes every failure, and it keeps no failcnt
                # (measured on 6.18: memory.failcnt and memory.memsw.failcnt
                # both 0 after an OOM kill at the limit; 76 without memsw).
                swap = _swap_total()
                if swap == 0:
                    self.notes.append("no swap on this host: memory.memsw.limit_in_bytes not set "
                                      "(swap enabled later during the run would not be limited)")
                elif os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                    files["memory.memsw.limit_in_bytes"] = self._set(d, "memory.memsw.limit_in_bytes",
                                                                     str(lim.memory_max))
                else:
                    self.notes.append("memory.memsw.limit_in_bytes absent (swapaccount off): swap use is not limited")
                value = int(files["memory.limit_in_bytes"])
            if value is None or value > lim.memory_max or value < lim.memory_max - 65536:
                raise ContainmentUnavailable(f"memory limit read back as {files} after writing {lim.memory_max}")
            # The kernel rounds down to whole pages: say what holds.
            self.applied["memory_max_bytes"] = {"value": value, "via": via, "cgroup": self.cg_path(d),
                                                "files": files}
        if lim.pids_max is not None:
            d, via = self._dir_for("pids")
            got = self._set(d, "pids.max", str(lim.pids_max))
            if got != str(lim.pids_max):
                raise ContainmentUnavailable(f"pids.max read back as {got!r} after writing {lim.pids_max}")
            self.applied["pids_max"] = {"value": lim.pids_max, "via": via, "cgroup": self.cg_path(d),
                                        "files": {"pids.max": got}}
        if lim.cpu_max is not None:
            d, via = self._dir_for("cpu")
            cm = lim.cpu_max
            if via == "cgroup2":
                got = self._set(d, "cpu.max", f"{cm.quota_us} {cm.period_us}")
                files = {"cpu.max": got}
                ok = got.split() == [str(cm.quota_us), str(cm.period_us)]
            else:
                # Period first: the quota is checked against it.
                files = {"cpu.cfs_period_us": self._set(d, "cpu.cfs_period_us", str(cm.period_us)),
                         "cpu.cfs_quota_us": self._set(d, "cpu.cfs_quota_us", str(cm.quota_us))}
                ok = (files["cpu.cfs_period_us"], files["cpu.cfs_quota_us"]) == (str(cm.period_us), str(cm.quota_us))
            if not ok:
                raise ContainmentUnavailable(f"cpu limit read back as {files}")
            self.applied["cpu_max"] = {"value": cm.to_dict(), "via": via, "cgroup": self.cg_path(d), "files": files}

    # -- the spawn ----------------------------------------------------------

    def join_fds(self) -> list[int]:
        """One `cgroup.procs` fd per v1 cgroup of the run, opened O_WRONLY |
        O_CLOEXEC by this (privileged) process: the child writes "0" to each
        before exec, and since 5.16 the kernel checks a migration against the
        opener's credentials (the fix for CVE-2021-4197), so a child that has
        already dropped privileges can still join. The caller passes them to
        the spawn and calls `close_join_fds()` right after it."""
        self.close_join_fds()
        try:
            for name in sorted(self.v1):
                self._fds.append(os.open(os.path.join(self.v1[name], "cgroup.procs"),
                                         os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
        except OSError as e:
            self.close_join_fds()
            raise ContainmentUnavailable(f"cannot open a cgroup.procs of {self.name}: {os.strerror(e.errno or 0)}") from e
        return list(self._fds)

    def close_join_fds(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []

    def verify(self, pid: int) -> dict[str, Any]:
        """Right after the spawn: /proc/<pid>/cgroup names our cgroup on every
        v1 hierarchy the run joined. Evidence-shaped: observed True (all
        placed), False (one is elsewhere: the caller must not let the run go
        on as if limited), None (could not be read)."""
        via = f"/proc/{pid}/cgroup"
        if not self.v1:
            return {"observed": True, "via": via, "detail": {"v1": {}, "note": "no v1 cgroup to join"}}
        try:
            where = proc_cgroup(pid)
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
        except OSError as e:
            return {"observed": None, "via": via, "detail": f"not readable: {os.strerror(e.errno or 0)}"}
        if st[st.rfind(")") + 2:st.rfind(")") + 3] in ("Z", "X"):
            # An exited task's cgroup line is no statement about placement.
            return {"observed": None, "via": via, "detail": f"pid {pid} has exited"}
        detail: dict[str, Any] = {}
        ok = True
        for name, d in sorted(self.v1.items()):
            want = self.v1_hier[name].cg_path(d)
            got = where.get(name)
            inside = got is not None and (got == want or got.startswith(want.rstrip("/") + "/"))
            detail[name] = {"expected": want, "found": got, "ok": inside}
            ok = ok and inside
        return {"observed": ok, "via": via, "detail": {"v1": detail}}

    # -- reading and ending -------------------------------------------------

    def v1_members(self) -> dict[str, list[int]] | None:
        """Pids still listed in the run's v1 cgroups (and below). After the v2
        container is observed empty, any pid here is a member that left the
        v2 container but not this one. None if a list could not be read."""
        out: dict[str, list[int]] = {}
        for name, top in self.v1.items():
            pids: list[int] = []
            for d, _subdirs, _files in os.walk(top):
                txt = _read(os.path.join(d, "cgroup.procs"))
                if txt is None:
                    if os.path.isdir(d):
                        return None
                    continue
                pids.extend(int(x) for x in txt.split())
            out[name] = sorted(set(pids))
        return out

    def remove(self) -> str | None:
        """Remove the v1 cgroups made here, bottom-up (nested runs' first).
        Returns None, or why not (a cgroup with a task cannot be removed:
        EBUSY, cgroup-v1 docs)."""
        import time

        self.close_join_fds()
        problems = []
        for top in self.made:
            for d, _subdirs, _files in sorted(os.walk(top, topdown=False), key=lambda t: -len(t[0])):
                for attempt in range(50):
                    try:
                        os.rmdir(d)
                        break
                    except FileNotFoundError:
                        break
                    except OSError as e:
                        # The last task can still be leaving when the v2
                        # container reads empty; EBUSY then clears by itself.
                        if e.errno == errno.EBUSY and attempt < 49:
                            time.sleep(0.002)
                            continue
                        left = _read(os.path.join(d, "cgroup.procs"))
                        problems.append(f"rmdir {d}: {os.strerror(e.errno or 0)}"
                                        + (f" (still holds pid {' '.join(left.split()[:8])})" if left and left.strip() else ""))
                        break
        self.made = [d for d in self.made if os.path.isdir(d)]
        return "; ".join(problems) or None

    # -- the record ---------------------------------------------------------

    def limits_record(self) -> dict[str, Any]:
        """The record's `limits`: what was asked and what was applied (the
        driver adds `hit` from `_accounting.limit_hits` at the end)."""
        out: dict[str, Any] = {"asked": self.limits.asked(), "applied": dict(self.applied)}
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    def describe(self) -> dict[str, Any]:
        """What an adopter needs to read and remove these cgroups later (the
        run info), and what the record's containment says about them."""
        return {
            "name": self.name,
            "v1": {name: {"mount": self.v1_hier[name].mount, "root": self.v1_hier[name].root,
                          "cgroup": self.v1_hier[name].cg_path(d), "dir": d,
                          "created": d in self.made} for name, d in sorted(self.v1.items())},
            "controllers": {c: r.to_dict() for c, r in sorted(self.routes.items())},
        }

    @classmethod
    def attach(cls, desc: Mapping[str, Any], *, v2_dir: str | None) -> "RunCgroups":
        """Take over a run's cgroups from its run info (orphan adoption, or
        `status` of a live run). The info is untrusted: every v1 directory
        must sit on a v1 mount that is really there with those controllers,
        carry the run's name, and contain no symlink; anything else is
        refused with ValueError, so a forged file cannot make us read or
        remove another cgroup."""
        name = desc.get("name")
        if not isinstance(name, str) or not _RUN_NAME.match(name):
            raise ValueError("run cgroups: no valid name")
        if v2_dir is not None and os.path.basename(v2_dir) != name:
            raise ValueError(f"run cgroups: {name} does not match the v2 directory {v2_dir}")
        hs = {h.name: h for h in v1_hierarchies()}
        routes: dict[str, Route] = {}
        rc = cls(name, v2_dir, routes)
        v1 = desc.get("v1") or {}
        if not isinstance(v1, dict):
            raise ValueError("run cgroups: v1 is not a mapping")
        for hname, info in v1.items():
            h = hs.get(hname)
            if h is None or not isinstance(info, dict):
                raise ValueError(f"run cgroups: no v1 hierarchy {hname!r} is mounted")
            cg = info.get("cgroup")
            if (not isinstance(cg, str) or not cg.startswith("/") or os.path.normpath(cg) != cg
                    or os.path.basename(cg) != name):
                raise ValueError(f"run cgroups: {cg!r} is not the run's cgroup")
            d = h.fs_path(cg)
            if os.path.realpath(d) != d:
                raise ValueError(f"run cgroups: {d} is not a plain path")
            rc.v1[hname] = d
            rc.v1_hier[hname] = h
            if info.get("created"):
                rc.made.append(d)
            for c in h.controllers:
                routes[c] = Route(c, "v1", h)
        ctl = desc.get("controllers") or {}
        if isinstance(ctl, dict) and v2_dir is not None:
            for c, r in ctl.items():
                if isinstance(r, dict) and r.get("via") == "cgroup2" and c not in routes:
                    routes[c] = Route(str(c), "v2")
        return rc
