"""Where cgroup v2 hierarchies are mounted, and where our run cgroups go.

Discovered from /proc/self/mountinfo and from what is writable, never
assumed: `/sys/fs/cgroup` on unified hosts, `/sys/fs/cgroup/unified` on
hybrid ones, a delegated subtree for a user, a pod's cgroup namespace.
"""
from __future__ import annotations

import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable

from .._errors import ContainmentUnavailable
from .._policy import policy_env
from .._procfs import below, cgroup_of, hierarchy_path, mount_path, mounts


class Hierarchy:
    """A cgroup2 mount this process can see (a class, not a namedtuple:
    see _procfs.Mount)."""

    __slots__ = ("mount", "root", "nsdelegate")

    def __init__(self, mount: str, root: str, nsdelegate: bool) -> None:
        self.mount = mount              # where the cgroup2 filesystem is mounted
        self.root = root                # the mount's root inside the hierarchy (mountinfo field 4)
        self.nsdelegate = nsdelegate

    def __repr__(self) -> str:
        return f"Hierarchy({self.mount!r}, {self.root!r}, {self.nsdelegate!r})"

    def fs_path(self, cg_path: str) -> str:
        return mount_path(cg_path, self.root, self.mount)

    def cg_path(self, fs_path: str) -> str:
        return hierarchy_path(fs_path, self.mount, self.root)


def hierarchies() -> list[Hierarchy]:
    """Every cgroup2 mount visible here, read from /proc/self/mountinfo. A
    mount over another at the same point hides it (`mount --bind` of a
    subtree over the hierarchy); mountinfo lists the upper one later."""
    found: dict[str, Hierarchy] = {}
    for m in mounts():
        if m.point in found:
            del found[m.point]         # covered, whatever the upper mount is
        if m.fstype == "cgroup2":
            found[m.point] = Hierarchy(m.point, m.root, "nsdelegate" in m.super_options)
    return list(found.values())


def cgroup_mounts() -> tuple[list[str], list[str]]:
    """(cgroup2 mount points, cgroup v1 mount points) from /proc/self/mountinfo,
    each without the points that sit below another of its kind (detaching
    or re-binding the upper one covers them)."""
    all_mounts = mounts()
    v2 = [m.point for m in all_mounts if m.fstype == "cgroup2"]
    v1 = [m.point for m in all_mounts if m.fstype == "cgroup"]

    def top(paths: list[str], above: list[str]) -> list[str]:
        out: list[str] = []
        for p in sorted(set(paths), key=len):
            if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out + above):
                out.append(p)
        return out

    v2 = top(v2, [])
    return v2, top(v1, v2)


def dev_of(st: os.stat_result) -> str:
    """A device as mountinfo spells it (major:minor of st_dev, proc(5))."""
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def identify(h: Hierarchy, base: str, d: str) -> dict[str, Any]:
    """The identity of a cgroup directory just created (run.json's
    `cgroup_identity`, and the run directory's tag), which an adopter
    verifies (cgattach.py): path, device, inode (the cgroup id), the mount
    it was made through, and the inode of each directory down to it."""
    rel = below(d, h.mount)
    chain = []
    p = h.mount
    for comp in rel.split(os.sep):
        p = os.path.join(p, comp)
        chain.append(os.stat(p, follow_symlinks=False).st_ino)
    st = os.stat(d, follow_symlinks=False)
    return {"dir": d, "cgroup": h.cg_path(d), "dev": dev_of(st), "ino": st.st_ino,
            "mount": h.mount, "mount_root": h.root, "mount_ino": os.stat(h.mount).st_ino,
            "base": base, "chain": chain}


