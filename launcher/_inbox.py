"""The owner's side of the cancel inbox: requests in, acknowledgements out.

    pending()          the requests appended since the last read
    arrive(req, snap)  a request the owner must act on (an `Arrival`), or None
                       (no op id, repeated, refused for another run uid: the
                       refusal is acknowledged here)
    acknowledge(...)   the acknowledgement, written after the driver applied
                       the cancel, with the state it led to
    settle(snap)       at the end: every `cancel_requested` becomes what the
                       run's end proved (`_state.effect_at_end`)

The requesting side (append the intent durably, wait for the answer, adopt
when the owner is gone) is _cancel.py; the effects themselves are the pure
functions of _state.py. See docs/protocol.md.
"""
from __future__ import annotations

import os
from . import _signals as signal
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

    from ._evidence import RunEvidence
    from ._layout import RunDir

from . import _state as S
from ._errors import LauncherError, RunConflict
from ._record import now_iso


def grace_of(req: dict[str, Any]) -> float | None:
    """A request's grace, if it gives a usable one: a finite number of
    seconds >= 0. Anything else is input that chooses nothing (the run's
    own grace applies)."""
    g = req.get("grace")
    if isinstance(g, bool) or not isinstance(g, (int, float)):
        return None
    g = float(g)
    return g if g >= 0 and g != float("inf") else None     # nan fails g >= 0


_CHUNKS_PER_TURN = 16             # of _requests.INBOX_CHUNK each: then the loop looks at the tree again
_MAX_ANSWERED_REJECTIONS = 100    # journal lines and `unknown` answers for lines that are not requests


def _rejected_only(ack: dict[str, Any]) -> bool:
    """An answer written for an inbox line that was not a request."""
    return ack.get("effect") == S.Effect.UNKNOWN and str(ack.get("detail") or "").startswith("rejected: ")


class Arrival:
    """A cancel request the owner applies, with its effect on arrival."""

    __slots__ = ("op", "req", "effect", "ack")

    def __init__(self, op: str, req: dict[str, Any], effect: str, ack: dict[str, Any]) -> None:
        self.op = op
        self.req = req
        self.effect = effect
        self.ack = ack


