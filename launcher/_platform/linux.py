"""The cgroup v2 backend: one run, one subtree, entered at clone time.

Layout of a run (the run's directory is what is killed and watched):

    <base>/run-<id>-<uid>/          cgroup.events, cgroup.kill, cpu.stat
    <base>/run-<id>-<uid>/main/     the worker's leaf (clone3 target)
    <base>/run-<id>-<uid>/sub-*/    nested runs, beside the worker

Nothing is ever written to a `cgroup.procs` but this process's own pid
(`_leave_internal_position`) and, in the fallback path, the child's "0"
written by the child itself into its own fresh leaf's; and
`cgroup.kill` is only written in a run directory this process created.
"""
from __future__ import annotations

import errno
import os
import select
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable

from .. import _tags
from .._errors import ContainmentUnavailable, SpawnFailed
from .._controllers import read_file
from .._procfs import cgroup_of
from . import pidwall, posix, sealing
from .cgroups import (Hierarchy, dev_of, hierarchies, identify, kill_by_freezing, remove_made, resolve_base, rmdir_known,
                      run_suffix, walk_dirs, writable_procs_above)
from .._signals import signal_name
from .posixwait import Root

if TYPE_CHECKING:
    from .cgattach import CgroupCheck      # adoption only: not loaded on the run path

KIND = "cgroup2"

