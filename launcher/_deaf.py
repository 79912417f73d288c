"""The members a stop's polite signal cannot reach, told at once.

A stop caused by SIGINT or SIGQUIT (a Ctrl-C at the terminal, `contain run`
forwarding what it got) sends that signal to the tree first, as a terminal
would. But a shell starts its background jobs (`cmd &`) with SIGINT and
SIGQUIT ignored (POSIX, "Shell Execution Environment"), so those members
never react to it, and the stop waited out the whole grace for them before
the SIGKILL (issue 31: 5 s for every Ctrl-C of a script with a `&` child,
where bwrap stops the same tree at once).

A member whose /proc/PID/status `SigIgn` has the signal gets SIGTERM (and
SIGCONT) right after the polite signal: it can still clean up, and the kill
follows after the grace as for everyone else. Each is pinned by pidfd first
and signalled only if the container still lists its pid afterwards (a pid
reused meanwhile names a process the pidfd does not: the signal to it fails
with ESRCH, never reaches a stranger).
"""
from __future__ import annotations

import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from . import _signals as signal

# Signals a shell leaves ignored in its background jobs (Windows has no
# SIGQUIT, and no shell there ignores anything in its jobs: nothing to do).
DEAF_PRONE = (signal.SIGINT, signal.SIGQUIT) if hasattr(signal, "SIGQUIT") else ()


def _ignores(pid: int, signum: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigIgn:"):
                    return bool((int(line.split()[1], 16) >> (signum - 1)) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


# Members pinned at once: a tree can have more deaf members than the owner
# has descriptors to spare (the owner holds every run of its process), and
# pinning them all before signalling any would leave none told.
_BATCH = 64


def term_the_deaf(container: Any, signum: int) -> dict[str, Any] | None:
    """SIGTERM (+SIGCONT) to the members that ignore `signum`, for a stop
    whose polite signal is SIGINT or SIGQUIT. Returns what was done for the
    record (None when nothing was to do or the members cannot be listed).
    Members are pinned and told _BATCH at a time."""
    if signum not in DEAF_PRONE or not hasattr(os, "pidfd_open"):
        return None
    try:
        pids = container.members()
    except OSError:
        return None
    sent: list[int] = []
    missed = 0
    for at in range(0, len(pids), _BATCH):
        done, skipped = _term_batch(container, pids[at:at + _BATCH], signum)
        if done is None:
            missed += skipped
            continue
        sent.extend(done)
        missed += skipped
    if not sent:
        return None
    out: dict[str, Any] = {"signal": "SIGTERM", "because": f"they ignore {signal.signal_name(signum)}",
                           "pids": sent[:8], "count": len(sent)}
    if missed:
        out["not_pinned"] = missed      # no descriptor for them: they wait out the grace
    return out


def _term_batch(container: Any, pids: list[int], signum: int) -> tuple[list[int] | None, int]:
    """One batch: (the pids told, or None when the container could not be
    listed again; how many could not be pinned)."""
    pinned: dict[int, int] = {}
    missed = 0
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            except OSError:
                missed += 1
                continue
            if _ignores(pid, signum):
                pinned[pid] = fd
            else:
                os.close(fd)
        if not pinned:
            return [], missed
        try:
            still = set(container.members())
        except OSError:
            return None, missed + len(pinned)
        sent = []
        for pid, fd in pinned.items():
            if pid not in still:
                continue
            try:
                signal.pidfd_send_signal(fd, signal.SIGTERM)
                signal.pidfd_send_signal(fd, signal.SIGCONT)
                sent.append(pid)
            except OSError:
                continue
        return sent, missed
    finally:
        for fd in pinned.values():
            os.close(fd)
