"""`launcher.run`'s `subprocess` manners: capture, input, text, check.

    rec = launcher.run(["make"], capture_output=True, text=True, check=True)
    rec.returncode, rec.stdout, rec.stderr, rec.state

The result is the run's stop record (a `CompletedRun`), so everything a
record says is there too. `check=True` raises `RunFailed`, a
`subprocess.CalledProcessError`, when the worker's status is not 0 or the
stop did not hold (the record's state is neither REAPED nor EXITED); a run
ended by `timeout=` raises `RunTimedOut`, a `subprocess.TimeoutExpired`.
Both are `LauncherError`s and carry the record. Without `check`, a timed-out
run returns its record (outcome `timed_out`), as it always has.

Imported only when a run asks for one of these (`subprocess` stays off the
`contain run` path).
"""
from __future__ import annotations

import subprocess
from typing import Any, Mapping

from ._errors import LauncherError
from ._record import StopRecord


class CompletedRun(StopRecord):
    """What `launcher.run` returns: the run's stop record, with what
    `subprocess.run`'s CompletedProcess has besides (`args`, `returncode`,
    `stdout`, `stderr`: bytes, str with `text=True`, None when not
    captured). `to_dict()` is the record alone."""

    __slots__ = ("args", "stdout", "stderr")

    def __init__(self, record: StopRecord | Mapping[str, Any], args: Any, stdout: Any = None,
                 stderr: Any = None) -> None:
        super().__init__(record.to_dict() if isinstance(record, StopRecord) else record)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "stdout", stdout)
        object.__setattr__(self, "stderr", stderr)

    def __reduce__(self) -> Any:
        return (type(self), (self.to_dict(), self.args, self.stdout, self.stderr))

    def check_returncode(self) -> None:
        """Raise RunFailed (a subprocess.CalledProcessError) when the run
        did not end well: a non-zero status, or a stop that did not hold."""
        check(self)

    def __repr__(self) -> str:
        return (f"CompletedRun(args={self.args!r}, returncode={self.returncode!r}, "
                f"state={self.get('state')!r}, outcome={self.get('outcome')!r})")


class RunFailed(LauncherError, subprocess.CalledProcessError):
    """`check=True`: the run ended with a non-zero status, or its stop did
    not hold. `returncode`, `cmd`, `output`/`stdout`, `stderr` as
    `CalledProcessError` has them; `record` is the stop record."""

    def __init__(self, returncode: int, cmd: Any, output: Any = None, stderr: Any = None,
                 record: CompletedRun | None = None, why: str | None = None) -> None:
        subprocess.CalledProcessError.__init__(self, returncode, cmd, output, stderr)
        self.record = record
        self.run_id = record.get("run_id") if record is not None else None
        self.why = why

    def __str__(self) -> str:
        base = subprocess.CalledProcessError.__str__(self)
        return f"{base[:-1]}: {self.why}." if self.why else base

    def __reduce__(self) -> Any:
        return (type(self), (self.returncode, self.cmd, self.output, self.stderr, self.record, self.why))


class RunTimedOut(LauncherError, subprocess.TimeoutExpired):
    """`check=True`: the run was ended by its `timeout=`. `cmd`, `timeout`,
    `output`/`stdout`, `stderr` as `TimeoutExpired` has them; `record` is
    the stop record (outcome `timed_out`: the tree was stopped)."""

    def __init__(self, cmd: Any, timeout: float, output: Any = None, stderr: Any = None,
                 record: CompletedRun | None = None) -> None:
        subprocess.TimeoutExpired.__init__(self, cmd, timeout, output, stderr)
        self.record = record
        self.run_id = record.get("run_id") if record is not None else None

    def __reduce__(self) -> Any:
        return (type(self), (self.cmd, self.timeout, self.output, self.stderr, self.record))


def check(rec: CompletedRun, timeout: float | None = None) -> None:
    """Raise what `check=True` raises for `rec`, or nothing."""
    if rec.get("outcome") == "timed_out":
        raise RunTimedOut(rec.args, timeout if timeout is not None else float("nan"),
                          rec.stdout, rec.stderr, rec)
    state = rec.get("state")
    code = rec.returncode
    if state not in ("REAPED", "EXITED"):
        raise RunFailed(code if code is not None else 125, rec.args, rec.stdout, rec.stderr, rec,
                        f"its stop did not hold (state {state})")
    if code != 0:
        raise RunFailed(code if code is not None else 125, rec.args, rec.stdout, rec.stderr, rec)


def decode(data: bytes | None, encoding: str | None, errors: str | None) -> str | None:
    """As `subprocess` in text mode: the locale's encoding unless one is
    given, and universal newlines."""
    if data is None:
        return None
    if encoding is None:
        import locale

        encoding = locale.getpreferredencoding(False)
    text = data.decode(encoding, errors or "strict")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def encode(data: Any, text_mode: bool, encoding: str | None, errors: str | None) -> bytes | None:
    if data is None:
        return None
    if isinstance(data, str):
        if not text_mode:
            raise TypeError("input must be bytes unless text=True (or encoding=, errors=)")
        if encoding is None:
            import locale

            encoding = locale.getpreferredencoding(False)
        return data.encode(encoding, errors or "strict")
    return bytes(data)
