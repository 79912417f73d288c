"""The run directory: everything another process needs to find a run, ask
what happened to it, or cancel it after a reconnect.

    <state>/runs/<id>/run.json                    who and what (written once per run uid)
    <state>/runs/<id>/journal.ndjson              transitions, appended (diagnostic)
    <state>/runs/<id>/record.json                 the stop record (atomic)
    <state>/runs/<id>/owner.lock                  flock held by the owner for its lifetime
    <state>/runs/<id>/cancellations/requests.ndjson   one line per cancel request (the inbox)
    <state>/runs/<id>/cancellations/wake          FIFO the owner reads; a requester pokes it
    <state>/runs/<id>/waiters/<pid>-<hex>         one FIFO per waiting process; the owner pokes
                                                  each after writing a record or an acknowledgement
    <state>/runs/<id>/cancellations/<op>.json     acknowledgement, written only by the owner

The owner's flock is how death is detected: the kernel drops it when the
owner dies, whatever happens to its pid afterwards.

What is fsynced, and why only that: every write here is visible to every
other process as soon as it is made (the page cache is shared), whatever
happens to the writer, so fsync only matters for an OS crash. An OS crash
also ends every process of a run, so a live run's files (run.json, a
RUNNING record, pending acknowledgements, the journal) describe nothing that
could outlive it; they are written atomically but not fsynced. What does
outlive the processes is made durable: the terminal stop record and the
settled acknowledgements (`durable=True`), and the cancel intent, which is
fsynced before the owner may act on it (_cancel.py). The default state
directories (/run, $XDG_RUNTIME_DIR) are tmpfs, where fsync costs nothing;
on a disk each fsync cost 0.3 to 2.5 ms here, eight of them per run
(benchmarks/bench_cli.py, docs/performance.md).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Iterator

from ._errors import RunConflict, RunNotFound
from ._record import fsync_dir, now_iso, read_json, write_json_atomic
from ._state import LIVE_STATES

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_OP_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def state_dir(env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    explicit = env.get("CONTAIN_STATE_DIR")
    if explicit:
        return explicit
    if os.geteuid() == 0:
        return "/run/contain"
    xdg = env.get("XDG_RUNTIME_DIR")
    return os.path.join(xdg, "contain") if xdg else f"/tmp/contain-{os.geteuid()}"


def check_id(run_id: str) -> str:
    if not _ID_RE.match(run_id):
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
    if not op or len(op) > 200:
        raise ValueError("operation id must be 1 to 200 characters")
    safe = _OP_SAFE.sub("_", op)
    if safe != op or safe.startswith("."):
        import hashlib      # only for odd ids: kept off the `contain run` path

        safe = f"{safe.lstrip('.')[:80]}~{hashlib.sha256(op.encode()).hexdigest()[:12]}"
    return safe + ".json"


class RunDir:
    def __init__(self, path: str) -> None:
        self.path = path
        self.id = os.path.basename(path)
        self.cancellations = os.path.join(path, "cancellations")
        self.requests = os.path.join(self.cancellations, "requests.ndjson")
        self._lock_fd = -1

    # -- finding -----------------------------------------------------------

    @staticmethod
    def runs_root(sd: str | None = None) -> str:
        return os.path.join(sd or state_dir(), "runs")

    @classmethod
    def find(cls, run_id: str, sd: str | None = None) -> "RunDir":
        check_id(run_id)
        d = cls(os.path.join(cls.runs_root(sd), run_id))
        # A claimed directory is a run being born: findable before run.json.
        if not os.path.isdir(d.cancellations):
            raise RunNotFound(f"no run {run_id!r} in {cls.runs_root(sd)}")
        return d

    @classmethod
    def all(cls, sd: str | None = None) -> Iterator["RunDir"]:
        root = cls.runs_root(sd)
        try:
            names = sorted(os.listdir(root))
        except FileNotFoundError:
            return
        for n in names:
            if not n.startswith(".") and os.path.exists(os.path.join(root, n, "run.json")):
                yield cls(os.path.join(root, n))

    # -- claiming ----------------------------------------------------------

    @classmethod
    def claim(cls, run_id: str, sd: str | None = None) -> "RunDir":
        """Create the directory for a new run and take ownership (the flock).
        A live run's id cannot be taken; an ended run's id is reused after
        its directory is moved aside (it keeps its own run uid)."""
        check_id(run_id)
        root = cls.runs_root(sd)
        os.makedirs(root, mode=0o755, exist_ok=True)
        d = cls(os.path.join(root, run_id))
        guard = os.open(os.path.join(root, ".claim.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            if os.path.exists(d.path):
                if d.is_live():
                    raise RunConflict(f"run id {run_id!r} is held by a live run")
                old_uid = (d.read_run() or {}).get("run_uid", token_hex(4))
                os.rename(d.path, os.path.join(root, f".ended-{run_id}-{old_uid}"))
            os.mkdir(d.path)
            os.mkdir(d.cancellations)
            d.take_ownership()
        finally:
            os.close(guard)
        return d

    def take_ownership(self) -> bool:
        """Hold the owner lock. False if a live owner holds it."""
        fd = os.open(os.path.join(self.path, "owner.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def owner_alive(self) -> bool:
        """Whether some process holds the owner lock right now."""
        if self._lock_fd >= 0:
            return True
        try:
            fd = os.open(os.path.join(self.path, "owner.lock"), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def is_live(self) -> bool:
        """A run is live while its owner lives or its last record is not terminal."""
        if self.owner_alive():
            return True
        rec = self.read_record()
        return rec is None or rec.get("state") in LIVE_STATES

    # -- files -------------------------------------------------------------

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def write_run(self, info: dict[str, Any]) -> None:
        write_json_atomic(self.file("run.json"), info, fsync=False)

    def read_run(self) -> dict[str, Any] | None:
        try:
            return read_json(self.file("run.json"))
        except (FileNotFoundError, ValueError):
            return None

    def write_record(self, rec: dict[str, Any], *, durable: bool) -> None:
        write_json_atomic(self.file("record.json"), rec, fsync=durable)
        self.poke_waiters()

    def read_record(self) -> dict[str, Any] | None:
        try:
            return read_json(self.file("record.json"))
        except (FileNotFoundError, ValueError):
            return None

    def journal(self, event: str, sync: bool = False, **fields: Any) -> None:
        line = json.dumps({"at": now_iso(), "event": event, **fields}, separators=(",", ":")) + "\n"
        fd = os.open(self.file("journal.ndjson"), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, line.encode())
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read_journal(self) -> list[dict[str, Any]]:
        try:
            with open(self.file("journal.ndjson"), "rb") as f:
                return [json.loads(x) for x in f if x.strip()]
        except FileNotFoundError:
            return []

    # -- cancel inbox ------------------------------------------------------

    def append_request(self, req: dict[str, Any]) -> None:
        """Durably record a cancel intent: one O_APPEND write (atomic for a
        line under PIPE_BUF), fsynced before anyone may act on it."""
        data = (json.dumps(req, separators=(",", ":")) + "\n").encode()
        if len(data) > 4000:
            raise ValueError("cancel request too large")
        fd = os.open(self.requests, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.cancellations)
        self.poke_owner()

    @property
    def wake_fifo(self) -> str:
        return os.path.join(self.cancellations, "wake")

    def open_wake(self) -> int:
        """The owner's end of the inbox's wake-up FIFO. Opened read-write, so
        the owner is always a writer too and never polls a hung-up FIFO
        (fifo(7)). A byte in it carries no authority, only "read the inbox",
        so anyone may write it."""
        try:
            os.mkfifo(self.wake_fifo, 0o600)
            os.chmod(self.wake_fifo, 0o622)
        except FileExistsError:
            pass
        return os.open(self.wake_fifo, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)

    def poke_owner(self) -> None:
        """Wake the owner to read the inbox. No FIFO, or no reader (ENXIO),
        means no owner is listening; whoever cares checks owner_alive()."""
        try:
            fd = os.open(self.wake_fifo, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        try:
            os.write(fd, b"!")
        except OSError:
            pass     # full (EAGAIN): a wake-up is already pending
        finally:
            os.close(fd)

    def read_requests(self, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
        """Complete lines after `offset`, and the offset after them."""
        try:
            with open(self.requests, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        end = data.rfind(b"\n") + 1
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue   # a torn line cannot be an intent; it is skipped, not guessed
        return out, offset + end

    def ack_path(self, op: str) -> str:
        return os.path.join(self.cancellations, op_filename(op))

    def read_ack(self, op: str) -> dict[str, Any] | None:
        try:
            ack = read_json(self.ack_path(op))
        except (FileNotFoundError, ValueError):
            return None
        if ack.get("op_id") != op:
            raise RunConflict(f"operation id {op!r} collides with {ack.get('op_id')!r} in {self.ack_path(op)}")
        return ack

    def write_ack(self, op: str, ack: dict[str, Any], *, durable: bool = False) -> None:
        path = self.ack_path(op)
        try:
            existing = read_json(path)
        except (FileNotFoundError, ValueError):
            existing = None
        if existing is not None and existing.get("op_id") != op:
            raise RunConflict(f"operation id {op!r} collides with {existing.get('op_id')!r}")
        write_json_atomic(path, ack, fsync=durable)
        self.poke_waiters()

    # -- waiters -------------------------------------------------------------

    @property
    def waiters(self) -> str:
        return os.path.join(self.path, "waiters")

    def add_waiter(self) -> tuple[int, str]:
        """A FIFO for this process to wait on: (read fd, path). It is opened
        before it is renamed into waiters/, so a FIFO found there without a
        reader (ENXIO) belongs to a waiter that is gone."""
        os.makedirs(self.waiters, exist_ok=True)
        name = f"{os.getpid()}-{os.urandom(4).hex()}"
        tmp = os.path.join(self.waiters, "." + name)
        os.mkfifo(tmp, 0o600)
        try:
            os.chmod(tmp, 0o622)     # the owner may be another uid; a poke carries no data
            fd = os.open(tmp, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            os.unlink(tmp)
            raise
        path = os.path.join(self.waiters, name)
        os.rename(tmp, path)
        return fd, path

    def poke_waiters(self) -> None:
        """Wake every waiter (after a write it may be waiting for)."""
        try:
            names = os.listdir(self.waiters)
        except OSError:
            return
        for n in names:
            if n.startswith("."):
                continue
            path = os.path.join(self.waiters, n)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                if e.errno == errno.ENXIO:       # its reader is gone
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
                continue
            try:
                os.write(fd, b"!")
            except OSError:
                pass         # full (EAGAIN): a wake-up is already pending
            finally:
                os.close(fd)

    def acks(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            names = os.listdir(self.cancellations)
        except FileNotFoundError:
            return out
        for n in sorted(names):
            if n.endswith(".json"):
                try:
                    out.append(read_json(os.path.join(self.cancellations, n)))
                except (OSError, ValueError):
                    continue
        return out
