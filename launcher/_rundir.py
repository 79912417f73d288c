"""A run's directory as a place: finding it, opening it (verified, by held
fds), and owning it (the OFD owner lock). What is in it is _layout's
(RunDir, built on this), _requests' and _fifos'.

Every use opens through the verified state directory (_statedir). An object
that owns the run (claim, take_ownership) holds no descriptor of it: it
keeps the directory's identity (device, inode) and opens it again through
a state directory its process holds open (one per state directory, not per
run: a live run holds at most two descriptors, issue 27), refusing what is
not the very directory it owns. The owner lock is an OFD lock (fcntl F_OFD_SETLK):
one byte of the owning process's owners file, named by the run's `owner`
link (_ownerslots: no descriptor per run), or, in a run directory of the
old layout, the whole of its own `owner.lock`. Observers ask with
F_OFD_GETLK on a read-only descriptor and take nothing, so they can
neither block the owner nor make a live run look orphaned (with flock, a
reader's LOCK_SH made a concurrent adopter fail and a claim lose its lock).
"""
from __future__ import annotations

import errno
import os
import stat
import _thread
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Iterator, Literal, TypeVar

    D = TypeVar("D", bound="RunDirBase")

from . import _ownerslots as slots
from . import _safefs as F
from ._errors import RunNotFound
from ._ofdlock import Locks, drop_lock, lock_held, locked_at, take_lock
from ._names import valid_id
from ._safefs import UnsafePath
from ._statedir import FILE_MODE, RUN_DIR_MODE, StateDir, location


def _any_of(dir_fd: int, names: tuple[str, ...]) -> bool:
    """Whether any of `names` is in `dir_fd` (not followed)."""
    for name in names:
        try:
            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            return True
        except OSError:
            continue
    return False


def check_id(run_id: str) -> str:
    if not valid_id(run_id):
        raise ValueError(f"invalid run id {run_id!r}: use letters, digits, '.', '_' or '-' (at most 100)")
    return run_id


# The run directories this process owns, by object id. An OFD lock belongs to
# the open file description, which fork() shares: a child of the owner's
# process that outlived it (multiprocessing's fork, a daemonising helper)
# went on holding the run as supervised, so `ls` showed it live and `contain
# cancel` waited on an owner that no longer existed. The child is not the
# owner: its copies are closed (not unlocked, which would free the parent's).
_OWNED: dict[int, "RunDirBase"] = {}


def _forget_owned_in_child() -> None:
    global _held_mu
    _held_mu = _thread.allocate_lock()      # another thread may have held it at the fork
    slots.forget_in_child()
    for d in list(_OWNED.values()):
        d._slot = None
        reinit = getattr(d._mu, "_at_fork_reinit", None)
        if reinit is not None:
            reinit()              # held by a thread that is not in the child
        fd, d._lock_fd = d._lock_fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    _OWNED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_owned_in_child)


