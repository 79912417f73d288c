"""The stop sequence: linger, polite signal, kill, wait for empty, retry.

Where the stop is decided: the driver (_run.Run) begins a stop when the
table says the run is stopping (root exit, cancel, timeout) and feeds back
the events this room returns; nothing here changes the run's state itself.

    begin(now, grace, signum=, linger=)
                       observe first; if members remain: a linger (after a
                       root exit, when asked), or `signum` (SIGTERM, or the
                       signal that cancelled the run) and SIGCONT to every
                       member and a grace deadline, or the kill at once
    shorten(now, grace, signum)
                       a later cancel: a linger ends now (the polite step
                       begins, with that cancel's signal and grace); a grace
                       under way ends no later than `now + grace`
    advance(now)       at the end of the linger: the polite step; at the end
                       of the grace: the kill (cgroup.kill); at the end of
                       the kill wait: Event.DEADLINE (UNCONFIRMED)
    retry(now)         unconfirmed is not terminal: the kill again
    observe()          the container's emptiness, as an event: EMPTY (kernel,
                       no escaper alive), EMPTY_ESCAPED, TREE_GONE (degraded),
                       OBSERVE_FAILED, or None while members remain

REAPED can only follow EMPTY, and EMPTY is returned only on an observed
`populated 0` of a kernel container with every escaper proven gone.

The linger (`--linger`, `linger=`) exists because cleaning up at once has
real side effects: `git gc --auto` backgrounds the gc and exits, and a
SIGTERM 1 ms later left no pack and a stale `gc.pid.lock`. The tree stays in
its container while it lingers; a tree that empties on its own within it
ends REAPED with nothing signalled, and the record says what lingered.
"""
from __future__ import annotations

import os
from . import _signals as signal
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable

    from ._evidence import RunEvidence
    from ._escapes import EscapeWatch

from . import _state as S
from ._deaf import DEAF_PRONE, term_the_deaf
from ._identity import ProcessIdentity
from ._signals import signal_name
from ._procfs import read_comm
from ._record import not_measured, now_iso

_NAMES_KEPT = 16     # processes named in the record per step; the count is always exact


