"""One tree of errors under `LauncherError` (see docs/api.md)."""
from __future__ import annotations

import errno as _errno
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class LauncherError(Exception):
    """Base of every error `launcher` raises on purpose. One raised by a
    run that had started (a failed spawn, a container refused after the
    claim) carries that run's final record as `record` and its id as
    `run_id` (None before any run existed)."""

    record: object = None
    run_id: str | None = None


class SpawnFailed(LauncherError, OSError):
    """The worker could not be started. `exit_code` is what a shell would
    say. Also an OSError with the errno of the failure (a missing program:
    ENOENT, as `subprocess` raises FileNotFoundError) and the program as
    `filename` (for an exec failure)."""

    def __init__(self, message: str, *, errno: int = 0, stage: str = "exec", path: str = "") -> None:
        OSError.__init__(self, errno, message)
        self.errno = errno
        self.stage = stage
        self.path = path
        if path and stage == "exec":
            self.filename = path
        # (init pid, PID namespace inode, reaped) of the wall it failed in, if any
        self.wall_init: tuple[int, int | None, bool] | None = None

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> Any:
        return (_spawn_failed, (str(self.strerror), self.errno, self.stage, self.path))

    @property
    def exit_code(self) -> int:
        if self.stage != "exec":
            return 125
        return 127 if self.errno in (_errno.ENOENT, _errno.ENOTDIR) else 126


def _spawn_failed(message: str, errno: int, stage: str, path: str) -> SpawnFailed:
    return SpawnFailed(message, errno=errno, stage=stage, path=path)


class ContainmentUnavailable(LauncherError):
    """The requested container cannot be made on this host."""

    def __init__(self, reason: str, *, doctor: str = "run `contain doctor` for what this host provides") -> None:
        super().__init__(f"{reason} ({doctor})")
        self.reason = reason
        self.doctor = doctor


class ProcessGone(LauncherError):
    """The process named by an identity no longer exists (or is another process now)."""


class AccessDenied(LauncherError):
    """The kernel refused an operation or an observation."""


class RunNotFound(LauncherError):
    """No run with that id exists in the state directory."""


class RunConflict(LauncherError):
    """The run id is held by a live run, or an operation id collides."""


class Unsupported(LauncherError):
    """This host lacks the capability the operation needs."""


def from_oserror(err: OSError, what: str) -> LauncherError:
    """Translate an OSError from `what` (a syscall or file) into our tree."""
    msg = f"{what}: {os.strerror(err.errno) if err.errno else err}"
    if err.errno in (_errno.EACCES, _errno.EPERM, _errno.EROFS):
        return AccessDenied(msg)
    if err.errno == _errno.ESRCH:
        return ProcessGone(msg)
    if err.errno in (_errno.ENOSYS, _errno.EOPNOTSUPP, _errno.EINVAL):
        return Unsupported(msg)
    return LauncherError(msg)


class ResourceExhausted(LauncherError, OSError):
    """A spawn this process cannot afford (its descriptors, RLIMIT_NOFILE):
    refused before anything started, errno EMFILE (_fdbudget.py)."""

    def __init__(self, message: str, err: int = _errno.EMFILE) -> None:
        OSError.__init__(self, err, message)
        self.errno = err

    def __str__(self) -> str:
        return str(self.strerror)
