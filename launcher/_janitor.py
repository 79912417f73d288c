"""`contain janitor`: finish every run of a state directory whose owner died.

An owner that dies (SIGKILL, the OOM killer, a library program that exits
without waiting) leaves its runs RUNNING until somebody adopts them
(_adopt.py). The janitor is that somebody, for every such run, as it
happens: the stop where anything is left, the final record, by adoption and
under adoption's rules (never more than observed; REAPED only when the
container is observed empty).

It watches owners, not runs. Every owning process has one owners file,
`<state>/owners/<pid>-<start>-<hex>` (_ownerslots.py): its name says the
process, byte 0 is locked for the process's life. So the janitor

- opens a pidfd for each owners file's process, after checking that the
  process's /proc start time is the name's (a pid alone may be reused) and
  that byte 0 is still locked (a file whose byte 0 is free belongs to a
  process that is gone, whatever its pid is now);
- waits on all those pidfds at once, with an inotify watch on `owners/`
  (a new file is renamed into place: IN_MOVED_TO), in one poll(2);
- when a pidfd polls readable (the whole process has exited: a pidfd of a
  thread-group leader is not readable while other threads live), or a file's
  process is found gone, finishes every run whose `owner` link names that
  file, whose slot is free and whose record is not final;
- and, at start and every FULL_PASS_S, makes a full pass over every run
  (old run directories with `owner.lock`, runs whose adopter died, a file it
  could not watch): the orphans `contain ls` shows (_views.live_view, with
  the owner locks from one read of /proc/locks).

Each run is finished with an operation of its own, `janitor-<run uid>`: the
same id for every janitor, so that two janitors, or a janitor and
`contain cancel`, racing on one run make one request between them, and the
owner lock decides who acts (the loser leaves it: take_over returns None).
The record's notes say the owner died and who finished the run.

A pass finishes runs one after another; a run whose tree ignores SIGTERM
takes its grace. Retention is the one `contain run` applies (the automatic
bound, CONTAIN_KEEP_RUNS), or `--keep N` as `contain gc --keep N`.
"""
from __future__ import annotations

import errno
import os
import select
import signal
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable

from . import _ownerslots as slots
from . import _safefs as F
from ._adopt import take_over
from ._errors import LauncherError
from ._layout import RunDir
from ._ofdlock import write_locked
from ._procfs import read_stat
from ._record import now_iso
from ._statedir import StateDir, claim_lock, claim_unlock
from ._views import live_view

FULL_PASS_S = 15.0
_IN_CREATE, _IN_MOVED_TO, _IN_Q_OVERFLOW = 0x100, 0x80, 0x4000


def op_for(run_uid: str | None, run_id: str) -> str:
    """The janitor's operation id for one run: the same in every janitor."""
    return f"janitor-{run_uid or run_id}"[:200]


class Finished:
    """One run the janitor finished (or found finished by a racing adopter)."""

    __slots__ = ("id", "run_uid", "op_id", "state", "outcome", "effect", "owner", "error")

    def __init__(self, run_id: str, run_uid: str | None, op_id: str, owner: str) -> None:
        self.id = run_id
        self.run_uid = run_uid
        self.op_id = op_id
        self.owner = owner
        self.state: str | None = None
        self.outcome: str | None = None
        self.effect: str | None = None
        self.error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    def line(self) -> str:
        if self.error:
            return f"{self.id}: not finished: {self.error}"
        return f"{self.id} {self.state} ({self.owner}; op {self.op_id})"


def _owner_text(d: RunDir, named: Any) -> str:
    """Who the owner was, as the run directory names it (input: a name, not
    evidence of anything but what the janitor looked at)."""
    if named:
        who = slots.owner_of(named[0])
        if who is not None:
            return f"its owner process (pid {who[0]}, owners file {named[0]}) died"
    info = d.read_run() or {}
    sup = info.get("supervisor")
    pid = sup.get("pid") if isinstance(sup, dict) else None
    return f"its owner process (pid {pid}) died" if isinstance(pid, int) else "its owner process died"