class Container:
    """One run's cgroup subtree."""

    backend = KIND

    def __init__(self, hierarchy: Hierarchy, base: str, name: str) -> None:
        self.hierarchy = hierarchy
        self.dir = os.path.join(base, name)
        self.path = hierarchy.cg_path(self.dir)      # as /proc/<pid>/cgroup names it
        self.leaf = os.path.join(self.dir, "main")
        self._events_fd = -1
        self.events_watched = False             # an inotify watch stands for _events_fd (watch_events)
        self._dir_fd = -1                 # held by an adopter: what it verified is what it kills
        self._leaves: list[str] = []
        self.identity: dict[str, Any] | None = None   # recorded at creation (cgroups.identify)
        self.run_id = name
        self.vouched: str | None = None   # a lead's proof for its nested run (_adopt.finish_nested)
        self._made: list[str] = []       # base directories made for this run, removed after it
        self.seal_detail: dict[str, Any] | None = None
        self.can_move_out: str | None = None    # how a member could move itself out of the run's cgroups
        self.seal_error: str | None = None      # why --seal cannot be had (the spawn fails with it)
        self.seal_uid: int | None = None        # the host uid 0 is mapped to, when sealed
        self.uid_claim: str | None = None       # the dynamic uid's claim file (sealing.py)
        self.state_dir: str | None = None
        self.empty_proof = "cgroup.events populated 0"
        self.wall: pidwall.PidWall | None = None
        self.wall_mode: bool | None = None      # None: where the kernel allows; True: required
        self.wall_problem: str | None = None    # why a wall that was wanted is not there
        self.also_killed: str | None = None     # what else the last kill did (the wall's init)
        self.wall_gone = False                  # adopted: the wall's init was already reaped
        self.failed_walls: list[dict[str, Any]] = []
        self.wall_unknown: str | None = None    # adopted: why the wall cannot be observed
        self.seen_empty: bool | None = None     # what cgroup.events said when last read (None: never read)

    @classmethod
    def create(cls, run_id: str, env: dict[str, str] | os._Environ[str] = os.environ,
               parent_dir: str | None = None, uid: str | None = None) -> "Container":
        made: list[str] = []      # base directories this run made (removed with it)
        if parent_dir is not None:
            h = next((x for x in hierarchies() if parent_dir.startswith(x.mount.rstrip("/") + "/")), None)
            if h is None:
                raise ContainmentUnavailable(f"{parent_dir} is not in a cgroup v2 hierarchy")
            base = parent_dir
        else:
            h, base = resolve_base(env, made)
        prefix = "sub" if parent_dir is not None else "run"
        # The base comes from a probe of the host taken once per process
        # (cgroups.host_view): when what was built on it fails, the host is
        # probed again and the run tried once more before the failure counts.
        fresh = parent_dir is not None

        def again() -> tuple[Hierarchy, str]:
            try:
                got = resolve_base(env, made, refresh=True)
            except BaseException:
                remove_made(made)
                raise
            made[:] = list(dict.fromkeys(made))     # a base made again is listed once (remove_made stops at a gap)
            return got

        for attempt in range(8):
            # Named from the run uid (journaled at the claim, before this):
            # what a supervisor killed before it could tag the cgroup leaves
            # is found by name and removed (_gc, _strays.remove_strays).
            suffix = run_suffix(uid) if attempt == 0 else os.urandom(4).hex()
            c = cls(h, base, f"{prefix}-{run_id}-{suffix}")
            c.run_id = run_id
            c._made = made
            try:
                os.mkdir(c.dir)
            except FileExistsError:
                continue
            except FileNotFoundError:
                if parent_dir is not None:
                    raise ContainmentUnavailable(f"cannot create {c.dir}: its parent is gone") from None
                # The run that made the base removed it as it ended (or the
                # mounts changed): make it again, from a fresh probe.
                h, base = again()
                fresh = True
                continue
            except OSError as e:
                if not fresh:
                    h, base = again()
                    fresh = True
                    continue
                remove_made(made)
                raise ContainmentUnavailable(f"cannot create {c.dir}: {os.strerror(e.errno or 0)}") from e
            except BaseException:
                # An interrupt the moment mkdir returned: the name is ours and new.
                try:
                    os.rmdir(c.dir)
                except OSError:
                    pass
                remove_made(made)
                raise
            try:
                c.identity = identify(h, base, c.dir)
                os.mkdir(c.leaf)
                c._leaves.append(c.leaf)
                c._events_fd = os.open(os.path.join(c.dir, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
            except BaseException as e:          # an interrupt too: nothing has run in it, nothing stays
                c.remove()
                if isinstance(e, OSError) and not fresh:
                    h, base = again()
                    fresh = True
                    continue
                if isinstance(e, OSError):
                    raise ContainmentUnavailable(f"cannot prepare {c.dir}: {os.strerror(e.errno or 0)}") from e
                raise
            return c
        remove_made(made)
        raise ContainmentUnavailable(f"no free cgroup name under {base}")

    def bind(self, tag: _tags.RunTag) -> str | None:
        """Tag the cgroup with the run directory (dev:ino) and run uid it is
        made for, before anything runs in it; the run directory's own tag
        (`tag`) already holds the cgroup's identity (_tags.py). None, or why
        the cgroup could not be tagged."""
        if tag.key is None:
            return f"{tag.run_dir} cannot be identified: the cgroup is not tagged"
        problems = [_tags.write(self.dir, _tags.CGROUP_TAG, {"run_dir": tag.key, "run_uid": tag.value.get("run_uid")}),
                    tag.update()]
        return "; ".join(p for p in problems if p) or None

    def adopt_wall(self, desc: dict[str, Any]) -> None:
        """The PID-namespace wall of an adopted run, as its owner tagged it
        (pidwall.adopt says how it is re-attached, or why it cannot be)."""
        self.wall, self.wall_gone, self.wall_unknown = pidwall.adopt(desc)
        self.empty_proof = f"cgroup.events populated 0, and {pidwall.PROOF}"

    @classmethod
    def attach(cls, check: CgroupCheck) -> "Container":
        """Take over a run cgroup that cgattach.verify found `live` (orphan
        adoption). Its descriptor is kept: the kill goes to the directory
        that was verified."""
        if check.status != "live" or check.hierarchy is None or check.dir is None:
            raise ContainmentUnavailable(f"not a verified cgroup: {check.reason}")
        c = cls(check.hierarchy, os.path.dirname(check.dir), os.path.basename(check.dir))
        c._dir_fd, check.fd = check.fd, -1
        c._events_fd = os.open("cgroup.events", os.O_RDONLY | os.O_CLOEXEC, dir_fd=c._dir_fd)
        return c

    # -- spawning ----------------------------------------------------------

    def spawn(self, req: posix.SpawnRequest) -> posix.Spawned:
        if self.seal_error:
            raise ContainmentUnavailable(self.seal_error)
        try:
            sp = self._spawn(req)
        except SpawnFailed as e:
            # A sealed run's user namespace comes with its wall: without it
            # the worker would run as the supervisor's uid, host root. So a
            # seal that cannot be made fails the run; it never falls back.
            # A run that dies with its owner needs the wall too (the init is
            # what ends it): no fallback either.
            if not (req.pidns and self.wall_mode is None and req.userns != "map" and req.owner_pidfd < 0
                    and pidwall.unavailable(e)):
                self.failed_walls = pidwall.failed_wall(e.wall_init)     # a worker that never ran in its wall
                raise
            # `auto`: this host will not make the namespace; the cgroup alone.
            self.wall_problem = f"PID-namespace wall unavailable: {e}"
            req.pidns = req.mount_proc = False
            sp = self._spawn(req)
        try:
            if sp.wall:
                self.wall = pidwall.PidWall.of(sp, req.userns)
                self.empty_proof = f"cgroup.events populated 0, and {pidwall.PROOF}"
        except BaseException:
            if self.wall is None:
                posix.discard(sp)     # an interrupt before anything holds it: no zombie, no descriptor left
            raise
        return sp

    def root(self, sp: posix.Spawned) -> Any:
        """The worker as the owner watches it."""
        return self.wall.root(sp) if self.wall is not None else Root(sp.pid, sp.pidfd)

    def expected_placement(self) -> str:
        """Where the worker must be right after the spawn (/proc/<pid>/cgroup's v2 path)."""
        return self.hierarchy.cg_path(self.leaf)

    def unleavable(self) -> str | None:
        """How no member can have left unseen, if the container itself says so."""
        return pidwall.UNLEAVABLE if self.wall is not None or self.wall_gone else None

    def walls(self) -> list[dict[str, Any]]:
        # How it was observed empty, only if it was: an UNCONFIRMED stop's
        # cgroup said populated 1 (or was never read), never "populated 0".
        if self.seen_empty is None and (self._events_fd >= 0 or self.events_watched) and self.wall is not None:
            try:
                self.seen_empty = b"populated 0" in self._read_events()
            except OSError:
                pass
        seen = self.seen_empty
        out: list[dict[str, Any]] = [{"kind": "cgroup", "path": self.path, "observed_empty": seen,
                                      "via": "cgroup.events populated 0" if seen else
                                      "cgroup.events populated 1" if seen is False else "not read"}]
        return out + (pidwall.wall_records(self.wall, self.wall_gone, self.wall_unknown) or self.failed_walls)

    def owns(self, pid: int) -> bool:
        return self.wall is not None and self.wall.owns(pid)

    def _spawn(self, req: posix.SpawnRequest) -> posix.Spawned:
        """clone3 straight into the leaf. Where clone3 is refused (a seccomp
        filter: Docker's default profile), or the kernel lacks
        CLONE_INTO_CGROUP, or the child is killed at birth (the cgroup.kill
        fork bug), the child joins a leaf itself before exec instead (it
        writes "0" to the leaf's cgroup.procs, opened here, and checks that
        /proc/self/cgroup names the leaf): placed before exec, not at clone
        time. contain's own child code runs outside the leaf for a few
        system calls; no instruction of the worker's does."""
        reason = posix.clone3_refused()
        leaf = self.leaf             # fresh: nothing was ever cloned into it
        if reason is None:
            sp = self._clone_into(req)
            if isinstance(sp, posix.Spawned):
                return sp
            reason = sp
            leaf = os.path.join(self.dir, f"main-{os.urandom(2).hex()}")
            os.mkdir(leaf)
            self._leaves.append(leaf)
            self.leaf = leaf
        procs = os.open(os.path.join(leaf, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
        try:
            sp = posix.spawn(req, join_fds=[procs], expect_cgroup=["0::" + self.hierarchy.cg_path(leaf)])
        finally:
            os.close(procs)
        refused = posix.clone3_refused()
        who = "the init joined the leaf before forking the worker" if sp.wall else \
            f"{'clone' if refused else 'clone3'}(CLONE_VM|CLONE_VFORK|CLONE_PIDFD), joined its leaf before exec"
        sp.via = (f"{who} (wrote 0 to cgroup.procs, verified /proc/self/cgroup: placed before exec, not at clone "
                  "time; contain's own set-up ran outside the leaf for a few system calls, no instruction of the "
                  "worker's did)")
        if sp.wall:
            sp.via = f"{sp.via}; {posix.wall_via(req)}"     # names the clone, and why not clone3
        if not (sp.wall and refused):
            sp.via = f"{sp.via} ({reason})"
        return sp

    def _clone_into(self, req: posix.SpawnRequest) -> posix.Spawned | str:
        """clone3(CLONE_INTO_CGROUP) into the leaf: the worker, or why the
        join is needed instead."""
        fd = os.open(self.leaf, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        sp = None
        try:
            sp = posix.spawn(req, cgroup_fd=fd)
        except posix.CloneUnsupported:
            return posix.clone3_refused() or "clone3(CLONE_INTO_CGROUP) unsupported"
        except posix.DiedAtBirth:
            return "child SIGKILLed at birth (cgroup.kill fork bug); fresh leaf"
        finally:
            try:
                os.close(fd)
            except BaseException:
                if sp is not None:
                    posix.discard(sp)     # an interrupt as the spawn returned: nothing else holds it
                raise
        if sp.wall is None:      # a wall's init says how it was made
            sp.via = "clone3(CLONE_INTO_CGROUP|CLONE_PIDFD)"
        return sp

    empty_via = "cgroup.events populated"

    def prepare(self, req: posix.SpawnRequest, opts: Any) -> None:
        """The wall where it is wanted (pidwall.py), then the seal."""
        self.wall_mode = getattr(opts, "pidns", None)
        pidwall.shape(req, self.wall_mode)
        self._prepare_seal(req, opts)

    def _prepare_seal(self, req: posix.SpawnRequest, opts: Any) -> None:
        sealing.prepare(self, req, opts)

    def seal_status(self, req: posix.SpawnRequest) -> tuple[bool, str | None]:
        """Whether the tree's host credentials cannot act outside the run
        (CONTRACT.md "sealed"), with what was checked (`seal_detail`)."""
        return sealing.status(self, req, writable_procs_above(
            req.uid if req.uid >= 0 and req.userns != "map" else os.geteuid(), posix.gids_of(req), self.dir))

    def escape_evidence(self) -> dict[str, Any]:
        return {"observed": None, "at": None, "via": "none",
                "detail": "no fork ledger: a process that left the cgroup would not be seen"}

    def placed(self, pid: int) -> str | None:
        """Where the kernel says `pid` is, or None if that cannot be read.
        Behind the wall a worker that exits at once is reaped by the init
        before we look: it was forked by the init, in the init's cgroup, so
        the init's placement (our unreaped child) is where it ran."""
        try:
            return cgroup_of(pid)
        except OSError:
            pass
        if self.wall is not None:
            try:
                return cgroup_of(self.wall.init.pid)
            except OSError:
                return None
        return None

    # -- observing ---------------------------------------------------------

    @property
    def events_fd(self) -> int:
        return self._events_fd

    def watch_events(self, add_watch: Callable[[str], int]) -> int:
        """Let an inotify instance stand for the open cgroup.events (the
        process's owner loop watches every run's through one: systemd does
        the same for its units; a change of `populated` is IN_MODIFY,
        cgroup-v2.rst). `add_watch(path)` adds the watch (by the inode the
        path names) and returns its descriptor or -errno; once it is there
        the file is closed, and read again only when looked at, through the
        directory verified as the one made for the run. The watch, -errno,
        or -1 when there is nothing to watch."""
        if self._events_fd < 0 or self.identity is None:
            return -1
        wd = add_watch(f"/proc/self/fd/{self._events_fd}")
        if wd >= 0:
            os.close(self._events_fd)
            self._events_fd = -1
            self.events_watched = True
        return wd

    def _open_events(self) -> int:
        """cgroup.events of the directory made for the run, opened anew: the
        directory is opened first and must be the one made (its inode is
        the cgroup's id, recorded at creation), so a rename of the run's
        cgroup and an empty one put in its place read as failure, not as
        `populated 0`."""
        ident = self.identity or {}
        dfd = os.open(self.dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(dfd)
            if st.st_ino != ident.get("ino") or dev_of(st) != ident.get("dev"):
                raise OSError(errno.ESTALE, f"{self.dir} is no longer the cgroup made for the run")
            return os.open("cgroup.events", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dfd)
        finally:
            os.close(dfd)

    def _read_events(self) -> bytes:
        if self._events_fd >= 0:
            return os.pread(self._events_fd, 4096, 0)
        if not self.events_watched:
            raise OSError(errno.EBADF, "cgroup.events is not open")
        fd = self._open_events()
        try:
            return os.pread(fd, 4096, 0)
        finally:
            os.close(fd)

    def sources(self) -> list[tuple[int, int]]:
        """What the owner loop waits on: a change of `populated`, and the wall's init."""
        own = [(self._events_fd, select.POLLPRI | select.POLLERR)] if self._events_fd >= 0 else []
        return own + (self.wall.sources() if self.wall is not None else [])

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
        if self.wall is not None:
            self.wall.drain(ready)

    def populated(self) -> bool:
        """`populated` of the run's cgroup.events. Only this (or rmdir) is
        authoritative: cgroup.procs can list exiting tasks (cgroup-v2.rst).
        Raises OSError when it cannot be read."""
        if self.wall_unknown and not getattr(self, "vouched", None):
            # (A lead that proved its own namespace empty vouches for the
            # nested walls inside it: _adopt.finish_nested.)
            raise OSError(errno.ENOENT, self.wall_unknown)
        if self.wall is not None and not self.wall.empty():
            return True
        data = self._read_events()
        for line in data.split(b"\n"):
            if line.startswith(b"populated "):
                self.seen_empty = line[10:].strip() == b"0"
                return not self.seen_empty
        raise OSError(errno.EIO, "cgroup.events has no populated line")

    def wait_change(self, timeout: float) -> None:
        """Sleep until cgroup.events changes (POLLPRI, as the kernel's
        test_kill.c waits) or `timeout` seconds pass."""
        fd = self._events_fd if self._events_fd >= 0 else self._open_events()
        try:
            p = select.poll()
            p.register(fd, select.POLLPRI | select.POLLERR)
            p.poll(max(0, int(timeout * 1000)))
        finally:
            if fd != self._events_fd:
                os.close(fd)

    def members(self) -> list[int]:
        """The tree's processes in the subtree (the wall's init is ours, not
        the tree's). Raises OSError when the subtree cannot be listed (a
        partial list would read as "these are all")."""
        init = self.wall.init.pid if self.wall is not None else -1
        pids: list[int] = []

        def fail(e: OSError) -> None:
            if e.errno != errno.ENOENT:
                raise e

        for d in walk_dirs(self.dir, fail):
            try:
                data = _read_all(os.path.join(d, "cgroup.procs"))
            except OSError:
                continue
            pids.extend(p for p in map(int, data.split()) if p != init)
        return pids

    def cpu_stat(self) -> dict[str, int] | None:
        text = read_file(os.path.join(self.dir, "cpu.stat"))
        if text is None:
            return None
        out = {}
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k in ("usage_usec", "user_usec", "system_usec"):
                out[k] = int(v)
        return out

    # -- stopping ----------------------------------------------------------

    def terminate(self, sig: int = 15) -> tuple[str, dict[str, Any]]:
        """The polite step: `sig` (and SIGCONT, so a stopped process can act
        on it) to every member, each pinned by pidfd and re-checked to be
        inside; behind the wall, to the init, which forwards it. Returns how,
        and what was signalled. Raises OSError."""
        if self.wall is not None:
            return self.wall.terminate(sig)
        from .._native import ffi, lib

        sent = ffi.new("int*")
        failed = ffi.new("int*")
        rc = lib.ct_cgroup_signal_members(self.dir.encode(), self.path.encode(), sig, 1, sent, failed)
        if rc < 0:
            raise OSError(-rc, f"signal members of {self.dir}: {os.strerror(-rc)}")
        name = signal_name(sig)
        return f"{name}+SIGCONT by pidfd to {sent[0]} member(s)", {"signalled": sent[0], "failed": failed[0]}

    def kill(self) -> str:
        """SIGKILL the whole subtree. cgroup.kill (5.14) deals with concurrent
        forks and migrations; it does not wait. Returns how it was done."""
        try:
            if self._dir_fd >= 0:
                fd = os.open("cgroup.kill", os.O_WRONLY | os.O_CLOEXEC, dir_fd=self._dir_fd)
            else:
                fd = os.open(os.path.join(self.dir, "cgroup.kill"), os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            via = kill_by_freezing(self.dir, self.path)
        else:
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)
            via = "cgroup.kill"
        if self.wall is not None:
            # Both walls at once: a member that left the cgroup is still in
            # the namespace, and dies with its init.
            self.also_killed = self.wall.kill()
        return via

    def remove(self) -> str | None:
        """Remove the run's cgroups bottom-up. Returns None, or why not."""
        if self.wall is not None:
            self.wall.close()
        sealing.release_claim(self.uid_claim)
        for fd in (self._events_fd, self._dir_fd):
            if fd >= 0:
                os.close(fd)
        self._events_fd = self._dir_fd = -1
        problem = None
        if rmdir_known([*reversed(self._leaves), self.dir]):
            remove_made(self._made)       # the usual end: nothing below but the leaves we made
            return None
        failed: list[OSError] = []
        dirs = walk_dirs(self.dir, failed.append) or [self.dir]
        for d in sorted(dirs, key=len, reverse=True):
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
        if problem is None and os.path.isdir(self.dir):
            # os.walk swallowed why the subtree could not be listed (EMFILE).
            problem = f"rmdir {self.dir}: not removed (" + ("; ".join(
                f"{e.filename}: {os.strerror(e.errno or 0)}" for e in failed[:3]) or "still there") + ")"
        if problem is None:
            remove_made(self._made)
        return problem


def _read_all(path: str) -> bytes:
    """A cgroup file's whole content, by os.read: open() would add a
    buffered text layer (an isatty ioctl, two lseeks and an fstat) to every
    file a stop reads, a thousand stops at once."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks: list[bytes] = []
        while True:
            b = os.read(fd, 65536)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)
