"""One run, from spawn to stop record: the driver of the state table.

The owner of a run (the `contain run` process, a library thread, or an
adopter after the supervisor died) loops on kernel readiness, never on a
sleep: the worker's pidfd (root exit), the run cgroup's `cgroup.events`
(POLLPRI on `populated` changes), the cancel inbox's wake-up FIFO (poked by
every process that appends a request, see _layout.RunDir.poke_owner), and a
wake-up pipe for in-process callers and signals. Every event goes through
`_state.step`; every observation is recorded as evidence of its own layer.
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable, Sequence

from . import _nested
from . import _state as S
from ._errors import ContainmentUnavailable, LauncherError, SpawnFailed
from ._identity import ProcessIdentity, boot_id
from ._ledger import EscapeWatch
from ._layout import RunDir, new_id, new_uid
from ._record import LAYERS, StopRecord, evidence, not_measured, now_iso, write_json_atomic
from ._platform import posix

DEFAULT_GRACE = 5.0
DEFAULT_KILL_TIMEOUT = 10.0
UNCONFIRMED_RETRIES = 2

# Without a wake-up FIFO the inbox is still read this often.
_INBOX_FALLBACK_S = 0.5


class Options:
    """Everything about how to run and stop, fixed before spawn."""

    __slots__ = ("grace", "timeout", "kill_timeout", "backend", "seal", "user", "workspace",
                 "record_file", "env", "cwd", "stdio", "state_dir", "subreaper", "parent_cgroup",
                 "new_pgroup", "check_sockets")

    def __init__(self, *, grace: float = DEFAULT_GRACE, timeout: float | None = None,
                 kill_timeout: float = DEFAULT_KILL_TIMEOUT, backend: str = "auto",
                 seal: bool | None = None, user: str | None = None, workspace: str | None = None,
                 record_file: str | None = None, env: dict[str, str] | None = None,
                 cwd: str | None = None, stdio: tuple[int, int, int] = (-1, -1, -1),
                 state_dir: str | None = None, subreaper: bool = False,
                 parent_cgroup: str | None = None, new_pgroup: bool = False,
                 check_sockets: bool = False) -> None:
        if grace < 0 or (timeout is not None and timeout <= 0) or kill_timeout <= 0:
            raise ValueError("grace must be >= 0, timeout and kill_timeout > 0")
        if backend not in ("auto", "cgroup2", "job-object", "none"):
            raise ValueError(f"unknown backend {backend!r} (auto, cgroup2, job-object or none)")
        self.grace = grace
        self.timeout = timeout
        self.kill_timeout = kill_timeout
        self.backend = backend
        self.seal = seal
        self.user = user
        self.workspace = workspace
        self.record_file = record_file
        self.env = env
        self.cwd = cwd
        self.stdio = stdio
        self.state_dir = state_dir
        self.subreaper = subreaper
        self.parent_cgroup = parent_cgroup
        self.new_pgroup = new_pgroup
        self.check_sockets = check_sockets


def _make_container(run_id: str, opts: Options) -> Any:
    """The strongest container the options and the host allow."""
    env = opts.env if opts.env is not None else os.environ
    backend = opts.backend if opts.backend != "auto" else env.get("CONTAIN_BACKEND", "auto")
    if backend == "job-object" or (backend == "auto" and sys.platform == "win32"):
        if sys.platform != "win32":
            raise ContainmentUnavailable("Job Objects exist only on Windows")
        from ._platform import windows

        return windows.Container.create(run_id)
    if backend in ("auto", "cgroup2"):
        from ._platform import linux

        parent = opts.parent_cgroup or _inherited_parent(env)
        try:
            return linux.Container.create(run_id, env, parent_dir=parent)
        except ContainmentUnavailable:
            if backend == "cgroup2":
                raise
    elif backend != "none":
        raise ValueError(f"unknown backend {backend!r}")
    from ._platform import none

    return none.Container(run_id)


def _inherited_parent(env: Any) -> str | None:
    """A run started from inside another run goes beside that run's worker
    (a nested run), so cancelling the lead stops it too."""
    d = env.get("CONTAIN_RUN_CGROUP")
    if d and os.path.isdir(d) and os.access(d, os.W_OK):
        return str(d)
    return None


class Run:
    """A run and its owner loop. Use `start()`, then `supervise()`."""

    def __init__(self, argv: Sequence[str], *, id: str | None = None, options: Options | None = None) -> None:
        if not argv:
            raise ValueError("nothing to run: argv is empty")
        self.argv = [os.fsdecode(a) for a in argv]
        self.opts = options or Options()
        self.id = id or new_id()
        self.uid = new_uid()
        self.layout: RunDir | None = None
        self.container: Any = None
        self.pid = -1
        self.pidfd = -1
        self.identity: ProcessIdentity | None = None
        self.snap = S.Snapshot()
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.ev: dict[str, dict[str, Any]] = {}
        self.times: dict[str, str | None] = {"spawned_at": None, "root_exit_at": None, "empty_at": None,
                                              "ended_at": None}
        self._t_spawn = 0.0
        self._t_stop = 0.0
        self.cpu: dict[str, int] | None = None
        self.escapes: list[dict[str, Any]] = []
        self._watch: EscapeWatch | None = None          # seal/ledger hook (issue 4)
        self.notes: list[str] = []
        self.sealed: tuple[bool, str | None] = (False, "not sealed")
        self.placement: str | None = None
        self.cleanup: dict[str, Any] = {}
        self.ops: dict[str, dict[str, Any]] = {}        # op id -> ack as written
        self.record_file = self.opts.record_file
        self._requests_offset = 0
        self._cancel_grace: float | None = None
        self._stop_stage: str | None = None
        self._stage_deadline = 0.0
        self._kill_rounds = 0
        self._deadline_timeout = 0.0
        self._wake_r, self._wake_w = -1, -1
        self._inbox_fd = -1
        self._signals: list[int] = []
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._final: StopRecord | None = None
        self.on_change: Callable[[], None] | None = None
        self.adopted = False
        self._sockets: tuple[set[int], list[str]] | None = None
        self.lead: dict[str, Any] | None = None          # set when this run is nested in another
        self._nested_seen: list[dict[str, Any]] = []     # runs nested in this one, as the kernel showed them

    # -- start -------------------------------------------------------------

    def start(self) -> None:
        """Claim the id, make the container, spawn the worker inside it.
        Raises RunConflict, ContainmentUnavailable or SpawnFailed; in the
        last two cases a final record with outcome `spawn_failed` exists."""
        self.layout = RunDir.claim(self.id, self.opts.state_dir)
        self.layout.journal("claimed", run_uid=self.uid)
        try:
            self.container = _make_container(self.id, self.opts)
        except ContainmentUnavailable as e:
            self._spawn_failed(e, container_made=False)
            raise
        self._note_lead()
        self._open_channels()
        req = self._spawn_request()
        # seal/ledger hook (issue 4): the fork ledger listens before the spawn
        self._watch = EscapeWatch.before_spawn(self.container, req, self.opts.env)
        # The run is described before anything runs in it: an owner killed
        # right after the spawn still leaves a run that `ls` shows and that
        # `cancel` can adopt by its container.
        self.layout.write_run(self._run_info(None))
        t0 = time.time()
        try:
            sp = self.container.spawn(req)
        except (SpawnFailed, ContainmentUnavailable, OSError) as e:
            err = e if isinstance(e, LauncherError) else ContainmentUnavailable(f"spawn: {e}")
            self._spawn_failed(err, container_made=True)
            raise err from (None if err is e else e)
        self._t_spawn = time.monotonic()
        self.pid, self.pidfd = sp.pid, sp.pidfd
        self._watch.after_spawn(sp.pid)                  # seal/ledger hook (issue 4)
        self.times["spawned_at"] = now_iso(t0)
        try:
            self.identity = ProcessIdentity.read(sp.pid, sp.pidfd)
        except OSError as e:
            # The worker is our unreaped child, so its /proc entry exists even
            # if it already exited; failing here is an observation failure.
            self.identity = None
            self.notes.append(f"identity not read: {e}")
        self.placement = self.container.placed(sp.pid)
        if self.container.backend != "none":
            expected = self.container.hierarchy.cg_path(self.container.leaf)
            if self.placement is not None and self.placement != expected:
                self.escapes.append({"pid": sp.pid, "seen_in": self.placement, "at": now_iso(),
                                     "via": "/proc/<pid>/cgroup right after spawn"})
        self.sealed = self.container.seal_status(req)
        if self.opts.timeout is not None:
            self._deadline_timeout = self._t_spawn + self.opts.timeout
        self.layout.write_run(self._run_info(sp.via))
        self.layout.journal("spawned", pid=sp.pid, via=sp.via)
        self._write_record()

    def _spawn_request(self) -> posix.SpawnRequest:
        env = dict(self.opts.env if self.opts.env is not None else os.environ)
        if self.container.backend == "cgroup2":
            env["CONTAIN_RUN_CGROUP"] = self.container.dir
        env["CONTAIN_RUN_ID"] = self.id
        if self.layout is not None:
            env[_nested.ENV_DIR] = self.layout.path
        uid = gid = -1
        groups: list[int] = []
        if self.opts.user is not None:
            uid, gid, groups = _resolve_user(self.opts.user)
        req = posix.SpawnRequest(self.argv, env=env, cwd=self.opts.cwd, stdio=self.opts.stdio,
                                 new_pgroup=self.opts.new_pgroup, uid=uid, gid=gid, groups=groups)
        self.container.prepare(req, self.opts)
        return req

    def _open_channels(self) -> None:
        assert self.layout is not None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        # A FIFO rather than inotify on the inbox: closing an inotify fd that
        # holds a watch waits for an SRCU grace period (fsnotify_destroy_group
        # -> __flush_work, seen in /proc/<tid>/stack), 0.1 to 24 ms here, and
        # every run closes it (docs/performance.md).
        try:
            self._inbox_fd = self.layout.open_wake()
        except OSError as e:
            self.notes.append(f"cancel wake-up FIFO unavailable ({e}): inbox read every {_INBOX_FALLBACK_S} s")

    def _spawn_failed(self, err: LauncherError, container_made: bool) -> None:
        self.snap = S.step(self.snap, S.Event.SPAWN_FAILED)
        self.notes.append(str(err))
        self.ev["root_exit"] = evidence(False, "spawn", {"error": str(err), "stage": getattr(err, "stage", None)})
        self.exit_code = getattr(err, "exit_code", 125)
        if container_made and self.container is not None:
            self._finish_stop_without_root()
        else:
            self.snap = S.step(self.snap, S.Event.TREE_GONE)
            self._finalise()

    def _finish_stop_without_root(self) -> None:
        """After a failed spawn the leaf may hold a child that is exiting:
        observe it empty like any other stop."""
        self._enter_stop(now=time.monotonic(), grace=0.0)
        while not self.snap.terminal:
            if not self._check_empty():
                if time.monotonic() > self._stage_deadline:
                    self._event(S.Event.DEADLINE)
                    break
                self.container.wait_change(0.05)
        self._finalise()

    @classmethod
    def adopt(cls, layout: RunDir) -> "Run":
        """Become the owner of a run whose owner is gone (the caller holds the
        owner lock). State, evidence and acknowledgements come from the run
        directory alone; the container is re-attached by path and the worker,
        if still alive, by identity (pidfd_open, then the start time re-read)."""
        info = layout.read_run()
        if info is None:
            raise LauncherError(f"run {layout.id}: run.json unreadable")
        rec = layout.read_record() or {}
        opts = Options(grace=float(info.get("grace", DEFAULT_GRACE)),
                       kill_timeout=float(info.get("kill_timeout", DEFAULT_KILL_TIMEOUT)))
        r = cls(info["argv"], id=info["run_id"], options=opts)
        r.uid = info["run_uid"]
        r.layout = layout
        r.adopted = True
        r.snap = S.from_record(rec.get("state", "RUNNING"), rec.get("outcome"))
        r.exit_code, r.signal = rec.get("exit_code"), rec.get("signal")
        r.ev = dict(rec.get("evidence") or {})
        esc = r.ev.pop("escapes", None) or {}
        if esc.get("observed") and isinstance(esc.get("detail"), list):
            r.escapes = list(esc["detail"])   # re-checked at the end, like any escaper
        r.times.update(rec.get("timings") or {})
        r.cpu = rec.get("cpu")
        r.notes = list(rec.get("notes") or [])
        r.notes.append(f"adopted by pid {os.getpid()} after the owner was gone")
        c = rec.get("containment") or {}
        r.sealed = (bool(c.get("sealed")), c.get("sealed_reason"))
        r.placement = c.get("placement")
        for ack in layout.acks():
            if ack.get("run_uid") == r.uid and ack.get("op_id"):
                r.ops[ack["op_id"]] = ack
        if rec.get("identity"):
            r.identity = ProcessIdentity.from_dict(rec["identity"])
            r.pid = r.identity.pid
        if info.get("backend") == "cgroup2" and info.get("cgroup_dir"):
            from ._platform import linux

            if os.path.isdir(info["cgroup_dir"]):
                r.container = linux.Container.attach(info["cgroup_dir"])
            else:
                # e.g. a nested run whose lead's stop killed its owner and
                # removed its cgroup with the lead's subtree.
                r.container = linux.Container.removed(info["cgroup_dir"])
        else:
            from ._platform import none

            r.container = none.Container(r.id)
            r.container.pgid = r.container.root_pid = r.pid
        if not r.snap.terminal and r.exit_code is None and r.signal is None and r.identity is not None:
            r._reattach_root()
        r._open_channels()
        r._t_spawn = time.monotonic()
        return r

    def _reattach_root(self) -> None:
        assert self.identity is not None
        try:
            fd = os.pidfd_open(self.identity.pid)
        except OSError:
            fd = -1
        if fd >= 0 and self.identity.is_alive():
            self.pidfd = fd     # pinned: the pid cannot be reused while we hold it
            return
        if fd >= 0:
            os.close(fd)
        if "root_exit" not in self.ev or not self.ev["root_exit"].get("observed"):
            self.ev["root_exit"] = evidence(True, "identity re-read after adoption (pid + start time gone)",
                                            "exit status unknown: the owner was gone when it exited")
            self.times["root_exit_at"] = self.times.get("root_exit_at") or now_iso()
            self._event(S.Event.ROOT_EXITED)

    # -- the owner loop ----------------------------------------------------

    def wake(self) -> None:
        """Make the owner loop look at its inputs now (thread- and signal-safe)."""
        try:
            os.write(self._wake_w, b"!")
        except OSError:
            pass

    def deliver_signal(self, signum: int) -> None:
        self._signals.append(signum)
        self.wake()

    def supervise(self, *, extra_fds: Sequence[int] = ()) -> StopRecord:
        """Own the run until it ends (or until an unconfirmed stop has been
        retried `UNCONFIRMED_RETRIES` times). Returns the stop record."""
        try:
            while self.owning():
                self._wait(extra_fds)
                self._turn()
        finally:
            if self.snap.terminal or self.snap.phase is S.Phase.UNCONFIRMED:
                self._finalise()
        assert self._final is not None
        return self._final

    # The owner loop is driven here (supervise) or by an event loop (_aio.py):
    # both wait on poll_set() until _next_deadline(), then drain() and _turn().

    def owning(self) -> bool:
        """Whether the owner loop goes on: until the run has ended, or an
        unconfirmed stop has been retried `UNCONFIRMED_RETRIES` times."""
        if self.snap.terminal:
            return False
        return not (self.snap.phase is S.Phase.UNCONFIRMED and self._kill_rounds > UNCONFIRMED_RETRIES)

    def poll_set(self) -> list[tuple[int, int]]:
        """What the owner waits on, as (fd, poll events)."""
        fds = []
        if self.pidfd >= 0 and self.exit_code is None and self.signal is None:
            fds.append((self.pidfd, select.POLLIN))
        efd = self.container.events_fd if self.container is not None else -1
        if efd >= 0:
            fds.append((efd, select.POLLPRI | select.POLLERR))
        if self._inbox_fd >= 0:
            fds.append((self._inbox_fd, select.POLLIN))
        if self._wake_r >= 0:
            fds.append((self._wake_r, select.POLLIN))
        return fds

    def drain(self, ready: Sequence[int]) -> None:
        """Consume the wake-ups among `ready` fds (level-triggered inputs)."""
        efd = self.container.events_fd if self.container is not None else -1
        for fd in ready:
            if fd >= 0 and fd == efd:
                # kernfs keeps POLLPRI|POLLERR raised on this open file until
                # it is read again (kernfs_generic_poll compares the file's
                # event count with the node's; kernfs_seq_show updates it).
                # Unread, the populated 0 -> 1 at spawn made every poll return
                # at once for the worker's whole life: the owner spun at 80%
                # of a CPU (docs/performance.md).
                try:
                    os.pread(efd, 4096, 0)
                except OSError:
                    pass
            elif fd >= 0 and fd in (self._wake_r, self._inbox_fd):
                try:
                    while os.read(fd, 4096):
                        pass
                except (BlockingIOError, InterruptedError):
                    pass

    def _wait(self, extra_fds: Sequence[int]) -> None:
        p = select.poll()
        for fd, events in self.poll_set():
            p.register(fd, events)
        for fd in extra_fds:
            p.register(fd, select.POLLIN)
        timeout = self._next_deadline() - time.monotonic()
        ready = p.poll(None if timeout == float("inf") else max(0, int(timeout * 1000) + 1))
        self.drain([fd for fd, _ in ready])

    def _next_deadline(self) -> float:
        t = float("inf")
        if self._deadline_timeout and self.snap.phase is S.Phase.RUNNING:
            t = self._deadline_timeout
        if self._stop_stage is not None:
            t = min(t, self._stage_deadline)
        if self.container is not None and self.container.backend == "none" and self.snap.stopping:
            t = min(t, time.monotonic() + 0.02)   # degraded mode has no emptiness event
        if self._inbox_fd < 0 and self.layout is not None:
            t = min(t, time.monotonic() + _INBOX_FALLBACK_S)
        return t

    def _turn(self) -> None:
        """Look at every input once. Cheap enough to do on any wake-up."""
        with self._lock:
            now = time.monotonic()
            while self._signals:
                self._cancel_from_signal(self._signals.pop(0))
            self._read_inbox()
            self._check_root()
            if self.opts.subreaper:
                self._reap_orphans()
            if self._deadline_timeout and self.snap.phase is S.Phase.RUNNING and now >= self._deadline_timeout:
                self._event(S.Event.TIMEOUT)
                if self.layout:
                    self.layout.journal("timeout", after=self.opts.timeout)
                self._enter_stop(now)
            if self.snap.stopping:
                if not self._check_empty():
                    self._advance_stop(now)
        if self.on_change is not None:
            self.on_change()

    # -- inputs ------------------------------------------------------------

    def _check_root(self) -> None:
        if self.pidfd < 0 or self.exit_code is not None or self.signal is not None:
            return
        if self.adopted:
            # Not our child: its pidfd polls readable on exit, but its status
            # went to whoever reaped it (pidfd_open(2)).
            p = select.poll()
            p.register(self.pidfd, select.POLLIN)
            if p.poll(0):
                self.ev["root_exit"] = evidence(True, "pidfd readable (adopted: not our child)",
                                                "exit status unknown: reaped by another process")
                self._root_gone(None)
            return
        try:
            info = os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            info = None
            self.ev["root_exit"] = evidence(None, "waitid(P_PIDFD)", "ECHILD: status taken by another waiter")
            self._root_gone(None)
            return
        if info is None:
            return
        if info.si_code == os.CLD_EXITED:
            self.exit_code = info.si_status
            how = S.Outcome.EXITED
        else:
            self.signal = info.si_status
            how = S.Outcome.SIGNALED
        detail = {"exit_code": self.exit_code} if self.signal is None else {"signal": self.signal}
        self.ev["root_exit"] = evidence(True, "pidfd readable + waitid(P_PIDFD)", detail)
        self._root_gone(how)

    def _root_gone(self, how: S.Outcome | None) -> None:
        self.times["root_exit_at"] = now_iso()
        os.close(self.pidfd)
        self.pidfd = -1
        was_stopping = self.snap.stopping
        self._event(S.Event.ROOT_EXITED, how)
        if self.layout:
            self.layout.journal("root_exited", exit_code=self.exit_code, signal=self.signal)
        if not was_stopping:
            self._enter_stop(time.monotonic())

    def _reap_orphans(self) -> None:
        """As child subreaper, reap whatever reparented to us. WNOWAIT first so
        the worker's own status is left for its pidfd."""
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            if info.si_pid == self.pid and self.pidfd >= 0:
                self._check_root()
                continue
            try:
                os.waitpid(info.si_pid, os.WNOHANG)
            except ChildProcessError:
                return

    def _read_inbox(self) -> None:
        if self.layout is None:
            return
        reqs, self._requests_offset = self.layout.read_requests(self._requests_offset)
        for req in reqs:
            self._apply_request(req)

    def _apply_request(self, req: dict[str, Any]) -> None:
        assert self.layout is not None
        op = str(req.get("op_id") or "")
        if not op:
            return
        try:
            existing = self.layout.read_ack(op)
        except LauncherError as e:
            self.notes.append(str(e))
            return
        if op in self.ops or existing is not None:
            return   # a repeated operation never applies twice
        ack = {"op_id": op, "run_id": self.id, "run_uid": self.uid, "requested_at": req.get("requested_at"),
               "acknowledged_at": now_iso(), "by": req.get("by")}
        if req.get("run_uid") not in (None, self.uid):
            ack.update(effect=S.Effect.UNKNOWN.value, state=self.snap.state.value,
                       detail=f"refused: run uid {req.get('run_uid')} is not the current run ({self.uid})")
            self._write_ack(op, ack)
            return
        effect = S.effect_on_arrival(self.snap)
        first_cancel = not (self.ev.get("cancel_requested") or {}).get("observed")
        if first_cancel and effect is S.Effect.CANCEL_REQUESTED:
            self.ev["cancel_requested"] = evidence(True, f"operation {op}", {"by": req.get("by")})
            self.ev["cancel_requested"]["at"] = req.get("requested_at") or self.ev["cancel_requested"]["at"]
            if req.get("grace") is not None:
                self._cancel_grace = float(req["grace"])
        before = self.snap
        self._event(S.Event.CANCEL)
        ack.update(effect=effect.value, state=self.snap.state.value, outcome=_v(self.snap.outcome))
        self.layout.journal("cancel", op_id=op, effect=effect.value)
        self._write_ack(op, ack)
        if self.snap.stopping and not before.stopping:
            self._enter_stop(time.monotonic(), grace=self._cancel_grace)
        elif before.phase is S.Phase.UNCONFIRMED:
            self._retry_kill(time.monotonic())
        if not before.terminal:
            self._write_record()   # one result: a terminal record is never rewritten

    def _write_ack(self, op: str, ack: dict[str, Any]) -> None:
        assert self.layout is not None
        self.ops[op] = ack
        self.layout.write_ack(op, ack, durable=self.snap.terminal)

    def _cancel_from_signal(self, signum: int) -> None:
        """SIGINT/SIGTERM/SIGHUP to the supervisor cancel the run, through the
        same durable inbox as any other cancel (intent first)."""
        if self.layout is None:
            return
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = str(signum)
        op = f"signal-{name}-{os.getpid()}"
        if op in self.ops:
            return
        self.layout.append_request({"op_id": op, "run_uid": self.uid, "requested_at": now_iso(),
                                    "by": {"pid": os.getpid(), "signal": name}})
        self._read_inbox()

    # -- the stop sequence -------------------------------------------------

    def _enter_stop(self, now: float, grace: float | None = None) -> None:
        self._t_stop = self._t_stop or now
        self._see_nested()
        if self._check_empty():
            return
        if self.opts.check_sockets and self._sockets is None:
            from ._postconditions import socket_inodes

            self._sockets = socket_inodes(self.container.members())
        grace = self.opts.grace if grace is None else grace
        if grace > 0:
            self._terminate()
            self._stop_stage, self._stage_deadline = "term", now + grace
        else:
            self._kill(now)

    def _advance_stop(self, now: float) -> None:
        if self._stop_stage is None:
            self._enter_stop(now)
        elif now < self._stage_deadline:
            return
        elif self._stop_stage == "term":
            self._kill(now)
        elif self._stop_stage == "kill":
            self._event(S.Event.DEADLINE)
            if self.layout:
                self.layout.journal("deadline", after=self.opts.kill_timeout)
            self._write_record()
            self._retry_kill(now)

    def _terminate(self) -> None:
        try:
            sent, failed = self.container.terminate()
            self._signal_evidence("term", True, f"SIGTERM+SIGCONT by pidfd to {sent} member(s)",
                                  {"signalled": sent, "failed": failed})
        except OSError as e:
            self._signal_evidence("term", None, "SIGTERM by pidfd", f"failed: {e}")

    def _kill(self, now: float) -> None:
        self._kill_rounds += 1
        try:
            via = self.container.kill()
            self._signal_evidence("kill", True, via, {"round": self._kill_rounds})
        except OSError as e:
            self._signal_evidence("kill", None, "cgroup.kill", f"failed: {e}")
        if self.layout:
            self.layout.journal("kill", round=self._kill_rounds)
        self._stop_stage, self._stage_deadline = "kill", now + self.opts.kill_timeout

    def _retry_kill(self, now: float) -> None:
        """Unconfirmed is not terminal: repeat the kill and keep watching."""
        self._kill(now)

    def _signal_evidence(self, kind: str, observed: bool | None, via: str, detail: Any) -> None:
        cur = self.ev.get("signal_sent")
        steps = list(cur["detail"]["steps"]) if cur and isinstance(cur.get("detail"), dict) else []
        steps.append({"kind": kind, "observed": observed, "via": via, "detail": detail, "at": now_iso()})
        ok = [s for s in steps if s["observed"]]
        if ok:
            self.ev["signal_sent"] = {"observed": True, "at": ok[0]["at"], "via": ok[0]["via"], "detail": {"steps": steps}}
        else:
            self.ev["signal_sent"] = {"observed": None, "at": None, "via": via, "detail": {"steps": steps}}

    def _check_empty(self) -> bool:
        """Observe the container. Feeds EMPTY (kernel) or TREE_GONE (degraded)
        and returns True once the run has ended; False while members remain."""
        if self.snap.terminal:
            return True
        try:
            populated = self.container.populated()
        except OSError as e:
            self.ev["container_empty"] = evidence(None, self.container.empty_via, f"observation failed: {e}")
            if self.snap.phase is S.Phase.STOPPING:
                self._event(S.Event.OBSERVE_FAILED)
            return False
        if populated:
            return False
        if self.pidfd >= 0 and self.exit_code is None and self.signal is None:
            # Empty before we reaped the root: take its status first, so the
            # outcome is the worker's own exit rather than an inference.
            self._check_root()
        t = time.time()
        self.times["empty_at"] = now_iso(t)
        if self.container.backend == "none":
            self.ev["container_empty"] = not_measured("no kernel container (degraded mode)")
            # Everything the scan saw is gone, but nothing held the tree: that
            # every descendant exited cannot be observed here (null, with
            # what was seen), and never reads as true.
            self.ev["descendants_exit"] = {"observed": None, "at": now_iso(t), "via": self.container.empty_via,
                                           "detail": self.container.seen_summary()}
            self._event(S.Event.TREE_GONE)
            return True
        self.ev["container_empty"] = evidence(True, self.container.empty_proof, {"path": self.container.path}, at=t)
        self.ev["descendants_exit"] = evidence(True, f"{self.container.empty_proof} (no member left in the subtree)",
                                               None, at=t)
        if self._watch is not None:                      # seal/ledger hook (issue 4)
            self.escapes.extend(self._watch.at_empty(self.container, self.opts.kill_timeout))
        alive = self._escapers_alive()
        if alive is not False:
            # The container is empty, but a process that left it is alive or
            # not proven gone: the tree's descendants did not all exit.
            seen_alive = any(e.get("alive_at_end") is True for e in self.escapes)
            self.ev["descendants_exit"] = {
                "observed": False if seen_alive else None, "at": now_iso(t),
                "via": "cgroup.events populated 0, and the escapers' identities re-read",
                "detail": "the container emptied; escaper(s) " + ("alive" if seen_alive else "not proven gone")}
        self._event(S.Event.EMPTY if alive is False else S.Event.EMPTY_ESCAPED)
        return True

    def _escapers_alive(self) -> bool | None:
        """False only when every process seen leaving is proven gone."""
        if not self.escapes:
            return False
        anyone = False
        for e in self.escapes:
            ident = e.get("identity")
            if e.get("gone") is True:                    # its pidfd was seen readable (issue 4)
                e["alive_at_end"] = False
                continue
            alive = ProcessIdentity.from_dict(ident).is_alive() if ident else None
            e["alive_at_end"] = alive
            if alive is not False:
                anyone = True
        return None if anyone else False

    def _event(self, ev: S.Event, how: S.Outcome | None = None) -> None:
        self.snap = S.step(self.snap, ev, how)

    # -- ending ------------------------------------------------------------

    def close(self) -> None:
        """Give up ownership without writing anything (used after acknowledging
        a cancel on a run that had already ended)."""
        for fd in (self._wake_r, self._wake_w, self._inbox_fd, self.pidfd):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = self._inbox_fd = self.pidfd = -1
        if self.layout is not None:
            self.layout.release()
        self._done.set()

    def _finalise(self) -> None:
        if self._final is not None and self._final.terminal:
            return
        if self.snap.terminal:
            self._postconditions()
        if self.container is not None:
            self.cpu = self.container.cpu_stat() or self.cpu
            self._see_nested()
            if self.snap.terminal:
                problem = self.container.remove()
                self.cleanup = {"container_removed": problem is None, "detail": problem}
        if self.snap.phase is S.Phase.REAPED and self._nested_seen:
            self._finish_nested()
        if self._watch is not None:                      # seal/ledger hook (issue 4)
            self._watch.close()
        if self.pidfd >= 0 and self.snap.terminal:
            os.close(self.pidfd)
            self.pidfd = -1
        self.times["ended_at"] = now_iso() if self.snap.terminal else None
        # The record first: an acknowledgement may only claim what a written
        # record already says (an owner dying in between leaves acks to be
        # settled by the next adopter, never the reverse).
        rec = self._write_record()
        self._settle_acks()
        if self.layout is not None:
            self.layout.journal("ended" if self.snap.terminal else "unconfirmed", state=self.snap.state.value)
            self.layout.release()
        for fd in (self._wake_r, self._wake_w, self._inbox_fd):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = self._inbox_fd = -1
        self._final = rec
        self._done.set()

    def _postconditions(self) -> None:
        """Measured only where asked for, and only once the tree is gone."""
        if self.opts.workspace:
            from ._postconditions import workspace_quiescent

            self.ev["workspace_quiescent"] = workspace_quiescent(self.opts.workspace)
        if self.opts.check_sockets:
            from ._postconditions import sockets_closed

            held, problems = self._sockets if self._sockets is not None else (set(), [])
            self.ev["sockets_closed"] = sockets_closed(held, problems)
            if self._sockets is None:
                self.ev["sockets_closed"]["detail"] = {
                    "held_at_stop": 0, "note": "the container was already empty when the stop began: "
                    "sockets handed to other processes before that are not known"}

    def _settle_acks(self) -> None:
        if self.layout is None:
            return
        for op, ack in list(self.ops.items()):
            eff = S.effect_at_end(S.Effect(ack["effect"]), self.snap)
            if eff.value != ack["effect"] or ack.get("state") != self.snap.state.value:
                ack = dict(ack, effect=eff.value, state=self.snap.state.value, settled_at=now_iso(),
                           outcome=_v(self.snap.outcome))
                self._write_ack(op, ack)

    def record_dict(self) -> dict[str, Any]:
        ev = {}
        for layer in LAYERS:
            if layer in self.ev:
                ev[layer] = self.ev[layer]
        ev.setdefault("cancel_requested", evidence(False, "cancel inbox", None) if self.layout else
                      not_measured("no run directory"))
        ev.setdefault("signal_sent", {"observed": False, "at": None, "via": "none",
                                      "detail": "nothing was signalled"})
        if self.pid > 0:
            ev.setdefault("root_exit", evidence(False, "pidfd", "worker running"))
        elif self.adopted:
            ev.setdefault("root_exit", not_measured("the owner died before recording the worker's identity"))
        else:
            ev.setdefault("root_exit", not_measured("no worker"))
        if self.container is None or self.container.backend == "none":
            ev.setdefault("container_empty", not_measured("no kernel container (degraded mode)"))
        else:
            ev.setdefault("container_empty", evidence(False, "cgroup.events populated 1", None)
                          if not self.snap.terminal else not_measured("not observed"))
        ev.setdefault("descendants_exit", not_measured("not yet observed"))
        if self.escapes:
            ev["escapes"] = {"observed": True, "at": self.escapes[0]["at"], "via": self.escapes[0]["via"],
                             "detail": self.escapes}
        else:
            ev.setdefault("escapes", self._watch.evidence(self.container, self.snap.terminal)
                          if self._watch is not None and self.container is not None   # issue 4
                          else self.container.escape_evidence() if self.container is not None
                          else not_measured("no container"))
        c = self.container
        containment = {
            "backend": c.backend if c is not None else "none",
            "path": c.path if c is not None else None,
            "sealed": self.sealed[0],
            "sealed_reason": self.sealed[1],
            "placement": self.placement,
            "seal": getattr(c, "seal_detail", None),     # issue 4: how it is sealed, when it is
        }
        if c is not None and getattr(c, "spawn_via", None):
            containment["spawn_via"] = c.spawn_via
        durations = {}
        if self._t_spawn and self._t_stop and self.times.get("empty_at"):
            durations["stop_to_empty_s"] = round(time.monotonic() - self._t_stop, 6) if not self.snap.terminal else None
        rec = {
            "schema": "contain.stop-record/1",
            "run_id": self.id,
            "run_uid": self.uid,
            "state": self.snap.state.value,
            "outcome": _v(self.snap.outcome),
            "exit_code": self.exit_code,
            "signal": self.signal,
            "argv": self.argv,
            "containment": containment,
            "evidence": ev,
            "identity": self.identity.to_dict() if self.identity else None,
            "timings": dict(self.times),
            "cpu": self.cpu,
            "cancellations": sorted(self.ops),
            "cleanup": self.cleanup or None,
            "notes": self.notes,
            "record_written_at": now_iso(),
        }
        if self.adopted:
            rec["adopted_by"] = {"pid": os.getpid()}
        rec["nested"] = _nested.describe(self._nested_seen, self.layout.path if self.layout else None)
        if self.lead is not None:
            rec["lead"] = self.lead
        return rec

    # -- nested runs (issue 6; see _nested.py) -------------------------------

    def _note_lead(self) -> None:
        """If this run's container was made inside the run named by the
        environment, it is nested: say so in the record and tell the lead."""
        env = self.opts.env if self.opts.env is not None else os.environ
        lead_dir = env.get(_nested.ENV_CGROUP)
        c = self.container
        if c is None or c.backend != "cgroup2" or not lead_dir:
            return
        if os.path.dirname(c.dir) != os.path.normpath(lead_dir):
            return
        self.lead = {"run_id": env.get("CONTAIN_RUN_ID"), "cgroup": c.hierarchy.cg_path(os.path.dirname(c.dir))}
        assert self.layout is not None
        problem = _nested.register(env, {"id": self.id, "run_uid": self.uid, "cgroup": c.path,
                                         "run_dir": self.layout.path})
        if problem is not None:
            self.notes.append(problem)

    def _finish_nested(self) -> None:
        """Runs nested in this one died with it (their owners lived in this
        tree). This run observed its whole subtree empty, theirs included, so
        each one left RUNNING is finished the way any orphan is: a durable
        cancel from this run, then adoption (docs/protocol.md)."""
        from ._cancel import adopt_quietly

        assert self.layout is not None
        for reg in _nested.registered(self.layout.path):
            run_dir = reg.get("run_dir")
            if not run_dir or not os.path.isdir(str(run_dir)):
                continue
            try:
                adopt_quietly(RunDir(str(run_dir)), f"lead-{self.uid}", reg.get("run_uid"),
                              {"pid": os.getpid(), "lead": self.id})
            except (LauncherError, OSError) as e:
                self.notes.append(f"nested run {reg.get('id')}: not finished: {e}")

    def _see_nested(self) -> None:
        """Remember the runs nested in this one while their containers exist:
        they end with this run (at the start of its stop, and before removal)."""
        if self.container is not None and self.container.backend == "cgroup2":
            self._nested_seen = _nested.merge(self._nested_seen, _nested.scan(self.container))

    def _write_record(self) -> StopRecord:
        rec = self.record_dict()
        durable = self.snap.terminal     # only the result outlives the processes (see _layout.py)
        if self.layout is not None:
            self.layout.write_record(rec, durable=durable)
        if self.record_file:
            try:
                write_json_atomic(self.record_file, rec, fsync=durable)
            except OSError as e:
                self.notes.append(f"--record {self.record_file}: {e}")
        return StopRecord(rec)

    def record(self) -> StopRecord:
        with self._lock:
            return self._final if self._final is not None else StopRecord(self.record_dict())

    def _run_info(self, via: str | None) -> dict[str, Any]:
        c = self.container
        return {
            "run_id": self.id, "run_uid": self.uid, "argv": self.argv,
            "started_at": self.times["spawned_at"],
            "worker": self.identity.to_dict() if self.identity else ({"pid": self.pid} if self.pid > 0 else None),
            "supervisor": ProcessIdentity.read(os.getpid()).to_dict(),
            "backend": c.backend, "cgroup": c.path, "cgroup_dir": getattr(c, "dir", None),
            "spawn_via": via, "state_dir": self.layout.path if self.layout else None,
            "boot_id": boot_id(), "grace": self.opts.grace, "kill_timeout": self.opts.kill_timeout,
        }

    def exit_status(self) -> int:
        """What `contain run` exits with (CONTRACT.md)."""
        out = self.snap.outcome
        if out is S.Outcome.SPAWN_FAILED:
            return self.exit_code if self.exit_code is not None else 125
        if out is S.Outcome.TIMED_OUT:
            return 124
        if self.snap.phase in (S.Phase.UNCONFIRMED, S.Phase.BREACHED):
            return 125
        if self.signal is not None:
            return 128 + self.signal
        return self.exit_code if self.exit_code is not None else 125


def _v(x: Any) -> Any:
    return None if x is None else x.value


def _resolve_user(user: str) -> tuple[int, int, list[int]]:
    import grp
    import pwd

    try:
        pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, ValueError):
        if user.isdigit():
            return int(user), int(user), []
        raise ValueError(f"no such user {user!r}") from None
    groups = [g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem]
    return pw.pw_uid, pw.pw_gid, sorted({pw.pw_gid, *groups})
