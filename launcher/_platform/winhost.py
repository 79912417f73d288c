"""The owner loop's pieces on Windows (`_platform.host` here): the worker as
the owner watches it (`Root`), the owner's wake-ups (`Wakeups`) and the
wait itself (`wait_ready`), with the names posixwait.py gives them on Linux.

One Waiter per run (winsync.py) on the run's completion port, the port the
Job Object posts its messages to: `Wakeups` makes it on the container's
port and listens there on the run's owner event (cancel requests from
other processes) and, from the main thread, on the console's Ctrl-C; the
worker's process handle is registered on it by `wait_ready` the first time
a `Root` is among the sources. Every source is an opaque object that
`wait_ready` understands; a packet is only a wake-up, and the driver reads
every input again after each (the worker's handle, ActiveProcesses, the
inbox). There is no polling loop: without a deadline the wait has no timeout.

There is no child subreaper on Windows (`reap_orphans` does nothing): an
orphan is not reparented to anyone, and the job holds it wherever it is.
"""
from __future__ import annotations

import errno
import threading
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable, Sequence

from .._record import evidence
from . import winproc
from .exits import RootExit as RootExit
from .winsync import Waiter, owner_event_name

# Readiness masks as on Linux; meaningless here (wait_ready reads no fds).
POLLIN, POLLPRI, POLLERR = 1, 2, 8


class Root:
    """The worker, by its process handle: `poll()` is its end, once. Our
    own worker's handle is the Container's (`owned=False`); an adopter's
    (`reattach`) is its own and is closed here."""

    def __init__(self, pid: int, handle: int, *, owned: bool, adopted: bool = False) -> None:
        self.pid = pid
        self.handle = handle
        self.owned = owned
        self.adopted = adopted
        self.ended = False
        self.watcher: Waiter | None = None

    @classmethod
    def reattach(cls, identity: Any) -> "Root | None":
        """The worker of an adopted run, if this very process (pid and
        creation time) still runs; pinned by the handle from then on."""
        try:
            h = winproc.open_identity(int(identity.pid), int(identity.start_time))
        except (OSError, TypeError, ValueError):
            return None
        return None if h is None else cls(int(identity.pid), h, owned=True, adopted=True)

    def source(self) -> "Root | None":
        return self if self.handle and not self.ended else None

    def watch(self, waiter: Waiter) -> None:
        """Have `waiter` woken when the worker exits (once per handle)."""
        if self.handle and not self.ended and not waiter.watching(self.handle):
            waiter.watch_process(self.handle)
            self.watcher = waiter

    def poll(self) -> RootExit | None:
        """The worker's end if it has ended (returned once)."""
        if not self.handle or self.ended:
            return None
        via = "process handle signalled + GetExitCodeProcess"
        if self.adopted:
            via += " (adopted: opened by pid + creation time)"
        try:
            running, code = winproc.status(self.handle)
        except OSError as e:
            self.ended = True
            self.close()
            return RootExit(None, None, None, evidence(None, via, f"failed: {e}"))
        if running:
            return None
        self.ended = True
        self.close()
        return RootExit("exited", code, None, evidence(True, via, {"exit_code": code}))

    def close(self) -> None:
        if not self.owned or not self.handle:
            return
        if self.watcher is not None:
            try:
                self.watcher.unwatch_process(self.handle)
            except OSError:
                return          # still registered: leaking the handle is safer than closing it
        winproc.close_handle(self.handle)
        self.handle = 0


def reap_orphans(root: Any, keep: Callable[[int], bool] = lambda pid: False) -> RootExit | None:
    """Nothing to reap on Windows: no process is reparented to the owner."""
    return None


def reap_tree_children(run: Any) -> RootExit | None:
    return None


class Wakeups:
    """The run's Waiter: on the container's completion port when it has one
    (then the container closes it before its handles, `Container.remove`),
    else on a port of its own (an adopter of a run whose job is gone).
    `wake()` is thread-safe. Without a run uid (or when the owner event is
    taken by someone else) there is no cross-process wake-up: `problem`
    says why, and the driver reads the inbox on a timer."""

    def __init__(self, layout: Any, *, container: Any = None, run_uid: str | None = None, pipe: bool = True) -> None:
        port = int(getattr(container, "port", 0) or 0)
        self.waiter = Waiter(port, job=int(getattr(container, "key", 0) or 0))
        if port:
            container.waiter = self.waiter
        self.problem: str | None = None
        self._listening = False
        if layout is not None:
            try:
                if not run_uid:
                    raise OSError(errno.EINVAL, "no run uid")
                self.waiter.listen(owner_event_name(run_uid))
                self._listening = True
            except (OSError, ValueError) as e:
                self.problem = f"cancel wake-up event unavailable ({e})"
        if threading.current_thread() is threading.main_thread():
            # The main thread blocked in the wait would see Ctrl-C (and run
            # Python's handler) only when the wait returns: make it return.
            try:
                self.waiter.forward_console_ctrl()
            except OSError:
                pass

    @property
    def inbox_woken(self) -> bool:
        return self._listening

    def sources(self) -> list[Any]:
        return [self.waiter]

    def drain(self, ready: Sequence[Any]) -> None:
        pass                 # wait() took every packet already

    def wake(self) -> None:
        self.waiter.wake()

    def close(self) -> None:
        self.waiter.close()


