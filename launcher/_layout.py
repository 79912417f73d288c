"""The run directory: everything another process needs to find a run, ask
what happened to it, or cancel it after a reconnect.

    <state>/runs/<id>/run.json                    who and what (written once per run uid)
    <state>/runs/<id>/journal.ndjson              transitions, appended (diagnostic)
    <state>/runs/<id>/record.json                 the stop record (atomic)
    <state>/runs/<id>/summary.json                what `ls` shows of it, and which record.json it
                                                  was made from (a hint, read only while it names it)
    <state>/runs/<id>/owner                       symlink naming the owner's slot, "<file>:<k>": an OFD
                                                  write lock on byte k of <state>/owners/<file>, held by
                                                  the owner for its lifetime (_ownerslots; a run
                                                  directory of the old layout has owner.lock instead)
    <state>/runs/<id>/cancellations/requests.ndjson   one line per cancel request (the inbox)
    <state>/runs/<id>/cancellations/wake          FIFO the owner reads; a requester pokes it
    <state>/runs/<id>/waiters/<pid>-<hex>         one FIFO per waiting process; the owner pokes
                                                  each after writing a record or an acknowledgement
    <state>/runs/<id>/cancellations/<op>.json     acknowledgement, written only by the owner

Every file is opened relative to a held, verified directory fd with
O_NOFOLLOW (_safefs, _statedir); directories are 0700 and files 0600 whatever
the umask; what is read is parsed in one place (_runfiles) and what does not
fit is rejected, never indexed into (docs/protocol.md, "What the layout
trusts and what it verifies").

The owner's lock is how death is detected: the kernel drops it when the
owner dies, whatever happens to its pid afterwards. It is an OFD lock
(fcntl F_OFD_SETLK), and observers ask about it with F_OFD_GETLK on a
read-only descriptor: they take no lock, so they can neither block the owner
nor make a live run look orphaned (with flock, a reader's LOCK_SH made a
concurrent adopter fail and a claim lose its lock).

Nothing is fsynced: crash-consistent, not power-loss durable
(_safefs.POWER_LOSS_DURABLE says why). Every write here is visible to every
other process as soon as it is made (the page cache is shared), whatever
happens to the writer, and an OS crash ends every process of a run, which
the boot id proves afterwards. Files are still replaced atomically (a
temporary file renamed over), and the cancel intent is written before the
owner may act on it (append_request). `durable=True` still marks what
outlives the processes (the terminal record, settled acknowledgements) for
the order of renames it needs (_safefs.replace_file, keep_old).
"""
from __future__ import annotations

import _thread
import errno
import os
import sys
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from . import _fifos, _gc, _ownerslots, _requests
from . import _safefs as F
from ._errors import RunConflict
from ._jsonenc import dumps
from ._record import now_iso
from ._requests import InboxRead, op_filename
from ._rundir import RunDirBase, check_id
from ._runfiles import (MAX_RECORD, MAX_RUN_INFO, MAX_SUMMARY, SUMMARY, RunInfo, Unreadable, encode, loads,
                        parse_record, parse_run_info, record_summary)
from ._safefs import PersistError, UnsafePath
from ._state import LIVE_STATES
from ._statedir import FILE_MODE, RUN_DIR_MODE, StateDir, StateDirError, claim_lock, claim_unlock, location


__all__ = ["RunDir", "InboxRead", "PersistError", "UnsafePath", "StateDir", "StateDirError", "state_dir",
           "check_id", "new_id", "new_uid", "token_hex", "op_filename", "encode"]