class Inbox:
    def __init__(self, layout: RunDir | None, run_id: str, run_uid: str, facts: RunEvidence) -> None:
        self.layout = layout
        self.run_id = run_id
        self.run_uid = run_uid
        self.facts = facts
        self.offset = 0
        self.ops: dict[str, dict[str, Any]] = {}      # op id -> its acknowledgement as written
        self.first: dict[str, dict[str, Any]] = {}    # op id -> its acknowledgement as first written (cancel()'s answer)
        # Operations this process requested for a signal it received, and
        # that signal: held in memory, so a request read from the file can
        # never choose what is sent to the tree.
        self.signal_ops: dict[str, int] = {}
        self._undurable: list[dict[str, Any]] = []    # signal requests the inbox file refused
        self.rejected = 0                             # inbox lines that were not requests
        self.on_reject: Any = None                    # (offset, reason) -> None: the run's journal
        self.backlog = False                          # more was in the inbox than one turn reads
        self._rejections: list[Any] = []              # of the last read, answered after its requests
        # The signal operations' ids carry a nonce: a worker that can read
        # run.json (the supervisor's pid) cannot squat them.
        self._nonce = os.urandom(4).hex()

    def load(self) -> None:
        """The acknowledgements already written for this run (adoption)."""
        if self.layout is None:
            return
        for ack in self.layout.acks():
            # An answer to a line that was no request reserves nothing: a
            # valid request with that op id still applies.
            if ack.get("run_uid") == self.run_uid and ack.get("op_id") and not _rejected_only(ack):
                self.ops[ack["op_id"]] = ack

    def pending(self) -> list[dict[str, Any]]:
        """The requests appended since the last read, each checked
        (_runfiles.parse_request: an object, a bounded op id, a run uid, a
        finite grace). A line that is not one is journaled and, when it
        names an op id, answered `unknown` with the reason: the requester
        is not left waiting, and nothing in the file can stop the loop."""
        if self.layout is None:
            return []
        out, self._undurable = self._undurable, []
        self.backlog = False
        for _ in range(_CHUNKS_PER_TURN):
            got = self.layout.read_inbox(self.offset, None, require_uid=True)
            out.extend(r.to_dict() for r in got.accepted)
            self._rejections.extend(got.rejected)
            self.offset = got.offset
            self.backlog = got.more        # then the owner turns again at once (Run.next_deadline)
            if not got.more:
                break
        return out

    def answer_rejections(self) -> None:
        """After the requests of the same read were applied: journal each
        rejected line and answer its op id `unknown`, unless that op has a
        real answer (a rejection never reserves an op id, and never speaks
        over an accepted request)."""
        todo, self._rejections = self._rejections, []
        for rej in todo:
            self.rejected += 1
            if self.rejected > _MAX_ANSWERED_REJECTIONS:
                continue            # a flood is counted, not answered line by line
            if self.on_reject is not None:
                self.on_reject(rej.offset, rej.reason)
            op = rej.op_id
            if not op or op in self.ops or op in self.signal_ops or self.layout is None:
                continue
            try:
                if self.layout.read_ack(op) is not None:
                    continue
                # Written, but not remembered in `ops`: a valid request with
                # this op id later still applies (arrive, load).
                self.layout.write_ack(op, {"op_id": op, "run_id": self.run_id, "run_uid": self.run_uid,
                                           "requested_at": None, "acknowledged_at": now_iso(),
                                           "effect": S.Effect.UNKNOWN, "state": None,
                                           "detail": f"rejected: {rej.reason}"})
            except (LauncherError, OSError):
                continue

    def arrive(self, req: dict[str, Any], snap: S.Snapshot) -> Arrival | None:
        assert self.layout is not None
        op = str(req.get("op_id") or "")
        if not op:
            return None
        try:
            self.layout.read_ack(op)       # raises RunConflict: the file names another operation
        except LauncherError as e:
            self.facts.notes.append(str(e))
            return None
        # A repeated operation never applies twice. What was answered is
        # what this owner wrote, or what an earlier owner did (load()): a
        # file on disk alone is no answer, since a worker that can write its
        # run directory answered every request before the owner read it,
        # and so swallowed every cancel.
        if op in self.ops:
            return None
        ack = {"op_id": op, "run_id": self.run_id, "run_uid": self.run_uid,
               "requested_at": req.get("requested_at"), "acknowledged_at": now_iso(), "by": req.get("by")}
        if req.get("run_uid") not in (None, self.run_uid):
            ack.update(effect=S.Effect.UNKNOWN, state=snap.state,
                       detail=f"refused: run uid {req.get('run_uid')} is not the current run ({self.run_uid})")
            self.write(op, ack, durable=snap.terminal)
            return None
        return Arrival(op, req, S.effect_on_arrival(snap), ack)

    def acknowledge(self, arrival: Arrival, snap: S.Snapshot) -> None:
        ack = dict(arrival.ack, effect=arrival.effect, state=snap.state,
                   outcome=snap.outcome)
        self.first[arrival.op] = ack
        self.write(arrival.op, ack, durable=snap.terminal)

    def settle(self, snap: S.Snapshot, *, emptied: bool = False) -> None:
        if self.layout is None:
            return
        for op, ack in list(self.ops.items()):
            eff = S.effect_at_end(S.checked(S.Effect, ack["effect"]), snap, emptied=emptied)
            if eff != ack["effect"] or ack.get("state") != snap.state:
                ack = dict(ack, effect=eff, state=snap.state, settled_at=now_iso(),
                           outcome=snap.outcome)
                self.write(op, ack, durable=snap.terminal)

    def write(self, op: str, ack: dict[str, Any], *, durable: bool) -> None:
        assert self.layout is not None
        self.ops[op] = ack
        try:
            self.layout.write_ack(op, ack, durable=durable)
        except RunConflict:
            raise
        except OSError as e:
            # The acknowledgement stays in memory and is settled again at the
            # end; a full state directory must not abort the stop.
            self.facts.not_saved(f"the acknowledgement of {op}", e)

    def signal_of(self, op: str) -> int | None:
        """The signal whose arrival made this process request `op`, if any:
        the stop it begins sends the tree that signal first."""
        return self.signal_ops.get(op)

    def request_from_signal(self, signum: int) -> bool:
        """SIGINT/SIGTERM/SIGHUP to the supervisor cancel the run through the
        same durable inbox as any other cancel (intent first). False if that
        signal's operation was already requested."""
        if self.layout is None:
            return False
        name = signal.name_of(signum) or str(signum)
        op = f"signal-{name}-{os.getpid()}-{self._nonce}"
        if op in self.ops or op in self.signal_ops:
            return False
        self.signal_ops[op] = signum
        req = {"op_id": op, "run_uid": self.run_uid, "requested_at": now_iso(),
               "by": {"pid": os.getpid(), "signal": name}}
        try:
            self.layout.append_request(req)
        except OSError as e:
            # A full or broken state directory must not keep a Ctrl-C from
            # stopping the run: the owner is alive and applies it itself;
            # the record says the intent was not made durable first.
            self.facts.notes.append(f"{op}: intent not written ({e}); applied by the owner directly")
            self._undurable.append(req)
        return True
