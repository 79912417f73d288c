"""`contain run --stats-json FILE`: one compact JSON line per run, appended.

For benchmark harnesses that run the same command many times: the record's
accounting flattened to numbers, with nulls where a number could not be
read, and the reason for each null. The format (schema `contain.stats/1`) is
documented in docs/accounting.md; fields are only ever added.
"""
from __future__ import annotations

import json
import os
import stat
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Mapping

SCHEMA = "contain.stats/1"

# (line field, accounting field, scale): CPU goes out in seconds.
_NUMBERS = (
    ("wall_s", "wall_s", None),
    ("cpu_s", "cpu_usec", 1e-6),
    ("user_s", "cpu_user_usec", 1e-6),
    ("sys_s", "cpu_system_usec", 1e-6),
    ("mem_peak_bytes", "memory_peak_bytes", None),
    ("tasks_peak", "tasks_peak", None),
    ("oom_kills", "oom_kills", None),
    ("io_read_bytes", "io_read_bytes", None),
    ("io_write_bytes", "io_write_bytes", None),
)


def _value(m: Any, scale: float | None) -> tuple[Any, str | None]:
    if not isinstance(m, dict):
        return None, "not in the record"
    v = m.get("value")
    if v is None:
        return None, str(m.get("reason") or "not read")
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None, "not a number in the record"
    return (round(v * scale, 6) if scale is not None else v), None


def stats_line(rec: Mapping[str, Any]) -> str:
    """The line for one stop record (without the trailing newline)."""
    acct = rec.get("accounting")
    acct = acct if isinstance(acct, dict) else {}
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "run_id": rec.get("run_id"),
        "state": rec.get("state"),
        "outcome": rec.get("outcome"),
        "exit_code": rec.get("exit_code"),
        "signal": rec.get("signal"),
    }
    null: dict[str, str] = {}
    for name, field, scale in _NUMBERS:
        out[name], why = _value(acct.get(field), scale)
        if why is not None:
            null[name] = why if acct else "no accounting in the record"
    limits = rec.get("limits")
    hit = limits.get("hit") if isinstance(limits, dict) else None
    if isinstance(hit, dict):
        out["limit_hit"] = {k: (v.get("observed") if isinstance(v, dict) else None) for k, v in sorted(hit.items())}
    else:
        out["limit_hit"] = None
    cause = rec.get("signal_cause")
    out["killed_by"] = cause.get("cause") if isinstance(cause, dict) else None
    ev = rec.get("evidence")
    rd = ev.get("redispatch_eligible") if isinstance(ev, dict) else None
    out["redispatch_eligible"] = rd.get("observed") if isinstance(rd, dict) else None
    out["null"] = null
    return json.dumps(out, separators=(",", ":"), sort_keys=False)


def _open_stats(path: str, *, create: bool) -> int | None:
    """The --stats-json file opened O_APPEND (made 0644 with `create`), or,
    without `create`, None when it does not exist yet and its directory
    may be written. The path is untrusted, like --record: never follows a
    symlink in its last component, never opens a FIFO or device (O_NONBLOCK
    at open, then a regular-file check). `-` is standard output, as for
    --record (a file named `-` is `./-`). Raises OSError."""
    from ._safepath import open_dir_trusted_links

    if path == "-":
        fd = os.dup(1)               # EBADF when contain's stdout is closed
        try:
            os.write(fd, b"")        # EBADF on the read-only placeholder of a closed one (_cli)
        except OSError:
            os.close(fd)
            raise
        return fd

    parent, name = os.path.split(path)
    if not name:
        raise OSError(21, "is a directory")
    from ._recordfile import prepare

    # What --record writes in place, --stats-json does too (issue 31): our
    # own stdout or stderr however named (/dev/stderr, /dev/fd/N of ours),
    # and a device or FIFO of root's or ours (/dev/null, a named pipe a
    # collector reads), checked and opened as _recordfile.prepare does them.
    # A regular file (or none yet) is appended to below.
    target = prepare(path)
    try:
        if target.kind == "stream":
            return os.dup(target.fileno())
    finally:
        target.close()
    # The directories above: a symlink there is followed only when it
    # belongs to root or to us, as in --record (another user's would choose
    # the directory root appends in).
    dfd = open_dir_trusted_links(parent or ".", path)
    try:
        try:
            st0 = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st0.st_mode):
                # Not even opened: opening a device can act (a tty would become
                # our controlling terminal, a watchdog would arm).
                raise OSError(21 if stat.S_ISDIR(st0.st_mode) else 22, "not a regular file")
        except FileNotFoundError:
            if not create:
                if not os.access(".", os.W_OK | os.X_OK, dir_fd=dfd):
                    raise OSError(13, "its directory is not writable") from None
                return None
        fd = os.open(name, os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0) | os.O_NOFOLLOW | os.O_CLOEXEC
                     | os.O_NONBLOCK | os.O_NOCTTY, 0o644, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(21 if stat.S_ISDIR(st.st_mode) else 22, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


# A stream (a FIFO, a device, our stdout) opened by check_stats is kept for
# the run's line: a FIFO's reader sees end-of-file once its last writer
# closes, so a check that closed it sent the collector away before the line.
_HELD: dict[str, int] = {}


def check_stats(path: str) -> None:
    """Before the run: whether append_stats could write `path`, creating
    nothing (a run that cannot keep its stats line is refused up front, as
    --record is). Raises OSError."""
    if path in _HELD:
        return
    fd = _open_stats(path, create=False)
    if fd is None:
        return
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
    else:
        _HELD[path] = fd


def append_stats(path: str, line: str) -> None:
    """Append one line with a single write(2) on an O_APPEND descriptor (so
    lines from concurrent runs do not interleave inside a line on a local
    file system), creating the file 0644 (_open_stats says what is refused).
    Raises OSError, which the caller reports (stderr and the exit status)."""
    fd = _HELD.pop(path, None)
    if fd is None:
        fd = _open_stats(path, create=True)
    assert fd is not None
    try:
        os.set_blocking(fd, True)
        data = (line.rstrip("\n") + "\n").encode()
        n = os.write(fd, data)
        if n != len(data):
            raise OSError(28, f"--stats-json {path}: short write ({n} of {len(data)} bytes)")
    finally:
        os.close(fd)