def writable_procs_above(uid: int, gids: list[int] | tuple[int, ...], run_dir: str) -> str | None:
    """The first cgroup.procs above the run that `uid` (with `gids`) may
    write by its mode bits, or None. Moving a process needs write access to
    the common ancestor's cgroup.procs (cgroup-v2.rst, "Delegation
    Containment"), and every way out of the run has its common ancestor
    above the run. Root is not asked: it may write them all."""
    d = os.path.dirname(run_dir)
    while True:
        try:
            st = os.stat(os.path.join(d, "cgroup.procs"))
        except OSError:
            st = None
        if st is not None:
            if st.st_uid == uid:
                ok = bool(st.st_mode & 0o200)
            elif st.st_gid in gids:
                ok = bool(st.st_mode & 0o020)
            else:
                ok = bool(st.st_mode & 0o002)
            if ok:
                return os.path.join(d, "cgroup.procs")
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def run_suffix(uid: str | None) -> str:
    """The last part of a run's cgroup name: the run uid's first 8 hex
    digits (so that the cgroups of a supervisor killed before it tagged them
    can be found from its journal), else 8 random ones."""
    u = (uid or "")[:8]
    if len(u) == 8 and all(ch in "0123456789abcdef" for ch in u):
        return u
    return os.urandom(4).hex()


def run_cgroup_name(run_id: str, uid: str | None) -> str:
    """`run-<id>-<run_suffix(uid)>`: the v2 directory's name
    (linux.Container.create), and the run's v1 cgroups' beside it."""
    return f"run-{run_id}-{run_suffix(uid)}"


def _writable_dir(path: str) -> bool:
    return os.access(path, os.W_OK | os.X_OK) and os.access(os.path.join(path, "cgroup.procs"), os.W_OK)


def _make_dirs(path: str) -> list[str]:
    """mkdir -p, returning the directories this call made (top first)."""
    missing = []
    d = path
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    made = []
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o755)
            except FileExistsError:
                continue
            made.append(d)
    except OSError:
        remove_made(made)
        raise
    return made


def rmdir_known(dirs: list[str]) -> bool:
    """rmdir each of `dirs` (deepest first), stopping at the first that
    fails. True if all are gone: the usual end of a run, whose cgroups hold
    nothing but the leaves it made, without listing them first. False
    leaves the rest to the caller's walk of what is there (an EBUSY of a
    task still leaving, a child cgroup a worker made)."""
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            return False
    return True


# Set on a CONTAIN_CGROUP_V1_BASE a run made, so that the last run out of it
# removes it, whichever run that is, and an adopter too; a base that was
# there before has none. trusted.*: only CAP_SYS_ADMIN can set it (a local
# user cannot mark a cgroup for removal) or see it. Where it cannot be set
# (not root, no xattrs) only the run that made the base removes it.
MADE_MARK = "trusted.contain.base"


def mkdir_under(base: str, d: str, *, make_base: bool, mark: bool = False) -> bool:
    """mkdir `d` in `base`; with `make_base`, `base` too when it is missing,
    and again if the run that made it removed it as it ended, between the
    two mkdirs (at most three times); with `mark`, a base made here gets
    MADE_MARK. True if `base` was made here. Raises OSError."""
    made = False
    for attempt in range(3):
        if make_base:
            try:
                os.mkdir(base, 0o755)
                made = True
                if mark:
                    try:
                        os.setxattr(base, MADE_MARK, b"1")
                    except OSError:
                        pass
            except FileExistsError:
                pass
        try:
            os.mkdir(d, 0o755)
            return made
        except FileNotFoundError:
            if not make_base or attempt == 2:
                raise
    return made


def remove_bases(bases: list[tuple[str, bool]]) -> None:
    """rmdir each of `bases` (path, made here) that a run made (here, or
    carrying MADE_MARK) while it is empty: one that holds another run's
    cgroup stays (EBUSY), and that run removes it when it ends. Never one
    without either (there before any run, root's shared /contain, an outer
    run's cgroup)."""
    for b, made in bases:
        if not made:
            try:
                os.getxattr(b, MADE_MARK)
            except OSError:
                continue
        try:
            os.rmdir(b)
        except OSError:
            pass


def remove_made(made: list[str]) -> None:
    """Remove the base directories a run made, deepest first, while they are
    empty: one that holds another run's cgroup stays (rmdir says EBUSY)."""
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError:
            return