def state_dir(env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The state directory's path (_statedir.location). Raises StateDirError."""
    return location(env)


def new_id() -> str:
    """Sortable by start time, unique enough to never be retried."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + token_hex(3)


def new_uid() -> str:
    return token_hex(8)


def op_id_or_new(op_id: str | None, prefix: str = "op") -> str:
    """The operation id a caller gave, checked as the owner checks it (1 to
    200 characters; ValueError otherwise), or a fresh one if none was given.
    An empty string is not "none given": a caller's unset variable would
    mint a new operation on every call and lose idempotency without a word."""
    if op_id is None:
        return f"{prefix}-{new_uid()}"
    op_filename(op_id)
    return op_id


def token_hex(nbytes: int) -> str:
    """What secrets.token_hex does (os.urandom), without importing secrets:
    secrets pulls in hmac, hashlib and OpenSSL, 3 ms of every `contain run`
    (python -X importtime, docs/performance.md)."""
    return os.urandom(nbytes).hex()


class Summary(dict):
    """A record's listing fields as summary.json gave them. The owner writes
    one after each final record, naming it: a record.json that a member
    rewrote has none, so a listing reads it whole (_views.fill_view)."""


class RunDir(RunDirBase):
    """One run's directory and what is in it. Constructed from its path
    (`<state>/runs/<id>`); nothing is opened until it is used, and every
    use opens through the verified state directory, unless this object owns
    the run (claim(), take_ownership()): then it holds the directory fds
    until release() (_rundir)."""

    _final_written = False      # this object has put a final record.json in place (write_record)
    _journal_made = False       # this object has appended to journal.ndjson (opened without O_CREAT first)
    _pokes_held = 0             # hold_pokes() depth: the waiters are poked once, at the outermost end
    _pokes_holder = -1          # the thread holding them: another thread's writes poke at once
    _poke_due = False

    # -- claiming ----------------------------------------------------------

    @classmethod
    def claim(cls, run_id: str, sd: str | None = None, *, info: dict[str, Any] | None = None) -> "RunDir":
        """Create the directory for a new run and take ownership: the run
        appears under its id (by rename) with the owner lock already held,
        its cancellations/ made and, when `info` is given, its run.json
        written. A live run's id cannot be taken (RunConflict); an ended
        run's directory is moved aside to `runs/.ended-<id>-<uid>` (it keeps
        its own run uid). Claims are serialised by `runs/.claim.lock`.
        Raises RunConflict, StateDirError, PersistError."""
        check_id(run_id)
        if info is not None:
            parse_run_info(info, run_id)
        with StateDir.open(sd, write=True, create=True) as st:
            guard = claim_lock(st)
            try:
                d = cls(os.path.join(st.path, "runs", run_id), _state=st)
                try:
                    old = F.open_private_dir(st.runs_fd, run_id, d.path, owners=st.owners)
                except FileNotFoundError:
                    old = -1
                except UnsafePath as e:
                    if e.errno != errno.ENOTDIR:
                        raise
                    old = -2      # not a directory: never a run; moved aside below
                if old != -1:
                    if old >= 0:
                        os.close(old)
                        if d.is_live():
                            raise RunConflict(f"run id {run_id!r} is held by a live run")
                    old_info = d.load_run()
                    _gc.move_aside(st, run_id, old_info.run_uid if isinstance(old_info, RunInfo) else None)
                d._create(st, info)
                try:
                    _gc.maybe_prune(st)
                except BaseException:
                    d.release()       # made and locked, but nobody holds it yet: an interrupt must not keep it
                    raise
            finally:
                claim_unlock(guard)
            d._state = None
        return d

    def _create(self, st: StateDir, info: dict[str, Any] | None) -> None:
        tmp = f".claim-{self.id}-{token_hex(4)}"
        os.mkdir(tmp, RUN_DIR_MODE, dir_fd=st.runs_fd)
        fd = -1
        try:
            fd = F.open_private_dir(st.runs_fd, tmp, os.path.join(st.path, "runs", tmp), owners=st.owners)
            os.fchmod(fd, RUN_DIR_MODE)
            self._hold(fd)
            name, k = _ownerslots.claim(st)
            self._own_slot((st.path, name, k))
            os.symlink(_ownerslots.target(name, k), _ownerslots.LINK, dir_fd=fd)
            if info is not None:
                F.replace_file(fd, "run.json", encode(info), self.file("run.json"), mode=FILE_MODE)
            try:
                os.rename(tmp, self.id, src_dir_fd=st.runs_fd, dst_dir_fd=st.runs_fd)
            except OSError as e:
                if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                    raise RunConflict(f"run id {self.id!r} was taken while it was claimed") from None
                raise
        except BaseException:
            self.release()
            if fd >= 0:
                os.close(fd)
            try:
                F.remove_tree(st.runs_fd, tmp)
            except OSError:
                pass
            raise
        os.close(fd)

    def is_live(self) -> bool:
        """A run is live while its owner lives, or while its last record is
        not terminal, or, with no record yet, once it has a run.json (an
        owner that died before the first record leaves a run to adopt). A
        record that is unreadable is not live (it never holds an id for
        ever); its directory is moved aside, not removed, on reuse. A
        record that says the run is over (or cannot be read) while what the
        run's tag names is alive was not its owner's (a member that can write
        its run directory wrote it): the run is a live orphan, and moving it
        aside would take it out of reach of `cancel ID`."""
        if self.owner_alive():
            return True
        rec = self.load_record()
        if rec is None:
            return self.load_run() is not None
        if isinstance(rec, Unreadable) or rec["state"] in ("REAPED", "EXITED"):
            from ._tags import still_alive

            if still_alive(self.path) is not None:
                return True
        return not isinstance(rec, Unreadable) and rec["state"] in LIVE_STATES

    # -- files -------------------------------------------------------------

    def _load(self, name: str, limit: int, parse: Any, sub: bool = False) -> Any:
        try:
            data = self.read_bytes(name, limit, sub=sub)
        except FileNotFoundError:
            return None
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

    def write_run(self, info: dict[str, Any]) -> None:
        """Raises PersistError."""
        fd = self.dir_fd(write=True)
        try:
            F.replace_file(fd, "run.json", encode(info), self.file("run.json"), mode=FILE_MODE)
        finally:
            os.close(fd)

    def never_described(self) -> bool:
        """No run.json and no run tag: the owner writes both before the spawn,
        so a run without either, whose owner is gone, started nothing (a tag
        with no run.json is a run whose files were removed, adoptable from
        the tag)."""
        from . import _tags

        return self.load_run() is None and _tags.read(self.path, _tags.RUN_TAG).value is None

    def load_run(self) -> RunInfo | Unreadable | None:
        """run.json, checked: RunInfo, Unreadable (with why), or None (none)."""
        return self._load("run.json", MAX_RUN_INFO, lambda o: parse_run_info(o, self.id))

    def read_run(self) -> dict[str, Any] | None:
        info = self.load_run()
        return info.raw if isinstance(info, RunInfo) else None

    def write_record(self, rec: dict[str, Any] | bytes, *, durable: bool) -> None:
        """Replace record.json (atomic; fsynced when `durable`), then wake
        the waiters. `rec` may be already encoded (encode()): one encoding
        per record for every place it goes. Raises PersistError; the
        previous record is then intact, except a live one that this
        object's first final record replaced (keep_old=False): a failed
        fsync after that rename removes record.json, and readers see a run
        before its first record (run.json), which an adopter finishes."""
        data = rec if isinstance(rec, bytes) else encode(rec)     # compact: the C encoder (pretty is --record's)
        fd = self.dir_fd(write=True)
        try:
            # Only a final record is kept across a crash at any cost: the
            # first one replaces a live run's, which says nothing run.json
            # does not (replace_file, keep_old).
            st = F.replace_file(fd, "record.json", data, self.file("record.json"), mode=FILE_MODE, durable=durable,
                                keep_old=self._final_written)
            self._final_written = self._final_written or durable
            if isinstance(rec, dict) and durable:
                # What `ls` shows of a final record, beside it (a hint: never
                # fsynced, believed only while it names this very
                # record.json; a live run's is read whole, there are few).
                try:
                    F.replace_file(fd, SUMMARY, encode(record_summary(rec, st)), self.file(SUMMARY), mode=FILE_MODE)
                except OSError:
                    pass              # an old summary names an old record: not believed
        finally:
            os.close(fd)
        self.poke_waiters()

    def load_record(self, *, summary: bool = False) -> dict[str, Any] | Unreadable | None:
        """record.json, checked: the record, Unreadable (with why), or None.
        `summary`: only the fields a listing shows, and from summary.json
        when that names the record.json there now (its inode, size and
        mtime): `ls` reads 400 bytes instead of 7 KB for each run."""
        if summary:
            got = self._load_summary()
            if got is not None:
                return got
        return self._load("record.json", MAX_RECORD, lambda o: parse_record(o, self.id, summary=summary))

    def _load_summary(self) -> dict[str, Any] | None:
        """summary.json if it is the summary of the record.json there now,
        checked as a record's summary fields are; else None (read the record)."""
        try:
            st = self.stat_file("record.json")
            data = self.read_bytes(SUMMARY, MAX_SUMMARY)
            if st is None or data is None or (st.st_mode & 0o170000) != 0o100000:    # a regular record.json
                return None
            obj = loads(data, SUMMARY)
        except (OSError, ValueError):
            return None
        if not isinstance(obj, dict) or obj.pop("of", None) != [st.st_ino, st.st_size, st.st_mtime_ns]:
            return None
        try:
            return Summary(parse_record(obj, self.id, summary=True))
        except ValueError:
            return None

    def read_record(self) -> dict[str, Any] | None:
        rec = self.load_record()
        return None if rec is None or isinstance(rec, Unreadable) else rec

    def journal(self, event: str, sync: bool = False, **fields: Any) -> None:
        """Append one line to the journal (diagnostic). Raises PersistError."""
        line = (dumps({"at": now_iso(), "event": event, **fields}, compact=True) + "\n").encode()
        # Opened for each line, never held: a handful of lines a run, and a
        # descriptor held per live run is what limits how many runs a
        # process can hold (_reactor.py).
        with self._mu:
            d = self.dir_fd(write=True)
            try:
                fd, _created, size = F.open_append_sized(d, "journal.ndjson", self.file("journal.ndjson"),
                                                         mode=FILE_MODE, existing=self._journal_made)
            finally:
                os.close(d)
            try:
                F.append_line(fd, line, self.file("journal.ndjson"), durable=sync, size=size)
                self._journal_made = True
            finally:
                os.close(fd)

    def read_journal(self) -> list[dict[str, Any]]:
        try:
            data = self.read_bytes("journal.ndjson", MAX_RECORD)
        except (OSError, UnsafePath):
            return []
        out = []
        for line in (data or b"").splitlines():
            try:
                obj = loads(line, "journal.ndjson")
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out

    # -- cancel inbox, acknowledgements, nested runs (_requests) -----------------

    def append_request(self, req: dict[str, Any], *, poke: bool = True) -> None:
        """Durably record a cancel intent (_requests.append_request). Raises
        ValueError, PersistError: then nothing may be signalled for it.
        `poke` False: the caller wakes the owner itself (a request of the
        owner's own process), so its wake-up FIFO is not opened."""
        _requests.append_request(self, req, poke=poke)

    def read_inbox(self, offset: int = 0, run_uid: str | None = None, *,
                   require_uid: bool = True) -> InboxRead:
        """Checked requests after `offset`, rejected lines with why, the next
        offset (_requests.read_inbox). Never raises for the file's content."""
        return _requests.read_inbox(self, offset, run_uid, require_uid=require_uid)

    def read_requests(self, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
        """The checked requests after `offset` as dicts, and the next offset."""
        return _requests.read_requests(self, offset)

    def ack_path(self, op: str) -> str:
        return f"{self.cancellations}/{op_filename(op)}"

    def read_ack(self, op: str) -> dict[str, Any] | None:
        """Raises RunConflict when the file names another operation."""
        return _requests.read_ack(self, op)

    def write_ack(self, op: str, ack: dict[str, Any], *, durable: bool = False) -> None:
        """Raises RunConflict, PersistError."""
        _requests.write_ack(self, op, ack, durable=durable)

    def acks(self) -> list[dict[str, Any]]:
        return _requests.acks(self)

    def append_nested(self, entry: dict[str, Any]) -> None:
        """Register a run nested in this one. Raises ValueError, UnsafePath,
        PersistError."""
        _requests.append_nested(self, entry)

    def read_nested(self, limit: int = 10_000) -> list[dict[str, Any]]:
        return _requests.read_nested(self, limit)

    # -- wake-ups (_fifos) -----------------------------------------------------

    @property
    def wake_fifo(self) -> str:
        return self.cancellations + "/wake"

    @property
    def waiters(self) -> str:
        return self.path + "/waiters"

    def open_wake(self) -> int:
        """The owner's end of the wake-up FIFO. Raises OSError."""
        return _fifos.open_wake(self)

    def poke_owner(self) -> None:
        _fifos.poke_owner(self)

    def add_waiter(self) -> tuple[int, str]:
        """A FIFO of this process's own to wait on: (read fd, path)."""
        return _fifos.add_waiter(self)

    def poke_waiters(self) -> None:
        if self._pokes_held and self._pokes_holder == _thread.get_ident():
            self._poke_due = True      # once, at the end of the turn that wrote (release_pokes)
            return
        _fifos.poke_waiters(self)

    def release_and_poke(self) -> None:
        """release(), then wake the waiters again (readers believe a final
        record or a settled ack only once the lock is free), through a
        descriptor of the run directory taken before the release: the very
        directory this object held (its path may name another run's by
        then), and not the walk from the state directory's path that
        dir_fd() makes once nothing is held (0.1 ms of every run)."""
        try:
            fd = self.dir_fd()
        except (OSError, UnsafePath):
            fd = -1
        try:
            self.release()
        finally:
            if fd < 0:
                self.poke_waiters()
            else:
                try:
                    _fifos.poke_waiters_at(fd)
                finally:
                    os.close(fd)
    def hold_pokes(self) -> None:
        """The owner's turn begins: what it writes (an acknowledgement, the
        record, their settling) wakes the waiters once, when it ends, not
        once per file. A waiter re-reads everything it waits for when woken;
        only the waking is put off, never a write. Owner thread only."""
        self._pokes_held += 1
        self._pokes_holder = _thread.get_ident()

    def release_pokes(self) -> None:
        self._pokes_held = max(0, self._pokes_held - 1)
        if self._pokes_held:
            return
        self._pokes_holder = -1
        if self._poke_due:
            self._poke_due = False
            _fifos.poke_waiters(self)


if sys.platform == "win32":
    # The same face on Windows, which has no directory fds, FIFOs or OFD
    # locks: verified paths, LockFileEx and named events (_platform/winlayout.py).
    from ._platform.winlayout import RunDir, StateDir, location as state_dir  # noqa: F811
