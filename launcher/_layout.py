"""The run directory: everything another process needs to find a run, ask
what happened to it, or cancel it after a reconnect.

    <state>/runs/<id>/run.json                    who and what (written once per run uid)
    <state>/runs/<id>/journal.ndjson              transitions, appended (diagnostic)
    <state>/runs/<id>/record.json                 the stop record (atomic)
    <state>/runs/<id>/owner.lock                  OFD write lock held by the owner for its lifetime
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

What is fsynced, and why only that: every write here is visible to every
other process as soon as it is made (the page cache is shared), whatever
happens to the writer, so fsync only matters for an OS crash. An OS crash
also ends every process of a run, so a live run's files (run.json, a
RUNNING record, pending acknowledgements, the journal) describe nothing that
could outlive it; they are written atomically but not fsynced. What does
outlive the processes is made durable: the terminal stop record and the
settled acknowledgements (`durable=True`), and the cancel intent, which is
fsynced before the owner may act on it (append_request). On a file system
that lives in memory (tmpfs, ramfs: the default /run and $XDG_RUNTIME_DIR)
nothing survives the crash fsync protects against, so it is skipped there
(_safefs.in_memory); on a disk each fsync cost 0.3 to 2.5 ms here
(benchmarks/bench_cli.py, docs/performance.md).
"""
from __future__ import annotations

import errno
import json
import os
import stat
import threading
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Iterator

from . import _safefs as F
from ._errors import RunConflict, RunNotFound
from ._record import now_iso
from ._runfiles import (ID_RE, MAX_ACK, MAX_LINE, MAX_RECORD, MAX_RUN_INFO, Rejected, Request, RunInfo,
                        Unreadable, loads, parse_ack, parse_nested, parse_record, parse_request, parse_run_info)
from ._safefs import PersistError, UnsafePath
from ._statedir import (FILE_MODE, PRUNE_SLACK, RUN_DIR_MODE, StateDir, StateDirError, claim_lock, keep_runs,
                        location)

_ID_RE = ID_RE
_LIVE_STATES = ("RUNNING", "UNCONFIRMED")
_OP_SAFE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")

# The inbox is read at most this much per call: a huge file (or line) costs
# one bounded read per wake-up, never the whole file again.
INBOX_CHUNK = 64 << 10
# At most this many waiter FIFOs are poked after a write, and this many
# acknowledgements listed: a directory stuffed with entries costs bounded work.
MAX_WAITERS = 1024
MAX_ACKS = 10_000

__all__ = ["RunDir", "InboxRead", "PersistError", "UnsafePath", "StateDirError", "state_dir", "check_id",
           "new_id", "new_uid", "token_hex", "op_filename", "encode"]


