"""The seal: the tree's host credentials cannot act outside its containers.

`sealed: true` only when (CONTRACT.md, docs/sealing.md) the tree has no host
root, `no_new_privs`, no capabilities (the bounding set emptied), cannot
signal anything outside (the PID-namespace wall: nothing outside has a pid
it can name), and has no write access to the state directory or to anything
the supervisor runs or reads. A user namespace that maps 0 to host 0 keeps
host root (DAC checks and signal permissions compare kuids): it is not a
seal (KERNEL-NOTES.md, 2026-12-01).

How a root supervisor seals a run:
- `--seal`: the worker is root *inside* a user namespace whose 0 maps to an
  unprivileged host uid: `--user`'s, or a per-run uid from DYNAMIC_FIRST to
  DYNAMIC_LAST (the range systemd's DynamicUser= uses), claimed for the run
  so two live runs never share one;
- `--user USER`: the worker runs as USER on the host, with no_new_privs and
  no capabilities; sealed when USER is not root and may write no
  cgroup.procs above the run.
Either way the run is behind the PID-namespace wall, which a seal needs (a
uid shared with processes outside could signal them without it).
"""
from __future__ import annotations

import errno
import os
import stat
import sys
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Iterable

DYNAMIC_FIRST, DYNAMIC_LAST = 61184, 65519
# Claims of dynamic uids are the host's, not one state directory's: two root
# supervisors with different state directories must never hand out the same
# host uid (a uid is checked free only against live processes, and a claimed
# one has none until its worker starts). /run is a tmpfs emptied at boot, as
# claims should be. Where it cannot be made (no /run, read-only), the state
# directory's own `dynamic-uids` is used, and only runs of that state
# directory are kept apart (docs/sealing.md says so).
CLAIMS_HOST = "/run/contain-uids"
CLAIMS = "dynamic-uids"          # the fallback, in the (root) state directory: one file per claimed uid
_CLAIM_STALE_S = 60.0            # a claim older than this whose uid no process has is free
_CLAIMS_WAIT_S = 10.0            # how long a claim waits for another's lock of the claims directory


def _uids_in_use() -> set[int]:
    """Every real, effective, saved and filesystem uid of a live process."""
    used: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        used.update(int(x) for x in line.split()[1:])
                        break
        except (OSError, ValueError):
            continue
    return used


def _is_account(uid: int) -> bool:
    """Whether `uid` (or the gid of that number) names a user or group of
    this host (NSS, as systemd's dynamic users check): one that has no
    process now is only logged out. A sealed worker with its uid could
    write its files, and it, once back, could signal or trace the tree."""
    import grp
    import pwd

    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            continue
        except OSError:
            return True       # NSS could not answer: not known to be free
    return False


def _claims_dir(state_dir: str) -> str:
    """Where claims live: the host's directory, else the state directory's."""
    try:
        os.mkdir(CLAIMS_HOST, 0o700)
    except FileExistsError:
        pass
    except OSError:
        d = os.path.join(state_dir, CLAIMS)
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        return d
    return CLAIMS_HOST


