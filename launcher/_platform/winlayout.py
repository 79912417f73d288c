"""The run directory on Windows: the same layout, files and parsers as
_layout.py, on the primitives Windows has (winfs.py, winsync.py).

    <state>\\runs\\<id>\\run.json, journal.ndjson, record.json    as on Linux
    <state>\\runs\\<id>\\owner.lock          LockFileEx, held by the owner for its lifetime
    <state>\\runs\\<id>\\cancellations\\requests.ndjson, <op>.json   the inbox, the acknowledgements
    <state>\\runs\\<id>\\waiters\\<token>     one empty file per waiting process; the owner sets
                                         the named event `winsync.waiter_event_name(token)`

What differs from Linux, and why:
- No directory fds (openat) on Windows: paths, each directory checked to be
  a real directory of this user (not a reparse point) when it is found or
  claimed, and every file opened with FILE_FLAG_OPEN_REPARSE_POINT and
  refused if it is one (winfs.read_at). Other users have no access to
  %LOCALAPPDATA%; a process of this user could as well end the owner.
- The owner's wake-up is the named event `Local\\contain-<run uid>-owner`
  (winhost.Wakeups listens, `poke_owner` sets it), not a FIFO; waiters
  wait on events of their own, not FIFOs.
- The owner lock is LockFileEx (winfs.OwnerLock): Windows drops it when
  its holder dies. It is taken after the claimed directory is renamed into
  place (Windows refuses to rename a directory while a file in it is open),
  so for that moment the lock is free; an adopter then finds no run.json
  and no record, and adopts nothing.
- Replacing a file that a reader holds open fails on Windows: replaces are
  retried for a bounded time (winfs.replace), then raise PersistError.
- Ended runs are moved aside on id reuse as on Linux. Retention and
  `contain gc` look at every run (winstate.collect): no link count to
  tell cheaply whether the bound is passed.
"""
from __future__ import annotations

import errno
import json
import os
import threading
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Iterator

from .. import _requests
from .._errors import RunConflict, RunNotFound
from .._record import now_iso
from .._requests import INBOX_CHUNK, MAX_ACKS, InboxRead, op_filename, parse_chunk
from .._names import valid_id
from .._runfiles import (MAX_ACK, MAX_LINE, MAX_RECORD, MAX_RUN_INFO, Rejected, RunInfo, Unreadable, encode,
                         loads, parse_ack, parse_nested, parse_record, parse_run_info)
from .._safefs import UnsafePath
from .._state import LIVE_STATES
from . import winfs, winsync
from .._statedir import PRUNE_SLACK, keep_runs
from .winstate import (StateDir as StateDir, Watcher as Watcher, check_dir, check_id, claim_guard, collect,
                       location as location, move_aside, persist_error, remove_tree)


def gc(st: StateDir, *, older_than: float | None = None, keep: int | None = None) -> Any:
    """`contain gc` on Windows (winstate.collect over this RunDir)."""
    return collect(st, RunDir, older_than=older_than, keep=keep)

MAX_WAITERS = 1024


