"""The cgroup v2 backend: one run, one subtree, entered at clone time.

Layout of a run (the run's directory is what is killed and watched):

    <base>/run-<id>-<uid>/          cgroup.events, cgroup.kill, cpu.stat
    <base>/run-<id>-<uid>/main/     the worker's leaf (clone3 target)
    <base>/run-<id>-<uid>/sub-*/    nested runs, beside the worker

Nothing is ever written to a `cgroup.procs` except the pid of a child we
just cloned and are holding before exec (the fallback path), and
`cgroup.kill` is only written in a run directory this process created.
"""
from __future__ import annotations

import errno
import os
import select
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, NamedTuple

from .._errors import ContainmentUnavailable
from . import posix

KIND = "cgroup2"

# Capabilities a root worker could use to undo a read-only cgroup mount or
# reach the host's: mount/setns/unshare (SYS_ADMIN), /proc/1/root and
# ptrace of outside processes (SYS_PTRACE), open_by_handle_at
# (DAC_READ_SEARCH), loading code into the kernel (SYS_MODULE, BPF).
SEAL_DROP_CAPS = (21, 19, 2, 16, 39)


if TYPE_CHECKING:
    class _HierarchyFields(NamedTuple):
        mount: str        # where the cgroup2 filesystem is mounted
        root: str         # the mount's root inside the hierarchy (mountinfo field 4)
        nsdelegate: bool
else:
    from collections import namedtuple

    _HierarchyFields = namedtuple("Hierarchy", ("mount", "root", "nsdelegate"))


class Hierarchy(_HierarchyFields):
    __slots__ = ()

    def fs_path(self, cg_path: str) -> str:
        rel = os.path.relpath(cg_path, self.root) if self.root != "/" else cg_path.lstrip("/")
        return os.path.normpath(os.path.join(self.mount, rel)) if rel not in ("", ".") else self.mount

    def cg_path(self, fs_path: str) -> str:
        rel = os.path.relpath(fs_path, self.mount)
        if rel == ".":
            return self.root
        return os.path.normpath(os.path.join(self.root, rel))


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (proc(5)).
    return field.encode().decode("unicode_escape") if "\\" in field else field


def hierarchies() -> list[Hierarchy]:
    """Every cgroup2 mount visible here, read from /proc/self/mountinfo."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            rf = right.split()
            if not rf or rf[0] != "cgroup2":
                continue
            lf = left.split()
            opts = set(rf[2].split(",")) if len(rf) > 2 else set()
            found.append(Hierarchy(_unescape(lf[4]), _unescape(lf[3]), "nsdelegate" in opts))
    return found


def cgroup_of(pid: int | str) -> str | None:
    """The v2 path of a process ("0::" line of /proc/<pid>/cgroup)."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].rstrip("\n")
    return None


def _uid_can_write_outside(uid: int, run_dir: str) -> bool:
    """Whether `uid` owns some cgroup.procs above the run (a delegation it
    could use to move). Ownership is what delegation hands out."""
    d = os.path.dirname(run_dir)
    while True:
        try:
            if os.stat(os.path.join(d, "cgroup.procs")).st_uid == uid:
                return True
        except OSError:
            pass
        parent = os.path.dirname(d)
        if parent == d:
            return False
        d = parent


def _writable_dir(path: str) -> bool:
    return os.access(path, os.W_OK | os.X_OK) and os.access(os.path.join(path, "cgroup.procs"), os.W_OK)


def resolve_base(env: dict[str, str] | os._Environ[str] = os.environ) -> tuple[Hierarchy, str]:
    """Choose where run directories go: (hierarchy, base filesystem path).

    CONTAIN_CGROUP_BASE if set; as root a `contain` directory under the mount;
    otherwise the caller's own cgroup when it is delegated to it."""
    hs = hierarchies()
    if not hs:
        raise ContainmentUnavailable("no cgroup v2 hierarchy is mounted")
    explicit = env.get("CONTAIN_CGROUP_BASE")
    if explicit:
        for h in hs:
            if explicit == h.mount or explicit.startswith(h.mount.rstrip("/") + "/"):
                path = explicit
                break
        else:
            h = hs[0]
            path = h.fs_path(explicit)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise ContainmentUnavailable(f"CONTAIN_CGROUP_BASE {path}: {os.strerror(e.errno or 0)}") from e
        if not _writable_dir(path):
            raise ContainmentUnavailable(f"CONTAIN_CGROUP_BASE {path} is not writable")
        return h, path
    own = cgroup_of("self") or "/"
    h = next((x for x in hs if own == x.root or own.startswith(x.root.rstrip("/") + "/")), hs[0])
    if os.geteuid() == 0:
        path = os.path.join(h.mount, "contain")
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        except OSError as e:
            raise ContainmentUnavailable(f"cannot create {path}: {os.strerror(e.errno or 0)}") from e
        return h, path
    path = h.fs_path(own)
    if not _writable_dir(path):
        raise ContainmentUnavailable(f"own cgroup {own} is not delegated to uid {os.geteuid()}")
    _leave_internal_position(path)
    return h, path