def claim_dynamic_uid(state_dir: str, run_id: str) -> tuple[int, str]:
    """A host uid for one sealed run, from the dynamic range: one no live
    process has, no account or group of this host names, and no recent
    claim names, in any state directory (CLAIMS_HOST). Returns (uid, claim path); the
    claim is removed when the run ends (release_claim). Claims are made
    under an flock of the claims directory, so two supervisors never take
    the same one. Raises OSError when none is free, or when the lock was
    held by another for _CLAIMS_WAIT_S (a stopped claimer, or a fork of
    one, must not wedge every later sealed run: a blocking flock waited for
    ever, deaf to SIGTERM)."""
    import fcntl

    d = _claims_dir(state_dir)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise OSError(errno.EPERM, f"{d}: not a private directory of this user")
        deadline = time.monotonic() + _CLAIMS_WAIT_S
        while True:
            try:
                fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(errno.EAGAIN, f"{d}: another claim held its lock for "
                                  f"{_CLAIMS_WAIT_S:.0f} s") from None
                time.sleep(0.01)
        used = _uids_in_use()
        now = time.time()
        claimed: set[int] = set()
        for name in os.listdir(dfd):
            if not name.isdigit():
                continue
            uid = int(name)
            try:
                age = now - os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime
            except OSError:
                continue
            if uid in used or age < _CLAIM_STALE_S:
                claimed.add(uid)
            else:
                os.unlink(name, dir_fd=dfd)       # stale: nothing runs with it any more
        span = DYNAMIC_LAST - DYNAMIC_FIRST + 1
        start = int.from_bytes(os.urandom(4), "little") % span     # (not `random`: 1 ms of imports)
        for i in range(span):
            uid = DYNAMIC_FIRST + (start + i) % span
            if uid in used or uid in claimed or _is_account(uid):
                continue
            fd = os.open(str(uid), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=dfd)
            try:
                os.write(fd, run_id.encode() + b"\n")
            finally:
                os.close(fd)
            return uid, os.path.join(d, str(uid))
        raise OSError(errno.EUSERS, f"no free uid in {DYNAMIC_FIRST}-{DYNAMIC_LAST}")
    finally:
        try:
            fcntl.flock(dfd, fcntl.LOCK_UN)   # not only close: a fork's copy of dfd would keep it
        except OSError:
            pass
        os.close(dfd)