def wait_ready(sources: Sequence[Any], timeout: float) -> list[Any]:
    """Block until any of `sources` has something or `timeout` seconds pass;
    what woke (opaque: the driver reads every input again). The Waiter
    among the sources is what blocks; a Root among them is registered on
    it first. With no Waiter (nothing can wake us), a bounded sleep."""
    waiter = next((s for s in sources if isinstance(s, Waiter)), None)
    if waiter is None:
        if timeout > 0:
            time.sleep(min(timeout, 0.05))
        return []
    for s in sources:
        if isinstance(s, Root):
            s.watch(waiter)
    waiter.wait(None if timeout == float("inf") else max(0.0, timeout))
    return [waiter]


class Orphaned:
    """The job of a run whose owner is gone (adoption). It was anonymous
    and only its owner held a handle: with KILL_ON_JOB_CLOSE, Windows ended
    the tree when that handle closed, unless a process of the tree held one
    too. Nothing can open it now, so nothing is observed or signalled: the
    stop is UNCONFIRMED with the reason, never REAPED."""

    backend = "job-object"
    dir = None
    leaf = None
    hierarchy = None
    events_fd = -1
    seal_detail = None
    vouched: str | None = None
    port = 0
    key = 0
    waiter: Any = None
    empty_via = "QueryInformationJobObject ActiveProcesses"
    empty_proof = ""
    # The stop's words when a step fails (_stop.py): Windows', not Linux's.
    term_via = "GenerateConsoleCtrlEvent(CTRL_BREAK_EVENT)"
    kill_via = "TerminateJobObject"

    def __init__(self, path: str | None, reason: str | None = None) -> None:
        self.path = path
        self.reason = reason or (
            "the run's Job Object is gone with its owner: it was anonymous and held only by the owner, so it "
            "cannot be opened to be observed; KILL_ON_JOB_CLOSE ended the tree when the owner's last handle "
            "closed, unless a process of the tree held a handle to the job, and no one observed it empty")

    def _refuse(self) -> OSError:
        return OSError(errno.ESTALE, self.reason)

    def sources(self) -> list[Any]:
        return []

    def drain(self, ready: Any) -> None:
        pass

    def root(self, sp: Any) -> Any:
        raise self._refuse()

    def unleavable(self) -> str | None:
        return None

    def leavable(self) -> str | None:
        return self.reason

    def walls(self) -> list[dict[str, Any]]:
        return [{"kind": "job", "path": self.path, "observed_empty": None, "via": "none", "detail": self.reason}]

    def owns(self, pid: int) -> bool:
        return False

    def placed(self, pid: int) -> str | None:
        return None

    def seal_status(self, req: Any) -> tuple[bool, str | None]:
        return False, "the worker ran as the supervisor's user"

    def escape_evidence(self) -> dict[str, Any]:
        return {"observed": None, "at": None, "via": "none", "detail": self.reason}

    def populated(self) -> bool:
        raise self._refuse()

    def wait_change(self, timeout: float) -> None:
        time.sleep(min(timeout, 0.05))

    def members(self) -> list[int]:
        return []

    def cpu_stat(self) -> dict[str, int] | None:
        return None

    def terminate(self, sig: int = 15) -> tuple[str, dict[str, Any]]:
        raise self._refuse()

    def kill(self) -> str:
        raise self._refuse()

    def remove(self) -> str | None:
        return None


class JobGone(Orphaned):
    """The named job of a run whose owner is gone, which no longer exists:
    OpenJobObjectW found no job of that name. A name lives as long as a
    handle to the object does, so no handle to the job is left anywhere,
    and the job's last handle closing ran KILL_ON_JOB_CLOSE (a limit no
    handle of this user could clear: the limits guard), which terminates
    every process in the job. That is the kernel's act, not an observation
    of ActiveProcesses == 0 (a job nobody holds cannot be queried): the
    stop observes it as the tree gone, unproven (_stop.observe: EXITED,
    `container_empty` null with this reason), and sends nothing."""

    empty_via = "OpenJobObjectW by the job's name"

    def __init__(self, path: str, where: str | None = None) -> None:
        # `where`: the namespace the lookup was made in, checked against the
        # one the owner recorded (_containers._job_namespace); None for a run
        # whose owner recorded none.
        super().__init__(path, (
            f"no job named {path} exists any more{' ' + where if where else ''}: no handle to it is left "
            "anywhere (a name lives as long as a handle does), so KILL_ON_JOB_CLOSE began terminating every "
            "process in it when the last one closed; but the processes hold the job by reference, not by "
            "handle, so the name's absence does not prove them gone, and a job nobody holds cannot be queried: "
            "ActiveProcesses == 0 was not observed"))
        self.gone_detail = self.reason

    def populated(self) -> bool:
        return False

    def walls(self) -> list[dict[str, Any]]:
        return [{"kind": "job", "path": self.path, "observed_empty": None, "via": self.empty_via,
                 "detail": self.reason}]
