"""`redispatch_eligible`: may the next attempt start in the same workspace?

A derived layer, a pure function of the record (no I/O, no clock): true
only when the run is REAPED (the kernel proved the tree gone) and every
postcondition that was measured holds; false, naming what failed, when the
state or a measured postcondition says no; null, naming what is missing,
when something it needs was not observed. A layer that was not asked for
(absent from the evidence) is not needed; one that was asked for and could
not be observed (`observed: null`) is.

A false anywhere wins over a null elsewhere: one postcondition known to fail
is enough to say no.
"""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Mapping

POSTCONDITIONS = ("workspace_quiescent", "sockets_closed", "locks_released")
VIA = "derived: state REAPED and every measured postcondition (" + ", ".join(POSTCONDITIONS) + ")"

# States that say no for good, and those that are not settled yet.
_NO = {"EXITED": "descendants are not proven gone (no kernel container proved the tree empty)",
       "BREACHED": "a process left the container and is not proven gone"}
_NOT_YET = {"RUNNING": "the run has not ended", "UNCONFIRMED": "emptiness was not observed (not terminal)"}


def redispatch_eligible(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The layer, evidence-shaped: {"observed", "at", "via", "detail"}. `at`
    is the latest `at` of the layers it was derived from (no clock is read)."""
    state = rec.get("state")
    ev = rec.get("evidence")
    ev = ev if isinstance(ev, dict) else {}
    failing: list[dict[str, Any]] = []
    missing: list[dict[str, Any]] = []
    held: list[str] = []
    ats: list[str] = []

    if state == "REAPED":
        ce = ev.get("container_empty")
        if not isinstance(ce, dict) or ce.get("observed") is not True:
            missing.append({"layer": "container_empty",
                            "why": "REAPED without an observed empty container: the record is inconsistent"})
        elif isinstance(ce.get("at"), str):
            ats.append(ce["at"])
    elif state in _NO:
        failing.append({"layer": "state", "state": state, "why": _NO[str(state)]})
    elif state in _NOT_YET:
        missing.append({"layer": "state", "state": state, "why": _NOT_YET[str(state)]})
    else:
        missing.append({"layer": "state", "state": state, "why": "not a known state"})

    measured = []
    for name in POSTCONDITIONS:
        layer = ev.get(name)
        if layer is None:
            continue                            # not asked for: not needed
        measured.append(name)
        obs = layer.get("observed") if isinstance(layer, dict) else None
        if isinstance(layer, dict) and isinstance(layer.get("at"), str):
            ats.append(layer["at"])
        if obs is True:
            held.append(name)
        elif obs is False:
            failing.append({"layer": name, "detail": layer.get("detail")})
        else:
            why = layer.get("detail") if isinstance(layer, dict) else "not a layer"
            missing.append({"layer": name, "why": why if why is not None else "not observed"})

    detail: dict[str, Any] = {"state": state, "measured": measured, "held": held}
    if failing:
        detail["failing"] = failing
        if missing:
            detail["unobserved"] = missing
        observed: bool | None = False
    elif missing:
        detail["unobserved"] = missing
        observed = None
    else:
        observed = True
    return {"observed": observed, "at": max(ats) if ats and observed is not None else None,
            "via": VIA, "detail": detail}