def state_dir(env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The state directory's path (_statedir.location). Raises StateDirError."""
    return location(env)


def check_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _ID_RE.match(run_id):
        raise ValueError(f"invalid run id {run_id!r}: use letters, digits, '.', '_' or '-' (at most 100)")
    return run_id


def new_id() -> str:
    """Sortable by start time, unique enough to never be retried."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + token_hex(3)


def new_uid() -> str:
    return token_hex(8)


def token_hex(nbytes: int) -> str:
    """What secrets.token_hex does (os.urandom), without importing secrets:
    secrets pulls in hmac, hashlib and OpenSSL, 3 ms of every `contain run`
    (python -X importtime, docs/performance.md)."""
    return os.urandom(nbytes).hex()


def op_filename(op: str) -> str:
    """A file name for an operation id. Ids that are already safe map to
    themselves; others get a digest suffix, so two different ids can only
    share a file if they are equal (and equality is checked on read)."""
    if not isinstance(op, str) or not op or len(op) > 200:
        raise ValueError("operation id must be 1 to 200 characters")
    safe = "".join(c if c in _OP_SAFE_CHARS else "_" for c in op)
    if safe != op or safe.startswith("."):
        import hashlib      # only for odd ids: kept off the `contain run` path

        safe = f"{safe.lstrip('.')[:80]}~{hashlib.sha256(op.encode()).hexdigest()[:12]}"
    return safe + ".json"


def encode(obj: Any, *, pretty: bool = False) -> bytes:
    """The one JSON encoding of a record or acknowledgement. Pretty only for
    the files people read once a run has ended: json's indent switches to
    the pure-Python encoder, ~0.1 ms a write."""
    return (json.dumps(obj, indent=2 if pretty else None) + "\n").encode()


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


class RunDir:
    """One run's directory. Constructed from its path (`<state>/runs/<id>`);
    nothing is opened until it is used, and every use opens through the
    verified state directory, unless this object owns the run (claim(),
    take_ownership()): then it holds the directory fds until release()."""

    def __init__(self, path: str, _state: StateDir | None = None) -> None:
        # (Plain string work, not os.path.join: `ls` makes one per run.)
        self.path = path if _state is not None else os.path.normpath(path)
        self.id = self.path.rpartition("/")[2]
        self.cancellations = self.path + "/cancellations"
        self.requests = self.cancellations + "/requests.ndjson"
        self._state = _state
        self._mu = threading.RLock()
        self._lock_fd = -1
        self._fd = -1           # held while owning
        self._cfd = -1
        self._journal_fd = -1

    def __repr__(self) -> str:
        return f"RunDir({self.path!r})"

    # -- finding -----------------------------------------------------------

    @staticmethod
    def runs_root(sd: str | None = None) -> str:
        return os.path.join(sd or state_dir(), "runs")

    @classmethod
    def find(cls, run_id: str, sd: str | None = None) -> "RunDir":
        """The run `run_id`. Raises ValueError (not an id), RunNotFound,
        StateDirError / UnsafePath (the directory is not ours)."""
        check_id(run_id)
        try:
            st = StateDir.open(sd, write=False)
        except FileNotFoundError:
            raise RunNotFound(f"no run {run_id!r} in {cls.runs_root(sd)}") from None
        with st:
            d = cls(os.path.join(st.path, "runs", run_id))
            try:
                fd = F.open_private_dir(st.runs_fd, run_id, d.path, owners=st.owners)
            except FileNotFoundError:
                raise RunNotFound(f"no run {run_id!r} in {os.path.join(st.path, 'runs')}") from None
            try:
                # A claimed directory is a run being born: findable before run.json.
                os.close(F.open_private_dir(fd, "cancellations", d.cancellations, owners=st.owners))
            except FileNotFoundError:
                raise RunNotFound(f"no run {run_id!r} in {os.path.join(st.path, 'runs')}") from None
            finally:
                os.close(fd)
        return d

    @classmethod
    def all(cls, sd: str | None = None) -> Iterator["RunDir"]:
        """Every run directory name in `runs/`, sorted, as RunDirs that open
        through one verified state directory while the iteration lasts.
        Entries that are not directories are yielded too (they read as
        UNREADABLE, with why); names that cannot be run ids are not."""
        try:
            st = StateDir.open(sd, write=False)
        except FileNotFoundError:
            return
        with st:
            with os.scandir(st.runs_fd) as it:
                names = sorted(e.name for e in it if _ID_RE.match(e.name))
            root = os.path.join(st.path, "runs") + "/"
            for n in names:
                yield cls(root + n, _state=st)

    # -- opening -----------------------------------------------------------

    def _open_fd(self, write: bool) -> int:
        """A new fd of this run's directory, verified. Caller closes it."""
        runs_root = os.path.dirname(self.path)
        if os.path.basename(runs_root) != "runs" or not _ID_RE.match(self.id):
            raise UnsafePath(self.path, "is not a run directory (<state>/runs/<id>)")
        st = self._state
        if st is not None and st.runs_fd >= 0 and (st.write or not write):
            return F.open_private_dir(st.runs_fd, self.id, self.path, owners=st.owners)
        with StateDir.open(os.path.dirname(runs_root), write=write) as st2:
            return F.open_private_dir(st2.runs_fd, self.id, self.path, owners=st2.owners)

    def _dir(self, write: bool = False) -> int:
        """An fd of the run directory that the caller closes: a dup of the
        held one while owning (so a concurrent release() cannot make it
        name another file), else a freshly verified one."""
        with self._mu:
            if self._fd >= 0:
                return os.dup(self._fd)
        return self._open_fd(write)

    def _cdir(self, write: bool = False, create: bool = False) -> int:
        """An fd of cancellations/ that the caller closes."""
        with self._mu:
            if self._cfd >= 0:
                return os.dup(self._cfd)
        fd = self._dir(write)
        try:
            return F.open_private_dir(fd, "cancellations", self.cancellations, owners=(os.geteuid(), 0)
                                      if not write else (os.geteuid(),),
                                      create_mode=RUN_DIR_MODE if create else None)
        finally:
            os.close(fd)

    def _hold(self, fd: int) -> None:
        """Keep `fd` (the run directory) and its cancellations/ for the
        owner's lifetime."""
        with self._mu:
            if self._fd < 0:
                self._fd = os.dup(fd)
            if self._cfd < 0:
                self._cfd = F.open_private_dir(self._fd, "cancellations", self.cancellations,
                                               owners=(os.geteuid(),), create_mode=RUN_DIR_MODE)

    def opened(self) -> "_Opened":
        """`with d.opened():` opens the directory once (verified) for a batch
        of reads, as `ls` does for thousands of runs. A no-op while owning."""
        return _Opened(self)

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
                    _move_aside(st, run_id, d)
                d._create(st, info)
                _maybe_prune(st)
            finally:
                os.close(guard)
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
            lock = os.open("owner.lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                           FILE_MODE, dir_fd=fd)
            os.fchmod(lock, FILE_MODE)
            if not F.take_lock(lock):
                os.close(lock)
                raise RunConflict(f"run {self.id}: the owner lock of a new directory is taken")
            self._lock_fd = lock
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

    def take_ownership(self) -> bool:
        """Hold the owner lock. False if a live owner holds it."""
        with self._mu:
            if self._lock_fd >= 0:
                return True
        fd = self._dir(write=True)
        try:
            try:
                lock = os.open("owner.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                               FILE_MODE, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise UnsafePath(self.file("owner.lock"), "is a symlink (not followed)", errno.ELOOP) from None
                raise
            if not stat.S_ISREG(os.fstat(lock).st_mode) or not F.take_lock(lock):
                os.close(lock)
                return False
            with self._mu:
                self._lock_fd = lock
            self._hold(fd)
            return True
        finally:
            os.close(fd)

    def release(self) -> None:
        """Give up ownership: the lock, the journal, the held directories."""
        with self._mu:
            for name in ("_lock_fd", "_journal_fd", "_cfd", "_fd"):
                fd = getattr(self, name)
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                    setattr(self, name, -1)

    def owner(self) -> bool | None:
        """Whether a process holds the owner lock now: True, False, or None
        when that cannot be told (e.g. the directory is not readable by
        this user). Takes no lock (F_OFD_GETLK)."""
        with self._mu:
            if self._lock_fd >= 0:
                return True
        try:
            fd = self._dir()
        except (OSError, UnsafePath):
            return None
        try:
            lock = os.open("owner.lock", F.O_READ, dir_fd=fd)
        except FileNotFoundError:
            return False
        except OSError:
            return None
        finally:
            os.close(fd)
        try:
            if not stat.S_ISREG(os.fstat(lock).st_mode):
                return None
            return F.lock_held(lock)
        except OSError:
            return None
        finally:
            os.close(lock)

    def owner_alive(self) -> bool:
        """Whether some process holds the owner lock right now. When that
        cannot be told, True: nobody adopts or reuses a run on a guess."""
        return self.owner() is not False

    def is_live(self) -> bool:
        """A run is live while its owner lives, or while its last record is
        not terminal, or, with no record yet, once it has a run.json (an
        owner that died before the first record leaves a run to adopt). A
        record that is unreadable is not live (it never holds an id for
        ever); its directory is moved aside, not removed, on reuse."""
        if self.owner_alive():
            return True
        rec = self.load_record()
        if rec is None:
            return self.load_run() is not None
        if isinstance(rec, Unreadable):
            return False
        return rec["state"] in _LIVE_STATES

    # -- files -------------------------------------------------------------

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _read(self, name: str, limit: int, sub: bool = False) -> bytes | None:
        """A file of the run directory (or of cancellations/), or None when
        it does not exist. Raises UnsafePath / OSError / ValueError."""
        fd = self._cdir() if sub else self._dir()
        try:
            return F.read_file(fd, name, f"{self.cancellations if sub else self.path}/{name}", limit)
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def _load(self, name: str, limit: int, parse: Any, sub: bool = False) -> Any:
        try:
            data = self._read(name, limit, sub)
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
        fd = self._dir(write=True)
        try:
            F.replace_file(fd, "run.json", encode(info), self.file("run.json"), mode=FILE_MODE)
        finally:
            os.close(fd)

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
        previous record is then intact."""
        data = rec if isinstance(rec, bytes) else encode(rec, pretty=durable)
        fd = self._dir(write=True)
        try:
            F.replace_file(fd, "record.json", data, self.file("record.json"), mode=FILE_MODE, durable=durable)
        finally:
            os.close(fd)
        self.poke_waiters()

    def load_record(self, *, summary: bool = False) -> dict[str, Any] | Unreadable | None:
        """record.json, checked: the record, Unreadable (with why), or None.
        `summary`: only the fields a listing shows are checked (ls)."""
        return self._load("record.json", MAX_RECORD, lambda o: parse_record(o, self.id, summary=summary))

    def read_record(self) -> dict[str, Any] | None:
        rec = self.load_record()
        return None if rec is None or isinstance(rec, Unreadable) else rec

    def journal(self, event: str, sync: bool = False, **fields: Any) -> None:
        """Append one line to the journal (diagnostic). Raises PersistError."""
        line = (json.dumps({"at": now_iso(), "event": event, **fields}, separators=(",", ":")) + "\n").encode()
        with self._mu:
            fd = self._journal_fd
            if fd < 0:
                d = self._dir(write=True)
                try:
                    fd, _created = F.open_append(d, "journal.ndjson", self.file("journal.ndjson"), mode=FILE_MODE)
                finally:
                    os.close(d)
                if self._lock_fd >= 0:
                    self._journal_fd = fd       # the owner appends many times
            try:
                F.append_line(fd, line, self.file("journal.ndjson"), durable=sync)
            finally:
                if fd != self._journal_fd:
                    os.close(fd)

    def read_journal(self) -> list[dict[str, Any]]:
        try:
            data = self._read("journal.ndjson", MAX_RECORD)
        except (OSError, UnsafePath):
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

    # -- cancel inbox ------------------------------------------------------

    def append_request(self, req: dict[str, Any]) -> None:
        """Durably record a cancel intent: one O_APPEND write (atomic for a
        line under PIPE_BUF), fsynced (file, and the directory when the
        inbox is new) before anyone may act on it, then the owner is poked.
        Raises ValueError (too large), PersistError (not durable: nothing
        may be signalled on its behalf)."""
        data = (json.dumps(req, separators=(",", ":")) + "\n").encode()
        if len(data) > MAX_LINE - 1:
            raise ValueError("cancel request too large")
        cfd = self._cdir(write=True, create=True)
        try:
            fd, created = F.open_append(cfd, "requests.ndjson", self.requests, mode=FILE_MODE)
            try:
                F.append_line(fd, data, self.requests, durable=True)
            finally:
                os.close(fd)
            if created:
                try:
                    F.sync(cfd)
                except OSError as e:
                    raise F.persist_error(e, "fsync of the directory", self.requests) from None
        finally:
            os.close(cfd)
        self.poke_owner()

    @property
    def wake_fifo(self) -> str:
        return os.path.join(self.cancellations, "wake")

    def open_wake(self) -> int:
        """The owner's end of the inbox's wake-up FIFO. Opened read-write, so
        the owner is always a writer too and never polls a hung-up FIFO
        (fifo(7)). A byte in it carries no authority, only "read the inbox";
        still, only this uid may write it (0600, in a 0700 directory): no
        other user can make the owner spin. Raises OSError (the owner then
        reads the inbox on a timer)."""
        cfd = self._cdir(write=True, create=True)
        try:
            for attempt in range(2):
                try:
                    os.mkfifo("wake", FILE_MODE, dir_fd=cfd)
                except FileExistsError:
                    pass
                fd = os.open("wake", os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cfd)
                st = os.fstat(fd)
                if stat.S_ISFIFO(st.st_mode) and st.st_uid == os.geteuid():
                    os.fchmod(fd, FILE_MODE)
                    return fd
                os.close(fd)
                if attempt == 0:
                    os.unlink("wake", dir_fd=cfd)     # not our FIFO: a regular file would read as always ready
            raise UnsafePath(self.wake_fifo, "is not a FIFO of this user")
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePath(self.wake_fifo, "is a symlink (not followed)", errno.ELOOP) from None
            raise
        finally:
            os.close(cfd)

    def poke_owner(self) -> None:
        """Wake the owner to read the inbox. No FIFO, or no reader (ENXIO),
        means no owner is listening; whoever cares checks owner_alive()."""
        try:
            cfd = self._cdir()
        except (OSError, UnsafePath):
            return
        try:
            _poke(cfd, "wake")
        finally:
            os.close(cfd)

    def read_inbox(self, offset: int = 0, run_uid: str | None = None, *,
                   require_uid: bool = True) -> InboxRead:
        """The requests after `offset`, at most INBOX_CHUNK bytes of them,
        each checked (_runfiles.parse_request; `run_uid`, when given, must
        match). Never raises for what is in the file: a line that is not a
        request is returned in `rejected` with the reason; a line longer than
        MAX_LINE is rejected once and skipped, never read again; an
        unterminated last line is left for the next call (its writer may be
        mid-write). A problem with the inbox itself (a symlink, a FIFO) is
        one rejection, the offset unchanged."""
        try:
            cfd = self._cdir()
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
                rejected.append(Rejected(f"requests.ndjson shrank below offset {offset}: read on from its end",
                                         offset))
                return InboxRead([], rejected, st.st_size, False)
            inside_long_line = offset > 0 and os.pread(fd, 1, offset - 1) != b"\n"
            data = os.pread(fd, INBOX_CHUNK, offset)
        except OSError as e:
            return InboxRead([], [Rejected(f"requests.ndjson: {os.strerror(e.errno or errno.EIO)}", offset)],
                             offset, False)
        finally:
            os.close(fd)
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

    def read_requests(self, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
        """The requests after `offset` as dicts, and the offset after them:
        the pre-typed interface of read_inbox (every line checked, rejected
        lines dropped). A request without a run uid is passed on (the owner
        compares it), as before requests were typed."""
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
        """The acknowledgement of `op`, checked; None if there is none (or
        it is unreadable: the owner answers again). Raises RunConflict when
        the file names another operation."""
        name = op_filename(op)
        try:
            data = self._read(name, MAX_ACK, sub=True)
        except (OSError, UnsafePath):
            return None
        if data is None:
            return None
        try:
            obj = loads(data, name)
        except ValueError:
            return None
        if isinstance(obj, dict) and isinstance(obj.get("op_id"), str) and obj["op_id"] != op:
            raise RunConflict(f"operation id {op!r} collides with {obj['op_id']!r} in {self.ack_path(op)}")
        try:
            return parse_ack(obj)
        except ValueError:
            return None

    def write_ack(self, op: str, ack: dict[str, Any], *, durable: bool = False) -> None:
        """Raises RunConflict (the file names another operation), PersistError."""
        name = op_filename(op)
        try:
            data = self._read(name, MAX_ACK, sub=True)
            existing = loads(data, name) if data is not None else None
        except (OSError, UnsafePath, ValueError):
            existing = None
        if isinstance(existing, dict) and existing.get("op_id") != op:
            raise RunConflict(f"operation id {op!r} collides with {str(existing.get('op_id'))[:200]!r}")
        cfd = self._cdir(write=True, create=True)
        try:
            F.replace_file(cfd, name, encode(ack, pretty=durable), self.ack_path(op), mode=FILE_MODE,
                           durable=durable)
        finally:
            os.close(cfd)
        self.poke_waiters()

    def acks(self) -> list[dict[str, Any]]:
        """Every readable acknowledgement, checked, by file name."""
        out: list[dict[str, Any]] = []
        try:
            cfd = self._cdir()
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
                    out.append(parse_ack(loads(F.read_file(cfd, n, os.path.join(self.cancellations, n), MAX_ACK), n)))
                except (OSError, UnsafePath, ValueError):
                    continue
        finally:
            os.close(cfd)
        return out

    # -- nested runs (the registry of _nested; phase 2 wires it) -------------

    def append_nested(self, entry: dict[str, Any]) -> None:
        """Register a run nested in this one: one O_APPEND line in
        nested.ndjson (O_NOFOLLOW, 0600). Raises ValueError (not a
        registration, too long), UnsafePath, PersistError."""
        parse_nested(entry)
        line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
        if len(line) > MAX_LINE - 1:
            raise ValueError("nested run registration too large")
        fd = self._dir(write=True)
        try:
            afd, _created = F.open_append(fd, "nested.ndjson", self.file("nested.ndjson"), mode=FILE_MODE)
            try:
                F.append_line(afd, line, self.file("nested.ndjson"))
            finally:
                os.close(afd)
        finally:
            os.close(fd)

    def read_nested(self, limit: int = 10_000) -> list[dict[str, Any]]:
        """The registrations in nested.ndjson, each checked (parse_nested);
        lines that do not fit are skipped. Bounded: at most `limit` lines of
        at most MAX_LINE bytes each are looked at."""
        try:
            data = self._read("nested.ndjson", limit * MAX_LINE)
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

    # -- waiters -------------------------------------------------------------

    @property
    def waiters(self) -> str:
        return os.path.join(self.path, "waiters")

    def add_waiter(self) -> tuple[int, str]:
        """A FIFO for this process to wait on: (read fd, path). It is opened
        before it is renamed into waiters/, so a FIFO found there without a
        reader (ENXIO) belongs to a waiter that is gone. 0600: the owner is
        this uid (other users cannot reach the run directory)."""
        fd = self._dir(write=True)
        try:
            wfd = F.open_private_dir(fd, "waiters", self.waiters, owners=(os.geteuid(),),
                                     create_mode=RUN_DIR_MODE)
        finally:
            os.close(fd)
        try:
            name = f"{os.getpid()}-{os.urandom(4).hex()}"
            tmp = "." + name
            os.mkfifo(tmp, FILE_MODE, dir_fd=wfd)
            try:
                rfd = os.open(tmp, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=wfd)
                try:
                    if not stat.S_ISFIFO(os.fstat(rfd).st_mode):
                        raise UnsafePath(os.path.join(self.waiters, tmp), "is not a FIFO")
                    os.fchmod(rfd, FILE_MODE)
                    os.rename(tmp, name, src_dir_fd=wfd, dst_dir_fd=wfd)
                except BaseException:
                    os.close(rfd)
                    raise
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=wfd)
                except OSError:
                    pass
                raise
        finally:
            os.close(wfd)
        return rfd, os.path.join(self.waiters, name)

    def poke_waiters(self) -> None:
        """Wake every waiter (after a write it may be waiting for)."""
        try:
            fd = self._dir()
        except (OSError, UnsafePath):
            return
        try:
            wfd = os.open("waiters", F.O_DIR, dir_fd=fd)
        except OSError:
            return
        finally:
            os.close(fd)
        try:
            with os.scandir(wfd) as it:
                names = []
                for e in it:
                    if not e.name.startswith("."):
                        names.append(e.name)
                        if len(names) >= MAX_WAITERS:
                            break
            for n in names:
                _poke(wfd, n, reap=True)
        except OSError:
            pass
        finally:
            os.close(wfd)


class _Opened:
    __slots__ = ("d", "fds")

    def __init__(self, d: RunDir) -> None:
        self.d = d
        self.fds: tuple[int, ...] = ()

    def __enter__(self) -> RunDir:
        d = self.d
        with d._mu:
            if d._fd >= 0:
                return d
        fd = d._open_fd(False)
        with d._mu:
            if d._fd >= 0:          # taken ownership meanwhile
                os.close(fd)
                return d
            d._fd = fd
            self.fds = (fd,)
        return d

    def __exit__(self, *exc: object) -> None:
        if not self.fds:
            return
        d = self.d
        with d._mu:
            if d._fd == self.fds[0] and d._lock_fd < 0:
                fd, d._fd = d._fd, -1
                cfd, d._cfd = d._cfd, -1
                for x in (fd, cfd):
                    if x >= 0:
                        os.close(x)


def _poke(dir_fd: int, name: str, reap: bool = False) -> None:
    """One byte into FIFO `name`, never blocking. With `reap`, a FIFO with
    no reader (its waiter is gone) is removed."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if reap and e.errno == errno.ENXIO:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                pass
        return
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, b"!")
    except OSError:
        pass         # full (EAGAIN): a wake-up is already pending
    finally:
        os.close(fd)


def _move_aside(st: StateDir, run_id: str, d: RunDir) -> None:
    """Rename an ended run's directory (or whatever is in its place) out of
    the way, keeping it for `contain gc`."""
    info = d.load_run()
    uid = info.run_uid if isinstance(info, RunInfo) else token_hex(4)
    for _ in range(4):
        try:
            os.rename(run_id, f".ended-{run_id}-{uid}", src_dir_fd=st.runs_fd, dst_dir_fd=st.runs_fd)
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                raise
            uid = f"{uid}-{token_hex(2)}"
    raise RunConflict(f"run id {run_id!r}: its ended directory cannot be moved aside")


def _maybe_prune(st: StateDir) -> None:
    """The automatic retention bound, checked at every claim for the cost of
    one fstat: a directory's link count is 2 + its subdirectories on tmpfs,
    ext4 and xfs (btrfs says 1: there, one claim in 64 looks). Retention
    never fails a run."""
    keep = keep_runs()
    if keep <= 0:
        return
    try:
        nlink = os.fstat(st.runs_fd).st_nlink
    except OSError:
        return
    if nlink >= 2:
        if nlink - 2 <= keep + PRUNE_SLACK:
            return
    elif os.urandom(1)[0] >= 4:
        return
    from ._gc import auto_prune       # kept off the run path until needed

    try:
        auto_prune(st, keep, nlink - 2 if nlink >= 2 else None)
    except (OSError, ValueError):
        pass
