"""redispatch_eligible: a pure function of the record, one test per branch."""
from __future__ import annotations

import copy

import pytest

from launcher._redispatch import POSTCONDITIONS, redispatch_eligible


def _layer(observed, detail=None, at="2026-12-01T10:00:00.000000Z"):
    return {"observed": observed, "at": at if observed is not None else None, "via": "test", "detail": detail}


def _rec(state="REAPED", **layers):
    ev = {"container_empty": _layer(True, at="2026-12-01T09:59:59.000000Z")}
    ev.update(layers)
    return {"state": state, "evidence": ev}


def test_clean_run_with_nothing_measured_is_eligible():
    out = redispatch_eligible(_rec())
    assert out["observed"] is True
    assert out["detail"]["measured"] == []
    assert out["at"] == "2026-12-01T09:59:59.000000Z"


def test_clean_run_with_every_postcondition_holding_is_eligible():
    out = redispatch_eligible(_rec(**{p: _layer(True) for p in POSTCONDITIONS}))
    assert out["observed"] is True
    assert out["detail"]["held"] == list(POSTCONDITIONS)
    assert out["at"] == "2026-12-01T10:00:00.000000Z"


@pytest.mark.parametrize("failing", POSTCONDITIONS)
def test_each_failing_postcondition_makes_it_false_and_is_named(failing):
    layers = {p: _layer(True) for p in POSTCONDITIONS}
    layers[failing] = _layer(False, {"held_by": [{"pid": 42}]})
    out = redispatch_eligible(_rec(**layers))
    assert out["observed"] is False
    assert [f["layer"] for f in out["detail"]["failing"]] == [failing]
    assert out["detail"]["failing"][0]["detail"] == {"held_by": [{"pid": 42}]}


@pytest.mark.parametrize("unobserved", POSTCONDITIONS)
def test_a_measured_postcondition_that_could_not_be_observed_makes_it_null(unobserved):
    layers = {p: _layer(True) for p in POSTCONDITIONS}
    layers[unobserved] = _layer(None, "sock_diag failed: EPERM")
    out = redispatch_eligible(_rec(**layers))
    assert out["observed"] is None and out["at"] is None
    assert out["detail"]["unobserved"] == [{"layer": unobserved, "why": "sock_diag failed: EPERM"}]


def test_false_wins_over_null():
    out = redispatch_eligible(_rec(sockets_closed=_layer(False, {"still_open": [1]}),
                                   locks_released=_layer(None, "/proc/locks not readable")))
    assert out["observed"] is False
    assert out["detail"]["failing"][0]["layer"] == "sockets_closed"
    assert out["detail"]["unobserved"][0]["layer"] == "locks_released"


@pytest.mark.parametrize("state", ["EXITED", "BREACHED"])
def test_a_terminal_state_weaker_than_reaped_is_false(state):
    out = redispatch_eligible(_rec(state, workspace_quiescent=_layer(True)))
    assert out["observed"] is False
    assert out["detail"]["failing"][0] == {"layer": "state", "state": state,
                                           "why": out["detail"]["failing"][0]["why"]}


@pytest.mark.parametrize("state", ["RUNNING", "UNCONFIRMED", None, "FORGED"])
def test_an_unsettled_or_unknown_state_is_null(state):
    out = redispatch_eligible(_rec(state))
    assert out["observed"] is None
    assert out["detail"]["unobserved"][0]["layer"] == "state"


def test_reaped_without_an_observed_empty_container_is_null():
    rec = _rec()
    rec["evidence"]["container_empty"] = _layer(None, "observation failed")
    assert redispatch_eligible(rec)["observed"] is None
    del rec["evidence"]["container_empty"]
    assert redispatch_eligible(rec)["observed"] is None


def test_malformed_evidence_never_reads_as_true():
    assert redispatch_eligible({"state": "REAPED"})["observed"] is None
    assert redispatch_eligible({"state": "REAPED", "evidence": "x"})["observed"] is None
    rec = _rec(locks_released="not a layer")
    assert redispatch_eligible(rec)["observed"] is None


def test_pure_the_record_is_not_changed():
    rec = _rec(sockets_closed=_layer(False, {"still_open": [1]}))
    before = copy.deepcopy(rec)
    redispatch_eligible(rec)
    assert rec == before