def release_claim(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def writable_places(uid: int, gids: Iterable[int], paths: Iterable[str]) -> list[str]:
    """Which of `paths` (and the directories above them) `uid` could change:
    write the file, or replace it through a directory above it (a sticky
    directory protects entries it does not own). Each path is looked at
    once (a sealed run checks some 2,000)."""
    gids = set(gids)
    found: list[str] = []
    seen: set[str] = set()
    stat_, dirname, isdir, sticky = os.stat, os.path.dirname, stat.S_ISDIR, stat.S_ISVTX
    for p in paths:
        cur = p if p.startswith("/") and "/." not in p and "//" not in p else os.path.abspath(p)
        first = True
        while cur not in seen:
            seen.add(cur)
            try:
                st = stat_(cur)
            except OSError:
                break
            mode = st.st_mode
            if st.st_uid == uid:
                w = mode & 0o200
            elif st.st_gid in gids:
                w = mode & 0o020
            else:
                w = mode & 0o002
            if w and (first or not (isdir(mode) and mode & sticky)):
                found.append(cur)
            parent = dirname(cur)
            if parent == cur:
                break
            cur, first = parent, False
    return found


# Modules outside the launcher package that it names in an import statement
# (often inside a function, so imported only once needed: after the spawn,
# at the stop, for a record). tests/test_seal.py holds this list to the
# package's import statements. Not imported here (that would cost every
# sealed run the start-up the lazy imports save): each is found as the import
# system would find it and its files are checked.
LATER_IMPORTS = (
    "_json", "_signal", "_socket", "_thread", "anyio", "argparse", "asyncio", "calendar", "cffi", "collections",
    "contextlib", "ctypes", "enum", "errno", "fcntl", "gc", "grp", "hashlib", "heapq", "importlib", "io", "locale",
    "itertools", "json", "math", "numbers", "os", "pathlib", "platform", "posixpath", "pwd", "pyroute2",
    "re", "resource", "secrets", "select", "selectors", "shlex", "shutil", "signal", "socket", "stat",
    "struct", "subprocess", "sys", "sysconfig", "tempfile", "termios", "textwrap", "threading", "time",
    "traceback", "types", "typing", "warnings", "weakref",
)
# Named by the package but never loaded on Linux (its Windows backend).
NOT_ON_THIS_PLATFORM = ("_winapi", "msvcrt")


def _tree(top: str) -> list[str]:
    """Every directory and file under `top` (not following links: a link is
    checked where it points by os.stat, and its directory as a directory)."""
    out = [top]
    for d, dirs, files in os.walk(top):
        out.extend(os.path.join(d, x) for x in dirs + files)
    return out


def _mapped_files() -> list[str]:
    """Every file mapped executable into this process (/proc/self/maps): the
    interpreter, libpython, libc, each extension module. The next
    supervisor runs them too. (Data a library caller maps is not code.)"""
    out: set[str] = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and "x" in parts[1] and parts[5].startswith("/"):
                    path = parts[5].rstrip("\n")
                    if not path.endswith(" (deleted)"):
                        out.add(path)
    except OSError:
        pass
    return sorted(out)


def _module_files() -> list[str]:
    """The source and cache file of every module loaded now."""
    out: list[str] = []
    for m in list(sys.modules.values()):
        for attr in ("__file__", "__cached__"):
            f = getattr(m, attr, None)
            if isinstance(f, str) and f:
                out.append(f)
    return out


def _later_files() -> list[str]:
    """The files of LATER_IMPORTS not loaded yet, as the import system would
    find them now (a package: every file in it), and every top-level entry
    of each directory on the module path (a module a later import reaches
    in its turn is most often one of those)."""
    from importlib.machinery import PathFinder

    out: list[str] = []
    for name in LATER_IMPORTS:
        if name in sys.modules:
            continue
        try:
            spec = PathFinder.find_spec(name)       # no import: only where it would come from
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                out.extend(_tree(loc))
        elif spec.origin and os.path.isabs(spec.origin):
            out.append(spec.origin)
    for d in sys.path:
        if d and os.path.isdir(d):
            try:
                out.extend(os.path.join(d, x) for x in os.listdir(d))
            except OSError:
                continue
    return out


def supervisor_paths(state_dir: str | None) -> list[str]:
    """What the supervisor runs or reads, now or after the spawn: its
    interpreter and every file mapped into it; every file and directory of
    the launcher package (it imports most of its own modules lazily);
    every module loaded, and where each module the package names would be
    found (LATER_IMPORTS); every top-level entry of the module path and the
    path's directories; and the state directory (the one given, else where
    this process keeps its runs: _statedir.location). A file is as good as
    its directories, which writable_places checks with it."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [sys.executable, os.path.realpath(sys.executable)] + _tree(here)
    paths += [p for p in sys.path if p and os.path.isdir(p)]
    paths += _mapped_files() + _module_files() + _later_files()
    if not state_dir:
        from .._statedir import location

        try:
            state_dir = location()
        except OSError:            # StateDirError: then no run gets this far
            state_dir = None
    if state_dir:
        paths.append(state_dir)
    return paths


CHECKED = ("interpreter and every file mapped into the supervisor, every file and directory of the launcher "
           "package, every module loaded and every module the package imports later (as found now; a "
           "package: all its files), each entry of the module path, state directory")


def check(uid: int, gids: Iterable[int], state_dir: str | None, *, wall: bool, no_new_privs: bool,
          no_caps: bool) -> tuple[bool, str | None, dict[str, Any]]:
    """(sealed, why not, what was checked) for a tree whose host uid is `uid`."""
    detail: dict[str, Any] = {"host_uid": uid, "no_new_privs": no_new_privs,
                              "capabilities": "none (bounding set emptied)" if no_caps else "kept",
                              "pid_namespace": wall}
    if uid == 0:
        return False, "the tree is root on the host", detail
    if not (no_new_privs and no_caps):
        return False, "the tree keeps capabilities or may gain privileges (no_new_privs unset)", detail
    if not wall:
        return False, (f"no PID-namespace wall: uid {uid} could signal processes outside that share it"), detail
    writable = writable_places(uid, gids, supervisor_paths(state_dir))
    detail["checked_not_writable"] = CHECKED
    if writable:
        detail["writable"] = writable[:10]
        return False, f"uid {uid} may write {writable[0]}, which the supervisor runs or reads", detail
    return True, None, detail


# -- what a cgroup2 run asks for, and what it got (linux.Container) -----------------

def prepare(c: Any, req: Any, opts: Any) -> None:
    """The seal when asked (sealing.py, docs/sealing.md). `--user` alone
    also gets no_new_privs and no capabilities; `--seal` (root only)
    makes the worker root inside a user namespace whose 0 is an
    unprivileged host uid, behind the wall."""
    c.seal_detail = c.seal_error = c.seal_uid = c.uid_claim = None
    c.state_dir = getattr(opts, "state_dir", None)
    if req.uid >= 0 or opts.seal:
        # A session of its own, so no controlling terminal: a worker that
        # shared the caller's could push input into it with TIOCSTI
        # (dev.tty.legacy_tiocsti, on by default before 6.2 and here), which
        # the caller's root shell reads once contain returns. Without it as
        # the controlling terminal TIOCSTI needs CAP_SYS_ADMIN (tty_io.c
        # tiocsti), and TIOCSCTTY cannot take it from the caller's session.
        req.new_session = True
    if req.uid >= 0:
        req.clear_caps = req.no_new_privs = True
    if not opts.seal:
        return
    if os.geteuid() != 0:
        c.seal_error = ("--seal needs a root supervisor (only root can map the worker to another "
                        "uid); run contain as root, or leave out --seal")
        return
    if c.wall_mode is False:
        c.seal_error = "--seal needs the PID-namespace wall: leave out --no-pidns"
        return
    if req.uid >= 0:
        uid, gid = req.uid, (req.gid if req.gid >= 0 else req.uid)
    else:
        from .._statedir import location

        c.state_dir = c.state_dir or location()
        uid, c.uid_claim = claim_dynamic_uid(c.state_dir, c.run_id)
        gid = uid
    # Root inside, `uid` outside: the init becomes 0 in the namespace once
    # the maps are written, and the worker keeps that (no setuid inside).
    req.uid = req.gid = -1
    req.groups = []
    c.seal_uid = uid
    from . import pidwall

    pidwall.shape(req, True, userns="map", uid_map=f"0 {uid} 1", gid_map=f"0 {gid} 1")


def status(c: Any, req: Any, above: str | None) -> tuple[bool, str | None]:
    """Whether the tree's host credentials cannot act outside the run
    (CONTRACT.md "sealed"), with what was checked (`seal_detail`). `above`:
    a cgroup.procs above the run that the worker's uid may write, if any."""
    walled = c.wall is not None
    if req.userns == "map" and c.seal_uid is not None:
        ok, why, detail = check(c.seal_uid, [c.seal_uid], c.state_dir, wall=walled,
                                no_new_privs=req.no_new_privs, no_caps=req.clear_caps)
        c.seal_detail = dict(detail, method="user namespace mapped to an unprivileged host uid",
                             uid_in_namespace=0, dynamic=c.uid_claim is not None)
        return ok, why
    uid = req.uid if req.uid >= 0 else os.geteuid()
    if uid == 0:
        c.seal_detail = None
        why = "worker runs as root"
        if not c.hierarchy.nsdelegate:
            why += " on a cgroup2 mount without nsdelegate"
        c.can_move_out = why + ": it could write its pid into another cgroup.procs (or a v1 tasks file)"
        return False, why + ": it could write its pid into another cgroup.procs (use --seal or --user)"
    if above is not None:
        c.seal_detail = None
        advice = "use --seal or --user" if os.geteuid() == 0 else "preventing that needs a root supervisor"
        c.can_move_out = f"worker uid {uid} may write {above}: it could move itself out"
        return False, f"worker uid {uid} may write {above}: it could move itself out ({advice})"
    gids = sorted({req.gid, *req.groups} - {-1}) if req.uid >= 0 else sorted({os.getegid(), *os.getgroups()})
    ok, why, detail = check(uid, gids, c.state_dir, wall=walled,
                            no_new_privs=req.no_new_privs, no_caps=req.clear_caps)
    c.seal_detail = dict(detail, method="unprivileged-uid", uid=uid,
                         checked="no cgroup.procs above the run is writable by this uid") if ok else None
    return ok, why