class StopSequence:
    def __init__(self, container: Any, facts: RunEvidence, *, kill_timeout: float,
                 check_sockets: bool = False, watch: EscapeWatch | None = None,
                 journal: Callable[..., None] | None = None) -> None:
        self.container = container
        self.journal = journal             # the run's diagnostic journal, if it has one
        self.facts = facts
        self.kill_timeout = kill_timeout
        self.check_sockets = check_sockets
        self.watch = watch
        self.timeout_at = 0.0              # monotonic end of the run's --timeout (0: none): a linger ends by then
        self.linger_began = 0.0
        self.stage: str | None = None      # None (not begun), "linger", "term" or "kill"
        self.deadline = 0.0                # monotonic end of the current stage
        self.kill_rounds = 0
        self.began_at = 0.0
        self.grace = 0.0                   # of the polite step (still to come while lingering)
        self.asked_grace: float | None = None   # a cancel's grace that came before this process began the stop (adoption)
        self.signum = int(signal.SIGTERM)  # the polite step's signal
        self.sockets: tuple[set[int], list[str]] | None = None   # held by members at the stop
        self.never_ran = False             # cancelled before, or failed at, the spawn: no worker instruction ran
        self.usage: Any = None             # the run's RunUsage (_usage.py): locks at the stop, time of empty

    def next_deadline(self) -> float:
        return self.deadline if self.stage is not None else float("inf")

    # -- acting --------------------------------------------------------------

    def begin(self, now: float, grace: float, *, signum: int = signal.SIGTERM, linger: float = 0.0) -> str | None:
        self.began_at = self.began_at or now
        ev = self.observe()
        if ev is not None and ev != S.Event.OBSERVE_FAILED:
            if linger > 0 and self.facts.linger is None:
                # Empty already: the linger asked for took no time (the record
                # says so rather than leave out what was asked).
                at = now_iso()
                self.facts.linger = {"asked_s": linger, "began_at": at, "ended_at": at, "lingered_s": 0.0,
                                     "ended_by": "emptied", "seen": {"count": 0}}
            return ev
        self._note_sockets()
        # The members are listed once here, for the locks they hold and for
        # the first step's `seen` (each listing walks the subtree and reads
        # every cgroup.procs): the same moment, the stop's beginning.
        try:
            pids: list[int] | None = self.container.members()
        except OSError:
            pids = None                    # the locks layer then says what it could not list; `seen` is null
        if self.usage is not None and pids is not None:
            self.usage.at_stop(pids)
        if self.asked_grace is not None:
            grace = min(grace, self.asked_grace)
        self.grace, self.signum = grace, int(signum)
        if linger > 0 and ev is None:
            self.stage, self.deadline = "linger", min(now + linger, self.timeout_at or float("inf"))
            self.linger_began = now
            self.facts.linger = {"asked_s": linger, "began_at": now_iso(), "ended_at": None,
                                 "lingered_s": None, "ended_by": None, "seen": self._seen(pids, listed=True)}
            if self.journal is not None:
                self.journal("linger", seconds=linger)
            return None
        self._polite(now, pids, listed=True)
        return ev

    def shorten(self, now: float, grace: float | None = None, signum: int | None = None) -> None:
        """A later cancel (a second signal, `cancel --grace`, `cancel(grace=)`)
        during the stop: a linger ends at once and the polite step begins
        (with this cancel's signal and grace where it gives them); a grace
        under way ends no later than `now + grace`. Before this process
        began the stop (an adopter reading the inbox of a run already
        stopping), the grace is kept for when it does."""
        if self.stage is None:
            if grace is not None:
                self.asked_grace = grace if self.asked_grace is None else min(self.asked_grace, grace)
        elif self.stage == "linger":
            self._end_linger(now, "cancel")
            if signum is not None:
                self.signum = int(signum)
            if grace is not None:
                self.grace = grace
            self._polite(now)
        elif self.stage == "term" and grace is not None:
            self.deadline = min(self.deadline, now + grace)

    def on_signal(self, now: float, signum: int) -> None:
        """A signal to the supervisor while the stop is under way (a second
        Ctrl-C): a linger ends and the polite step sends that signal; a grace
        under way ends now (the kill)."""
        if self.stage == "linger":
            self.shorten(now, None, signum)
        elif self.stage == "term":
            self.shorten(now, 0.0)

    def advance(self, now: float) -> str | None:
        if self.stage is None or now < self.deadline:
            return None
        if self.stage == "linger":
            by_timeout = self.timeout_at and self.deadline >= self.timeout_at
            if by_timeout and self.journal is not None:
                self.journal("timeout", during="linger")
            self._end_linger(now, "timeout" if by_timeout else "deadline")
            self._polite(now)
            return None
        if self.stage == "term":
            self._kill(now)
            return None
        return S.Event.DEADLINE

    def retry(self, now: float) -> None:
        self._kill(now)

    def _polite(self, now: float, pids: list[int] | None = None, listed: bool = False) -> None:
        if self.grace > 0 and self._terminate(pids, listed):
            self.stage, self.deadline = "term", now + self.grace
        else:
            # No grace, or nothing was asked to stop (a Job Object with no
            # member on our console, a signal that could not be sent):
            # waiting out the grace would buy nothing.
            self._kill(now, pids, listed)

    def _end_linger(self, now: float, why: str) -> None:
        lg = self.facts.linger
        if lg is not None and lg.get("ended_by") is None:
            lg.update(ended_at=now_iso(), ended_by=why,
                      lingered_s=round(max(0.0, now - self.linger_began), 3))
        self.stage = None

    def _note_sockets(self) -> None:
        """What the members hold at the stop (once more after a linger: what
        they opened meanwhile is theirs too)."""
        if not self.check_sockets:
            return
        from ._postconditions import socket_inodes     # lazy: only runs that asked for it

        try:
            held, problems = socket_inodes(self.container.members())
        except OSError as e:
            held, problems = set(), [f"the members could not be listed: {os.strerror(e.errno or 0)}"]
        if self.sockets is not None:
            held, problems = held | self.sockets[0], self.sockets[1] + problems
        self.sockets = (held, problems)

    def _seen(self, pids: list[int] | None = None, listed: bool = False) -> dict[str, Any] | None:
        """The members about to be signalled (or left to linger): how many,
        and the first few by pid and command name, for the record and `-v`.
        `listed`: `pids` is this moment's listing (None: it failed)."""
        if not listed:
            try:
                pids = self.container.members()
            except OSError:
                return None
        if pids is None:
            return None
        pids = sorted(pids)
        return {"count": len(pids), "processes": [{"pid": p, "comm": read_comm(p)} for p in pids[:_NAMES_KEPT]]}

    def _terminate(self, pids: list[int] | None = None, listed: bool = False) -> bool:
        """The polite step; whether it reached the tree."""
        name = signal_name(self.signum)
        if self.facts.linger is not None:
            self._note_sockets()
        seen = self._seen(pids, listed)
        try:
            via, detail = self.container.terminate(self.signum)
            # A container that could send nothing says so (`sent`: a Job
            # Object with no member on our console): the step is not observed.
            sent = detail.get("sent", True) if isinstance(detail, dict) else True
            self.facts.signal_step("term", sent, via, dict(detail, signal=name, seen=seen))
            if sent and self.signum in DEAF_PRONE:
                # Members that ignore it (a shell's `&` jobs) would wait out
                # the grace: told with SIGTERM now (_deaf.py).
                deaf = term_the_deaf(self.container, self.signum)
                if deaf is not None:
                    self.facts.signal_step("term", True, f"SIGTERM+SIGCONT by pidfd to {deaf['count']} member(s) "
                                           f"that ignore {name}", deaf)
            return bool(sent)
        except OSError as e:
            via = getattr(self.container, "term_via", None) or f"{name} by pidfd"
            self.facts.signal_step("term", None, via, f"failed: {e}")
            return False

    def _kill(self, now: float, pids: list[int] | None = None, listed: bool = False) -> None:
        self.kill_rounds += 1
        seen = self._seen(pids, listed) if self.kill_rounds == 1 and self.stage is None else None
        try:
            via = self.container.kill()
            detail: dict[str, Any] = {"round": self.kill_rounds}
            also = getattr(self.container, "also_killed", None)
            if also:
                detail["also"] = also
            if seen is not None:
                detail["seen"] = seen
            self.facts.signal_step("kill", True, via, detail)
        except OSError as e:
            self.facts.signal_step("kill", None, getattr(self.container, "kill_via", None) or "cgroup.kill",
                                   f"failed: {e}")
        if self.journal is not None:
            self.journal("kill", round=self.kill_rounds)
        self.stage, self.deadline = "kill", now + self.kill_timeout

    # -- observing -----------------------------------------------------------

    def observe(self) -> str | None:
        c, facts = self.container, self.facts
        try:
            populated = c.populated()
        except OSError as e:
            facts.set("container_empty", None, c.empty_via, f"observation failed: {e}")
            return S.Event.OBSERVE_FAILED
        if populated:
            return None
        if self.stage == "linger":
            self._end_linger(time.monotonic(), "emptied")
        t = time.time()
        gone = getattr(c, "gone_detail", None)
        if gone:
            # A Windows job nobody holds any more (winhost.JobGone): the
            # kernel ended its tree, but an empty job cannot be observed.
            facts.layers["container_empty"] = {"observed": None, "at": now_iso(t), "via": c.empty_via,
                                               "detail": gone}
            facts.layers["descendants_exit"] = {"observed": None, "at": now_iso(t), "via": c.empty_via,
                                                "detail": gone}
            return S.Event.TREE_GONE
        facts.times["empty_at"] = now_iso(t)
        if self.usage is not None:
            self.usage.at_empty()
        unproven = c.proof_problem() if c.backend == "subreaper" else None
        if unproven is not None:
            # The subtree has no member left that can be told, but it holds a
            # child that may be the tree's, or the supervisor stopped being a
            # subreaper: emptiness is not observed, and nothing is claimed.
            facts.layers["container_empty"] = {"observed": None, "at": now_iso(t), "via": c.empty_via,
                                               "detail": unproven}
            facts.layers["descendants_exit"] = {"observed": None, "at": now_iso(t), "via": c.empty_via,
                                                "detail": c.seen_summary()}
            return S.Event.TREE_GONE
        if c.backend == "none":
            facts.layers["container_empty"] = not_measured("no kernel container (degraded mode)")
            # Everything the scan saw is gone, but nothing held the tree: that
            # every descendant exited cannot be observed here (null, with
            # what was seen), and never reads as true.
            facts.layers["descendants_exit"] = {"observed": None, "at": now_iso(t), "via": c.empty_via,
                                                "detail": c.seen_summary()}
            return S.Event.TREE_GONE
        facts.set("container_empty", True, c.empty_proof, {"path": c.path}, at=t)
        how, why_not = self._unleavable()
        if how is None:
            # Empty is not "every descendant exited" when a member could have
            # walked out unseen: one layer never signs for another.
            facts.layers["descendants_exit"] = {
                "observed": None, "at": None, "via": c.empty_proof,
                "detail": f"the container emptied, but a member could have left it unseen: {why_not}"}
            if self.watch is not None:
                facts.escapes.extend(self.watch.at_empty(c, self.kill_timeout))
            return S.Event.EMPTY_ESCAPED if escapers_alive(facts.escapes) is not False else S.Event.EMPTY_LEAVABLE
        facts.set("descendants_exit", True, f"{c.empty_proof}, and no member could leave unseen ({how})", None, at=t)
        if self.watch is not None:
            facts.escapes.extend(self.watch.at_empty(c, self.kill_timeout))
            if how == LEDGER_PROOF:
                # The escapers acted until the pass stopped them: a fork one
                # made outside (clone(CLONE_PARENT), reported as a reaper's)
                # is judged only now, with every event it caused read.
                how, why_not = self._unleavable()
                if how is None:
                    facts.layers["descendants_exit"] = {
                        "observed": None, "at": now_iso(), "via": c.empty_proof,
                        "detail": f"the container emptied, but a member could have left it unseen: {why_not}"}
                    return (S.Event.EMPTY_ESCAPED if escapers_alive(facts.escapes) is not False
                            else S.Event.EMPTY_LEAVABLE)
        alive = escapers_alive(facts.escapes)
        if alive is not False:
            # The container is empty, but a process that left it is alive or
            # not proven gone: the tree's descendants did not all exit.
            seen_alive = any(e.get("alive_at_end") is True for e in facts.escapes)
            facts.layers["descendants_exit"] = {
                "observed": False if seen_alive else None, "at": now_iso(t),
                "via": "cgroup.events populated 0, and the escapers' identities re-read",
                "detail": "the container emptied; escaper(s) " + ("alive" if seen_alive else "not proven gone")}
            return S.Event.EMPTY_ESCAPED
        return S.Event.EMPTY

    def _unleavable(self) -> tuple[str | None, str]:
        """(how the run proves no member left the container unseen, or None;
        and if None, why not)."""
        if self.never_ran:
            return "the worker never ran: nothing of the run could act, let alone leave", ""
        wall = self.container.unleavable()
        if wall is not None:
            return wall, ""
        vouched = getattr(self.container, "vouched", None)
        if vouched:     # a nested run finished by its lead: the lead's proof covers it (_adopt.finish_nested)
            return vouched, ""
        sealed, sealed_reason = self.facts.sealed
        if sealed:
            method = (getattr(self.container, "seal_detail", None) or {}).get("method", "sealed")
            return f"sealed: {method}", ""
        missing = self.watch.saw_whole_run() if self.watch is not None else "no fork ledger"
        if missing is None:
            return LEDGER_PROOF, ""
        return None, f"not sealed ({sealed_reason}), and {missing}"

    def wait_empty(self, deadline: float) -> str:
        """Block until the container is observed empty or `deadline`
        (monotonic) passes; the last observation (a failed spawn's stop,
        which has no owner loop around it)."""
        while True:
            ev = self.observe()
            if ev is not None and ev != S.Event.OBSERVE_FAILED:
                return ev
            if time.monotonic() > deadline:
                return S.Event.DEADLINE
            self.container.wait_change(0.05)


LEDGER_PROOF = "the fork ledger saw every fork of the run"


def escapers_alive(escapes: list[dict[str, Any]]) -> bool | None:
    """False only when every process seen leaving is proven gone."""
    anyone = False
    for e in escapes:
        if e.get("gone") is True:          # its pidfd was seen readable
            e["alive_at_end"] = False
            continue
        ident = e.get("identity")
        alive = ProcessIdentity.from_dict(ident).is_alive() if ident else None
        e["alive_at_end"] = alive
        if alive is not False:
            anyone = True
    return None if anyone else False

