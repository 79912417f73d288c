"""The PID-namespace wall as a run's container uses it.

A process cannot leave its PID namespace, whatever its privileges or clone
flags; when the namespace's init exits the kernel SIGKILLs every member,
and the init is reaped only after every other member is gone (wall.py and
init.c cite the kernel). So a run behind the wall is observed empty when its
init is reaped, and nothing can have left it unseen.

    PidWall.shape(req, mode, ...)   ask the spawn for the wall (mode: None
                                    for "where the kernel allows", True
                                    for "required", False for "off")
    PidWall(init)                   the wall of a spawned run: its sources,
                                    the polite signal (to the init, which
                                    forwards it to every member), the kill,
                                    and whether it is empty
"""
from __future__ import annotations

import errno
import os
from .. import _signals as signal
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Sequence

    from .spawnreq import SpawnRequest, Spawned

from .._record import now_iso
from .posixwait import Init, WallRoot, kernel_keeps_exit_status

PROOF = "the PID namespace's init was reaped (the kernel reaps it only after every other member is gone)"
UNLEAVABLE = "a PID-namespace wall: no process can leave it, whatever its privileges"

# Errors of the clone itself that mean "this kernel or host will not make the
# namespace" (EPERM: no CAP_SYS_ADMIN or a seccomp filter; EINVAL/ENOSYS: no
# support; ENOSPC/EUSERS: a namespace limit), as opposed to the worker's own
# failures, which are the same with or without the wall.
_UNAVAILABLE = frozenset({errno.EPERM, errno.EINVAL, errno.ENOSYS, errno.ENOSPC, errno.EUSERS, errno.EACCES})
_WALL_STAGES = frozenset({"clone", "pid namespace init", "user namespace", "fork in the pid namespace"})


def shape(req: SpawnRequest, mode: bool | None, *, userns: str | None = None,
          uid_map: str | None = None, gid_map: str | None = None) -> None:
    """Ask the spawn for the wall, unless `mode` is False. `userns`: None for
    a root caller, "self" for a caller without root (its own ids mapped to
    themselves, no capabilities), "map" with the maps for a sealed root run."""
    if mode is False:
        return
    req.pidns = True
    req.mount_proc = True        # ps, $$ and /proc/self agree with the namespace
    req.userns = userns
    req.uid_map, req.gid_map = uid_map, gid_map
    if userns is not None:
        req.clear_caps = True
        req.no_new_privs = True


def unavailable(err: Any) -> bool:
    """Whether a failed spawn failed because the wall cannot be made here
    (so `auto` may go on without it), not because of the worker."""
    return getattr(err, "stage", None) in _WALL_STAGES and getattr(err, "errno", 0) in _UNAVAILABLE


def describe_init(init_pid: int, start_time: int | None, inode: int | None, userns: str | None) -> dict[str, Any]:
    """PidWall.describe() of a wall whose init has just been cloned, before
    it does anything for the worker (SpawnRequest.on_init): its start time
    and PID namespace as the spawn read them right after the clone, while
    it was our unreaped child (its pid cannot name another process)."""
    from .._identity import own_pidns

    return {"kind": "pidns", "init": {"pid": init_pid, "start_time": start_time}, "inode": inode,
            "userns": userns, "counted_in": own_pidns()}


class PidWall:
    def __init__(self, init: Init, userns: str | None = None, inode: int | None = None) -> None:
        self.init = init
        self.userns = userns
        self.inode: int | None = inode
        if inode is None:
            try:
                self.inode = os.stat(f"/proc/{init.pid}/ns/pid").st_ino
            except OSError:
                pass

    @classmethod
    def of(cls, sp: Spawned, userns: str | None = None) -> "PidWall":
        """The wall of a spawn, named as the spawn read its init right after
        the clone (our unreaped child then: its pid named no other process,
        and an init already gone has no ns links left)."""
        w = cls(Init(sp.init_pid, sp.init_pidfd, sp.report_fd, sp.events, start_time=sp.init_start), userns,
                sp.init_ns)
        w.init_identity = ({"pid": sp.init_pid, "start_time": sp.init_start} if sp.init_start is not None
                           else w.init.identity())
        return w

    init_identity: dict[str, Any] | None = None
    state_dir: dict[str, Any] | None = None     # hidden_dir(): the state directory out of the worker's reach

    def describe(self) -> dict[str, Any]:
        """What run.json records, for an adopter: the init's identity and
        the namespace it was counted in."""
        from .._identity import own_pidns

        return {"kind": "pidns", "init": self.init_identity, "inode": self.inode, "userns": self.userns,
                "counted_in": own_pidns()}

    def root(self, sp: Spawned) -> WallRoot:
        """The worker as the owner watches it. Where the kernel keeps a
        reaped process's status for its pidfd, the init's socket is closed
        here (Init.quiet), and the init's pidfd rests till the worker ends
        (Init.rest): a live walled run then holds one descriptor, the
        worker's pidfd."""
        if sp.pidfd >= 0 and not self.init.adopted and kernel_keeps_exit_status():
            self.init.quiet()
            self.init.rest()     # and its pidfd, till the worker ends: one descriptor per live run
        return WallRoot(self.init, sp.pid, sp.pidfd)

    def sources(self) -> list[tuple[int, int]]:
        return self.init.sources()

    def drain(self, ready: Any) -> None:
        self.init.pump()

    def empty(self) -> bool:
        return self.init.reaped()

    def owns(self, pid: int) -> bool:
        """The init is our child: a subreaper loop must leave it to us."""
        return pid == self.init.pid

    def terminate(self, sig: int) -> tuple[str, dict[str, Any]]:
        """The polite signal, to the init: it forwards a signal from outside
        to every member with kill(-1, sig), then SIGCONT (init.c)."""
        name = signal.signal_name(sig)
        try:
            self.init.signal(sig)
        except ProcessLookupError:
            return f"{name}: the PID namespace's init was already gone", {"init_pid": self.init.pid}
        # What was done is the signal to the init; the forwarding is its
        # job, not observed from here (a frozen or traced init forwards nothing).
        return (f"{name} sent to the PID namespace's init, which forwards it to every member (kill(-1)) "
                "with SIGCONT", {"init_pid": self.init.pid})

    def kill(self) -> str:
        self.init.kill()
        return "SIGKILL to the PID namespace's init (the kernel then kills every member)"

    def record(self) -> dict[str, Any]:
        """This wall's entry in `containment.walls`."""
        reaped = self.init.reaped_at
        return {"kind": "pidns", "inode": self.inode, "init_pid": self.init.pid,
                "user_namespace": self.userns,
                "observed_empty": True if reaped is not None else False,
                "at": now_iso(reaped) if reaped is not None else None, "via": PROOF,
                "notes": self.init.notes or None,
                **({"state_dir": self.state_dir} if self.state_dir is not None else {})}

    def cpu(self) -> dict[str, int] | None:
        """Whole-tree CPU from the init's rusage (it reaps every member)."""
        ru = self.init.rusage
        if ru is None:
            return None
        user, system = int(ru.ru_utime * 1e6), int(ru.ru_stime * 1e6)
        return {"usage_usec": user + system, "user_usec": user, "system_usec": system}

    def close(self) -> None:
        self.init.close()


