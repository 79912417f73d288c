"""The run's states and the one table of allowed transitions. Pure: no I/O.

The supervisor and an adopter (a `contain cancel` that takes over a run whose
supervisor died) both feed events through `step`, so every interleaving of
natural exit, cancel, kill failure, timeout and supervisor death is decided in
one place and can be tested without a process (tests/test_state.py).

Rules the table encodes (CONTRACT.md):
- The first event that decides *why* the run ends fixes `outcome`; later
  events never change it ("one result").
- `REAPED` is reachable only through `Event.EMPTY`, which the stop sequence
  emits only on an observed `populated 0` of a kernel container that no
  member could have left unseen (a wall that cannot be left, a seal, or a
  fork ledger that saw the whole run), with every escaper proven gone.
  A container that could have been left gives `EMPTY_LEAVABLE`: `EXITED`.
- `UNCONFIRMED` is not terminal: a new cancel reopens the stop.
- Terminal states absorb every event.

Every set of names is a class of str constants, not an `enum`: `enum` and
what it imports (functools, collections) cost `contain run` 2.3 ms of its
start-up, a sixth of what the whole run may take over a plain
`subprocess.call` (docs/performance.md). The public `launcher.State`,
`Outcome` and `Effect` are StrEnums of these same names (_enums.py).
Compare with `==`: a value read from a file is an equal string, not the
same object.
"""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path


def names(of: type) -> dict[str, str]:
    """NAME -> value of one set of names, in definition order."""
    return {k: v for k, v in vars(of).items() if k.isupper() and isinstance(v, str)}


def checked(of: type, value: object) -> str:
    """`value` if it is one of `of`'s values (the canonical constant), else
    ValueError, as `Enum(value)` would raise."""
    for v in names(of).values():
        if v == value:
            return v
    raise ValueError(f"{value!r} is not a valid {of.__name__}")


class State:
    RUNNING = "RUNNING"
    REAPED = "REAPED"
    EXITED = "EXITED"
    UNCONFIRMED = "UNCONFIRMED"
    BREACHED = "BREACHED"


class Outcome:
    EXITED = "exited"
    SIGNALED = "signaled"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    SPAWN_FAILED = "spawn_failed"


class Phase:
    """Finer than State: RUNNING and STOPPING both read as State.RUNNING."""

    RUNNING = "running"          # live, nothing asked it to stop
    STOPPING = "stopping"        # a stop is under way (after exit, cancel or timeout)
    UNCONFIRMED = "unconfirmed"  # the stop's deadline passed without emptiness
    REAPED = "reaped"
    EXITED = "exited"
    BREACHED = "breached"


class Event:
    ROOT_EXITED = "root_exited"      # carries how: Outcome.EXITED or Outcome.SIGNALED
    CANCEL = "cancel"                # a durable cancel request reached the owner
    TIMEOUT = "timeout"
    EMPTY = "empty"                  # kernel container observed empty, no escaper alive
    EMPTY_ESCAPED = "empty_escaped"  # container empty, but an escaper is not proven gone
    EMPTY_LEAVABLE = "empty_leavable"  # container empty, but a member could have left it unseen
    TREE_GONE = "tree_gone"          # degraded mode: every process it saw is gone
    DEADLINE = "deadline"            # the stop deadline passed without emptiness
    OBSERVE_FAILED = "observe_failed"
    SPAWN_FAILED = "spawn_failed"


TERMINAL = frozenset({Phase.REAPED, Phase.EXITED, Phase.BREACHED})

# The one definition of which contract states are final (and which are not):
# every reader of a record (ls, status, wait, cancel, adoption, the layout's
# liveness check) asks these; a state read from JSON is looked up as it is.
TERMINAL_STATES = frozenset({State.REAPED, State.EXITED, State.BREACHED})
LIVE_STATES = frozenset({State.RUNNING, State.UNCONFIRMED})

_STATE_OF = {
    Phase.RUNNING: State.RUNNING,
    Phase.STOPPING: State.RUNNING,
    Phase.UNCONFIRMED: State.UNCONFIRMED,
    Phase.REAPED: State.REAPED,
    Phase.EXITED: State.EXITED,
    Phase.BREACHED: State.BREACHED,
}

