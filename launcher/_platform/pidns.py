"""The `pidns` backend: the PID-namespace wall alone, for callers with no
cgroup of their own (a laptop terminal, cron, most CI containers).

The wall is a container in its own right (pidwall.py): nothing can leave a
PID namespace, and its init is reaped only once every member is gone. A
caller without root gets it inside a user namespace that maps its own uid
to itself, with every capability dropped before the worker runs
(pidwall.shape). There is no cgroup: the run can end REAPED; its whole-tree
CPU is the run's own v1 `cpuacct` cgroup where it has one (a root caller on
a hybrid host), else unknown, with the init's rusage as a lower bound (a
member that ignores SIGCHLD has its children reaped by the kernel, and
their CPU reaches no rusage); limits need a cgroup (refused).
"""
from __future__ import annotations

import errno
import os
import select
import stat
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from .._errors import ContainmentUnavailable, SpawnFailed
from . import pidwall, posix, sealing
from .posixwait import WallRoot

KIND = "pidns"

_available: dict[str | None, str | None] = {}

# What "empty" rests on before any namespace exists (a start refused or
# rolled back before the spawn): never the init's reaping, which did not happen.
NOT_MADE = "no PID namespace was made: the run ended before its spawn, so nothing of it ran"


def available() -> str | None:
    """None if this caller can make the wall here, else why not (probed
    once per process: a spawn of /bin/true behind one)."""
    userns = None if os.geteuid() == 0 else "self"
    if userns not in _available:
        _available[userns] = posix.wall_available(userns, mount_proc=True)
    return _available[userns]


def replaceable_link(state_dir: str) -> str | None:
    """Why readers of `state_dir` could be pointed elsewhere by a worker of
    the caller's own uid, or None. The init pins every directory above it
    (a mount point cannot be renamed: init.c, pin_ancestors), but a symlink
    on the way is followed by readers, and one in a directory this uid may
    write can be replaced; the pin follows it and holds only its target."""
    path = os.path.abspath(state_dir)
    parts = [p for p in path.split("/") if p]
    cur = "/"
    for name in parts:
        parent, cur = cur, os.path.join(cur, name)
        try:
            st = os.lstat(cur)
        except OSError:
            return None                   # made later, by us, as a directory
        if not stat.S_ISLNK(st.st_mode):
            continue
        try:
            pst = os.stat(parent)
        except OSError:
            continue
        sticky_guard = pst.st_mode & stat.S_ISVTX and os.geteuid() not in (st.st_uid, pst.st_uid)
        if os.access(parent, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids) \
                and not sticky_guard:
            return (f"{cur} is a symlink in {parent}, which the worker (uid {os.geteuid()}, behind the PID-namespace "
                    f"wall) may replace, pointing readers at another state directory with forged records; use the "
                    f"real path (CONTAIN_STATE_DIR={os.path.realpath(path)})")
    return None


