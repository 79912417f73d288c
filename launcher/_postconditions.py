"""Postconditions beyond the container: the workspace, the sockets, the locks.

An empty container proves that no member process is left. It says nothing
about a descriptor handed to a process outside (over a unix socket, or by an
escaper), about a socket or a file lock kept alive by such a holder, or about
writes still in flight. These layers look at exactly that, each on its own.
The locks layer lives in _locks.py (its own parser of /proc/locks); it is
re-exported here so the driver finds every postcondition in one place.
`redispatch_eligible` (_redispatch.py) is derived from all of them.
"""
from __future__ import annotations

import errno
import os
import select
import socket
import time
from typing import Any, Iterable

from ._locks import HeldLocks as HeldLocks, locks_released as locks_released
from ._record import evidence
from ._redispatch import POSTCONDITIONS as POSTCONDITIONS


def _links(pid: str) -> Iterable[tuple[str, str]]:
    """(how, target) for the cwd, root and every fd of one process."""
    for how in ("cwd", "root"):
        try:
            yield how, os.readlink(f"/proc/{pid}/{how}")
        except OSError:
            continue
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return
    for fd in fds:
        try:
            yield f"fd {fd}", os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue


def socket_inodes(pids: Iterable[int]) -> tuple[set[int], list[str]]:
    """Socket inodes held by these processes, and what could not be read."""
    found: set[int] = set()
    problems: list[str] = []
    my_net = _netns("self")
    for pid in pids:
        if _netns(str(pid)) not in (my_net, None):
            problems.append(f"pid {pid} is in another network namespace")
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue
        except PermissionError:
            problems.append(f"pid {pid}: fd list not readable")
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                found.add(int(target[8:-1]))
    return found, problems