def _leave_internal_position(own_fs: str) -> None:
    """With a domain controller enabled, a cgroup with children may hold no
    processes (cgroup-v2.rst, "No Internal Process Constraint"; systemd#26311):
    a delegated caller moves itself into `<own>/supervisor` first. Only our own
    pid is ever moved, and only in a subtree delegated to our uid."""
    try:
        with open(os.path.join(own_fs, "cgroup.subtree_control")) as f:
            enabled = f.read().strip()
    except OSError:
        return
    if not enabled:
        return
    leaf = os.path.join(own_fs, "supervisor")
    os.makedirs(leaf, exist_ok=True)
    with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


class Container:
    """One run's cgroup subtree."""

    backend = KIND

    def __init__(self, hierarchy: Hierarchy, base: str, name: str) -> None:
        self.hierarchy = hierarchy
        self.dir = os.path.join(base, name)
        self.path = hierarchy.cg_path(self.dir)      # as /proc/<pid>/cgroup names it
        self.leaf = os.path.join(self.dir, "main")
        self._events_fd = -1
        self._leaves: list[str] = []

    @classmethod
    def create(cls, run_id: str, env: dict[str, str] | os._Environ[str] = os.environ,
               parent_dir: str | None = None) -> "Container":
        if parent_dir is not None:
            h = next(x for x in hierarchies() if parent_dir.startswith(x.mount))
            base = parent_dir
        else:
            h, base = resolve_base(env)
        prefix = "sub" if parent_dir is not None else "run"
        for _ in range(8):
            c = cls(h, base, f"{prefix}-{run_id}-{os.urandom(4).hex()}")
            try:
                os.mkdir(c.dir)
            except FileExistsError:
                continue
            except OSError as e:
                raise ContainmentUnavailable(f"cannot create {c.dir}: {os.strerror(e.errno or 0)}") from e
            try:
                os.mkdir(c.leaf)
                c._leaves.append(c.leaf)
                c._events_fd = os.open(os.path.join(c.dir, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                c.remove()
                raise ContainmentUnavailable(f"cannot prepare {c.dir}: {os.strerror(e.errno or 0)}") from e
            return c
        raise ContainmentUnavailable(f"no free cgroup name under {base}")

    @classmethod
    def attach(cls, fs_dir: str) -> "Container":
        """Take over an existing run directory (orphan adoption)."""
        h = next((x for x in hierarchies() if fs_dir.startswith(x.mount.rstrip("/") + "/")), None)
        if h is None:
            raise ContainmentUnavailable(f"{fs_dir} is not on a cgroup2 mount")
        c = cls(h, os.path.dirname(fs_dir), os.path.basename(fs_dir))
        c._events_fd = os.open(os.path.join(c.dir, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
        return c

    # -- spawning ----------------------------------------------------------

    def spawn(self, req: posix.SpawnRequest) -> posix.Spawned:
        """clone3 straight into the leaf. If the kernel lacks CLONE_INTO_CGROUP,
        or the child is killed at birth (the cgroup.kill fork bug), fall back
        to a fresh leaf and a child held before exec until its placement is
        written and verified: it never runs a worker instruction outside."""
        fd = os.open(self.leaf, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            sp = posix.spawn(req, cgroup_fd=fd)
        except posix.CloneUnsupported:
            sp = None
            reason = "clone3(CLONE_INTO_CGROUP) unsupported"
        except posix.DiedAtBirth:
            sp = None
            reason = "child SIGKILLed at birth (cgroup.kill fork bug); fresh leaf"
        finally:
            os.close(fd)
        if sp is not None:
            sp.via = "clone3(CLONE_INTO_CGROUP|CLONE_PIDFD)"
            return sp
        leaf = os.path.join(self.dir, f"main-{os.urandom(2).hex()}")
        os.mkdir(leaf)
        self._leaves.append(leaf)
        self.leaf = leaf
        held = posix.spawn_held(req)
        try:
            with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
                f.write(str(held.pid))
            where = cgroup_of(held.pid)
            if where != self.hierarchy.cg_path(leaf):
                raise ContainmentUnavailable(f"held child {held.pid} is in {where}, not {leaf}")
        except BaseException:
            held.abort()
            raise
        sp = held.release()
        sp.via = f"held before exec, moved by cgroup.procs ({reason})"
        return sp

    empty_via = "cgroup.events populated"

    def prepare(self, req: posix.SpawnRequest, opts: Any) -> None:
        """Apply the seal (see docs/design.md, "Sealing"): a private mount and
        cgroup namespace in which every cgroup2 mount is read-only, with the
        capabilities that could undo it dropped and no_new_privs set."""
        if opts.seal:
            req.seal_ro_paths = [h.mount for h in hierarchies()]
            req.drop_caps = list(SEAL_DROP_CAPS)
            req.no_new_privs = True

    def seal_status(self, req: posix.SpawnRequest) -> tuple[bool, str | None]:
        if req.seal_ro_paths is not None:
            return True, None
        uid = req.uid if req.uid >= 0 else os.geteuid()
        if uid != 0 and not _uid_can_write_outside(uid, self.dir):
            return True, None
        why = "worker runs as root"
        if not self.hierarchy.nsdelegate:
            why += " on a cgroup2 mount without nsdelegate"
        return False, why + ": it could write its pid into another cgroup.procs (use --seal or --user)"

    def escape_evidence(self) -> dict[str, Any]:
        return {"observed": None, "at": None, "via": "none",
                "detail": "no fork ledger: a process that left the cgroup would not be seen"}

    def placed(self, pid: int) -> str | None:
        """Where the kernel says `pid` is, or None if that cannot be read."""
        try:
            return cgroup_of(pid)
        except OSError:
            return None

    # -- observing ---------------------------------------------------------

    @property
    def events_fd(self) -> int:
        return self._events_fd

    def populated(self) -> bool:
        """`populated` of the run's cgroup.events. Only this (or rmdir) is
        authoritative: cgroup.procs can list exiting tasks (cgroup-v2.rst).
        Raises OSError when it cannot be read."""
        data = os.pread(self._events_fd, 4096, 0)
        for line in data.split(b"\n"):
            if line.startswith(b"populated "):
                return line[10:].strip() != b"0"
        raise OSError(errno.EIO, "cgroup.events has no populated line")

    def wait_change(self, timeout: float) -> None:
        """Sleep until cgroup.events changes (POLLPRI, as the kernel's
        test_kill.c waits) or `timeout` seconds pass."""
        p = select.poll()
        p.register(self._events_fd, select.POLLPRI | select.POLLERR)
        p.poll(max(0, int(timeout * 1000)))

    def members(self) -> list[int]:
        pids: list[int] = []
        for d, _subdirs, _files in os.walk(self.dir):
            try:
                with open(os.path.join(d, "cgroup.procs")) as f:
                    pids.extend(int(x) for x in f.read().split())
            except OSError:
                continue
        return pids

    def cpu_stat(self) -> dict[str, int] | None:
        try:
            with open(os.path.join(self.dir, "cpu.stat")) as f:
                out = {}
                for line in f:
                    k, _, v = line.partition(" ")
                    if k in ("usage_usec", "user_usec", "system_usec"):
                        out[k] = int(v)
                return out
        except OSError:
            return None

    # -- stopping ----------------------------------------------------------

    def terminate(self) -> tuple[int, int]:
        """SIGTERM (and SIGCONT, so a stopped process can act on it) to every
        member, each pinned by pidfd and re-checked to be inside. Returns
        (signalled, failed)."""
        from .._native import ffi, lib

        sent = ffi.new("int*")
        failed = ffi.new("int*")
        rc = lib.ct_cgroup_signal_members(self.dir.encode(), self.path.encode(), 15, 1, sent, failed)
        if rc < 0:
            raise OSError(-rc, f"signal members of {self.dir}: {os.strerror(-rc)}")
        return sent[0], failed[0]

    def kill(self) -> str:
        """SIGKILL the whole subtree. cgroup.kill (5.14) deals with concurrent
        forks and migrations; it does not wait. Returns how it was done."""
        try:
            fd = os.open(os.path.join(self.dir, "cgroup.kill"), os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return self._kill_by_freezing()
        try:
            os.write(fd, b"1")
        finally:
            os.close(fd)
        return "cgroup.kill"

    def _kill_by_freezing(self) -> str:
        """Before 5.14: freeze so nothing forks, SIGKILL each member (fatal
        signals reach frozen tasks), repeat until no member is left."""
        from .._native import ffi, lib

        freeze = os.path.join(self.dir, "cgroup.freeze")
        with open(freeze, "w") as f:
            f.write("1")
        sent = ffi.new("int*")
        failed = ffi.new("int*")
        for _ in range(100):
            lib.ct_cgroup_signal_members(self.dir.encode(), self.path.encode(), 9, 0, sent, failed)
            if sent[0] == 0:
                break
        return "cgroup.freeze + SIGKILL per member"

    def remove(self) -> str | None:
        """Remove the run's cgroups bottom-up. Returns None, or why not."""
        if self._events_fd >= 0:
            os.close(self._events_fd)
            self._events_fd = -1
        problem = None
        for d, _subdirs, _files in sorted(os.walk(self.dir, topdown=False), key=lambda t: -len(t[0])):
            for attempt in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    # populated 0 can precede the last task's cgroup exit by
                    # a moment; EBUSY then clears on its own.
                    if e.errno == errno.EBUSY and attempt < 49:
                        time.sleep(0.002)
                        continue
                    problem = f"rmdir {d}: {os.strerror(e.errno or 0)}"
                    break
        return problem

    def describe(self) -> dict[str, Any]:
        return {"backend": KIND, "path": self.path, "dir": self.dir,
                "nsdelegate": self.hierarchy.nsdelegate}


def available() -> str | None:
    """None if a cgroup2 container can be made here, else the reason."""
    try:
        h, base = resolve_base()
    except ContainmentUnavailable as e:
        return e.reason
    except OSError as e:
        return str(e)
    return None

