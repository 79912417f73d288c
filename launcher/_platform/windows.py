"""The `job-object` backend: one run, one Windows Job Object.

The worker is created suspended and inside the job (winproc.py), with
IsProcessInJob checked before its first instruction. The job never allows
breakaway and kills its tree when its last handle closes, so the
supervisor's death stops the run. Emptiness is `ActiveProcesses == 0`
from QueryInformationJobObject; completion-port messages only wake the
owner loop (they are "not guaranteed", JOBOBJECT_ASSOCIATE_COMPLETION_PORT),
whose waiting lives in winhost.py and winsync.py.

Whether the job can be left. No API takes a process out of a job: a
process leaves only by being created with breakaway, which needs a
breakaway limit on the job, and setting one needs a handle with
JOB_OBJECT_SET_ATTRIBUTES. The handle kept here has none (ct_job_restrict),
and the job's descriptor grants it to nobody (jobobject.c), so a process
that duplicates our handle (it can open us: it runs as our user) gets
nothing it can leave with. That is observed for this token at creation
(ct_job_probe: DuplicateHandle asked for SET_ATTRIBUTES, WRITE_DAC and
WRITE_OWNER with every privilege of the token enabled): only when all three
are refused does `unleavable()` say so, and only then can a run be REAPED.

Imported only on Windows (_containers.make_container chooses it); every
entry point checks the platform first, so mypy reads the rest as Windows
code (`mypy --platform win32` checks it).
"""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

    from .._limits import Limits
    from .winlimits import JobLimits
    from .winproc import SpawnRequestLike

from .._errors import ContainmentUnavailable
from . import winacct, winlimits, winproc
from .winproc import Request as Request, Spawned as Spawned, environment_block as environment_block
from .winsync import check as _check, error as _error, require_windows

KIND = "job-object"
# The exit code TerminateJobObject gives every process it ends. Windows has
# no signals, so the killer picks the code: 128 + SIGKILL, so a worker the
# stop killed reads as it would on Linux (`contain run` exits 137), and not
# as a worker's own exit 1 (CPython's Popen.kill uses 1).
KILL_EXIT_CODE = 137

# winnt.h
_LIMIT_BREAKAWAY_OK = 0x800
_LIMIT_SILENT_BREAKAWAY_OK = 0x1000
_LIMIT_KILL_ON_JOB_CLOSE = 0x2000
_JOB_OBJECT_SET_ATTRIBUTES, _WRITE_DAC, _WRITE_OWNER = 0x10, 0x40000, 0x80000
_ERROR_MORE_DATA = 234
_ERROR_ALREADY_EXISTS = 183
_ERROR_ACCESS_DENIED = 5
_INFINITE = 0xFFFFFFFF
# How long an adopter's kill waits for ActiveProcesses == 0 before the
# driver observes (and, if members remain, retries the kill as on Linux).
_ADOPTED_KILL_WAIT_MS = 5000