def _netns(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def live_socket_inodes(cgroups: frozenset[int] = frozenset()) -> tuple[set[int], set[int]]:
    """Every inet (TCP, UDP) and unix socket in this network namespace, by
    sock_diag (pyroute2), and those inet sockets, open in some process, that
    were made in one of `cgroups` (INET_DIAG_CGROUP_ID: the cgroup v2 id the
    kernel stamps on a socket at its creation, Linux 5.7). Raises OSError
    when the kernel will not answer."""
    from pyroute2.netlink.diag import DiagSocket

    out: set[int] = set()
    made_in: set[int] = set()
    with DiagSocket() as ds:
        ds.bind()
        for fam in (socket.AF_INET, socket.AF_INET6):
            for proto in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
                for s in ds.get_sock_stats(family=fam, protocol=proto, states=0xFFF):
                    ino = int(s.get("idiag_inode"))
                    out.add(ino)
                    # Inode 0: no descriptor (TIME_WAIT, an orphan the kernel finishes).
                    if ino and cgroups and s.get_attr("INET_DIAG_CGROUP_ID") in cgroups:
                        made_in.add(ino)
        for s in ds.get_sock_stats(family=socket.AF_UNIX, states=0xFFF):
            out.add(int(s.get("udiag_ino")))
    return out, made_in


def cgroup_ids(top: str | None) -> frozenset[int]:
    """The ids of a cgroup v2 directory and every cgroup below it (a v2
    cgroup's id is its directory's inode number)."""
    ids: set[int] = set()
    stack = [top] if top else []
    while stack:
        d = stack.pop()
        try:
            ids.add(os.stat(d).st_ino)
            with os.scandir(d) as it:
                stack.extend(e.path for e in it if _is_dir(e))
        except OSError:
            continue
    return frozenset(ids)


def sockets_closed(before: set[int], problems: list[str], cgroups: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Whether every socket the tree held at the stop is gone now. sock_diag
    lists only the hashed TCP/UDP and the unix sockets: an unbound inet
    socket, a netlink, raw or packet one is open while any descriptor names
    it, so those are looked for in every process's fds too. `cgroups`: the
    run's v2 cgroups, checked once the container is empty: an inet socket
    made in one of them and still open is the tree's, wherever it went (one
    handed out before the stop is in no member's fds at the stop)."""
    via = "sock_diag (pyroute2), then /proc/*/fd, against socket inodes held by members at the stop"
    if cgroups:
        via += ", and inet sockets made in the run's cgroups (INET_DIAG_CGROUP_ID)"
    try:
        live, made_in = live_socket_inodes(cgroups)
        alive = (before & live) | made_in
    except Exception as e:  # pyroute2 raises its own NetlinkError as well as OSError
        return evidence(None, via, f"sock_diag failed: {e}")
    unseen = before - alive
    if unseen:
        held, denied = _sockets_in_any_fd(unseen)
        alive |= held
        if denied:
            problems = problems + [f"{denied} process(es) could not be inspected for the sockets sock_diag "
                                   "does not list"]
    if alive:
        return evidence(False, via, {"still_open": sorted(alive), "held_at_stop": len(before)})
    if problems:
        return evidence(None, via, {"unobservable": problems, "held_at_stop": len(before)})
    return evidence(True, via, {"held_at_stop": len(before)})


def _sockets_in_any_fd(inodes: set[int]) -> tuple[set[int], int]:
    """Which of these socket inodes some process's fd names, and how many
    processes could not be inspected."""
    from ._procfs import every_fd

    names = {f"socket:[{ino}]": ino for ino in inodes}
    found: set[int] = set()
    fds, denied = every_fd()                 # this process too: a library caller may hold one
    for pid, fd in fds:
        try:
            ino = names.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if ino is not None:
            found.add(ino)
    return found, denied


def workspace_quiescent(path: str, window: float = 0.2) -> dict[str, Any]:
    """No process anywhere holds DIR (cwd, root, open fd) and nothing under it
    changes for `window` seconds."""
    via = f"/proc/*/(cwd|root|fd) scan + inotify for {window} s"
    try:
        real = os.path.realpath(path)
    except OSError as e:
        return evidence(None, via, f"workspace not resolvable: {e}")
    if not os.path.isdir(real):
        return evidence(None, via, f"workspace {real} is not a directory")
    watch, unwatched = _watch_tree(real)
    holders: list[dict[str, Any]] = []
    denied = 0
    me = str(os.getpid())
    callers = _ancestors()
    prefix = real.rstrip("/") + "/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        try:
            for how, target in _links(pid):
                if how in ("cwd", "root") and pid in callers:
                    continue    # `cd ws && contain run --workspace .`: the caller's shell stands there
                if target == real or target.startswith(prefix):
                    holders.append({"pid": int(pid), "how": how, "path": target})
        except PermissionError:
            denied += 1
    changes = _drain(watch, window) if watch is not None else None
    if holders:
        return evidence(False, via, {"held_by": holders[:50]})
    if changes:
        return evidence(False, via, {"changes_in_window": changes})
    if watch is None:
        return evidence(None, via, "inotify unavailable: writes could not be watched")
    if unwatched:
        return evidence(None, via, {"not_watched": unwatched[:20],
                                    "why": "writes under these could not be seen"})
    if denied:
        return evidence(None, via, f"{denied} process(es) could not be inspected")
    return evidence(True, via, {"window_s": window})


def _ancestors() -> set[str]:
    """The pids above this process (its caller, the caller's shell, ...):
    their working directory is where the run was started from, not a hold
    of the run's. Their open files still count."""
    from ._procfs import read_stat

    out: set[str] = set()
    pid = os.getppid()
    while pid > 1 and str(pid) not in out and len(out) < 64:
        out.add(str(pid))
        st = read_stat(pid)
        if st is None:
            break
        pid = st[1]
    return out


# A directory removed (or replaced) since it was listed holds nothing to
# watch; recreating it is an event in its parent, watched before it.
_GONE = (errno.ENOENT, errno.ENOTDIR)


def _watch_tree(root: str, limit: int = 2000) -> tuple[int | None, list[str]]:
    """An inotify fd watching every directory under `root`, and what is not
    watched (past `limit` directories, unreadable, a failed watch): a write
    there would go unseen, so the layer cannot say true."""
    from ._native import lib

    fd = lib.ct_inotify_open()
    if fd < 0:
        return None, []
    mask = 0x2 | 0x4 | 0x8 | 0x40 | 0x80 | 0x100 | 0x200  # modify attrib close_write moved create delete
    unwatched: list[str] = []

    def unreadable(e: OSError) -> None:
        if e.errno not in _GONE:
            unwatched.append(f"{e.filename}: {os.strerror(e.errno or 0)}")

    # Our own stack, not os.walk: 3.11's os.walk recurses, and a worker
    # that nests directories deeper than the recursion limit in its
    # workspace (1,000 `mkdir a; cd a`) would raise out of the stop. Each
    # directory is watched before it is listed: a subdirectory made after
    # the listing is an event of the watched parent.
    n = 0
    stack = [root]
    while stack:
        d = stack.pop()
        if n >= limit:
            unwatched.append(f"{d} and any further directories: only {limit} are watched")
            break
        rc = lib.ct_inotify_watch(fd, os.fsencode(d), mask)   # names need not be UTF-8
        if rc >= 0:
            n += 1
        elif -rc not in _GONE:
            unwatched.append(f"{d}: inotify_add_watch: {os.strerror(-rc)}")
        try:
            with os.scandir(d) as it:
                subdirs = [e.path for e in it if _is_dir(e)]
        except OSError as e:
            unreadable(e)
            continue
        stack.extend(reversed(subdirs))
    return fd, unwatched


def _is_dir(e: os.DirEntry[str]) -> bool:
    try:
        return e.is_dir(follow_symlinks=False)     # a link is never descended into
    except OSError:
        return False


def _drain(fd: int, window: float) -> int:
    events = 0
    deadline = time.monotonic() + window
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                break
            try:
                data = os.read(fd, 65536)
                events += max(1, len(data) // 16)
            except BlockingIOError:
                continue
    finally:
        os.close(fd)
    return events


def measure(workspace: str | None, check_sockets: bool,
            sockets_at_stop: tuple[set[int], list[str]] | None,
            cgroup_dir: str | None = None) -> dict[str, dict[str, Any]]:
    """The postcondition layers a run asked for, measured once its tree is
    gone. `sockets_at_stop`: what the members held when the stop began
    (None if the container was already empty then). `cgroup_dir`: the run's
    v2 cgroup, still there (the inet sockets made in it are the tree's)."""
    layers: dict[str, dict[str, Any]] = {}
    if workspace:
        layers["workspace_quiescent"] = workspace_quiescent(workspace)
    if check_sockets:
        held, problems = sockets_at_stop if sockets_at_stop is not None else (set(), [])
        cgroups = cgroup_ids(cgroup_dir)
        layers["sockets_closed"] = layer = sockets_closed(held, problems, cgroups)
        if sockets_at_stop is None and isinstance(layer["detail"], dict):
            what = "unix sockets" if cgroups else "sockets"
            made = ": inet sockets made in the run's cgroups are found by their cgroup id" if cgroups else ""
            layer["detail"]["note"] = (f"the container was already empty when the stop began: {what} handed to "
                                       f"other processes before that are not known{made}")
    return layers