def finish(d: RunDir, named: Any = None) -> Finished | None:
    """Finish run `d` if it is an orphan: its owner lock free and its record
    not final (as `contain ls` tells an orphan). None if it is not one, or
    if another adopter became its owner first (it finishes the run)."""
    v = live_view(d, live=False, summary=True)
    if not v.get("orphaned"):
        return None
    uid = v.get("run_uid") if isinstance(v.get("run_uid"), str) else None
    op = op_for(uid, d.id)
    if named is None:
        try:
            fd = d.dir_fd()
        except (OSError, F.UnsafePath):
            fd = -1
        if fd >= 0:
            try:
                named = slots.read_link(fd)
            except OSError:
                named = None
            finally:
                os.close(fd)
    owner = _owner_text(d, named)
    res = Finished(d.id, uid, op, owner)
    info = d.read_run() or {}
    note = f"finished by contain janitor (pid {os.getpid()}): {owner}"
    if info.get("die_with_owner") is True:
        note += ("; the run was started with die_with_owner (its wall's init exits when the owner process "
                 "does, and the kernel then kills every member of its namespace)")
    try:
        if d.read_ack(op) is None:
            d.append_request({"op_id": op, "run_uid": uid, "requested_at": now_iso(),
                              "by": {"pid": os.getpid(), "janitor": True, "reason": owner}})
        ack = take_over(d, op, note=note)
    except (LauncherError, OSError, ValueError, F.UnsafePath) as e:
        res.error = str(e)[:300]
        return res
    if ack is None:
        return None                     # another adopter won the owner lock: it finishes the run
    a = ack.to_dict()
    res.state, res.outcome, res.effect = a.get("state"), a.get("outcome"), a.get("effect")
    return res


def full_pass(sd: str | None, say: Callable[[Finished], None]) -> int:
    """Every orphan of the state directory, finished. Returns how many."""
    locked = write_locked()
    n = 0
    for d in RunDir.all(sd):
        try:
            # One read of /proc/locks for the whole listing: a run whose owner
            # lock it shows held is live, and is not opened further.
            if locked is not None and d.owner_among(locked) is True:
                continue
        except (OSError, F.UnsafePath, ValueError):
            pass              # finish() says what could not be read
        n += _finish_and_say(d, None, say)
    return n


def _finish_and_say(d: RunDir, named: tuple[str, int] | None, say: Callable[[Finished], None]) -> int:
    """finish(d), said; a failure is said too, never raised. 1 if said."""
    try:
        res = finish(d, named) if named is not None else finish(d)
    except (OSError, F.UnsafePath, ValueError) as e:
        res = Finished(d.id, None, op_for(None, d.id), "its owner is gone")
        res.error = str(e)[:300]
    if res is None:
        return 0
    say(res)
    return 1


def finish_file(sd: str | None, name: str, say: Callable[[Finished], None]) -> int:
    """The runs whose `owner` link names owners file `name` (its process
    died), finished. Returns how many."""
    n = 0
    for d in RunDir.all(sd):
        try:
            fd = d.dir_fd()
        except (OSError, F.UnsafePath):
            continue
        try:
            named = slots.read_link(fd)
        except OSError:
            continue
        finally:
            os.close(fd)
        if not named or named[0] != name:
            continue
        n += _finish_and_say(d, named, say)
    return n


def retain(st: StateDir, keep: int | None) -> None:
    """Retention after a pass, as `contain run` applies it (the automatic
    bound, under the claim lock) or as `contain gc --keep N`."""
    from . import _gc

    try:
        if keep is not None:
            _gc.gc(st, keep=keep)
            return
        fd = claim_lock(st)
        try:
            _gc.maybe_prune(st)
        finally:
            claim_unlock(fd)
    except (OSError, ValueError, LauncherError):
        pass


class _Owners:
    """The owners files' processes, each watched by a pidfd."""

    def __init__(self, st: StateDir) -> None:
        self.st = st
        self.fds: dict[int, str] = {}        # pidfd -> owners file name
        self.watched: dict[str, int] = {}    # owners file name -> pidfd
        self.gone: set[str] = set()          # files whose process was found gone (finished once)

    def scan(self, dfd: int) -> list[str]:
        """Watch every new owners file; returns those whose process is gone."""
        try:
            names = [n for n in os.listdir(dfd) if slots.valid_name(n)]
        except OSError:
            return []
        present = set(names)
        self.gone &= present
        dead: list[str] = []
        for name in names:
            if name in self.watched or name in self.gone:
                continue
            fd = self._watch(name)
            if fd is None:
                self.gone.add(name)
                dead.append(name)
            elif fd >= 0:
                self.watched[name] = fd
                self.fds[fd] = name
        return dead

    def _watch(self, name: str) -> int | None:
        """A pidfd of the process owners file `name` belongs to; None if
        that process is gone; -1 if it cannot be told (no pidfd: EMFILE,
        a name that does not say; the full pass covers it)."""
        who = slots.owner_of(name)
        if who is None:
            return -1
        pid, start = who
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        except OSError:
            return -1
        st = read_stat(pid)          # after the pidfd: the pid cannot name another process from here on
        held = slots.held(self.st, name, 0)
        if st is None or st[4] != start or held is False:
            os.close(fd)
            return None
        return fd

    def fired(self, fd: int) -> str | None:
        name = self.fds.pop(fd, None)
        if name is not None:
            del self.watched[name]
            self.gone.add(name)
        os.close(fd)
        return name

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        self.watched.clear()