_host: tuple[int, list[Hierarchy], str] | None = None    # (pid that probed, cgroup2 mounts, own cgroup)


def host_view(refresh: bool = False) -> tuple[list[Hierarchy], str]:
    """(the cgroup2 mounts, this process's own cgroup v2 path), probed once
    per process (the owner's decision on issue 27: 0.15 ms of every run
    went to reading mountinfo and /proc/self/cgroup again) and again with
    `refresh`, which every caller asks for when what it built on them
    failed (Container.create: the base or the run cgroup could not be
    made, or is not a cgroup). A child of a fork probes for itself (it
    may have moved, or be in other namespaces); a process that moves
    itself (_leave_internal_position) forgets what it had."""
    global _host
    pid = os.getpid()
    if refresh or _host is None or _host[0] != pid:
        _host = (pid, hierarchies(), cgroup_of("self") or "/")
    return _host[1], _host[2]


def forget_host() -> None:
    global _host
    _host = None


def _choose_base(env: dict[str, str] | os._Environ[str], refresh: bool = False) -> tuple[Hierarchy, str, str]:
    """(hierarchy, base filesystem path, which rule chose it), with no side
    effect: CONTAIN_CGROUP_BASE if set ("explicit"); as root a `contain`
    directory under the mount ("root"); otherwise the caller's own cgroup
    ("own"). The mounts and own cgroup are host_view()'s."""
    hs, own = host_view(refresh)
    if not hs:
        raise ContainmentUnavailable("no cgroup v2 hierarchy is mounted")
    explicit = policy_env("CONTAIN_CGROUP_BASE", env)
    if explicit:
        for h in hs:
            if explicit == h.mount or explicit.startswith(h.mount.rstrip("/") + "/"):
                return h, os.path.normpath(explicit), "explicit"
        _not_elsewhere(explicit)
        return hs[0], hs[0].fs_path(explicit), "explicit"
    h = next((x for x in hs if own == x.root or own.startswith(x.root.rstrip("/") + "/")), hs[0])
    if os.geteuid() == 0:
        return h, os.path.join(h.mount, "contain"), "root"
    path = h.fs_path(own)
    if os.path.basename(path) == "supervisor" and _writable_dir(os.path.dirname(path)):
        # Our own leaf (_leave_internal_position): the base is the delegated
        # cgroup above it, for the second run of a process and for an adopter.
        path = os.path.dirname(path)
    return h, path, "own"


def _not_elsewhere(explicit: str) -> None:
    """A CONTAIN_CGROUP_BASE outside every cgroup2 mount is taken as a
    cgroup path inside the first hierarchy (`/ci/contain`): but one that
    names a place on another file system (a cgroup v1 hierarchy such as
    /sys/fs/cgroup/memory/x, or a directory that exists) was meant as that
    place, and silently became a nested v2 cgroup of the same name (issue
    31). Refused, with what it is."""
    best = None
    for m in mounts():
        if explicit == m.point or explicit.startswith(m.point.rstrip("/") + "/"):
            if best is None or len(m.point) >= len(best.point):
                best = m
    if best is None:
        return
    if best.fstype == "cgroup":
        ctl = ",".join(o for o in best.super_options if o not in ("rw", "ro")) or "named"
        raise ContainmentUnavailable(f"CONTAIN_CGROUP_BASE {explicit} is on a cgroup v1 hierarchy ({ctl} at "
                                     f"{best.point}); it must name a cgroup2 directory")
    if os.path.lexists(explicit) or best.point != "/":
        raise ContainmentUnavailable(f"CONTAIN_CGROUP_BASE {explicit} is on {best.fstype} at {best.point}, "
                                     "not on a cgroup2 mount")