# (phase, event) -> next phase. A pair that is missing leaves the phase as it is.
_NEXT: dict[tuple[str, str], str] = {
    (Phase.RUNNING, Event.ROOT_EXITED): Phase.STOPPING,
    (Phase.RUNNING, Event.CANCEL): Phase.STOPPING,
    (Phase.RUNNING, Event.TIMEOUT): Phase.STOPPING,
    # A failed spawn is stopped like any run: the leaf may hold the dying
    # child, and REAPED still needs an observed populated 0.
    (Phase.RUNNING, Event.SPAWN_FAILED): Phase.STOPPING,
    (Phase.STOPPING, Event.EMPTY): Phase.REAPED,
    (Phase.STOPPING, Event.EMPTY_ESCAPED): Phase.BREACHED,
    (Phase.STOPPING, Event.EMPTY_LEAVABLE): Phase.EXITED,
    (Phase.STOPPING, Event.TREE_GONE): Phase.EXITED,
    (Phase.STOPPING, Event.DEADLINE): Phase.UNCONFIRMED,
    (Phase.STOPPING, Event.OBSERVE_FAILED): Phase.UNCONFIRMED,
    (Phase.UNCONFIRMED, Event.CANCEL): Phase.STOPPING,   # a retry repeats the kill
    (Phase.UNCONFIRMED, Event.TIMEOUT): Phase.STOPPING,
    (Phase.UNCONFIRMED, Event.EMPTY): Phase.REAPED,
    (Phase.UNCONFIRMED, Event.EMPTY_ESCAPED): Phase.BREACHED,
    (Phase.UNCONFIRMED, Event.EMPTY_LEAVABLE): Phase.EXITED,
    (Phase.UNCONFIRMED, Event.TREE_GONE): Phase.EXITED,
}

# Which events may fix the outcome, and to what.
_OUTCOME_OF = {
    Event.CANCEL: Outcome.CANCELLED,
    Event.TIMEOUT: Outcome.TIMED_OUT,
    Event.SPAWN_FAILED: Outcome.SPAWN_FAILED,
}


class Snapshot(tuple[str, "str | None"]):
    """(phase, outcome): immutable, compared and hashed as a tuple (a
    namedtuple would import collections, see above)."""
    __slots__ = ()

    def __new__(cls, phase: str = Phase.RUNNING, outcome: str | None = None) -> Snapshot:
        return tuple.__new__(cls, (phase, outcome))

    @property
    def phase(self) -> str:
        return self[0]

    @property
    def outcome(self) -> str | None:
        return self[1]

    def __getnewargs__(self) -> tuple[str, str | None]:
        # copy and pickle call __new__ with these: tuple's own would pass the
        # whole tuple as `phase` (namedtuple defines this for the same reason)
        return (self[0], self[1])

    def __repr__(self) -> str:
        return f"Snapshot(phase={self[0]!r}, outcome={self[1]!r})"

    @property
    def state(self) -> str:
        return _STATE_OF[self.phase]

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL

    @property
    def stopping(self) -> bool:
        """A stop is wanted: the driver must keep the kill going."""
        return self.phase in (Phase.STOPPING, Phase.UNCONFIRMED)


def step(snap: Snapshot, event: str, how: str | None = None) -> Snapshot:
    """Apply one event. `how` says how the root exited, for ROOT_EXITED."""
    if snap.terminal:
        return snap
    phase = _NEXT.get((snap.phase, event), snap.phase)
    outcome = snap.outcome
    if outcome is None:
        if event == Event.ROOT_EXITED:
            outcome = how or Outcome.EXITED
        else:
            outcome = _OUTCOME_OF.get(event)
    return Snapshot(phase, outcome)


def from_record(state: str, outcome: str | None) -> Snapshot:
    """The snapshot an adopter resumes from, given only the last record.
    RUNNING with an outcome means a stop was under way (STOPPING)."""
    out = checked(Outcome, outcome) if outcome else None
    phase = {
        State.REAPED: Phase.REAPED,
        State.EXITED: Phase.EXITED,
        State.BREACHED: Phase.BREACHED,
        State.UNCONFIRMED: Phase.UNCONFIRMED,
    }.get(checked(State, state))
    if phase is None:
        phase = Phase.STOPPING if out is not None else Phase.RUNNING
    return Snapshot(phase, out)


