"""The line files and acknowledgements of a run directory: the cancel inbox
(`cancellations/requests.ndjson`), the acknowledgements
(`cancellations/<op>.json`) and the registry of nested runs
(`nested.ndjson`).

Functions of a RunDir, through its public face (dir_fd, cancellations_fd,
read_bytes, the pokes); RunDir's methods of the same names call them.
Every line read is checked (_runfiles.parse_request, parse_nested) and what
does not fit is rejected with the reason, never raised at the owner.
"""
from __future__ import annotations

import errno
import os
import stat
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Iterator

    from ._layout import RunDir

from . import _safefs as F
from ._errors import RunConflict
from ._jsonenc import dumps
from ._runfiles import (MAX_ACK, MAX_LINE, Rejected, Request, encode, loads, parse_ack, parse_nested,
                        parse_request, valid_op_id)
from ._safefs import UnsafePath
from ._statedir import FILE_MODE

# The inbox is read at most this much per call: a huge file (or line) costs
# one bounded read per wake-up, never the whole file again.
INBOX_CHUNK = 64 << 10
# At most this many acknowledgements are listed: a directory stuffed with
# entries costs bounded work.
MAX_ACKS = 10_000
_OP_SAFE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def op_filename(op: str) -> str:
    """A file name for an operation id. Ids that are already safe map to
    themselves; others get a digest suffix, so two different ids can only
    share a file if they are equal (and equality is checked on read)."""
    if valid_op_id(op) is None:
        # As the owner checks a request (parse_request): an id it would drop
        # unanswered is refused here, before anything is written.
        raise ValueError("operation id must be 1 to 200 printable characters")
    safe = "".join(c if c in _OP_SAFE_CHARS else "_" for c in op)
    if safe != op or safe.startswith("."):
        import hashlib      # only for odd ids: kept off the `contain run` path

        safe = f"{safe.lstrip('.')[:80]}~{hashlib.sha256(op.encode()).hexdigest()[:12]}"
    return safe + ".json"


class InboxRead:
    """What one read of the inbox found: requests to act on, lines rejected
    (each with its reason and, when it had one, its op id), the offset to
    read from next, and whether more is already there (read again)."""

    __slots__ = ("accepted", "rejected", "offset", "more")

    def __init__(self, accepted: list[Request], rejected: list[Rejected], offset: int, more: bool) -> None:
        self.accepted = accepted
        self.rejected = rejected
        self.offset = offset
        self.more = more

    def __iter__(self) -> Iterator[Any]:
        return iter((self.accepted, self.rejected, self.offset))

    def __repr__(self) -> str:
        return f"InboxRead(accepted={self.accepted!r}, rejected={self.rejected!r}, offset={self.offset})"


# -- the inbox ---------------------------------------------------------------------

def append_request(d: RunDir, req: dict[str, Any], *, poke: bool = True) -> None:
    """Record a cancel intent: one O_APPEND write (atomic for a line under
    PIPE_BUF), written before anyone may act on it (crash-consistent, not
    fsynced: _safefs.POWER_LOSS_DURABLE), then the owner is poked. Raises
    ValueError (too large), PersistError (not written: nothing may be
    signalled on its behalf)."""
    data = (dumps(req, compact=True) + "\n").encode()
    if len(data) > MAX_LINE - 1:
        raise ValueError("cancel request too large")
    cfd = d.cancellations_fd(write=True, create=True)
    try:
        fd, created = F.open_append(cfd, "requests.ndjson", d.requests, mode=FILE_MODE)
        try:
            F.append_line(fd, data, d.requests, durable=True)
        finally:
            os.close(fd)
        if created:
            try:
                F.sync(cfd)
            except OSError as e:
                raise F.persist_error(e, "fsync of the directory", d.requests) from None
    finally:
        os.close(cfd)
    if poke:
        d.poke_owner()