class Container:
    """One run's Job Object, its completion port and the worker's handle."""

    backend = KIND
    dir = None
    leaf = None
    hierarchy = None
    events_fd = -1        # no fd to poll: the owner loop blocks on the completion port (winhost.py)
    empty_via = "QueryInformationJobObject ActiveProcesses"
    empty_proof = "QueryInformationJobObject ActiveProcesses == 0"
    seal_detail = None
    # The stop's words when a step fails (_stop.py): Windows', not Linux's.
    term_via = "GenerateConsoleCtrlEvent(CTRL_BREAK_EVENT) to the worker's process group"
    kill_via = "TerminateJobObject"

    def __init__(self, run_id: str, job: int, port: int, key: int, name: str | None = None) -> None:
        self.run_id = run_id
        self.job = job            # JOB_OBJECT_QUERY | TERMINATE | ASSIGN_PROCESS only (ct_job_restrict)
        self.port = port
        self.key = key            # the completion key of the job's messages (the handle it was associated with)
        self.process = 0
        self.pid = -1
        self.spawn_via: str | None = None
        # Named after the run uid (winsync.job_name), so that an adopter can
        # open it once the owner is gone; anonymous only without a run uid
        # (the doctor's probe).
        self.name = name
        self.path = name or f"anonymous job of run {run_id}"
        # Opened by name by an adopter (`open`): no completion port (a job
        # has one, its owner's), no console shared with the tree. `verified`:
        # the run's worker, alive, was seen in it (_containers._attach_job);
        # else `unverified` says why the job may not be the run's.
        self.adopted = False
        self.verified: bool | None = None
        self.unverified: str | None = None
        self.last_terminate: dict[str, Any] | None = None
        self.waiter: Any = None   # the owner loop's Waiter on our port (winhost.Wakeups), closed first
        self.guard: dict[str, Any] = {}   # how the job is kept from being told to allow breakaway
        self.job_limits: JobLimits | None = None   # the limits written and read back (winlimits.py)
        self._worker_times: dict[str, int] | None = None
        self._wait: Any = None
        # Where the job's name lives (session, object directory), for run.json.
        self.namespace: dict[str, Any] | None = None

    @classmethod
    def create(cls, run_id: str, limits: Limits | None = None, uid: str | None = None) -> "Container":
        """`limits` (--memory-max, --pids-max, --cpu-max) are written and
        read back here, while the handle can still set them and nothing is
        in the job (winlimits.py); ContainmentUnavailable if one is refused.
        With the run's `uid` the job is named (winsync.job_name); a job of
        that name existing already is refused (someone squats the name)."""
        require_windows("Job Objects")
        from .._native import ffi, lib
        from .winsync import job_name

        job = ffi.new("uintptr_t*")
        name = job_name(uid) if uid else None
        rc = lib.ct_job_create_named(job, name.encode() if name else ffi.NULL)
        if name and rc == _ERROR_ALREADY_EXISTS:
            raise ContainmentUnavailable(f"a Job Object named {name} exists already: not made by this run, refused")
        if name and rc == _ERROR_ACCESS_DENIED:
            # CreateJobObjectW opens an existing name for all access, which a
            # job made with our descriptor (another run's, or a squatter's
            # copy of it) does not grant.
            raise ContainmentUnavailable(f"a Job Object named {name} exists already (CreateJobObjectW: access "
                                         "denied): not made by this run, refused")
        if rc != 0:
            raise ContainmentUnavailable(f"CreateJobObjectW/SetInformationJobObject: {_error(rc, 'job')}")
        key = int(job[0])
        # The port must be associated before the worker is assigned, or its
        # NEW_PROCESS message is never posted.
        port = ffi.new("uintptr_t*")
        applied, rc = None, -1
        try:
            rc = lib.ct_job_port_create(job[0], port)
            if rc == 0 and limits:
                # Before ct_job_restrict: the kept handle cannot set them.
                applied = winlimits.apply(int(job[0]), limits, f"anonymous job of run {run_id}")
            if rc == 0:
                rc = lib.ct_job_restrict(job)
        finally:
            if rc != 0 or (limits and applied is None):
                lib.ct_job_close_take(job[0])
                if port[0]:
                    lib.ct_job_close_take(port[0])
        if rc != 0:
            raise ContainmentUnavailable(f"completion port / restricted job handle: {_error(rc, 'job')}")
        c = cls(run_id, int(job[0]), int(port[0]), key, name)
        c.job_limits = applied
        c._wait = ffi.new("struct ct_job_wait_result*")
        c.guard = c._probe()
        if name:
            c.namespace = c._namespace()
        return c

    def _namespace(self) -> dict[str, Any]:
        """Where the job's name lives, for an adopter that finds no job of
        that name (_containers._attach_job): the session this process runs
        in, the object directory the name resolved to, and whether this is
        an AppContainer (whose `Local\\` is a directory of its own)."""
        from .winsync import in_app_container, object_directory, session_id

        out: dict[str, Any] = {"name": self.name, "session": None, "directory": None, "app_container": None}
        for key, read in (("session", session_id), ("directory", lambda: object_directory(self.job)),
                          ("app_container", in_app_container)):
            try:
                out[key] = read()
            except OSError:
                pass
        return out

    @classmethod
    def open(cls, run_id: str, name: str) -> "Container":
        """The job of a run whose owner is gone, opened by its name with
        what its descriptor grants this user (query, terminate: ct_job_open).
        OSError (winerror 2) when no job has that name: no handle to it is
        left anywhere, so KILL_ON_JOB_CLOSE ended its tree. The caller checks
        that it is the run's job (_containers._attach_job). The limits guard
        is probed again on this handle: what the descriptor grants decides."""
        require_windows("Job Objects")
        from .._native import ffi, lib

        job = ffi.new("uintptr_t*")
        _check(lib.ct_job_open(name.encode(), job), f"OpenJobObjectW {name}")
        c = cls(run_id, int(job[0]), 0, int(job[0]), name)
        c.adopted = True
        c._wait = ffi.new("struct ct_job_wait_result*")
        c.guard = c._probe()
        return c

    def _probe(self) -> dict[str, Any]:
        """What any process of this token could get on the job (ct_job_probe)."""
        from .._native import ffi, lib

        got = ffi.new("uint32_t*")
        enabled = ffi.new("uint32_t*")
        system = ffi.new("int*")
        rc = lib.ct_job_probe(self.job, got, enabled)
        orc = lib.ct_job_owner_is_system(self.job, system)
        owner = None if orc else {1: "LocalSystem", 0: "this user (OWNER RIGHTS: read only)", -1: None}[system[0]]
        if rc != 0:
            return {"obtainable": None, "owner": owner, "why": f"probe failed: {_error(rc, 'DuplicateHandle')}"}
        names = [n for bit, n in ((_JOB_OBJECT_SET_ATTRIBUTES, "JOB_OBJECT_SET_ATTRIBUTES"), (_WRITE_DAC, "WRITE_DAC"),
                                  (_WRITE_OWNER, "WRITE_OWNER")) if got[0] & bit]
        return {"obtainable": names, "owner": owner, "privileges_enabled_for_probe": int(enabled[0]),
                "via": "DuplicateHandle of the kept handle asking for JOB_OBJECT_SET_ATTRIBUTES, WRITE_DAC and "
                       "WRITE_OWNER, every privilege of this token enabled"}

    # -- spawning ----------------------------------------------------------

    def prepare(self, req: SpawnRequestLike, opts: Any) -> None:
        if getattr(opts, "seal", None):
            raise ContainmentUnavailable(
                "--seal is not available for Job Objects: the worker runs as the supervisor's user "
                "(a seal needs a restricted token; see docs/windows.md)")
        if getattr(opts, "user", None):
            raise ContainmentUnavailable("--user is not available for Job Objects (it would need a logon token)")
        req.new_pgroup = True   # CTRL_BREAK_EVENT reaches the worker's group

    def seal_status(self, req: SpawnRequestLike) -> tuple[bool, str | None]:
        return False, ("the worker runs as the supervisor's user: it can write the state directory, end the "
                       "supervisor, and hold the run's job open past it (opened by name, or a handle copied out "
                       "of the supervisor), so that its tree outlives the supervisor until an adopter "
                       "(`contain cancel`) terminates the job")

    def spawn(self, req: SpawnRequestLike) -> Spawned:
        sp, self.spawn_via = winproc.spawn_into(self.job, req)
        self.process, self.pid = sp.handle, sp.pid
        return sp

    def root(self, sp: Spawned) -> Any:
        """The worker as the owner watches it: its handle (ours until remove())."""
        from .winhost import Root

        return Root(sp.pid, sp.handle, owned=False)

    def worker_identity(self) -> dict[str, Any]:
        """The worker's identity (pid + creation time), read from its handle."""
        return winproc.identity(self.pid, self.process)

    def placed(self, pid: int) -> str | None:
        """The job's path if the kernel says `pid` is in it, "outside" if not,
        None if it cannot be asked."""
        from .._native import ffi, lib

        inside = ffi.new("int*")
        if lib.ct_job_contains(self.job, pid, inside) != 0:
            return None
        return self.path if inside[0] else "outside"

    def unleavable(self) -> str | None:
        """How no member can have left the job, if it cannot be left (see the
        module docstring); None otherwise (`leavable()` says why)."""
        if self.leavable() is not None:
            return None
        return ("a Job Object allows no breakaway, and no process of this token can obtain a handle that "
                f"changes that ({self.guard['via']}: all refused; owner {self.guard.get('owner')})")

    def leavable(self) -> str | None:
        """Why a member could have left the job unseen, or None."""
        if self.unverified:
            return self.unverified
        got = self.guard.get("obtainable")
        if got is None:
            return f"whether the job's limits can be changed is not known ({self.guard.get('why')})"
        if got:
            return (f"a process of this token can obtain {', '.join(got)} on the job (an administrator's "
                    "privileges): it could allow breakaway and leave")
        return None

    def walls(self) -> list[dict[str, Any]]:
        wall = {"kind": "job", "path": self.path, "via": self.empty_proof, "breakaway": "never allowed",
                "limits_guard": dict(self.guard), "unleavable": self.leavable() is None,
                "leavable_because": self.leavable()}
        if self.adopted:
            wall["opened_by"] = "OpenJobObjectW by name, by the adopter (the owner was gone)"
        return [wall]

    def owns(self, pid: int) -> bool:
        return False

    def expected_placement(self) -> str:
        """Where the worker must be right after the spawn: in this job."""
        return self.path

    def escape_evidence(self) -> dict[str, Any]:
        """No API removes a process from a job; leaving needs breakaway at
        creation, which needs a breakaway flag on the job. So: are they set?"""
        from .._native import ffi, lib

        flags = ffi.new("uint32_t*")
        rc = lib.ct_job_limits(self.job, flags)
        via = "QueryInformationJobObject(JobObjectExtendedLimitInformation)"
        if rc != 0:
            return {"observed": None, "at": None, "via": via, "detail": f"query failed: {_error(rc, via)}"}
        f = int(flags[0])
        if f & (_LIMIT_BREAKAWAY_OK | _LIMIT_SILENT_BREAKAWAY_OK):
            return {"observed": True, "at": None, "via": via,
                    "detail": f"limit flags 0x{f:x} allow breakaway: something in the tree changed them"}
        if self.leavable() is None:
            return {"observed": False, "at": None, "via": "the job's limits guard (ct_job_probe)",
                    "detail": "no process of this token could allow breakaway: nothing can have left"}
        if not f & _LIMIT_KILL_ON_JOB_CLOSE:
            return {"observed": None, "at": None, "via": via,
                    "detail": f"limit flags read back as 0x{f:x} without our KILL_ON_JOB_CLOSE: not a reliable "
                    "read (Wine zero-fills this query)"}
        return {"observed": None, "at": None, "via": via,
                "detail": f"breakaway not allowed now; {self.leavable()}, and clear it again in between"}

    # -- observing (the owner loop waits in winhost.wait_ready) ------------

    def sources(self) -> list[Any]:
        return []           # the job posts to the port the run's Waiter blocks on

    def drain(self, ready: Any) -> None:
        pass

    def job_accounting(self) -> Any:
        from .._native import ffi, lib

        acc = ffi.new("struct ct_job_accounting*")
        _check(lib.ct_job_accounting(self.job, acc), "QueryInformationJobObject(JobObjectBasicAccountingInformation)")
        return acc

    def populated(self) -> bool:
        """ActiveProcesses != 0: the only emptiness the record trusts."""
        return int(self.job_accounting().active) != 0

    def wait_change(self, timeout: float) -> None:
        """Block on the completion port until the job is observed empty (by
        query) or `timeout` passes. Only while no Waiter shares the port:
        this drops every packet that is not the job's."""
        from .._native import lib

        if self.waiter is not None:
            self.waiter.wait(timeout)
            return
        ms = _INFINITE - 1 if timeout == float("inf") else max(0, int(timeout * 1000))
        _check(lib.ct_job_wait_empty(self.key, self.port, ms, self._wait), "GetQueuedCompletionStatus")

    def root_status(self) -> tuple[bool, int | None]:
        """(running, exit code) of the worker, from its handle."""
        running, code = winproc.status(self.process)
        if not running and self._worker_times is None:
            try:
                self._worker_times = winproc.process_times(self.process)
            except OSError:
                pass
        return running, code

    def members(self) -> list[int]:
        from .._native import ffi, lib

        cap = 64
        while True:
            pids = ffi.new("uint64_t[]", cap)
            assigned = ffi.new("uint32_t*")
            listed = ffi.new("uint32_t*")
            rc = lib.ct_job_pids(self.job, pids, cap, assigned, listed)
            if rc == _ERROR_MORE_DATA and cap < 1 << 20:   # it grew; ask again, larger
                cap = max(cap * 2, int(assigned[0]) + 16)
                continue
            _check(rc, "QueryInformationJobObject(JobObjectBasicProcessIdList)")
            return sorted(int(pids[i]) for i in range(listed[0]))

    def worker_times(self) -> dict[str, int] | None:
        if self._worker_times is None and self.process:
            try:
                return winproc.process_times(self.process)
            except OSError:
                return None
        return self._worker_times

    def accounting(self) -> dict[str, Any]:
        """Whole-tree CPU and peak memory, `null` with the reason where the
        job's numbers cannot be a measurement (winacct.py)."""
        return winacct.accounting(self)

    def limit_messages(self) -> dict[str, int]:
        """The port's limit messages over the run, as counted by whoever
        drained it (the owner's Waiter, ct_job_wait_empty)."""
        out = {"job_memory_limit": 0, "job_process_limit": 0}
        if self.waiter is not None:
            for k in out:
                out[k] += int(self.waiter.seen.get(k, 0))
        if self._wait is not None:
            out["job_memory_limit"] += int(self._wait.memory_limit)
            out["job_process_limit"] += int(self._wait.process_limit)
        return out

    def limits_record(self) -> dict[str, Any] | None:
        """The record's `limits` when limits were asked, else None."""
        if self.job_limits is None:
            return None
        return self.job_limits.record(self.limit_messages())

    def cpu_stat(self) -> dict[str, int] | None:
        """The job's CPU totals where accounting() finds them plausible, else None."""
        return winacct.cpu_stat(self)

    # -- stopping ----------------------------------------------------------

    def terminate(self, sig: int = 15) -> tuple[str, dict[str, Any]]:
        """The polite step: CTRL_BREAK_EVENT to the worker's process group,
        whatever `sig` asked for (Windows has no signals to send). It reaches
        only the group's processes attached to our console (a GUI program, a
        DETACHED_PROCESS child or a process of another console gets
        nothing), so it is sent only when a member of the job is attached to
        our console. The detail says what was sent, to whom it could be
        delivered, and why not (`sent`: true, false, or null when sending
        failed); the kill after the grace is what the record relies on."""
        from .._native import lib

        via = "GenerateConsoleCtrlEvent(CTRL_BREAK_EVENT) to the worker's process group"
        detail: dict[str, Any] = {"event": "CTRL_BREAK_EVENT", "asked_for": sig, "process_group": self.pid,
                                  "sent": False, "delivered": False, "reached": 0, "not_reached": None}
        self.last_terminate = detail
        if self.adopted:
            detail["reason"] = ("adopted after the owner died: a console control event reaches only the "
                                "sender's own console, and the tree's was its owner's")
            return via, detail
        if self.pid < 0:
            detail["reason"] = "no worker"
            return via, detail
        try:
            members = set(self.members())
        except OSError as e:
            detail.update(sent=None, delivered=None, reason=f"job members unknown: {e}")
            return via, detail
        detail["not_reached"] = len(members)
        console, why = winproc.console_pids()
        if console is None:
            detail["reason"] = f"this process has no console: {why}"
            return via, detail
        reach = sorted(members & console)
        detail["attached_to_our_console"] = reach
        if not reach:
            detail["reason"] = "no member of the job is attached to this process's console"
            return via, detail
        rc = lib.ct_job_ctrl_break(self.pid)
        if rc != 0:
            # Wine 8 implements only CTRL_C_EVENT (server/console.c,
            # propagate_console_signal).
            detail["reason"] = str(_error(rc, "GenerateConsoleCtrlEvent"))
            return via, detail
        # Posted to those processes; whether their handlers exit is theirs.
        detail.update(sent=True, delivered=True, reached=len(reach), not_reached=len(members) - len(reach))
        return via, detail

    def kill(self) -> str:
        from .._native import lib

        _check(lib.ct_job_terminate(self.job, KILL_EXIT_CODE), "TerminateJobObject")
        if self.adopted:
            # No completion port wakes an adopter when the job empties: wait
            # here, bounded, re-reading ActiveProcesses (ct_job_wait_empty
            # without a port queries every 100 ms); the driver observes next.
            _check(lib.ct_job_wait_empty(self.job, 0, _ADOPTED_KILL_WAIT_MS, self._wait),
                   "QueryInformationJobObject(JobObjectBasicAccountingInformation)")
            return "TerminateJobObject (the job opened by name by the adopter)"
        return "TerminateJobObject"

    def remove(self) -> str | None:
        """Close our handles. The job's last handle closing kills whatever is
        left (KILL_ON_JOB_CLOSE), so this is only called once it is empty;
        the Waiter on our port is closed first (it waits on our handles)."""
        from .._native import lib

        problem = None
        if self.waiter is not None:
            try:
                self.waiter.close()
            except OSError as e:
                problem = str(e)
        for name in ("process", "port", "job"):
            h = getattr(self, name)
            if h:
                rc = lib.ct_job_close_take(h)
                setattr(self, name, 0)
                if rc != 0 and problem is None:
                    problem = str(_error(rc, f"CloseHandle({name})"))
        return problem


def available() -> str | None:
    """None if a Job Object can be made here, else the reason."""
    try:
        Container.create("probe").remove()
    except ContainmentUnavailable as e:
        return e.reason
    except OSError as e:
        return str(e)
    return None