def expected_base(env: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Where this process would put its runs (resolve_base without creating
    or moving anything), or None if it has no cgroup2 base at all. An
    adopter acts only on cgroups below it: probed afresh, off the run path."""
    try:
        return _choose_base(env, refresh=True)[1]
    except (ContainmentUnavailable, OSError):
        return None


def resolve_base(env: dict[str, str] | os._Environ[str] = os.environ,
                 made: list[str] | None = None, refresh: bool = False) -> tuple[Hierarchy, str]:
    """Choose where run directories go: (hierarchy, base filesystem path)
    (_choose_base says which rule applies). An explicit base that does not
    exist is made, and the directories made are added to `made` so that
    whoever asked removes them when its run ends (nothing `contain` creates
    is left behind); without `made` (a probe) nothing is created: a missing
    base is reported as such."""
    if not refresh:
        try:
            return _resolve(env, made, False)
        except (ContainmentUnavailable, OSError):
            pass                        # built on a probe that may be stale: probe again
    return _resolve(env, made, True)


def _resolve(env: dict[str, str] | os._Environ[str], made: list[str] | None,
             refresh: bool) -> tuple[Hierarchy, str]:
    h, path, how = _choose_base(env, refresh)
    if how == "explicit":
        if made is None:
            if not os.path.isdir(path):
                raise ContainmentUnavailable(f"CONTAIN_CGROUP_BASE {path} does not exist "
                                             "(a run makes it, and removes it when it ends)")
            mine: list[str] = []
        else:
            try:
                mine = _make_dirs(path)
            except OSError as e:
                raise ContainmentUnavailable(f"CONTAIN_CGROUP_BASE {path}: {os.strerror(e.errno or 0)}") from e
        if not _writable_dir(path):
            remove_made(mine)
            raise ContainmentUnavailable(f"CONTAIN_CGROUP_BASE {path} is not writable")
        if made is not None:
            made.extend(mine)
        return h, path
    if how == "root":
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        except OSError as e:
            raise ContainmentUnavailable(f"cannot create {path}: {os.strerror(e.errno or 0)}") from e
        return h, path
    if not _writable_dir(path):
        raise ContainmentUnavailable(f"own cgroup {h.cg_path(path)} is not delegated to uid {os.geteuid()}")
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
    forget_host()                   # our own cgroup is about to change
    with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def available() -> str | None:
    """None if a cgroup2 container can be made here, else the reason."""
    try:
        h, base = resolve_base()
    except ContainmentUnavailable as e:
        return e.reason
    except OSError as e:
        return str(e)
    return None


def kill_by_freezing(cg_dir: str, cg_path: str) -> str:
    """Before 5.14: freeze so nothing forks, SIGKILL each member (fatal
    signals reach frozen tasks), repeat until no member is left."""
    from .._native import ffi, lib

    freeze = os.path.join(cg_dir, "cgroup.freeze")
    with open(freeze, "w") as f:
        f.write("1")
    sent = ffi.new("int*")
    failed = ffi.new("int*")
    for _ in range(100):
        lib.ct_cgroup_signal_members(cg_dir.encode(), cg_path.encode(), 9, 0, sent, failed)
        if sent[0] == 0:
            break
    return "cgroup.freeze + SIGKILL per member"


def walk_dirs(top: str, onerror: Callable[[OSError], None] | None = None) -> list[str]:
    """`top` and every directory below it that could be listed, parents
    first, never through a symlink: the directories os.walk(top) yields, but
    with a stack of our own. 3.11's os.walk recurses, and a root worker that
    nests cgroups deeper than the recursion limit (1,000 `mkdir a; cd a` in
    its own cgroup) made the stop raise RecursionError: no record, the
    subtree left. `onerror` gets each failed listing's OSError, as os.walk's."""
    out: list[str] = []
    stack = [top]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                subs = [e.path for e in it if _real_dir(e)]
        except OSError as e:
            if onerror is not None:
                onerror(e)
            continue
        out.append(d)
        stack.extend(reversed(subs))
    return out


def _real_dir(e: os.DirEntry[str]) -> bool:
    try:
        return e.is_dir(follow_symlinks=False)
    except OSError:
        return False
