"""`contain run` as PID 1 of its PID namespace: a container's entrypoint.

PID 1 is the namespace's child reaper: every orphan of the namespace comes
to it, the tree's and those of processes that entered from outside
(`docker exec`, `kubectl exec`), and after the reparenting nothing tells
them apart. So `contain run` as PID 1 first forks its supervisor off and
stays an init, as tini and `docker run --init` do:

- PID 1 reaps whatever reparents to it (visitors' orphans), forwards every
  signal it can catch to the supervisor (`docker stop`'s SIGTERM cancels
  the run, as it would a `contain run` that is not PID 1), and exits with
  the supervisor's status (128+N when a signal ended it: a PID 1 is not
  killed by its own namespace's signals, and the kernel then ends every
  process left in the namespace, pid_namespaces(7));
- the supervisor is an ordinary `contain run` below it, a child subreaper
  from before its spawn: the tree's orphans reparent to the supervisor, the
  nearest living subreaper ancestor, never to PID 1; so the subreaper wall
  holds (_platform/subreaper.py), and visitors' orphans never reach it.
"""
from __future__ import annotations

import os
import sys


def split() -> None:
    """In PID 1 of a namespace (not on Windows): fork the supervisor and
    return in it; PID 1 itself never returns. Anywhere else: return."""
    if sys.platform == "win32" or os.getpid() != 1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        return
    _init(child)


def _init(child: int) -> None:
    import signal     # not on the run path of a contain that is not PID 1 (tests/test_startup.py)

    # SIGCHLD is PID 1's own, SIGKILL and SIGSTOP cannot be caught, 32/33 are glibc's.
    not_forwarded = {signal.SIGCHLD, signal.SIGKILL, signal.SIGSTOP}

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)       # our unreaped child: its pid cannot name another process
        except OSError:
            pass

    for s in range(1, signal.NSIG):
        if s in not_forwarded or (32 <= s < signal.SIGRTMIN):
            continue
        try:
            signal.signal(s, forward)
        except (OSError, ValueError):
            pass
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(1)                  # cannot happen while the supervisor lives
        if pid == child:
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
