"""stdin/stdout/stderr for a worker, spelled as in `subprocess`.

Each of `stdin`, `stdout`, `stderr` is one of:

- `None`: inherit the caller's descriptor (the supervisor never copies it);
- `subprocess.DEVNULL`: `/dev/null`;
- `subprocess.PIPE`: a new pipe; the caller's end is returned;
- `subprocess.STDOUT` (stderr only): wherever stdout goes;
- an `int` file descriptor, or an object with `fileno()`: used as is, and
  left open (it stays the caller's).

Every descriptor made here is close-on-exec (on Windows: not inheritable,
Python's default), so no concurrent spawn in this process can inherit it;
the spawn dup2()s the child's ends onto 0-2 (on Windows it passes their
handles in PROC_THREAD_ATTRIBUTE_HANDLE_LIST). After
the spawn the caller's copies of the child's ends are closed, whether the
spawn succeeded or not.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import IO, Any, Union

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT

StdioSpec = Union[None, int, IO[Any]]


def _pipe() -> tuple[int, int]:
    if sys.platform == "win32":
        return os.pipe()           # not inheritable (PEP 446)
    return os.pipe2(os.O_CLOEXEC)


class Stdio:
    """The descriptors of one spawn: `child` for the C spawn (-1 inherits),
    `parent` the caller's ends of pipes (None where there is no pipe)."""

    __slots__ = ("child", "parent", "_opened_child")

    def __init__(self) -> None:
        self.child: tuple[int, int, int] = (-1, -1, -1)
        self.parent: list[int | None] = [None, None, None]
        self._opened_child: list[int] = []

    @property
    def pipes(self) -> bool:
        return any(p is not None for p in self.parent)

    def spawned(self) -> None:
        """The child has its copies: close ours of its ends."""
        while self._opened_child:      # one at a time: an interrupt between two never closes one twice
            os.close(self._opened_child.pop())

    def abort(self) -> None:
        """The spawn did not happen: close everything made here."""
        self.spawned()
        for i, fd in enumerate(self.parent):
            if fd is not None:
                os.close(fd)
                self.parent[i] = None


def _fd_of(spec: Any, name: str) -> int:
    if isinstance(spec, bool):
        raise TypeError(f"{name}: expected None, PIPE, DEVNULL, a file descriptor or a file, not {spec!r}")
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"{name}: invalid file descriptor {spec}")
        return spec
    fileno = getattr(spec, "fileno", None)
    if fileno is None:
        raise TypeError(f"{name}: expected None, PIPE, DEVNULL, a file descriptor or a file, not {spec!r}")
    fd = fileno()
    if not isinstance(fd, int) or fd < 0:
        raise ValueError(f"{name}: fileno() returned {fd!r}")
    return int(fd)


def resolve(stdin: StdioSpec = None, stdout: StdioSpec = None, stderr: StdioSpec = None) -> Stdio:
    """Make the descriptors for one spawn. On error nothing stays open."""
    st = Stdio()
    child = [-1, -1, -1]
    devnull = -1
    try:
        for i, (name, spec) in enumerate((("stdin", stdin), ("stdout", stdout), ("stderr", stderr))):
            if spec is None:
                continue
            if spec is PIPE or (isinstance(spec, int) and not isinstance(spec, bool) and spec == PIPE):
                r, w = _pipe()
                child_end, parent_end = (r, w) if i == 0 else (w, r)
                st._opened_child.append(child_end)
                st.parent[i] = parent_end
                child[i] = child_end
            elif isinstance(spec, int) and not isinstance(spec, bool) and spec == DEVNULL:
                if devnull < 0:
                    devnull = os.open(os.devnull, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
                    st._opened_child.append(devnull)
                child[i] = devnull
            elif isinstance(spec, int) and not isinstance(spec, bool) and spec == STDOUT:
                if i != 2:
                    raise ValueError("STDOUT is only valid for stderr")
                child[i] = child[1] if child[1] >= 0 else 1
            else:
                child[i] = _fd_of(spec, name)
    except BaseException:
        st.abort()
        raise
    st.child = (child[0], child[1], child[2])
    return st
