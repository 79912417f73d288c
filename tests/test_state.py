"""The pure state table under every interleaving (no processes)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from launcher import _state as S

E = S.Event
EVENTS = st.sampled_from([
    (E.ROOT_EXITED, S.Outcome.EXITED), (E.ROOT_EXITED, S.Outcome.SIGNALED), (E.CANCEL, None),
    (E.TIMEOUT, None), (E.EMPTY, None), (E.EMPTY_ESCAPED, None), (E.TREE_GONE, None),
    (E.DEADLINE, None), (E.OBSERVE_FAILED, None), (E.SPAWN_FAILED, None),
    ("SUPERVISOR_DIED", None),   # modelled as: record written, adopter resumes from it
])


def apply(snap, ev, how):
    if ev == "SUPERVISOR_DIED":
        return S.from_record(snap.state, snap.outcome)
    return S.step(snap, ev, how)


@settings(max_examples=3000)
@given(st.lists(EVENTS, max_size=14))
def test_invariants_over_every_interleaving(events):
    snap = S.Snapshot()
    outcome_fixed = None
    for ev, how in events:
        before = snap
        snap = apply(snap, ev, how)
        # REAPED only from an observed-empty kernel container.
        if snap.phase == S.Phase.REAPED and before.phase != S.Phase.REAPED:
            assert ev == E.EMPTY
        # Terminal states absorb everything.
        if before.terminal:
            assert snap == before
        # One result: the outcome, once set, never changes.
        if outcome_fixed is not None:
            assert snap.outcome is outcome_fixed
        if snap.outcome is not None:
            outcome_fixed = snap.outcome
        # Ending requires a decided outcome (why it ended is always known).
        if snap.terminal:
            assert snap.outcome is not None
        # A stop in progress always knows why.
        if snap.stopping:
            assert snap.outcome is not None


@given(st.lists(EVENTS, max_size=10), st.lists(EVENTS, max_size=10))
def test_adoption_resumes_exactly(prefix, suffix):
    """An adopter that starts from the record behaves like the dead owner."""
    snap = S.Snapshot()
    for ev, how in prefix:
        snap = apply(snap, ev, how)
    adopted = S.from_record(snap.state, snap.outcome)
    assert (adopted.state, adopted.outcome) == (snap.state, snap.outcome)
    a, b = snap, adopted
    for ev, how in suffix:
        a, b = apply(a, ev, how), apply(b, ev, how)
        assert (a.state, a.outcome) == (b.state, b.outcome)


def test_natural_exit_first_makes_cancel_not_live():
    s = S.step(S.Snapshot(), E.ROOT_EXITED, S.Outcome.EXITED)
    assert S.effect_on_arrival(s) == S.Effect.NOT_LIVE
    s = S.step(s, E.CANCEL)
    assert s.outcome == S.Outcome.EXITED
    s = S.step(s, E.EMPTY)
    assert s.phase == S.Phase.REAPED and s.outcome == S.Outcome.EXITED


def test_cancel_first_wins_over_a_later_exit():
    s = S.step(S.Snapshot(), E.CANCEL)
    assert s.outcome == S.Outcome.CANCELLED
    s = S.step(s, E.ROOT_EXITED, S.Outcome.SIGNALED)
    assert s.outcome == S.Outcome.CANCELLED
    end = S.step(s, E.EMPTY)
    assert S.effect_at_end(S.Effect.CANCEL_REQUESTED, end) == S.Effect.CANCELLED


def test_concurrent_cancels_join_one_stop():
    s = S.step(S.Snapshot(), E.CANCEL)
    assert S.effect_on_arrival(s) == S.Effect.CANCEL_REQUESTED
    s2 = S.step(s, E.CANCEL)
    assert s2 == s


def test_unconfirmed_is_not_terminal_and_a_retry_reopens_the_stop():
    s = S.step(S.step(S.Snapshot(), E.CANCEL), E.DEADLINE)
    assert s.state == S.State.UNCONFIRMED and not s.terminal
    assert S.effect_at_end(S.Effect.CANCEL_REQUESTED, s) == S.Effect.CANCEL_REQUESTED
    s = S.step(s, E.CANCEL)
    assert s.phase == S.Phase.STOPPING
    s = S.step(s, E.EMPTY)
    assert s.state == S.State.REAPED and s.outcome == S.Outcome.CANCELLED


def test_kill_failure_is_unconfirmed_not_reaped():
    s = S.step(S.step(S.Snapshot(), E.CANCEL), E.OBSERVE_FAILED)
    assert s.state == S.State.UNCONFIRMED


def test_timeout_then_cancel_keeps_timed_out():
    s = S.step(S.step(S.Snapshot(), E.TIMEOUT), E.CANCEL)
    assert s.outcome == S.Outcome.TIMED_OUT
    assert S.effect_on_arrival(S.step(S.Snapshot(), E.TIMEOUT)) == S.Effect.NOT_LIVE


def test_breach_and_degraded_never_reaped():
    s = S.step(S.step(S.Snapshot(), E.CANCEL), E.EMPTY_ESCAPED)
    assert s.state == S.State.BREACHED and S.step(s, E.EMPTY).state == S.State.BREACHED
    s = S.step(S.step(S.Snapshot(), E.ROOT_EXITED, S.Outcome.EXITED), E.TREE_GONE)
    assert s.state == S.State.EXITED


def test_spawn_failure_still_needs_emptiness():
    s = S.step(S.Snapshot(), E.SPAWN_FAILED)
    assert s.outcome == S.Outcome.SPAWN_FAILED and s.state == S.State.RUNNING
    assert S.step(s, E.EMPTY).state == S.State.REAPED


def test_a_stop_that_did_not_hold_exits_125_even_after_a_timeout():
    """`--timeout` is 124 only when the stop after it held: a caller must
    never read "timed out and stopped" for a tree that may live on."""
    snap = S.step(S.step(S.Snapshot(), S.Event.TIMEOUT), S.Event.DEADLINE)
    assert snap.phase == S.Phase.UNCONFIRMED
    assert S.exit_status(snap, None, None) == 125
    snap = S.step(S.step(S.Snapshot(), S.Event.TIMEOUT), S.Event.EMPTY_ESCAPED)
    assert S.exit_status(snap, None, 9) == 125
    snap = S.step(S.step(S.Snapshot(), S.Event.TIMEOUT), S.Event.EMPTY)
    assert S.exit_status(snap, None, 15) == 124


def test_a_snapshot_survives_copy_and_pickle():
    """Snapshot is a tuple subclass whose __new__ takes (phase, outcome): a
    copy or an unpickling that handed it tuple's own __getnewargs__ (the
    whole tuple as one argument) would come back as phase=('reaped',
    'cancelled'), outcome=None, a state no table knows (a namedtuple, which
    Snapshot was, defines __getnewargs__ for exactly this)."""
    import copy
    import pickle

    snap = S.Snapshot(S.Phase.REAPED, S.Outcome.CANCELLED)
    for again in (copy.copy(snap), copy.deepcopy(snap), pickle.loads(pickle.dumps(snap))):
        assert again == snap
        assert (again.phase, again.outcome, again.state) == (S.Phase.REAPED, S.Outcome.CANCELLED, S.State.REAPED)
