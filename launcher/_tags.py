"""Tags: what a later owner may act on, kept where the worker cannot rewrite it.

run.json and record.json describe a run to its readers, and a worker that
can write its run directory can rewrite both (issue 10: a worker rewrote
run.json to name a victim cgroup, killed its supervisor, and root's
`contain cancel` killed the victim). So what an adopter *acts on* (which
cgroup to kill, which processes to signal, whether the run was sealed) is
also kept by the supervisor in an extended attribute:

    RUN_TAG     on the run directory (state dir): the run uid, the cgroup's
                identity, the worker's identity, its process group, the
                members seen (degraded mode), the seal
    CGROUP_TAG  on the run's cgroup directory: which run directory (dev:ino)
                and run uid the cgroup was made for

A root supervisor writes them in the `trusted.` namespace: setting, changing
or removing a `trusted.` attribute needs CAP_SYS_ADMIN in the initial user
namespace (xattr(7); `capable()` in fs/xattr.c), which no process inside a
user namespace has, whatever its uid, and no `--user` worker has. A worker
that replaces the whole directory makes one without the tag, which an
adopter reads as "not to be trusted", never as "nothing to do".

A non-root supervisor uses `user.`, which any writer of the directory may
set, its own worker included. That worker is walled in a PID namespace and
could not signal anything outside it, so a rewritten tag can make the
adopter do what the worker could not (name another run's init, which is pid
1 of a namespace too: tests/test_record_forgery.py, strict xfail). Such a worker
can rewrite everything in the state directory, so nothing there binds it;
only hiding the state directory from it would.
"""
from __future__ import annotations

import errno
import os

from ._jsonenc import dumps
from ._runfiles import loads

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

RUN_TAG = "contain.run"
CGROUP_TAG = "contain.cgroup"
MAX_BYTES = 3500        # one ext4 xattr block holds about 4 KB (the inode's other xattrs included)
MAX_MEMBERS = 100       # member identities kept in RUN_TAG; `more` says when some were left out


def prefix() -> str:
    """The namespace this process writes and trusts."""
    return "trusted." if hasattr(os, "geteuid") and os.geteuid() == 0 else "user."   # (Windows: no xattrs at all)


def dir_key(path: str) -> str | None:
    """A run directory's identity ("dev:ino"), or None if it cannot be read."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


def write(path: str, name: str, value: dict[str, Any], data: bytes | None = None) -> str | None:
    """Set a tag on `path` (never through a symlink). None, or why not.
    `data`: `value` already encoded (compact), by a caller that had to."""
    if data is None:
        data = dumps(value, compact=True).encode()
    if len(data) > MAX_BYTES:
        return f"tag {name} on {path}: {len(data)} bytes, more than {MAX_BYTES}"
    try:
        os.setxattr(path, prefix() + name, data, follow_symlinks=False)
    except (OSError, AttributeError) as e:      # AttributeError: no xattrs on this platform
        why = os.strerror(e.errno or 0) if isinstance(e, OSError) else "no extended attributes here"
        return f"tag {prefix()}{name} on {path}: {why}"
    return None


def remove(path: str, name: str) -> None:
    """Remove a tag of ours from `path` (never through a symlink), if any."""
    try:
        os.removexattr(path, prefix() + name, follow_symlinks=False)
    except (OSError, AttributeError):
        pass


class TagRead:
    """One tag as read: `value` (a dict) or None; when None, `supported`
    says whether the file system could hold one (an absent tag where this
    process could have written one, `can_write`, is evidence of tampering),
    and `why` says what happened."""

    __slots__ = ("value", "supported", "why")

    def __init__(self, value: dict[str, Any] | None, supported: bool, why: str | None) -> None:
        self.value, self.supported, self.why = value, supported, why


def read(path: str, name: str) -> TagRead:
    if not hasattr(os, "getxattr"):        # Windows: no xattrs (and no geteuid for the prefix)
        return TagRead(None, False, "no extended attributes on this platform")
    full = prefix() + name
    try:
        data = os.getxattr(path, full, follow_symlinks=False)
    except AttributeError:
        return TagRead(None, False, "no extended attributes on this platform")
    except OSError as e:
        if e.errno == errno.ENODATA:
            return TagRead(None, True, f"{path} carries no {full}")
        if e.errno in (errno.EOPNOTSUPP, errno.EPERM):
            return TagRead(None, False, f"{full} on {path}: {os.strerror(e.errno)}")
        return TagRead(None, True, f"{full} on {path}: {os.strerror(e.errno or 0)}")
    try:
        value = loads(data, full)
    except ValueError:
        return TagRead(None, True, f"{full} on {path} is not JSON")
    if not isinstance(value, dict):
        return TagRead(None, True, f"{full} on {path} is not an object")
    return TagRead(value, True, None)


def can_write(path: str) -> bool:
    """Whether this process may set tags on `path` (a directory it owns the
    run of): a probe attribute is set and removed. A root process in a user
    namespace may not (EPERM), and neither could the supervisor next to it."""
    probe = prefix() + "contain.probe"
    try:
        os.setxattr(path, probe, b"1", follow_symlinks=False)
    except (OSError, AttributeError):
        return False
    try:
        os.removexattr(path, probe, follow_symlinks=False)
    except OSError:
        pass
    return True


def still_alive(run_dir: str) -> str | None:
    """For a reader of a final record: which process the run's tag names
    (the wall's init, the worker, by pid + start time) is alive now, or
    None. An owner writes its final record only once its container was
    observed empty, so a live one means the record is not the owner's (a
    worker that can write its run directory wrote it). This only ever makes
    a reader more cautious: a forged tag can make it say "not final" about
    the forger's own run, never "final"."""
    from ._identity import boot_id
    from ._procfs import read_stat

    v = read(run_dir, RUN_TAG).value
    if v is None or v.get("boot_id") != boot_id():
        return None
    wall = v.get("wall")
    init = wall.get("init") if isinstance(wall, dict) else None
    for what, ident in (("the PID namespace's init", init), ("the worker", v.get("worker"))):
        if not isinstance(ident, dict):
            continue
        pid, start = ident.get("pid"), ident.get("start_time")
        if not isinstance(pid, int) or not isinstance(start, int) or pid <= 0:
            continue
        st = read_stat(pid)
        # A zombie is not alive: an init's exit waits for every member of
        # its namespace to be gone (zap_pid_ns_processes), and a zombie
        # waits only for its new parent to reap it.
        if st is not None and st[4] == start and st[0] not in ("Z", "X"):
            return f"{what} (pid {pid}) is still alive"
    return None


class RunTag:
    """The run directory's tag, kept by the owner: fields are changed with
    `update`, which rewrites the tag only when something changed."""

    def __init__(self, run_dir: str, value: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.key = dir_key(run_dir)       # what the cgroup's own tag names
        self.value = dict(value)
        self.problem: str | None = None
        self._written: bytes | None = None

    def update(self, **fields: Any) -> str | None:
        self.value.update(fields)
        # One encoding, sorted: what is compared is what is written.
        data = dumps(self.value, compact=True, sort_keys=True).encode()
        if data == self._written:
            return self.problem
        self.problem = write(self.run_dir, RUN_TAG, self.value, data)
        if self.problem is None:
            self._written = data
        return self.problem

    def current(self) -> bool:
        """Whether the value as it stands is on disk (the value changes only
        through update, which writes it or keeps the problem)."""
        return self.problem is None and self._written is not None
