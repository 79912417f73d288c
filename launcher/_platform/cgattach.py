"""Attaching to a run cgroup this process did not create: adoption, and the
live views of `ls`/`status`.

Where to kill is never taken from the run directory alone (issue 10). At
creation the cgroup's identity is recorded (`cgroups.identify`): its path, its inode
(on cgroup2 the inode number is the kernfs node id, which is the cgroup id
that name_to_handle_at returns, unique for the boot: checked here, see
tests/test_adoption.py), the device of the hierarchy's superblock, the mount
it was made through (point, root, inode of the mount's root) and the inode of
every directory from the mount down to it. `verify` checks a recorded
identity against this process's own view before anything acts on it:

- the path is below this process's cgroup base, every directory under the
  base is named like one of our leaves (`run-<id>-<8 hex>`, `sub-<id>-<8
  hex>`), the last one names the run being attached, and no link is followed;
- the directory there is the recorded one (device and inode), and it carries
  the tag naming the run directory it was made for (_tags.py);
- a missing directory means "removed" only when this process sees the same
  hierarchy through the same mount (same superblock, same root) and every
  recorded directory above it is there with its recorded inode, or when the
  kernel says the cgroup id no longer resolves (open_by_handle_at: ESTALE).
  Anything else (another mount or cgroup namespace, a bind of a subtree, an
  unreadable directory) is "unseen": the stop is UNCONFIRMED, never terminal.
"""
from __future__ import annotations

import errno
import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from .. import _tags
from .._procfs import below
from .cgroups import Hierarchy, dev_of as _dev, hierarchies

_HEX = frozenset("0123456789abcdef")
FILEID_KERNFS = 0xFE        # include/linux/exportfs.h: the handle is the 64-bit kernfs node id


def leaf_run_id(name: str) -> str | None:
    """The run id in one of our cgroup names (`run-<id>-<8 hex>` or
    `sub-<id>-<8 hex>`), or None if the name is not one of ours."""
    head, sep, tail = name.rpartition("-")
    if not (sep and len(tail) == 8 and set(tail) <= _HEX):
        return None
    if head[:4] not in ("run-", "sub-") or len(head) < 5:
        return None
    return head[4:]


class CgroupIdentity:
    """A recorded identity, parsed and checked for shape (it is input)."""

    __slots__ = ("dir", "cgroup", "dev", "ino", "mount", "mount_root", "mount_ino", "base", "chain")

    def __init__(self, d: dict[str, Any]) -> None:
        def path(key: str) -> str:
            v = d.get(key)
            if not isinstance(v, str) or not v.startswith("/") or os.path.normpath(v) != v or "\0" in v:
                raise ValueError(f"cgroup identity: {key} is not a plain absolute path")
            return v

        def number(key: str) -> int:
            v = d.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"cgroup identity: {key} is not a positive integer")
            return v

        self.dir, self.mount, self.base = path("dir"), path("mount"), path("base")
        self.cgroup = d.get("cgroup") if isinstance(d.get("cgroup"), str) else None
        self.mount_root = d.get("mount_root") if isinstance(d.get("mount_root"), str) else None
        self.ino, self.mount_ino = number("ino"), number("mount_ino")
        dev = d.get("dev")
        if not isinstance(dev, str) or not all(x.isdigit() for x in dev.split(":")) or dev.count(":") != 1:
            raise ValueError("cgroup identity: dev is not major:minor")
        self.dev = dev
        if not self.dir.startswith(self.mount.rstrip("/") + "/"):
            raise ValueError(f"cgroup identity: {self.dir} is not below its mount {self.mount}")
        if self.base != os.path.dirname(self.dir):
            raise ValueError(f"cgroup identity: {self.dir} is not directly below its base {self.base}")
        chain = d.get("chain")
        comps = below(self.dir, self.mount).split(os.sep)
        if (not isinstance(chain, list) or len(chain) != len(comps)
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in chain) or chain[-1] != self.ino):
            raise ValueError("cgroup identity: chain does not match the path")
        self.chain = chain

    def same_as(self, other: "CgroupIdentity") -> bool:
        return (self.dir, self.dev, self.ino) == (other.dir, other.dev, other.ino)


