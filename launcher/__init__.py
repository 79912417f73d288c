"""contain: every worker in a kernel container from its first instruction.

This module only re-exports; everything lives in private modules. Names are
resolved on first use, so the `contain run` path imports only what it needs.
"""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path

__version__ = "0.1.0"

_EXPORTS = {
    "run": "._worker",
    "spawn": "._worker",
    "Worker": "._worker",
    "cancel": "._cancel",
    "open_worker": "._aio",
    "run_process": "._aio",
    "AsyncWorker": "._aio",
    "AsyncSupervisor": "._aio",
    "Supervisor": "._supervisor",
    "scan_processes": "._scan",
    "ProcessInfo": "._scan",
    "capabilities": "._doctor",
    "StopRecord": "._record",
    "CompletedRun": "._completed",
    "RunFailed": "._completed",
    "RunTimedOut": "._completed",
    "CancelRecord": "._record",
    "Unknown": "._record",
    "State": "._enums",
    "Outcome": "._enums",
    "Effect": "._enums",
    "LauncherError": "._errors",
    "SpawnFailed": "._errors",
    "ContainmentUnavailable": "._errors",
    "ProcessGone": "._errors",
    "AccessDenied": "._errors",
    "RunNotFound": "._errors",
    "RunConflict": "._errors",
    "Unsupported": "._errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from typing import Any

    from ._aio import (AsyncSupervisor as AsyncSupervisor, AsyncWorker as AsyncWorker, open_worker as open_worker,
                       run_process as run_process)
    from ._cancel import cancel as cancel
    from ._errors import (AccessDenied as AccessDenied, ContainmentUnavailable as ContainmentUnavailable,
                          LauncherError as LauncherError, ProcessGone as ProcessGone,
                          RunConflict as RunConflict, RunNotFound as RunNotFound,
                          SpawnFailed as SpawnFailed, Unsupported as Unsupported)
    from ._doctor import capabilities as capabilities
    from ._completed import CompletedRun as CompletedRun, RunFailed as RunFailed, RunTimedOut as RunTimedOut
    from ._record import CancelRecord as CancelRecord, StopRecord as StopRecord, Unknown as Unknown
    from ._scan import ProcessInfo as ProcessInfo, scan_processes as scan_processes
    from ._enums import Effect as Effect, Outcome as Outcome, State as State
    from ._supervisor import Supervisor as Supervisor
    from ._worker import Worker as Worker, run as run, spawn as spawn


del TYPE_CHECKING   # a flag for type checkers, not part of the public surface


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'launcher' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__ + ["__version__"]