def serve(sd: str | None, say: Callable[[Finished], None], *, once: bool = False, keep: int | None = None,
          interval: float = FULL_PASS_S, should_stop: Callable[[], bool] | None = None) -> int:
    """The janitor: one full pass (`once`), or for ever until SIGTERM or
    SIGINT (in the main thread), or until `should_stop()` says so (looked
    at every second and after each run); it finishes the run at hand, then
    returns. Returns how many runs it finished."""
    st = StateDir.open(sd, write=True, create=True)
    with st:
        path = st.path
        if once:
            n = full_pass(path, say)
            retain(st, keep)
            return n
        return _loop(st, path, say, keep, interval, should_stop)


def _loop(st: StateDir, path: str, say: Callable[[Finished], None], keep: int | None, interval: float,
          should_stop: Callable[[], bool] | None) -> int:
    from ._native import lib

    stop: list[int] = []
    rd, wr = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def on_signal(sig: int, _frame: Any) -> None:
        stop.append(sig)

    old: dict[int, Any] = {}
    old_wake: int | None = None
    dfd = ino = wd = -1
    owners = _Owners(st)
    n = 0
    try:
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                old[sig] = signal.signal(sig, on_signal)
            old_wake = signal.set_wakeup_fd(wr, warn_on_full_buffer=False)
        except ValueError:
            pass           # not the main thread: should_stop() is the way out
        dfd = F.open_private_dir(st.fd, slots.DIR, os.path.join(path, slots.DIR), owners=st.owners,
                                 create_mode=0o700)
        ino = lib.ct_inotify_open()      # -errno: no wake-up for new owners files, the full pass finds them
        if ino >= 0:
            wd = lib.ct_inotify_watch(ino, f"/proc/self/fd/{dfd}".encode(), _IN_CREATE | _IN_MOVED_TO)
        next_full = 0.0
        while not stop and not (should_stop is not None and should_stop()):
            now = time.monotonic()
            if now >= next_full:
                next_full = now + interval
                try:
                    for name in owners.scan(dfd):
                        n += finish_file(path, name, say)
                    n += full_pass(path, say)
                    retain(st, keep)
                except (LauncherError, OSError, F.UnsafePath) as e:
                    # The state directory could not be read this time (a
                    # failed observation, not an outcome): the next pass
                    # looks again; the janitor does not end for it.
                    say(_problem(path, e))
                next_full = time.monotonic() + interval
                continue
            p = select.poll()
            p.register(rd, select.POLLIN)
            if ino >= 0:
                p.register(ino, select.POLLIN)
            for fd in owners.fds:
                p.register(fd, select.POLLIN)
            try:
                wait_s = next_full - now if should_stop is None else min(1.0, next_full - now)
                ready = p.poll(max(0, int(wait_s * 1000)) + 1)
            except InterruptedError:
                continue
            done = 0
            try:
                done = _handle(ready, rd, ino, dfd, owners, path, say)
            except (LauncherError, OSError, F.UnsafePath) as e:
                say(_problem(path, e))
                next_full = 0.0           # look at everything again now
            if done:
                n += done
                retain(st, keep)
    finally:
        owners.close()
        if ino >= 0:
            if wd >= 0:
                lib.ct_inotify_unwatch(ino, wd)
            os.close(ino)
        if dfd >= 0:
            os.close(dfd)
        if old_wake is not None:
            signal.set_wakeup_fd(old_wake)
        for num, h in old.items():
            signal.signal(num, h)
        os.close(rd)
        os.close(wr)
    return n


def _handle(ready: list[tuple[int, int]], rd: int, ino: int, dfd: int, owners: _Owners, path: str,
            say: Callable[[Finished], None]) -> int:
    done = 0
    for fd, _ev in ready:
        if fd == rd:
            _drain(rd)
        elif fd == ino:
            _drain(ino)
            for name in owners.scan(dfd):
                done += finish_file(path, name, say)
        else:
            gone = owners.fired(fd)
            if gone is not None:
                done += finish_file(path, gone, say)
    return done


def _problem(path: str, e: BaseException) -> Finished:
    res = Finished("(state directory)", None, "-", path)
    res.error = f"{path}: {str(e)[:300]}"
    return res


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 65536):
            pass
    except BlockingIOError:
        pass
    except OSError as e:
        if e.errno != errno.EAGAIN:
            raise