class Container:
    backend = KIND
    dir = None
    leaf = None
    hierarchy = None
    events_fd = -1
    empty_via = "the PID namespace's init"

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.path = f"pid namespace of run {run_id}"
        self.wall: pidwall.PidWall | None = None
        self.userns: str | None = None if os.geteuid() == 0 else "self"
        self.seal_detail: dict[str, Any] | None = None
        self.can_move_out: str | None = None    # how a member could move itself out of the run's cgroups
        self.empty_proof = NOT_MADE       # pidwall.PROOF once a wall is spawned or adopted
        self._state_dir: str | None = None
        self._seal_error: str | None = None
        self.weaker: str | None = None   # auto got less than a root user would: said on stderr
        self.wall_gone = False           # adopted: the init's identity names no process (the namespace is empty)
        self.failed_walls: list[dict[str, Any]] = []
        self.wall_unknown: str | None = None  # adopted: why whether it is empty cannot be told

    @property
    def hides_state_dir(self) -> bool:
        """Behind a user namespace of the caller's own uid the worker would
        own the state directory (every run of this user's): the init covers
        it in the run's mount namespace (SpawnRequest.hide, init.c)."""
        return self.userns == "self"

    @classmethod
    def adopt(cls, run_id: str, desc: Any) -> "Container":
        """The container of a run whose owner is gone: its wall re-attached
        from what the owner tagged (pidwall.adopt, the init by pid + start
        time). What cannot be re-attached fails every observation with the
        reason, so the stop is UNCONFIRMED, never terminal."""
        c = cls(run_id)
        c.empty_proof = pidwall.PROOF
        if not isinstance(desc, dict):
            c.wall_unknown = "the run's tag records no wall: whether the namespace is empty cannot be told"
            return c
        c.wall, c.wall_gone, c.wall_unknown = pidwall.adopt(desc)
        if isinstance(desc.get("inode"), int):
            c.path = f"pid:[{desc['inode']}]"
        if c.wall is not None:
            c.userns = c.wall.userns
        return c

    def bind(self, tag: Any) -> str | None:
        """There is no cgroup to tag: the run's own tag (written by the
        owner, _evidence.bind_tags) carries the wall, all an adopter acts on."""
        return None

    # -- spawning ----------------------------------------------------------

    def prepare(self, req: posix.SpawnRequest, opts: Any) -> None:
        self._state_dir = getattr(opts, "state_dir", None)
        if getattr(opts, "seal", None):
            self._seal_error = ("--seal needs a root supervisor and a cgroup (the pidns backend runs as the "
                                "caller's own uid, which owns the state directory)")
        if req.uid >= 0:
            req.clear_caps = req.no_new_privs = True
            req.new_session = True    # no controlling terminal to push input into (sealing.prepare says why)
        pidwall.shape(req, True, userns=self.userns)

    def spawn(self, req: posix.SpawnRequest) -> posix.Spawned:
        if self._seal_error:
            raise ContainmentUnavailable(self._seal_error)
        self.empty_proof = pidwall.PROOF    # an init a failed spawn made is killed and reaped there (spawn_wall)
        try:
            sp = posix.spawn(req)
        except SpawnFailed as e:
            self.failed_walls = pidwall.failed_wall(e.wall_init)     # a worker that never ran in its wall
            raise
        self.wall = pidwall.PidWall.of(sp, self.userns)
        self.wall.state_dir = pidwall.hidden_dir(req, sp.events)
        if self.wall.inode is not None:
            self.path = f"pid:[{self.wall.inode}]"
        return sp

    def root(self, sp: posix.Spawned) -> WallRoot:
        assert self.wall is not None
        return self.wall.root(sp)

    def placed(self, pid: int) -> str | None:
        try:
            return os.readlink(f"/proc/{pid}/ns/pid")
        except OSError:
            return None

    def expected_placement(self) -> str | None:
        return None if self.wall is None or self.wall.inode is None else f"pid:[{self.wall.inode}]"

    def seal_status(self, req: posix.SpawnRequest) -> tuple[bool, str | None]:
        uid = req.uid if req.uid >= 0 else os.geteuid()
        if uid == 0 and req.userns != "map":
            # The wall holds it, but not the run's v1 cgroups (accounting, limits).
            self.can_move_out = "worker runs as root: it could write its pid into another cgroup's tasks file"
        gids = [req.gid] if req.gid >= 0 else [os.getegid(), *os.getgroups()]
        ok, why, detail = sealing.check(uid, gids, self._state_dir, wall=self.wall is not None,
                                        no_new_privs=req.no_new_privs, no_caps=req.clear_caps)
        self.seal_detail = dict(detail, method="unprivileged-uid", uid=uid) if ok else None
        return ok, why

    def escape_evidence(self) -> dict[str, Any]:
        return {"observed": None, "at": None, "via": "none",
                "detail": "not watched: a PID-namespace wall, which no process can leave"}

    # -- observing ---------------------------------------------------------

    def sources(self) -> list[tuple[int, int]]:
        return self.wall.sources() if self.wall is not None else []

    def drain(self, ready: Any) -> None:
        if self.wall is not None:
            self.wall.drain(ready)

    def populated(self) -> bool:
        if self.wall is None and self.wall_unknown:
            raise OSError(errno.ENOENT, self.wall_unknown)
        return self.wall is not None and not self.wall.empty()

    def wait_change(self, timeout: float) -> None:
        fds = [fd for fd, _ in self.sources()]
        if not fds:
            return
        p = select.poll()
        for fd in fds:
            p.register(fd, select.POLLIN)
        p.poll(max(0, int(timeout * 1000)))

    def members(self) -> list[int]:
        """Processes in the run's namespace (or below it), by its inode."""
        if self.wall is None or self.wall.inode is None:
            return []
        out = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.stat(f"/proc/{name}/ns/pid").st_ino == self.wall.inode:
                        out.append(int(name))
                except OSError:
                    continue
        return out

    def unleavable(self) -> str | None:
        return pidwall.UNLEAVABLE if self.wall is not None or self.wall_gone else None

    def walls(self) -> list[dict[str, Any]]:
        return pidwall.wall_records(self.wall, self.wall_gone, self.wall_unknown) or self.failed_walls

    def owns(self, pid: int) -> bool:
        return self.wall is not None and self.wall.owns(pid)

    def cpu_stat(self) -> dict[str, int] | None:
        """None: no whole-tree number is proven here (_usage.RunUsage.finish
        takes the run's own cgroup where it has one)."""
        return None

    def cpu_lower_bound(self) -> dict[str, int] | None:
        """The init's RUSAGE_CHILDREN: the CPU of every member reaped by a
        wait. A member that ignores SIGCHLD (or sets SA_NOCLDWAIT) has its
        children reaped by the kernel (exit_notify's autoreap), whose CPU is
        added to nobody's rusage: so this is only a lower bound."""
        return self.wall.cpu() if self.wall is not None else None

    # -- stopping ----------------------------------------------------------

    def terminate(self, sig: int = 15) -> tuple[str, dict[str, Any]]:
        if self.wall is None:
            if self.wall_gone:
                return "nothing to signal: the PID namespace's init was reaped", {"signalled": 0, "failed": 0}
            raise OSError(errno.ESRCH, self.wall_unknown or "no worker")
        return self.wall.terminate(sig)

    def kill(self) -> str:
        if self.wall is None:
            if self.wall_gone:
                return "nothing to kill: the PID namespace's init was reaped"
            raise OSError(errno.ESRCH, self.wall_unknown or "no worker")
        return self.wall.kill()

    def remove(self) -> str | None:
        if self.wall is not None:
            self.wall.close()
        return None