def read_inbox(d: RunDir, offset: int = 0, run_uid: str | None = None, *, require_uid: bool = True) -> InboxRead:
    """The requests after `offset`, at most INBOX_CHUNK bytes of them, each
    checked (_runfiles.parse_request; `run_uid`, when given, must match).
    Never raises for what is in the file: a line that is not a request is
    returned in `rejected` with the reason; a line longer than MAX_LINE is
    rejected once and skipped, never read again; an unterminated last line
    is left for the next call (its writer may be mid-write). A problem with
    the inbox itself (a symlink, a FIFO) is one rejection, offset unchanged."""
    try:
        cfd = d.cancellations_fd()
    except FileNotFoundError:
        return InboxRead([], [], offset, False)
    except (OSError, UnsafePath) as e:
        return InboxRead([], [Rejected(f"cancellations/: {e}", offset)], offset, False)
    try:
        try:
            fd = os.open("requests.ndjson", F.O_READ, dir_fd=cfd)
        except FileNotFoundError:
            return InboxRead([], [], offset, False)
        except OSError as e:
            why = "is a symlink (not followed)" if e.errno == errno.ELOOP else os.strerror(e.errno or errno.EIO)
            return InboxRead([], [Rejected(f"requests.ndjson {why}", offset)], offset, False)
    finally:
        os.close(cfd)
    rejected: list[Rejected] = []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return InboxRead([], [Rejected("requests.ndjson is not a regular file", offset)], offset, False)
        if offset > st.st_size:
            rejected.append(Rejected(f"requests.ndjson shrank below offset {offset}: read on from its end", offset))
            return InboxRead([], rejected, st.st_size, False)
        inside_long_line = offset > 0 and os.pread(fd, 1, offset - 1) != b"\n"
        data = os.pread(fd, INBOX_CHUNK, offset)
    except OSError as e:
        return InboxRead([], [Rejected(f"requests.ndjson: {os.strerror(e.errno or errno.EIO)}", offset)],
                         offset, False)
    finally:
        os.close(fd)
    return parse_chunk(data, offset, inside_long_line, run_uid, require_uid=require_uid, rejected=rejected)


def parse_chunk(data: bytes, offset: int, inside_long_line: bool, run_uid: str | None, *,
                require_uid: bool = True, rejected: list[Rejected] | None = None) -> InboxRead:
    """The requests in `data`, read from the inbox at `offset` (at most
    INBOX_CHUNK bytes; `inside_long_line`: the byte before `offset` is not a
    newline), as read_inbox returns them. Pure: Windows reads the file its
    own way (_platform/winlayout.py) and parses it here."""
    rejected = [] if rejected is None else rejected
    pos = 0
    if inside_long_line:
        nl = data.find(b"\n")
        if nl < 0:
            return InboxRead([], [], offset + len(data), len(data) == INBOX_CHUNK)
        pos = nl + 1
    accepted: list[Request] = []
    while True:
        nl = data.find(b"\n", pos)
        if nl < 0:
            break
        line = data[pos:nl]
        if len(line) > MAX_LINE:
            rejected.append(Rejected(f"line of {len(line)} bytes, more than {MAX_LINE}", offset + pos))
        elif line.strip():
            try:
                accepted.append(parse_request(line, offset + pos, run_uid, require_uid=require_uid))
            except Rejected as r:
                rejected.append(r)
        pos = nl + 1
    if len(data) - pos > MAX_LINE:
        rejected.append(Rejected(f"unterminated line of more than {MAX_LINE} bytes: skipped", offset + pos))
        pos = len(data)
    return InboxRead(accepted, rejected, offset + pos, len(data) == INBOX_CHUNK)