class RunDirBase:
    """One run's directory, `<state>/runs/<id>`, constructed from its path;
    nothing is opened until it is used."""

    def __init__(self, path: str, _state: StateDir | None = None) -> None:
        # (Plain string work, not os.path.join: `ls` makes one per run.)
        self.path = path if _state is not None else os.path.normpath(path)
        self.id = self.path.rpartition("/")[2]
        self.cancellations = self.path + "/cancellations"
        self.requests = self.cancellations + "/requests.ndjson"
        self._state = _state
        self._mu = _thread.RLock()
        self._lock_fd = -1      # owner.lock (the old layout, adopted)
        self._slot: tuple[str, str, int] | None = None    # (state path, owners file, slot) while owning
        self._fd = -1           # held for a batch of reads (opened())
        self._ino: tuple[int, int] | None = None     # the directory's identity while owning
        self._moved_to: str | None = None            # its name in runs/ since it was renamed (_reopen)

    def __repr__(self) -> str:
        return f"RunDir({self.path!r})"

    # -- finding -----------------------------------------------------------

    @staticmethod
    def runs_root(sd: str | None = None) -> str:
        return os.path.join(sd or location(), "runs")

    @classmethod
    def find(cls: type[D], run_id: str, sd: str | None = None) -> D:
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
                # ... and a run whose worker removed its cancellations/ (one
                # that can write the run directory) is still a run, not "no
                # such run": its cancel makes the directory again.
                if not _any_of(fd, ("run.json", slots.LINK, "owner.lock", "record.json")):
                    raise RunNotFound(f"no run {run_id!r} in {os.path.join(st.path, 'runs')}") from None
            finally:
                os.close(fd)
        return d

    @classmethod
    def all(cls: type[D], sd: str | None = None) -> Iterator[D]:
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
                names = sorted(e.name for e in it if valid_id(e.name))
            root = os.path.join(st.path, "runs") + "/"
            for n in names:
                yield cls(root + n, _state=st)

    # -- opening -----------------------------------------------------------

    def _open_fd(self, write: bool) -> int:
        """A new fd of this run's directory, verified. Caller closes it."""
        if self._ino is not None:
            return self._reopen()
        runs_root = os.path.dirname(self.path)
        if os.path.basename(runs_root) != "runs" or not valid_id(self.id):
            raise UnsafePath(self.path, "is not a run directory (<state>/runs/<id>)")
        st = self._state
        if st is not None and st.runs_fd >= 0 and (st.write or not write):
            return F.open_private_dir(st.runs_fd, self.id, self.path, owners=st.owners)
        with StateDir.open(os.path.dirname(runs_root), write=write) as st2:
            return F.open_private_dir(st2.runs_fd, self.id, self.path, owners=st2.owners)

    def _reopen(self) -> int:
        """The directory this object owns, opened again: through the state
        directory its process holds, and only if it is the very directory
        (device, inode) claimed or adopted. Raises UnsafePath when the path
        names another one now (a member that can write the state directory
        moved it), StateDirError, OSError."""
        want = self._ino
        names = [self.id] if self._moved_to is None else [self._moved_to, self.id]
        for fresh in (False, True):
            st = _held_state(self.state_path(), fresh)
            for name in names:
                try:
                    fd = os.open(name, F.O_DIR, dir_fd=st.runs_fd)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise F.dir_error(e, self.path, st.runs_fd, name) from None
                s = os.fstat(fd)
                if (s.st_dev, s.st_ino) == want:
                    return fd
                os.close(fd)
        # Renamed within runs/ under its live owner (anything of the owner's
        # uid that can write the state directory can): found again by its
        # identity, as the held descriptor of before followed it, and used
        # under its new name from now on. Rare, so a scan.
        st = _held_state(self.state_path(), False)
        with os.scandir(st.runs_fd) as it:
            for entry in it:
                try:
                    s = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if (s.st_dev, s.st_ino) != want or not stat.S_ISDIR(s.st_mode):
                    continue
                try:
                    fd = os.open(entry.name, F.O_DIR, dir_fd=st.runs_fd)
                except OSError:
                    continue
                s2 = os.fstat(fd)
                if (s2.st_dev, s2.st_ino) == want:
                    self._moved_to = entry.name
                    return fd
                os.close(fd)
        raise UnsafePath(self.path, "is no longer the run directory this process owns (moved out of runs/ or "
                         "replaced)", errno.ESTALE)

    def dir_fd(self, write: bool = False) -> int:
        """An fd of the run directory that the caller closes: a dup of the
        held one while owning (so a concurrent release() cannot make it
        name another file), else a freshly verified one (for writing: only
        in a state directory of this user's own). Raises UnsafePath,
        StateDirError, OSError."""
        with self._mu:
            if self._fd >= 0:
                return os.dup(self._fd)
        return self._open_fd(write)

    def cancellations_fd(self, write: bool = False, create: bool = False) -> int:
        """An fd of cancellations/ that the caller closes (made, 0700, with
        `create`). Raises like dir_fd.

        The owner opens it anew from the run directory it holds each time,
        rather than holding it for the run's life (a descriptor per live run
        is what limits how many runs a process can hold, _reactor.py): so
        it also follows the path when a worker that can write the run
        directory removed or replaced cancellations/ (requesters write to
        the path), made anew if missing."""
        if self._ino is not None:
            fd = self._reopen()
            try:
                return F.open_private_dir(fd, "cancellations", self.cancellations,
                                          owners=(os.geteuid(),), create_mode=RUN_DIR_MODE)
            finally:
                os.close(fd)
        fd = self.dir_fd(write)
        try:
            return F.open_private_dir(fd, "cancellations", self.cancellations, owners=(os.geteuid(), 0)
                                      if not write else (os.geteuid(),),
                                      create_mode=RUN_DIR_MODE if create else None)
        finally:
            os.close(fd)

    def _hold(self, fd: int) -> None:
        """Own `fd`'s directory (the run directory) for the owner's
        lifetime: its identity kept (opened again when used: _reopen), its
        cancellations/ made (cancellations_fd)."""
        s = os.fstat(fd)
        with self._mu:
            self._ino = (s.st_dev, s.st_ino)
        os.close(F.open_private_dir(fd, "cancellations", self.cancellations,
                                    owners=(os.geteuid(),), create_mode=RUN_DIR_MODE))

    def opened(self) -> "_Opened":
        """`with d.opened():` opens the directory once (verified) for a batch
        of reads, as `ls` does for thousands of runs. A no-op while owning."""
        return _Opened(self)

    def _borrow(self) -> tuple[int, ...]:
        with self._mu:
            if self._fd >= 0:
                return ()
        fd = self._open_fd(False)
        with self._mu:
            if self._fd >= 0:          # took ownership meanwhile
                os.close(fd)
                return ()
            self._fd = fd
        return (fd,)

    def _give_back(self, fd: int) -> None:
        with self._mu:
            if self._fd == fd:
                self._fd = -1
                os.close(fd)

    def _owning(self) -> bool:
        return self._lock_fd >= 0 or self._slot is not None

    def state_path(self) -> str:
        return os.path.dirname(os.path.dirname(self.path))

    def _state_dir(self, write: bool) -> StateDir:
        return StateDir.open(self.state_path(), write=write)

    def take_ownership(self) -> bool:
        """Hold the owner lock. False if a live owner holds it."""
        with self._mu:
            if self._owning():
                return True
        fd = self.dir_fd(write=True)
        try:
            named = slots.read_link(fd)
            if named is None:
                raise UnsafePath(self.file(slots.LINK), "does not name an owner slot")
            if named is not False:
                name, k = named
                with self._state_dir(write=True) as st:
                    if not slots.take(st, name, k):
                        return False
                    self._own_slot((st.path, name, k))
                self._hold(fd)
                return True
            try:
                lock = os.open("owner.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                               FILE_MODE, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise UnsafePath(self.file("owner.lock"), "is a symlink (not followed)", errno.ELOOP) from None
                raise
            if not stat.S_ISREG(os.fstat(lock).st_mode) or not take_lock(lock):
                os.close(lock)
                return False
            self._own(lock)
            self._hold(fd)
            return True
        finally:
            os.close(fd)

    def _own(self, lock: int) -> None:
        with self._mu:
            self._lock_fd = lock
            _OWNED[id(self)] = self

    def _own_slot(self, slot: tuple[str, str, int]) -> None:
        with self._mu:
            self._slot = slot
            _OWNED[id(self)] = self

    def release(self) -> None:
        """Give up ownership: the lock, the journal, the held directories."""
        with self._mu:
            _OWNED.pop(id(self), None)
            self._ino = None
            if self._slot is not None:
                slot, self._slot = self._slot, None
                slots.drop(*slot)
            for name in ("_lock_fd", "_fd"):
                fd = getattr(self, name)
                if fd >= 0:
                    if name == "_lock_fd":
                        try:
                            drop_lock(fd)      # not only close: a fork's copy would go on holding it
                        except OSError:
                            pass
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
            if self._owning():
                return True
        try:
            fd = self.dir_fd()
        except (OSError, UnsafePath):
            return None
        try:
            named = slots.read_link(fd)
        except OSError:
            os.close(fd)
            return None
        if named is None:
            os.close(fd)
            return None
        if named is not False:
            os.close(fd)
            st = self._state
            if st is not None and st.fd >= 0:
                return slots.held(st, *named)
            try:
                with self._state_dir(write=False) as st2:
                    return slots.held(st2, *named)
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
            return lock_held(lock)
        except OSError:
            return None
        finally:
            os.close(lock)

    def stat_file(self, name: str) -> os.stat_result | None:
        """lstat of `name` in the run directory (through the held directory
        when there is one), None if it does not exist. Raises OSError,
        UnsafePath."""
        with self._mu:
            fd, own = self._fd, False
            if fd < 0:
                fd, own = self._open_fd(False), True
            try:
                return os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            finally:
                if own:
                    os.close(fd)

    def owner_among(self, locked: Locks) -> bool | None:
        """owner() for a listing: whether the owner lock is among the locks
        `locked` names (_ofdlock.write_locked, read once for every run):
        a readlink and an lstat where owner() opens the lock; nothing at
        all when no OFD write lock is held anywhere. None when that cannot
        be told."""
        if not locked:
            return False
        try:
            named = self._read_owner_link()
        except (OSError, UnsafePath):
            return None
        if named is None:
            return None
        if named is not False:
            st0 = self._state
            if st0 is None or st0.fd < 0:
                return self.owner()
            key = slots.file_key(st0, named[0])
            return key is not None and locked_at(locked, key, named[1])
        try:
            st = self.stat_file("owner.lock")
        except (OSError, UnsafePath):
            return None
        if st is None:
            return False
        if not stat.S_ISREG(st.st_mode):
            return None
        return locked_at(locked, (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino), 0)

    def _read_owner_link(self) -> tuple[str, int] | None | Literal[False]:
        with self._mu:
            fd, own = self._fd, False
            if fd < 0:
                fd, own = self._open_fd(False), True
            try:
                return slots.read_link(fd)
            finally:
                if own:
                    os.close(fd)

    def owner_alive(self) -> bool:
        """Whether some process holds the owner lock right now. When that
        cannot be told, True: nobody adopts or reuses a run on a guess."""
        return self.owner() is not False

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def read_bytes(self, name: str, limit: int, *, sub: bool = False) -> bytes | None:
        """A regular file of the run directory (or of cancellations/, with
        `sub`), at most `limit` bytes, or None when it does not exist.
        Raises UnsafePath (a link, not a regular file, too large), OSError."""
        if not sub:
            with self._mu:
                if self._fd >= 0:     # held (owning, or `opened()` for a batch of reads): no dup
                    try:
                        return F.read_file(self._fd, name, f"{self.path}/{name}", limit)
                    except FileNotFoundError:
                        return None
        fd = self.cancellations_fd() if sub else self.dir_fd()
        try:
            return F.read_file(fd, name, f"{self.cancellations if sub else self.path}/{name}", limit)
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)


# The state directories this process owns runs in, held open (verified when
# opened) so that an owned run directory is opened again without a
# descriptor of its own: one per state directory, for the process's life.
_HELD: dict[str, StateDir] = {}
_held_mu = _thread.allocate_lock()


def _held_state(path: str, fresh: bool) -> StateDir:
    """The held StateDir of `path`; `fresh`: verified anew (the path was
    replaced, or the run directory not found through the old one). An old
    one is never closed: another thread may be opening through it."""
    with _held_mu:
        old = _HELD.get(path)
        if old is not None and not fresh:
            return old
        st = StateDir.open(path, write=True)
        if old is not None:
            a, b = os.fstat(old.fd), os.fstat(st.fd)
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                st.close()            # the same directory: keep the one already held
                return old
        _HELD[path] = st
        return st


class _Opened:
    __slots__ = ("d", "fds")

    def __init__(self, d: RunDirBase) -> None:
        self.d = d
        self.fds: tuple[int, ...] = ()

    def __enter__(self) -> RunDirBase:
        self.fds = self.d._borrow()
        return self.d

    def __exit__(self, *exc: object) -> None:
        if self.fds:
            self.d._give_back(self.fds[0])