class CgroupCheck:
    """What `verify` found. `status`:
        live      `dir` is the recorded cgroup, verified; `fd` is an open
                  descriptor of it (the caller owns it)
        removed   proven gone (`how` says how); nothing to signal
        refused   not the run's cgroup, or not ours to touch (`reason`)
        unseen    cannot be told from here (`reason`): never read as removed
    """

    __slots__ = ("status", "dir", "hierarchy", "fd", "how", "reason", "notes")

    def __init__(self, status: str, *, dir: str | None = None, hierarchy: Hierarchy | None = None,
                 fd: int = -1, how: str | None = None, reason: str | None = None) -> None:
        self.status, self.dir, self.hierarchy, self.fd = status, dir, hierarchy, fd
        self.how, self.reason = how, reason
        self.notes: list[str] = []

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def shape_problem(d: str, run_id: str, base: str | None) -> str | None:
    """Why `d` cannot be the cgroup of run `run_id` for a process whose base
    is `base`, or None."""
    if base is None:
        return "this process has no cgroup v2 base: it acts on no cgroup"
    if not d.startswith(base.rstrip("/") + "/"):
        return f"{d} is outside this process's cgroup base {base} (CONTAIN_CGROUP_BASE)"
    comps = below(d, base).split(os.sep)
    bad = [c for c in comps if leaf_run_id(c) is None]
    if bad:
        return f"{d}: {bad[0]!r} is not named like one of our cgroups (run-<id>-<8 hex>, sub-<id>-<8 hex>)"
    if leaf_run_id(comps[-1]) != run_id:
        return f"{d} is named for run {leaf_run_id(comps[-1])!r}, not {run_id!r}"
    if os.path.realpath(d) != d and os.path.lexists(d):
        return f"{d} goes through a symbolic link"
    return None