def read_requests(d: RunDir, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The requests after `offset` as dicts, and the offset after them: the
    pre-typed interface of read_inbox (every line checked, rejected lines
    dropped). A request without a run uid is passed on (the owner compares
    it), as before requests were typed."""
    out: list[dict[str, Any]] = []
    for _ in range(16):
        got = read_inbox(d, offset, None, require_uid=False)
        out.extend(r.to_dict() for r in got.accepted)
        offset = got.offset
        if not got.more:
            break
    return out, offset


# -- acknowledgements -------------------------------------------------------------

def read_ack(d: RunDir, op: str) -> dict[str, Any] | None:
    """The acknowledgement of `op`, checked; None if there is none (or it is
    unreadable: the owner answers again). Raises RunConflict when the file
    names another operation."""
    name = op_filename(op)
    try:
        data = d.read_bytes(name, MAX_ACK, sub=True)
    except (OSError, UnsafePath):
        return None
    if data is None:
        return None
    try:
        obj = loads(data, name)
    except ValueError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("op_id"), str) and obj["op_id"] != op:
        raise RunConflict(f"operation id {op!r} collides with {obj['op_id']!r} in {d.ack_path(op)}")
    try:
        return parse_ack(obj)
    except ValueError:
        return None


def write_ack(d: RunDir, op: str, ack: dict[str, Any], *, durable: bool = False) -> None:
    """Raises RunConflict (the file names another operation), PersistError."""
    name = op_filename(op)
    try:
        data = d.read_bytes(name, MAX_ACK, sub=True)
        existing = loads(data, name) if data is not None else None
    except (OSError, UnsafePath, ValueError):
        existing = None
    if isinstance(existing, dict) and existing.get("op_id") != op:
        raise RunConflict(f"operation id {op!r} collides with {str(existing.get('op_id'))[:200]!r}")
    cfd = d.cancellations_fd(write=True, create=True)
    try:
        F.replace_file(cfd, name, encode(ack), d.ack_path(op), mode=FILE_MODE, durable=durable)
    finally:
        os.close(cfd)
    d.poke_waiters()


def acks(d: RunDir) -> list[dict[str, Any]]:
    """Every readable acknowledgement, checked, by file name."""
    out: list[dict[str, Any]] = []
    try:
        cfd = d.cancellations_fd()
    except (OSError, UnsafePath):
        return out
    try:
        with os.scandir(cfd) as it:
            names = []
            for e in it:
                if e.name.endswith(".json") and not e.name.startswith("."):
                    names.append(e.name)
                    if len(names) >= MAX_ACKS:
                        break
        for n in sorted(names):
            try:
                out.append(parse_ack(loads(F.read_file(cfd, n, f"{d.cancellations}/{n}", MAX_ACK), n)))
            except (OSError, UnsafePath, ValueError):
                continue
    finally:
        os.close(cfd)
    return out


# -- nested runs (the registry of _nested) -----------------------------------------

def append_nested(d: RunDir, entry: dict[str, Any]) -> None:
    """Register a run nested in this one: one O_APPEND line in nested.ndjson
    (O_NOFOLLOW, 0600). Raises ValueError (not a registration, too long),
    UnsafePath, PersistError."""
    parse_nested(entry)
    line = (dumps(entry, compact=True) + "\n").encode()
    if len(line) > MAX_LINE - 1:
        raise ValueError("nested run registration too large")
    fd = d.dir_fd(write=True)
    try:
        afd, _created = F.open_append(fd, "nested.ndjson", d.file("nested.ndjson"), mode=FILE_MODE)
        try:
            F.append_line(afd, line, d.file("nested.ndjson"))
        finally:
            os.close(afd)
    finally:
        os.close(fd)


def read_nested(d: RunDir, limit: int = 10_000) -> list[dict[str, Any]]:
    """The registrations in nested.ndjson, each checked (parse_nested);
    lines that do not fit are skipped. Bounded: at most `limit` lines of at
    most MAX_LINE bytes each are looked at."""
    try:
        data = d.read_bytes("nested.ndjson", limit * MAX_LINE)
    except (OSError, UnsafePath):
        return []
    out = []
    for raw in (data or b"").split(b"\n")[:limit]:
        if not raw.strip() or len(raw) > MAX_LINE:
            continue
        try:
            out.append(parse_nested(loads(raw, "nested.ndjson")))
        except ValueError:
            continue
    return out