class RunDir:
    """One run's directory (`<state>\\runs\\<id>`), with the face of
    _layout.RunDir. Nothing is opened until it is used."""

    def __init__(self, path: str) -> None:
        self.path = os.path.normpath(path)
        self.id = os.path.basename(self.path)
        self.cancellations = os.path.join(self.path, "cancellations")
        self.requests = os.path.join(self.cancellations, "requests.ndjson")
        self._mu = threading.RLock()
        self._lock: winfs.OwnerLock | None = None

    def __repr__(self) -> str:
        return f"RunDir({self.path!r})"

    # -- finding and claiming ----------------------------------------------

    @staticmethod
    def runs_root(sd: str | None = None) -> str:
        return os.path.join(sd or location(), "runs")

    @classmethod
    def find(cls, run_id: str, sd: str | None = None) -> "RunDir":
        check_id(run_id)
        try:
            st = StateDir.open(sd, write=False)
            d = cls(os.path.join(st.runs, run_id))
            check_dir(d.path, create=False)
            check_dir(d.cancellations, create=False)   # a claimed directory: findable before run.json
        except FileNotFoundError:
            raise RunNotFound(f"no run {run_id!r} in {cls.runs_root(sd)}") from None
        return d

    @classmethod
    def all(cls, sd: str | None = None) -> Iterator["RunDir"]:
        try:
            st = StateDir.open(sd, write=False)
        except FileNotFoundError:
            return
        for n in sorted(e.name for e in os.scandir(st.runs) if valid_id(e.name)):
            yield cls(os.path.join(st.runs, n))

    @classmethod
    def claim(cls, run_id: str, sd: str | None = None, *, info: dict[str, Any] | None = None) -> "RunDir":
        """As _layout.RunDir.claim: the run appears under its id with its
        cancellations\\ made, then the owner lock is taken (see above)."""
        check_id(run_id)
        if info is not None:
            parse_run_info(info, run_id)
        st = StateDir.open(sd, write=True, create=True)
        guard = claim_guard(st)
        try:
            d = cls(os.path.join(st.runs, run_id))
            if os.path.lexists(d.path):
                try:
                    check_dir(d.path, create=False)
                    if d.is_live():
                        raise RunConflict(f"run id {run_id!r} is held by a live run")
                except UnsafePath:
                    pass        # not a directory of ours: never a run; moved aside
                old = d.load_run()
                move_aside(st, run_id, old.run_uid if isinstance(old, RunInfo) else None)
            d._create(st, info)
            keep = keep_runs()
            # (Counting names is cheap; reading every record is not.)
            if keep > 0 and sum(1 for e in os.scandir(st.runs) if valid_id(e.name)) > keep + PRUNE_SLACK:
                try:
                    collect(st, cls, prune_to=keep)    # the retention bound (docs/protocol.md)
                except OSError:
                    pass                              # retention never fails a run
        finally:
            guard.release()
        return d

    def _create(self, st: StateDir, info: dict[str, Any] | None) -> None:
        tmp = os.path.join(st.runs, f".claim-{self.id}-{os.urandom(4).hex()}")
        os.mkdir(tmp)
        try:
            check_dir(tmp, create=False)
            check_dir(os.path.join(tmp, "cancellations"), create=True)
            with open(os.path.join(tmp, "owner.lock"), "xb"):
                pass
            if info is not None:
                winfs.write_bytes_atomic(os.path.join(tmp, "run.json"), encode(info))
            try:
                os.rename(tmp, self.path)
            except FileExistsError:
                raise RunConflict(f"run id {self.id!r} was taken while it was claimed") from None
        except BaseException:
            remove_tree(tmp)
            raise
        if not self.take_ownership():
            raise RunConflict(f"run {self.id}: its owner lock was taken as it was claimed")

    def is_live(self) -> bool:
        """As _layout.RunDir.is_live."""
        if self.owner_alive():
            return True
        rec = self.load_record()
        if rec is None:
            return self.load_run() is not None
        if isinstance(rec, Unreadable):
            return False
        return rec["state"] in LIVE_STATES

    # -- owning ------------------------------------------------------------

    def take_ownership(self) -> bool:
        with self._mu:
            if self._lock is not None:
                return True
            try:
                lock = winfs.OwnerLock.acquire(self.file("owner.lock"))
            except OSError as e:
                raise UnsafePath(self.file("owner.lock"), e.strerror or str(e), e.errno or errno.EPERM) from None
            self._lock = lock
            return lock is not None

    def release(self) -> None:
        with self._mu:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def owner(self) -> bool | None:
        with self._mu:
            if self._lock is not None:
                return True
        return winfs.lock_held(self.file("owner.lock"))

    def owner_alive(self) -> bool:
        return self.owner() is not False

    def opened(self) -> "_Opened":
        return _Opened(self)

    # -- files -------------------------------------------------------------

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read_bytes(self, name: str, limit: int, *, sub: bool = False) -> bytes | None:
        path = os.path.join(self.cancellations if sub else self.path, name)
        try:
            return winfs.read_bytes(path, limit)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EFBIG, errno.EINVAL):
                raise UnsafePath(path, e.strerror or str(e), e.errno) from None
            raise

    def _load(self, name: str, limit: int, parse: Any) -> Any:
        try:
            data = self.read_bytes(name, limit)
        except UnsafePath as e:
            return Unreadable(e.problem)
        except OSError as e:
            return Unreadable(f"{name}: {os.strerror(e.errno or errno.EIO)}")
        if data is None:
            return None
        try:
            return parse(loads(data, name))
        except ValueError as e:
            return Unreadable(str(e))

    def _write_atomic(self, path: str, data: bytes, durable: bool = False) -> None:
        try:
            winfs.write_bytes_atomic(path, data, fsync=durable)
        except OSError as e:
            raise persist_error(e, "rename", path) from None

    def _append(self, path: str, line: bytes, durable: bool = False) -> None:
        """One appended line; started with a newline if a writer before us
        was cut short (as _safefs.append_line)."""
        try:
            try:
                _data, size, _prev = winfs.read_at(path, 0, 0)
                last = winfs.read_at(path, size - 1, 1)[0] if size else b"\n"
            except FileNotFoundError:
                last = b"\n"
            winfs.append_line(path, line if last == b"\n" else b"\n" + line, fsync=durable)
        except OSError as e:
            raise persist_error(e, "write", path) from None

    def write_run(self, info: dict[str, Any]) -> None:
        self._write_atomic(self.file("run.json"), encode(info))

    def load_run(self) -> RunInfo | Unreadable | None:
        return self._load("run.json", MAX_RUN_INFO, lambda o: parse_run_info(o, self.id))

    def read_run(self) -> dict[str, Any] | None:
        info = self.load_run()
        return info.raw if isinstance(info, RunInfo) else None

    def write_record(self, rec: dict[str, Any] | bytes, *, durable: bool) -> None:
        self._write_atomic(self.file("record.json"), rec if isinstance(rec, bytes) else encode(rec, pretty=durable),
                      durable)
        self.poke_waiters()

    def load_record(self, *, summary: bool = False) -> dict[str, Any] | Unreadable | None:
        return self._load("record.json", MAX_RECORD, lambda o: parse_record(o, self.id, summary=summary))

    def read_record(self) -> dict[str, Any] | None:
        rec = self.load_record()
        return None if rec is None or isinstance(rec, Unreadable) else rec

    def journal(self, event: str, sync: bool = False, **fields: Any) -> None:
        line = (json.dumps({"at": now_iso(), "event": event, **fields}, separators=(",", ":")) + "\n").encode()
        self._append(self.file("journal.ndjson"), line, sync)

    def read_journal(self) -> list[dict[str, Any]]:
        try:
            data = self.read_bytes("journal.ndjson", MAX_RECORD)
        except OSError:
            return []
        out = []
        for line in (data or b"").splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out

    # -- the inbox, acknowledgements, nested runs ----------------------------

    def append_request(self, req: dict[str, Any], *, poke: bool = True) -> None:
        """Durably record a cancel intent (FILE_FLAG_WRITE_THROUGH), then poke
        the owner (unless `poke` is False: the caller wakes it itself)."""
        data = (json.dumps(req, separators=(",", ":")) + "\n").encode()
        if len(data) > MAX_LINE - 1:
            raise ValueError("cancel request too large")
        check_dir(self.cancellations, create=True)
        self._append(self.requests, data, durable=True)
        if poke:
            self.poke_owner()

    def read_inbox(self, offset: int = 0, run_uid: str | None = None, *, require_uid: bool = True) -> InboxRead:
        """As _requests.read_inbox: never raises for the file's content."""
        try:
            data, size, prev = winfs.read_at(self.requests, offset, INBOX_CHUNK)
        except FileNotFoundError:
            return InboxRead([], [], offset, False)
        except OSError as e:
            return InboxRead([], [Rejected(f"requests.ndjson: {e.strerror or e}", offset)], offset, False)
        if offset > size:
            return InboxRead([], [Rejected(f"requests.ndjson shrank below offset {offset}: read on from its end",
                                           offset)], size, False)
        return parse_chunk(data, offset, offset > 0 and prev != b"\n", run_uid, require_uid=require_uid)

    def read_requests(self, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
        out: list[dict[str, Any]] = []
        for _ in range(16):
            got = self.read_inbox(offset, None, require_uid=False)
            out.extend(r.to_dict() for r in got.accepted)
            offset = got.offset
            if not got.more:
                break
        return out, offset

    def ack_path(self, op: str) -> str:
        return os.path.join(self.cancellations, op_filename(op))

    def read_ack(self, op: str) -> dict[str, Any] | None:
        return _requests.read_ack(self, op)  # type: ignore[arg-type]  # (read_bytes and ack_path only)

    def write_ack(self, op: str, ack: dict[str, Any], *, durable: bool = False) -> None:
        name = op_filename(op)
        try:
            data = self.read_bytes(name, MAX_ACK, sub=True)
            existing = loads(data, name) if data is not None else None
        except (OSError, ValueError):
            existing = None
        if isinstance(existing, dict) and existing.get("op_id") != op:
            raise RunConflict(f"operation id {op!r} collides with {str(existing.get('op_id'))[:200]!r}")
        check_dir(self.cancellations, create=True)
        self._write_atomic(self.ack_path(op), encode(ack, pretty=durable), durable)
        self.poke_waiters()

    def acks(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            names = sorted(n for n in os.listdir(self.cancellations)
                           if n.endswith(".json") and not n.startswith("."))[:MAX_ACKS]
        except OSError:
            return out
        for n in names:
            try:
                data = self.read_bytes(n, MAX_ACK, sub=True)
                if data is not None:
                    out.append(parse_ack(loads(data, n)))
            except (OSError, ValueError):
                continue
        return out

    def append_nested(self, entry: dict[str, Any]) -> None:
        parse_nested(entry)
        line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        if len(line) > MAX_LINE - 1:
            raise ValueError("nested run registration too large")
        self._append(self.file("nested.ndjson"), line)

    def read_nested(self, limit: int = 10_000) -> list[dict[str, Any]]:
        return _requests.read_nested(self, limit)  # type: ignore[arg-type]  # (read_bytes only)

    # -- wake-ups ------------------------------------------------------------

    @property
    def waiters(self) -> str:
        return os.path.join(self.path, "waiters")

    def open_wake(self) -> int:
        raise OSError(errno.ENOSYS, "no wake-up FIFO on Windows: the owner listens on a named event")

    def poke_owner(self) -> None:
        """Set the owner's event (named from run.json's run uid). Nobody
        listening, or no run.json yet, is not an error: whoever cares
        checks owner_alive()."""
        info = self.load_run()
        if isinstance(info, RunInfo):
            try:
                winsync.poke_owner(info.run_uid)
            except (OSError, ValueError):
                pass

    def add_waiter(self) -> str:
        """A token file of this process's own in waiters\\: its name is the
        token the owner pokes (winsync.waiter_event_name). The caller listens
        on that event before the file exists (Watcher)."""
        check_dir(self.waiters, create=True)
        return f"{os.getpid()}-{os.urandom(4).hex()}"

    def release_and_poke(self) -> None:
        """release(), then wake the waiters again (as on Linux)."""
        self.release()
        self.poke_waiters()

    def poke_waiters(self) -> None:
        """Set every waiter's event; a token whose event nobody holds is a
        waiter that is gone: its file is removed."""
        try:
            names = [n for n in os.listdir(self.waiters) if not n.startswith(".")][:MAX_WAITERS]
        except OSError:
            return
        for n in names:
            try:
                alive = winsync.poke(winsync.waiter_event_name(n))
            except (OSError, ValueError):
                continue
            if not alive:
                try:
                    os.unlink(os.path.join(self.waiters, n))
                except OSError:
                    pass


class _Opened:
    def __init__(self, d: RunDir) -> None:
        self.d = d

    def __enter__(self) -> RunDir:
        return self.d

    def __exit__(self, *exc: object) -> None:
        pass


