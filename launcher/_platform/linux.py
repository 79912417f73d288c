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
    from typing import Any

from .._errors import ContainmentUnavailable
from .._procfs import cgroup_of
from . import posix
from .cgroups import Hierarchy, cgroup_mounts, hierarchies, remove_made, resolve_base, writable_procs_above

KIND = "cgroup2"

# Capabilities dropped from a sealed worker's bounding set (and every other
# set). Inside the seal's user namespace they would only act on that
# namespace; dropping them too keeps the worker from building new mount or
# cgroup namespaces, loading code into the kernel, or reading raw memory:
# DAC_READ_SEARCH (open_by_handle_at), SYS_MODULE, SYS_RAWIO, SYS_PTRACE,
# SYS_ADMIN (mount, setns, unshare), SYS_BOOT (kexec), BPF.
SEAL_DROP_CAPS = (2, 16, 17, 19, 21, 22, 39)
_CAP_NAMES = {2: "CAP_DAC_READ_SEARCH", 16: "CAP_SYS_MODULE", 17: "CAP_SYS_RAWIO", 19: "CAP_SYS_PTRACE",
              21: "CAP_SYS_ADMIN", 22: "CAP_SYS_BOOT", 39: "CAP_BPF"}


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
        self._gone = False
        self._made: list[str] = []       # base directories made for this run, removed after it
        self.empty_proof = "cgroup.events populated 0"

    @classmethod
    def create(cls, run_id: str, env: dict[str, str] | os._Environ[str] = os.environ,
               parent_dir: str | None = None) -> "Container":
        made: list[str] = []      # base directories this run made (removed with it)
        if parent_dir is not None:
            h = next(x for x in hierarchies() if parent_dir.startswith(x.mount))
            base = parent_dir
        else:
            h, base = resolve_base(env, made)
        prefix = "sub" if parent_dir is not None else "run"
        for _ in range(8):
            c = cls(h, base, f"{prefix}-{run_id}-{os.urandom(4).hex()}")
            c._made = made
            try:
                os.mkdir(c.dir)
            except FileExistsError:
                continue
            except FileNotFoundError:
                if parent_dir is not None:
                    raise ContainmentUnavailable(f"cannot create {c.dir}: its parent is gone") from None
                # The run that made the base removed it as it ended: make it again.
                h, base = resolve_base(env, made)
                continue
            except OSError as e:
                remove_made(made)
                raise ContainmentUnavailable(f"cannot create {c.dir}: {os.strerror(e.errno or 0)}") from e
            try:
                os.mkdir(c.leaf)
                c._leaves.append(c.leaf)
                c._events_fd = os.open(os.path.join(c.dir, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                c.remove()
                raise ContainmentUnavailable(f"cannot prepare {c.dir}: {os.strerror(e.errno or 0)}") from e
            return c
        remove_made(made)
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

    @classmethod
    def removed(cls, fs_dir: str) -> "Container":
        """A run directory that no longer exists. The kernel removes a cgroup
        only when it has no live member and no child (rmdir fails with EBUSY
        otherwise, cgroup-v2.rst), and nothing can enter a removed cgroup: its
        absence is an observation of emptiness."""
        h = next((x for x in hierarchies() if fs_dir.startswith(x.mount.rstrip("/") + "/")), None)
        if h is None:
            raise ContainmentUnavailable(f"{fs_dir} is not on a cgroup2 mount")
        c = cls(h, os.path.dirname(fs_dir), os.path.basename(fs_dir))
        c._gone = True
        c.empty_proof = "cgroup directory removed (rmdir succeeds only on an empty cgroup)"
        return c

    # -- spawning ----------------------------------------------------------

    def spawn(self, req: posix.SpawnRequest) -> posix.Spawned:
        if getattr(self, "_seal_error", None):
            raise ContainmentUnavailable(self._seal_error or "")
        return self._spawn(req)

    def _spawn(self, req: posix.SpawnRequest) -> posix.Spawned:
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
        """Apply the seal when asked (docs/sealing.md): new mount, cgroup and
        user namespaces in which every cgroup2 mount is replaced by a
        read-only view of the run's own leaf, cgroup v1 mounts are read-only,
        the capabilities in SEAL_DROP_CAPS are gone and no_new_privs is set.
        `opts.seal` None ("auto") adds nothing to the spawn: the run is then
        sealed only if the worker's uid cannot write any cgroup.procs above it."""
        self.seal_detail: dict[str, Any] | None = None
        self._seal_error: str | None = None
        if not opts.seal:
            return
        if os.geteuid() != 0:
            uid = req.uid if req.uid >= 0 else os.geteuid()
            if writable_procs_above(uid, _gids_of(req), self.dir) is not None:
                self._seal_error = ("--seal: only a root supervisor can build the namespace seal, "
                                    f"and uid {uid} may write a cgroup.procs above the run")
            return
        cg2, v1 = cgroup_mounts()
        req.seal_cg2_paths = cg2
        req.seal_ro_paths = v1
        req.seal_userns = True
        req.drop_caps = sorted(set(req.drop_caps) | set(SEAL_DROP_CAPS))
        req.no_new_privs = True

    def seal_status(self, req: posix.SpawnRequest) -> tuple[bool, str | None]:
        """Whether the worker provably cannot leave, and how (`seal_detail`,
        recorded as containment.seal)."""
        uid = req.uid if req.uid >= 0 else os.geteuid()
        if req.seal_ro_paths is not None:
            self.seal_detail = {
                "method": "namespaces",
                "cgroup2_replaced": list(req.seal_cg2_paths),
                "cgroup1_read_only": list(req.seal_ro_paths),
                "user_namespace": "identity map" if req.seal_userns else None,
                "caps_dropped": [_CAP_NAMES.get(c, str(c)) for c in req.drop_caps],
                "no_new_privs": req.no_new_privs,
                "mounts": "private",
            }
            return True, None
        if uid != 0:
            above = writable_procs_above(uid, _gids_of(req), self.dir)
            if above is None:
                self.seal_detail = {"method": "unprivileged-uid", "uid": uid,
                                    "checked": "no cgroup.procs above the run is writable by this uid"}
                return True, None
            self.seal_detail = None
            return False, (f"worker uid {uid} may write {above}: it could move itself out "
                           "(use --seal)")
        self.seal_detail = None
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

    def source(self) -> tuple[int, int] | None:
        """What the owner loop waits on for a change of `populated`."""
        return (self._events_fd, select.POLLPRI | select.POLLERR) if self._events_fd >= 0 else None

    def drain(self, ready: Any) -> None:
        # kernfs keeps POLLPRI|POLLERR raised on this open file until it is
        # read again (kernfs_generic_poll compares the file's event count with
        # the node's; kernfs_seq_show updates it). Unread, the populated 0 -> 1
        # at spawn made every poll return at once for the worker's whole life:
        # the owner spun at 80% of a CPU (docs/performance.md).
        if self._events_fd >= 0 and self._events_fd in ready:
            try:
                os.pread(self._events_fd, 4096, 0)
            except OSError:
                pass

    def populated(self) -> bool:
        """`populated` of the run's cgroup.events. Only this (or rmdir) is
        authoritative: cgroup.procs can list exiting tasks (cgroup-v2.rst).
        Raises OSError when it cannot be read."""
        if self._gone:
            if os.path.exists(self.dir):
                raise OSError(errno.EEXIST, f"{self.dir} exists again: not the run's cgroup")
            return False
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

    def terminate(self, sig: int = 15) -> tuple[int, int]:
        """`sig` (SIGTERM, or the signal that cancelled the run) and SIGCONT,
        so a stopped process can act on it, to every member, each pinned by
        pidfd and re-checked to be inside. Returns (signalled, failed)."""
        from .._native import ffi, lib

        sent = ffi.new("int*")
        failed = ffi.new("int*")
        rc = lib.ct_cgroup_signal_members(self.dir.encode(), self.path.encode(), sig, 1, sent, failed)
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
        if problem is None:
            remove_made(self._made)
        return problem


def _gids_of(req: posix.SpawnRequest) -> list[int]:
    if req.uid >= 0:
        return sorted({req.gid, *req.groups} - {-1})
    return sorted({os.getegid(), *os.getgroups()})
