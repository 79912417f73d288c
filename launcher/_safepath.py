"""Reaching a directory by a path that may hold symlinks: each component
opened by its parent's fd (O_PATH|O_NOFOLLOW), a link followed only when its
owner is root or this user (the rule fs.protected_symlinks applies in sticky
directories, applied everywhere).

    check_ancestor(st, path)              a directory above ours: root's or ours, not writable by others
    open_ancestors(path)                  an fd of `path`, every component checked so
    open_dir_trusted_links(path, shown)   an fd of the directory `path` names (--record, --stats-json)
"""
from __future__ import annotations

import errno
import os
import stat

from ._safefs import O_DIR_PATH, UnsafePath, dir_error


def check_ancestor(st: os.stat_result, path: str) -> None:
    """A directory above ours: nobody but root or this user may rename or
    replace what is in it (owner root or us; writable by others only with
    the sticky bit, as /tmp)."""
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(path, "is not a directory", errno.ENOTDIR)
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafePath(path, f"is owned by uid {st.st_uid}: another user could replace what is in it")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(path, f"is writable by others without the sticky bit (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}): another user could replace what is in it")


def open_ancestors(path: str) -> int:
    """An O_PATH fd of directory `path`, resolved by the kernel once
    (realpath) and then walked from / one component at a time with
    O_NOFOLLOW, each component checked (check_ancestor). Trust is decided by
    the real directories, and a symlink on the way is followed only when it
    belongs to root or to us (_trusted_realpath)."""
    real = _trusted_realpath(path)
    fd = os.open("/", O_DIR_PATH)
    try:
        check_ancestor(os.fstat(fd), "/")
        walked = ""
        for comp in real.split("/"):
            if not comp:
                continue
            walked += "/" + comp
            try:
                nfd = os.open(comp, O_DIR_PATH, dir_fd=fd)
            except OSError as e:
                raise dir_error(e, walked, fd, comp) from None
            os.close(fd)
            fd = nfd
            check_ancestor(os.fstat(fd), walked)
    except BaseException:
        os.close(fd)
        raise
    return fd


def link_trusted(link: os.stat_result, parent: os.stat_result, euid: int) -> bool:
    """Whether a symlink may be followed: it is root's or ours, or it sits in
    a directory of root's or ours that nobody else may write (its owner
    cannot re-point it there: replacing a link needs write access to the
    directory). fs.protected_symlinks' idea, kept whatever the sysctl says."""
    if link.st_uid in (0, euid):
        return True
    return parent.st_uid in (0, euid) and not parent.st_mode & 0o022


def _trusted_realpath(path: str) -> str:
    """realpath(`path`), refusing a symlink of another user on the way
    (UnsafePath): its owner can re-point it at any time, at another of our
    directories (whose runs `contain ls` and `cancel` would then see instead
    of ours) or, for root, at a directory of root's where root then creates
    the state directory. A missing component ends the resolution; the walk
    that follows reports it. fs.protected_symlinks' rule, as
    open_dir_trusted_links applies it."""
    euid = os.geteuid()
    todo = [c for c in path.split("/") if c and c != "."][::-1]
    parts: list[str] = []
    links = 0
    while todo:
        comp = todo.pop()
        if comp == "..":
            if parts:
                parts.pop()
            continue
        here = "/" + "/".join([*parts, comp])
        try:
            st = os.lstat(here)
        except OSError:
            parts.append(comp)
            parts.extend(reversed(todo))
            break
        if stat.S_ISLNK(st.st_mode):
            if not link_trusted(st, os.stat("/" + "/".join(parts)), euid):
                raise UnsafePath(here, f"is a symlink owned by uid {st.st_uid}: not followed", errno.ELOOP)
            links += 1
            if links > 40:
                raise UnsafePath(path, "too many levels of symbolic links", errno.ELOOP)
            target = os.readlink(here)
            if target.startswith("/"):
                parts = []
            todo.extend(c for c in target.split("/")[::-1] if c and c != ".")
            continue
        parts.append(comp)
    return "/" + "/".join(parts)


def open_dir_trusted_links(path: str, shown: str) -> int:
    """An O_RDONLY fd of directory `path` (a path we were given, such as
    --record's), walked one component at a time; a symlink on the way is
    followed only when it belongs to root or to us. That is
    fs.protected_symlinks' rule, applied everywhere and whatever the sysctl
    says: another user's link in the middle of the path would otherwise
    choose the directory root writes in. `shown` names the path in errors."""
    euid = os.geteuid()
    todo = [c for c in path.split("/") if c and c != "."][::-1]
    fd = os.open("/" if path.startswith("/") else ".", O_DIR_PATH)
    walked = "/" if path.startswith("/") else ""
    links = 0
    try:
        while todo:
            comp = todo.pop()
            here = os.path.join(walked, comp)
            try:
                st = os.stat(comp, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    if not link_trusted(st, os.fstat(fd), euid):
                        raise UnsafePath(shown, f"{here} is a symlink owned by uid {st.st_uid}: not followed",
                                         errno.ELOOP)
                    links += 1
                    if links > 40:
                        raise UnsafePath(shown, "too many levels of symbolic links", errno.ELOOP)
                    target = os.readlink(comp, dir_fd=fd)
                    if target.startswith("/"):
                        os.close(fd)
                        fd = -1
                        fd = os.open("/", O_DIR_PATH)
                        walked = "/"
                    todo.extend(c for c in target.split("/")[::-1] if c and c != ".")
                    continue
                # O_NOFOLLOW: a link swapped in after the stat is refused, not followed.
                nfd = os.open(comp, O_DIR_PATH, dir_fd=fd)
            except UnsafePath:
                raise
            except OSError as e:
                raise UnsafePath(shown, f"its directory {here}: {os.strerror(e.errno or errno.EIO)}",
                                 e.errno or errno.EIO) from None
            os.close(fd)
            fd = nfd
            walked = here
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    finally:
        if fd >= 0:
            os.close(fd)
