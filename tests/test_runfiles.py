"""The one parser of every file in a run directory (launcher/_runfiles.py):
what the owner writes is accepted, anything else is rejected with a reason,
and no input raises anything but ValueError."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from launcher import _runfiles as R

UID = "0123456789abcdef"
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
        st.sampled_from(["state", "outcome", "run_uid", "run_id", "op_id", "effect", "grace", "argv", "evidence",
                         "observed", "at", "identity", "pid", "start_time", "boot_id", "worker", "supervisor",
                         "timings", "ended_at", "containment", "backend", "requested_at", "by", "x"]),
        kids, max_size=6),
    max_leaves=20)


@settings(max_examples=1500, deadline=None)
@given(JSON)
def test_no_input_raises_anything_but_valueerror(obj):
    raw = json.dumps(obj).encode()
    for parse in (R.parse_run_info, R.parse_record, R.parse_ack):
        try:
            parse(obj)
        except ValueError:
            pass
    try:
        R.parse_request(raw, 0, UID)
    except R.Rejected:
        pass


def test_what_the_owner_writes_is_accepted():
    info = R.parse_run_info({"run_id": "r", "run_uid": UID, "argv": ["true"], "started_at": None,
                             "worker": {"pid": 5}, "supervisor": {"pid": 4, "start_time": 9, "boot_id": "b",
                                                                   "pidns": 1, "pidfd_inode": None},
                             "backend": "cgroup2", "cgroup": "/c", "cgroup_dir": "/sys/fs/cgroup/c",
                             "grace": 5.0, "kill_timeout": 10.0}, "r")
    assert info.argv == ["true"] and info.grace == 5.0 and info.worker == {"pid": 5}
    rec = {"run_id": "r", "run_uid": UID, "state": "REAPED", "outcome": "cancelled", "exit_code": None,
           "signal": 15, "evidence": {"root_exit": {"observed": None, "at": None, "via": "x", "detail": "why"}},
           "identity": {"pid": 5, "start_time": 1, "boot_id": "b"}, "timings": {"ended_at": "2026-01-01T00:00:00Z"}}
    assert R.parse_record(rec, "r") is rec
    ack = {"op_id": "a/b", "effect": "cancelled", "state": "REAPED", "run_uid": UID}
    assert R.parse_ack(ack) is ack
    req = R.parse_request(json.dumps({"op_id": "o", "run_uid": UID, "grace": 0}).encode(), 7, UID)
    assert (req.op_id, req.grace, req.offset) == ("o", 0.0, 7)


@pytest.mark.parametrize("obj,why", [
    ([], "not a JSON object"),
    ({"run_id": "r", "run_uid": UID, "argv": []}, "argv"),
    ({"run_id": "r", "run_uid": UID, "argv": ["x"], "grace": "5"}, "grace"),
    ({"run_id": "r", "run_uid": UID, "argv": ["x"], "kill_timeout": 0}, "kill_timeout"),
    ({"run_id": "r", "run_uid": UID, "argv": ["x"], "supervisor": {"pid": 1}}, "start_time"),
    ({"run_id": "r", "run_uid": UID, "argv": ["x"], "worker": {"pid": True}}, "pid"),
    ({"run_id": "r", "run_uid": UID, "argv": ["x"], "cgroup_dir": "../../etc"}, "cgroup_dir"),
    ({"run_id": "other", "run_uid": UID, "argv": ["x"]}, "describes run"),
    ({"run_id": "r", "run_uid": UID, "argv": ["x"], "backend": "docker"}, "backend"),
])
def test_run_info_that_does_not_fit_is_rejected_with_why(obj, why):
    with pytest.raises(ValueError, match=why):
        R.parse_run_info(obj, "r")


@pytest.mark.parametrize("obj,why", [
    ("x", "not a JSON object"),
    ({"state": "RUNNING"}, "run_uid"),
    ({"state": "DONE", "run_uid": UID}, "state"),
    ({"state": "REAPED", "run_uid": UID}, "no outcome"),
    ({"state": "REAPED", "outcome": "won", "run_uid": UID}, "outcome"),
    ({"state": "RUNNING", "run_uid": UID, "evidence": {"root_exit": {"observed": 1}}}, "observed"),
    ({"state": "RUNNING", "run_uid": UID, "evidence": []}, "evidence"),
    ({"state": "RUNNING", "run_uid": UID, "identity": {"pid": -1}}, "pid"),
    ({"state": "RUNNING", "run_uid": UID, "exit_code": "0"}, "exit_code"),
])
def test_records_that_do_not_fit_are_rejected_with_why(obj, why):
    with pytest.raises(ValueError, match=why):
        R.parse_record(obj)


def test_json_bombs_are_rejected_not_raised():
    with pytest.raises(ValueError, match="nested too deeply|not JSON"):
        R.loads(b"[" * 100000 + b"]" * 100000, "record.json")
    with pytest.raises(ValueError, match="not JSON"):
        R.loads(b"1" * 5000, "record.json")        # int() digit limit
