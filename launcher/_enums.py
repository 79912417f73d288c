"""The public `launcher.State`, `launcher.Outcome` and `launcher.Effect`:
the contract's names (CONTRACT.md) as StrEnums, for callers who iterate
them, look a value up (`State("REAPED")`) or type-check against them.

The engine itself uses _state.py's str constants of the same names and
values, so that `contain run` never imports `enum` (see _state.py);
tests/test_exports.py holds the two to the same members. A record's
`state` is a plain str either way, equal to the member.
"""
from __future__ import annotations

import enum


class State(enum.StrEnum):
    RUNNING = "RUNNING"
    REAPED = "REAPED"
    EXITED = "EXITED"
    UNCONFIRMED = "UNCONFIRMED"
    BREACHED = "BREACHED"


class Outcome(enum.StrEnum):
    EXITED = "exited"
    SIGNALED = "signaled"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    SPAWN_FAILED = "spawn_failed"


class Effect(enum.StrEnum):
    """What one cancel operation did (CONTRACT.md, "Cancel operations")."""

    CANCEL_REQUESTED = "cancel_requested"
    CANCELLED = "cancelled"
    NOT_LIVE = "not_live"
    UNKNOWN = "unknown"