def verify(ident: CgroupIdentity, *, run_id: str, base: str | None, run_key: str | None,
           run_uid: str | None, need_tag: bool) -> CgroupCheck:
    """Check a recorded identity against this process's view (module doc).
    `need_tag`: a live cgroup without the tag naming `run_key`/`run_uid` is
    refused (an adopter about to act, that could itself write tags: an
    absent tag is then a sign the cgroup was not made for the run); a tag
    naming another run is refused whatever `need_tag` says."""
    problem = shape_problem(ident.dir, run_id, base)
    if problem is not None:
        return CgroupCheck("refused", reason=problem)
    h = next((x for x in hierarchies() if x.mount == ident.mount), None)
    try:
        st = os.stat(ident.mount)
        same_view = h is not None and (_dev(st), st.st_ino) == (ident.dev, ident.mount_ino)
    except OSError:
        same_view = False
    if not same_view or h is None:
        return _from_elsewhere(ident)
    p = ident.mount
    for comp, ino in zip(below(ident.dir, ident.mount).split(os.sep), ident.chain):
        p = os.path.join(p, comp)
        try:
            st = os.stat(p, follow_symlinks=False)
        except FileNotFoundError:
            return CgroupCheck("removed", how=f"{p} no longer exists in the hierarchy the run was made in "
                               "(a cgroup is removed only when it has no member and no child, cgroup-v2.rst, "
                               "and a removed cgroup cannot be entered)")
        except OSError as e:
            return CgroupCheck("unseen", reason=f"{p}: {os.strerror(e.errno or 0)}")
        if (_dev(st), st.st_ino) != (ident.dev, ino):
            # cgroup2 cannot rename a cgroup: a directory of that name with
            # another inode means the recorded one was removed from here.
            c = CgroupCheck("removed", how=f"{p} is another cgroup now (inode {st.st_ino}, recorded {ino}): "
                            "the recorded one was removed")
            c.notes.append(f"a look-alike cgroup sits at {p}: left alone")
            return c
    try:
        fd = os.open(ident.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return CgroupCheck("unseen", reason=f"{ident.dir}: {os.strerror(e.errno or 0)}")
    st = os.fstat(fd)
    if (_dev(st), st.st_ino) != (ident.dev, ident.ino):
        os.close(fd)
        return CgroupCheck("unseen", reason=f"{ident.dir} changed while it was verified")
    check = CgroupCheck("live", dir=ident.dir, hierarchy=h, fd=fd)
    tag = _tags.read(ident.dir, _tags.CGROUP_TAG)
    if tag.value is not None and (tag.value.get("run_dir"), tag.value.get("run_uid")) != (run_key, run_uid):
        check.close()
        return CgroupCheck("refused", reason=f"{ident.dir} was made for another run (run directory "
                           f"{tag.value.get('run_dir')}, run uid {tag.value.get('run_uid')})")
    if tag.value is None and tag.supported and need_tag:
        check.close()
        return CgroupCheck("refused", reason=f"{ident.dir} carries no tag naming this run: not made for it")
    if tag.value is None:
        check.notes.append(f"{ident.dir}: not verified by its tag ({tag.why})")
    return check


def _from_elsewhere(ident: CgroupIdentity) -> CgroupCheck:
    """This process does not see the hierarchy through the mount the run was
    made in. Only the kernel can still say whether the cgroup exists: a
    handle of its id (open_by_handle_at, which needs CAP_DAC_READ_SEARCH)
    through any mount of the same superblock."""
    view = f"the run's cgroup {ident.dir} was made through {ident.mount} (superblock {ident.dev}); " \
           "this process sees another hierarchy or another part of it there (mount or cgroup namespace)"
    mount = None
    for h in hierarchies():
        try:
            if _dev(os.stat(h.mount)) == ident.dev:
                mount = h.mount
                break
        except OSError:
            continue
    if mount is None:
        return CgroupCheck("unseen", reason=view + ", and no mount of that superblock")
    alive = cgroup_id_alive(mount, ident.ino)
    if alive is False:
        return CgroupCheck("removed", how=f"cgroup id {ident.ino} no longer resolves "
                           "(open_by_handle_at: ESTALE): the cgroup was removed")
    if alive is True:
        return CgroupCheck("unseen", reason=view + ": it still exists (open_by_handle_at), "
                           "but cannot be reached from here")
    return CgroupCheck("unseen", reason=view)


def cgroup_id_alive(mount: str, cgroup_id: int) -> bool | None:
    """Whether the cgroup with this id exists (True), was removed (False),
    or cannot be told (None: no privilege, no handle support)."""
    if os.geteuid() != 0:
        return None
    import ctypes          # lazy: only an adopter in another view gets here
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    try:
        mfd = os.open(mount, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fh = ctypes.create_string_buffer(struct.pack("=Ii", 8, FILEID_KERNFS) + struct.pack("<Q", cgroup_id))
        fd = libc.open_by_handle_at(mfd, fh, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if fd >= 0:
            os.close(fd)
            return True
        return False if ctypes.get_errno() == errno.ESTALE else None
    finally:
        os.close(mfd)


class Detached:
    """The container of an adopted run whose cgroup is not attached: proven
    removed (`removed`, empty, nothing to signal), or not verified (then
    every observation fails with the reason and nothing is signalled, so the
    stop is UNCONFIRMED, never terminal). Either way nothing here touches a
    cgroup: the recorded path may now hold a look-alike."""

    backend = "cgroup2"
    dir = None
    leaf = None
    hierarchy = None
    events_fd = -1
    seal_detail = None
    identity = None
    vouched: str | None = None     # set by a lead that finishes its nested run (_adopt.finish_nested)
    empty_via = "cgroup.events populated"

    def __init__(self, path: str | None, *, removed: str | None = None, reason: str | None = None) -> None:
        self.path = path                  # as recorded: for the record only
        self.removed, self.reason = removed, reason
        self.empty_proof = removed or ""
        self.wall: Any = None             # a PID-namespace wall, observed on its own (pidwall.adopt)
        self.wall_gone = False
        self.wall_unknown: str | None = None
        self.also_killed: str | None = None

    def adopt_wall(self, desc: dict[str, Any]) -> None:
        from . import pidwall

        self.wall, self.wall_gone, self.wall_unknown = pidwall.adopt(desc)
        if self.removed is not None:
            self.empty_proof = f"{self.removed}, and {pidwall.PROOF}"

    def _refuse(self) -> OSError:
        return OSError(errno.ESTALE, f"not attached: {self.reason}")

    def sources(self) -> list[Any]:
        return self.wall.sources() if self.wall is not None else []

    def drain(self, ready: Any) -> None:
        if self.wall is not None:
            self.wall.drain(ready)

    def root(self, sp: Any) -> Any:
        raise self._refuse()

    def unleavable(self) -> str | None:
        from . import pidwall

        return pidwall.UNLEAVABLE if self.wall is not None or self.wall_gone else None

    def walls(self) -> list[dict[str, Any]]:
        from . import pidwall

        out: list[dict[str, Any]] = [{"kind": "cgroup", "path": self.path,
                                      "observed_empty": True if self.removed else None,
                                      "via": self.removed or f"not attached: {self.reason}"}]
        return out + pidwall.wall_records(self.wall, self.wall_gone, self.wall_unknown)

    def owns(self, pid: int) -> bool:
        return False

    def populated(self) -> bool:
        if self.removed is None:
            raise self._refuse()
        if self.wall_unknown and not self.vouched:
            raise OSError(errno.ENOENT, self.wall_unknown)
        return self.wall is not None and not self.wall.empty()

    def wait_change(self, timeout: float) -> None:
        import time

        time.sleep(min(timeout, 0.05))

    def members(self) -> list[int]:
        return []

    def terminate(self, sig: int = 15) -> tuple[str, dict[str, Any]]:
        if self.removed is None:
            raise self._refuse()
        if self.wall is not None:
            return self.wall.terminate(sig)
        return "nothing to signal: the cgroup was removed", {"signalled": 0, "failed": 0}

    def kill(self) -> str:
        if self.removed is None:
            raise self._refuse()
        if self.wall is not None:
            return self.wall.kill()
        return "nothing to kill: the cgroup was removed"

    def placed(self, pid: int) -> None:
        return None

    def escape_evidence(self) -> dict[str, Any]:
        return {"observed": None, "at": None, "via": "none",
                "detail": "no fork ledger: a process that left the cgroup would not be seen"}

    def cpu_stat(self) -> None:
        return None

    def remove(self) -> str | None:
        return None if self.removed is not None else f"not removed: {self.reason}"