def hidden_dir(req: SpawnRequest, events: Sequence[Any]) -> dict[str, Any] | None:
    """What became of the directory the request asked the init to hide
    (SpawnRequest.hide): covered, or not with the init's reason. None if
    none was asked for."""
    from .._native import lib
    from .wall import InitNote

    if req.hide is None:
        return None
    failed = [e for e in events if isinstance(e, InitNote) and e.what == lib.CT_NOTE_HIDE]
    if failed:
        return {"path": req.hide, "hidden": False, "detail": failed[0].text}
    return {"path": req.hide, "hidden": True,
            "via": "an empty tmpfs over it in the run's mount namespace, which the worker cannot unmount"}


def failed_wall(init: tuple[int, int | None, bool] | None) -> list[dict[str, Any]]:
    """The `walls` entry of a wall whose worker never ran (its set-up or
    exec failed inside it: SpawnFailed.wall_init): the init said so and,
    once reaped, held nothing. [] when the failure came before any wall."""
    if init is None:
        return []
    init_pid, inode, reaped = init
    return [{"kind": "pidns", "inode": inode, "init_pid": init_pid, "observed_empty": reaped,
            "at": now_iso() if reaped else None, "via": PROOF if reaped else "the init was not reaped",
            "notes": ["the worker never ran: its start failed inside the wall"]}]


def wall_records(wall: "PidWall | None", gone: bool, unknown: str | None) -> list[dict[str, Any]]:
    """The `walls` entry of a container's PID-namespace wall: live, or as an
    adopter found it (adopt(): its init already reaped, or why it cannot be
    told); none when the run had no wall."""
    if wall is not None:
        return [wall.record()]
    if gone:
        return [{"kind": "pidns", "observed_empty": True,
                 "via": "the init's pid no longer names it: it was reaped, so every member was gone"}]
    if unknown:
        return [{"kind": "pidns", "observed_empty": None, "via": "none", "detail": unknown}]
    return []


def adopt(desc: dict[str, Any]) -> tuple["PidWall | None", bool, str | None]:
    """Re-attach the wall of a run whose owner is gone, from what its owner
    tagged (describe()): (the wall, or None; True if its init is provably
    gone, so the namespace is empty; or why it cannot be told). A pid only
    means something in the namespace it was read in: an adopter in another
    one cannot tell a gone init from one it cannot see, and says so."""
    from .._identity import own_pidns, pidns_inode

    raw = desc.get("init")
    ident: dict[str, Any] = raw if isinstance(raw, dict) else {}
    pid, start = ident.get("pid"), ident.get("start_time")
    if not isinstance(pid, int) or not isinstance(start, int) or pid <= 0:
        return None, False, "the wall's init was not recorded: whether the namespace is empty cannot be told"
    if own_pidns() != desc.get("counted_in"):
        return None, False, ("the wall's init was recorded in another PID namespace than this adopter's: "
                             "whether it is gone cannot be told from here")
    try:
        init = Init.adopt(pid, start)
    except OSError as e:
        return None, False, f"the wall's init could not be re-attached: {e}"
    if init is None:
        return None, True, None
    # The tag names the init by pid and start time; a worker that can write
    # it (a `user.` tag: the same uid) could name a process outside the wall
    # that it could never signal itself. Only pid 1 of the recorded
    # namespace, one below ours, is the wall's init.
    from .._procfs import read_nspid

    ns, nspid = pidns_inode(pid), read_nspid(pid)
    if (ns is None or ns != desc.get("inode") or ns == own_pidns() or nspid is None
            or len(nspid) < 2 or nspid[-1] != 1):
        init.close()
        return None, False, (f"the wall's init as tagged (pid {pid}) is not pid 1 of the recorded PID namespace: "
                             "not trusted with a stop, whether the namespace is empty cannot be told")
    w = PidWall(init, desc.get("userns") if isinstance(desc.get("userns"), str) else None)
    w.init_identity = {"pid": pid, "start_time": start}
    return w, False, None
