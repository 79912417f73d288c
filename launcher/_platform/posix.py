"""Spawning through the C extension, and the errors it reports.

What the worker inherits is decided here, not in C (spawn.c only does what
the request says):

- Signals. The worker starts with an empty signal mask, whatever the
  calling thread blocks, and every disposition at SIG_DFL except the set
  `SpawnRequest.keep_ignored`, which stays SIG_IGN. The rule the driver
  follows to fill it: what the supervisor's own caller chose to ignore stays
  ignored, as across any exec (`nohup contain run ...` keeps SIGHUP
  ignored); what Python itself ignores (SIGPIPE, SIGXFSZ, set by the
  interpreter at start-up) is restored, as `subprocess`'s
  `restore_signals` does; and an ignored SIGCHLD is never handed on (a
  library caller that ignores it for its own reasons would otherwise give
  the worker auto-reaped children, and `wait` in a shell would fail).
  `keep_ignored_now()` computes the set for a library caller from the
  dispositions at the time of the spawn; the CLI calls
  `caller_ignored_signals()` once at start-up, before it installs any
  handler, and passes that set (and should not install a cancelling
  handler over a signal its caller ignored).
- Descriptors. Every descriptor >= 3 is closed at exec except
  `SpawnRequest.pass_fds`, which stay open (made inheritable in the child,
  even if close-on-exec here), like `subprocess`'s `pass_fds`. The CLI
  calls `inherited_fds()` at start-up to pass on what its own caller handed
  it without close-on-exec (`<(...)`, `3<file`, make's jobserver), as `env`
  and `timeout` do.
- Exec follows execvp: the candidates of a PATH search in order, a file
  the kernel will not run (ENOEXEC) run by /bin/sh, and a file that exists
  but whose interpreter does not is "bad interpreter" (126), not "command
  not found".
- Spawned means exec'd: `spawn` returns once the kernel shows the child
  running the program (spawn.c says how), and a child that died before
  that is a failed spawn (`KilledBeforeExec` when a signal did it,
  `DiedAtBirth` when it never ran our code).

The PID-namespace wall (`SpawnRequest(pidns=True)`, init.c): the worker is
forked by an init of ours at pid 1 of a new PID namespace. `Spawned.pid`/
`pidfd` are then the worker's (not our child), `init_pid`/`init_pidfd` the
init's (our child), `report_fd` its message socket. The driver's side:
- wait on `report_fd` and `init_pidfd` together; `read_init_events` turns
  what the init said into typed events (`InitWorkerExit` carries the
  worker's status: its pidfd cannot be waited for);
- stop: SIGTERM to the init (`pidfd_send_signal(init_pidfd, ...)`; it
  forwards to every member, then SIGCONT), then SIGKILL to the init (and
  cgroup.kill where there is a cgroup): the kernel kills every member and
  holds the init's exit until they are gone;
- emptiness: the init reaped (`waitid` on `init_pidfd`; `os.wait4` on
  `init_pid` also gives the whole tree's CPU, as `InitEmpty` does when the
  init exits by itself). An adopter that is not the parent waits for
  `pidfd_open(init_pid)` to poll readable. `InitEmpty` alone is the init's
  word, not the kernel's: with a worker that is real root (no user
  namespace) a member can reach the init (ptrace) and speak for it.
"""
from __future__ import annotations

import os
from .. import _signals as signal

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Sequence

from .._native import ffi, lib
# The request, the result and the errors (spawnreq.py), and the wall
# (wall.py), are part of this module's face: callers import them from here.
from .spawnreq import (NEVER_KEPT as NEVER_KEPT, SHELL as SHELL, BadInterpreter as BadInterpreter,
                       CloneUnsupported as CloneUnsupported, DiedAtBirth as DiedAtBirth,
                       clone3_refused as clone3_refused, clone_call as clone_call,
                       KilledBeforeExec as KilledBeforeExec, SpawnRequest as SpawnRequest, Spawned as Spawned,
                       caller_ignored_signals as caller_ignored_signals, candidates as candidates,
                       ignored_signals as ignored_signals, inherited_fds as inherited_fds,
                       keep_ignored_now as keep_ignored_now, raise_failure, spawn_args)
from .wall import (InitClosed as InitClosed, InitEmpty as InitEmpty, InitEvent as InitEvent,
                   InitExec as InitExec, InitFailed as InitFailed, InitForwarded as InitForwarded,
                   InitNote as InitNote, InitStarted as InitStarted, InitUnknown as InitUnknown,
                   InitWorkerExit as InitWorkerExit, pid_of_pidfd as pid_of_pidfd,
                   read_init_events as read_init_events, spawn_wall, wall_available as wall_available,
                   wall_via as wall_via)


def spawn(req: SpawnRequest, cgroup_fd: int = -1, join_fds: Sequence[int] = (),
          expect_cgroup: Sequence[str] = ()) -> Spawned:
    """Start the worker; return once it has exec'd (or raise).

    `cgroup_fd`: a cgroup2 directory fd for clone3(CLONE_INTO_CGROUP), -1
    for the caller's cgroup. `join_fds`: cgroup.procs files (v2 or v1,
    opened for writing by the caller) the child writes "0" to before
    anything else, and `expect_cgroup`: lines /proc/self/cgroup must then
    hold (e.g. "0::/contain/run-x/main"), or the spawn fails at "placement"
    without running a worker instruction. The request's own `join_fds`
    are joined too."""
    join_fds = list(join_fds) + list(req.join_fds)
    if req.pidns:
        return spawn_wall(req, cgroup_fd, join_fds, expect_cgroup)
    keep: list[Any] = []
    a = spawn_args(req, cgroup_fd, join_fds, expect_cgroup, keep)
    r = ffi.new("struct ct_spawn_result*")
    r.pidfd = -1                 # ct_spawn leaves -1 on every failure (it reaps the child itself)
    try:
        rc = lib.ct_spawn(a, r)
        if rc < 0:
            raise_failure(rc, r, req, candidates(req.argv[0], req.env), cgroup_fd >= 0)
        return Spawned(r.pid, r.pidfd)
    except BaseException:
        if r.pidfd >= 0:
            # An interrupt raised the moment the call returned: the worker
            # runs, and the caller would never learn its pidfd. Killed and
            # reaped here, the pidfd closed.
            try:
                signal.pidfd_send_signal(r.pidfd, signal.SIGKILL)
                os.waitid(os.P_PIDFD, r.pidfd, os.WEXITED)
            except OSError:
                pass
            os.close(r.pidfd)
        raise


def gids_of(req: SpawnRequest) -> list[int]:
    """The groups the worker will have (its account's, else ours)."""
    if req.uid >= 0:
        return sorted({req.gid, *req.groups} - {-1})
    return sorted({os.getegid(), *os.getgroups()})


def discard(sp: Spawned) -> None:
    """A spawn nothing will own (an interrupt came as it returned): kill our
    child (the wall's init, or the worker), reap it, close its descriptors."""
    child = sp.init_pidfd if sp.wall else sp.pidfd
    if child >= 0:
        try:
            signal.pidfd_send_signal(child, signal.SIGKILL)
            os.waitid(os.P_PIDFD, child, os.WEXITED)
        except OSError:
            pass
    for fd in {sp.pidfd, sp.init_pidfd, sp.report_fd} - {-1}:
        try:
            os.close(fd)
        except OSError:
            pass
    sp.pidfd = sp.init_pidfd = sp.report_fd = -1
