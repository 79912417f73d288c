"""The stop sequence: polite signal, kill, wait for empty, retry.

Where the stop is decided: the driver (_run.Run) begins a stop when the
table says the run is stopping (root exit, cancel, timeout) and feeds back
the events this room returns; nothing here changes the run's state itself.

    begin(now, grace)  observe first; if members remain: SIGTERM (and SIGCONT)
                       to every member and a grace deadline, or the kill at once
    advance(now)       at the end of the grace: the kill (cgroup.kill); at the
                       end of the kill wait: Event.DEADLINE (UNCONFIRMED)
    retry(now)         unconfirmed is not terminal: the kill again
    observe()          the container's emptiness, as an event: EMPTY (kernel,
                       no escaper alive), EMPTY_ESCAPED, TREE_GONE (degraded),
                       OBSERVE_FAILED, or None while members remain

REAPED can only follow EMPTY, and EMPTY is returned only on an observed
`populated 0` of a kernel container with every escaper proven gone.
"""
from __future__ import annotations

import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Callable

    from ._evidence import RunEvidence
    from ._escapes import EscapeWatch

from . import _state as S
from ._identity import ProcessIdentity
from ._record import not_measured, now_iso


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
        self.stage: str | None = None      # None (not begun), "term" or "kill"
        self.deadline = 0.0                # monotonic end of the current stage
        self.kill_rounds = 0
        self.began_at = 0.0
        self.sockets: tuple[set[int], list[str]] | None = None   # held by members at the stop
        self.never_ran = False             # a failed spawn: no instruction of the worker ran

    def next_deadline(self) -> float:
        return self.deadline if self.stage is not None else float("inf")

    # -- acting --------------------------------------------------------------

    def begin(self, now: float, grace: float) -> S.Event | None:
        self.began_at = self.began_at or now
        ev = self.observe()
        if ev is not None and ev is not S.Event.OBSERVE_FAILED:
            return ev
        if self.check_sockets and self.sockets is None:
            from ._postconditions import socket_inodes     # lazy: only runs that asked for it

            self.sockets = socket_inodes(self.container.members())
        if grace > 0:
            self._terminate()
            self.stage, self.deadline = "term", now + grace
        else:
            self._kill(now)
        return ev

    def shorten(self, now: float, grace: float) -> None:
        """A later request for a shorter grace ends the running one sooner."""
        if self.stage == "term":
            self.deadline = min(self.deadline, now + grace)

    def advance(self, now: float) -> S.Event | None:
        if self.stage is None or now < self.deadline:
            return None
        if self.stage == "term":
            self._kill(now)
            return None
        return S.Event.DEADLINE

    def retry(self, now: float) -> None:
        self._kill(now)

    def _terminate(self) -> None:
        try:
            via, detail = self.container.terminate()
            # A container that could send nothing says so (`sent`: a Job
            # Object with no member on our console): the step is not observed.
            sent = detail.get("sent", True) if isinstance(detail, dict) else True
            self.facts.signal_step("term", sent, via, detail)
        except OSError as e:
            self.facts.signal_step("term", None, "SIGTERM by pidfd", f"failed: {e}")

    def _kill(self, now: float) -> None:
        self.kill_rounds += 1
        try:
            via = self.container.kill()
            detail: dict[str, Any] = {"round": self.kill_rounds}
            also = getattr(self.container, "also_killed", None)
            if also:
                detail["also"] = also
            self.facts.signal_step("kill", True, via, detail)
        except OSError as e:
            self.facts.signal_step("kill", None, "cgroup.kill", f"failed: {e}")
        if self.journal is not None:
            self.journal("kill", round=self.kill_rounds)
        self.stage, self.deadline = "kill", now + self.kill_timeout

    # -- observing -----------------------------------------------------------

    def observe(self) -> S.Event | None:
        c, facts = self.container, self.facts
        try:
            populated = c.populated()
        except OSError as e:
            facts.set("container_empty", None, c.empty_via, f"observation failed: {e}")
            return S.Event.OBSERVE_FAILED
        if populated:
            return None
        t = time.time()
        facts.times["empty_at"] = now_iso(t)
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
            return "the fork ledger saw every fork of the run", ""
        return None, f"not sealed ({sealed_reason}), and {missing}"

    def wait_empty(self, deadline: float) -> S.Event:
        """Block until the container is observed empty or `deadline`
        (monotonic) passes; the last observation (a failed spawn's stop,
        which has no owner loop around it)."""
        while True:
            ev = self.observe()
            if ev is not None and ev is not S.Event.OBSERVE_FAILED:
                return ev
            if time.monotonic() > deadline:
                return S.Event.DEADLINE
            self.container.wait_change(0.05)


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