class Effect:
    """What one cancel operation did (CONTRACT.md, "Cancel operations")."""

    CANCEL_REQUESTED = "cancel_requested"
    CANCELLED = "cancelled"
    NOT_LIVE = "not_live"
    UNKNOWN = "unknown"


def effect_on_arrival(before: Snapshot) -> str:
    """The effect of a cancel that reaches the owner in state `before`.

    A cancel joins a stop that a cancel started; it never takes credit for a
    run that had already ended or whose outcome something else decided."""
    if before.terminal:
        return Effect.NOT_LIVE
    if before.outcome is None or before.outcome == Outcome.CANCELLED:
        return Effect.CANCEL_REQUESTED
    return Effect.NOT_LIVE


def effect_at_end(first: str, final: Snapshot, *, emptied: bool = False) -> str:
    """The settled effect of an operation once the run is `final`.
    `emptied`: the run's container was observed empty (its container_empty
    layer is true). CONTRACT.md: `cancelled` is "this operation's stop ended
    the run and the container was observed empty", which REAPED implies,
    and an EXITED run whose cgroup emptied also says (a member could have
    left it unseen: the state says that, the effect does not need to)."""
    if first != Effect.CANCEL_REQUESTED or final.outcome != Outcome.CANCELLED:
        return first
    if final.phase == Phase.REAPED or (final.phase == Phase.EXITED and emptied):
        return Effect.CANCELLED
    # Still stopping, or ended without an observed-empty container (degraded
    # mode, a breach): the stop was issued, not proven.
    return Effect.CANCEL_REQUESTED


EXIT_CANCELLED = 128 + 15     # as if `contain` had been sent SIGTERM (docs/design.md, "Exit status")


def exit_status(snap: Snapshot, exit_code: int | None, signal: int | None) -> int:
    """What `contain run` exits with (CONTRACT.md, "Exit status"). A run
    cancelled by another process (`contain cancel`) exits 143 whatever its
    worker did: a worker that traps SIGTERM and exits 0 must not read as a
    success. (One cancelled by a signal to `contain` dies by that signal:
    the CLI's business, _sigproxy.py.)"""
    return _status(snap.phase not in (Phase.UNCONFIRMED, Phase.BREACHED), snap.outcome, exit_code, signal)


def record_exit_status(rec: dict) -> int:
    """What `contain run` gave, or would have given, for the run of this
    final record (`contain wait`'s status, CONTRACT.md): as exit_status,
    and 128+N for a cancel that came from signal N sent to `contain run`
    itself (which then died by it)."""
    code, sig = rec.get("exit_code"), rec.get("signal")
    code = code if isinstance(code, int) and not isinstance(code, bool) else None
    sig = sig if isinstance(sig, int) and not isinstance(sig, bool) and 0 < sig < 128 else None
    by_signal = None
    layer = (rec.get("evidence") or {}).get("cancel_requested") or {}
    by = (layer.get("detail") or {}).get("by") if isinstance(layer.get("detail"), dict) else None
    name = by.get("signal") if isinstance(by, dict) else None
    if isinstance(name, str) and name.startswith("SIG"):
        import signal

        num = getattr(signal, name, None)
        by_signal = num if isinstance(num, int) and 0 < num < 128 else None
    return _status(rec.get("state") in ("REAPED", "EXITED"), rec.get("outcome"), code, sig, by_signal)


def _status(held: bool, outcome: str | None, exit_code: int | None, signal: int | None,
            by_signal: int | None = None) -> int:
    if outcome == Outcome.SPAWN_FAILED:
        return exit_code if exit_code is not None else 125
    if not held:
        return 125        # the stop did not hold: that comes before why it was stopped (a timeout)
    if outcome == Outcome.TIMED_OUT:
        return 124
    if outcome == Outcome.CANCELLED:
        return 128 + by_signal if by_signal else EXIT_CANCELLED
    if signal is not None:
        return 128 + signal
    return exit_code if exit_code is not None else 125
