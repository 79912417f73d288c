"""Every file of a run directory, parsed into a typed value in one place.

The run directory is input, even the files the owner wrote: a worker with
the owner's uid, another owner, a full disk or a crash may have rewritten,
truncated or replaced any of them. What is read is checked against the
shape the owner writes; what does not fit is rejected with the reason, and
no caller ever indexes into raw JSON it did not get from here.

    parse_run_info  run.json               -> RunInfo
    parse_record    record.json            -> the record dict (checked)
    parse_ack       cancellations/<op>.json -> the acknowledgement dict (checked)
    parse_request   one inbox line         -> Request, or raises Rejected
    parse_nested    one nested.ndjson line -> the registration dict (checked)

Each raises ValueError (a `Rejected` for requests) with a one-line reason.
`encode` is the one JSON encoding of what the owner writes.
"""
from __future__ import annotations

import math
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from ._jsonenc import dumps, loads as loads
from ._names import valid_id, valid_iso, valid_uid
from ._state import TERMINAL_STATES, Effect, Outcome, State, names

# Bounds on what is read; anything larger was not written by an owner.
# run.json and the record both carry argv, which exec accepts up to 6 MiB
# with argv and environment together (fs/exec.c: a quarter of the stack
# rlimit, at most 3/4 of _STK_LIM), and which json escapes to at most 6
# bytes per byte ("\udcXX" for a byte that is not UTF-8). A run.json an
# adopter refuses is a run nobody can stop: it was 1 MiB, and a 2 MiB argv
# (the default 8 MiB stack) made its run unadoptable.
MAX_RECORD = 40 << 20
MAX_RUN_INFO = MAX_RECORD

# summary.json: what a listing shows of record.json, and which record.json
# it was made from ("of": its inode, size and mtime in ns). Written after
# each final record by its writer; believed only while it names the record.json
# there (_layout.RunDir.load_record), so a stale or missing one costs a
# full read, never a wrong line.
SUMMARY = "summary.json"
MAX_SUMMARY = 1 << 20
SUMMARY_FIELDS = ("run_id", "run_uid", "state", "outcome", "exit_code", "signal", "argv", "identity", "timings",
                  "cpu")
MAX_ACK = 1 << 20
# One inbox line (a request the requester may write: see append_request).
MAX_LINE = 4096

MAX_OP_ID = 200
PID_MAX = 1 << 22          # PID_MAX_LIMIT (include/linux/threads.h)

STATES = frozenset(names(State).values())
TERMINAL = TERMINAL_STATES
OUTCOMES = frozenset(names(Outcome).values())
EFFECTS = frozenset(names(Effect).values())
BACKENDS = frozenset({"cgroup2", "pidns", "subreaper", "job-object", "none"})


def iso_epoch(s: Any) -> float | None:
    """Seconds since the epoch of a time as now_iso writes it
    (`YYYY-MM-DDTHH:MM:SS[.ffffff]Z`), or None for anything else."""
    if not valid_iso(s):
        return None
    import calendar

    try:
        t = calendar.timegm((int(s[0:4]), int(s[5:7]), int(s[8:10]), int(s[11:13]), int(s[14:16]),
                             int(s[17:19]), 0, 0, 0))
    except (ValueError, OverflowError):
        return None
    return t + (float("0" + s[19:-1]) if s[19] == "." else 0.0)


class Unreadable:
    """A file that exists but cannot be used, and why. Shown as UNREADABLE,
    never guessed into a state."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Unreadable({self.reason!r})"


def encode(obj: Any, *, pretty: bool = False) -> bytes:
    """The one JSON encoding of a record or acknowledgement: compact in the
    state directory (`contain status` is how people read those); pretty only
    for --record FILE, since json's indent switches to the pure-Python
    encoder (0.2-0.3 ms for a record with its accounting)."""
    if pretty:
        import json     # lazy, like the decoder: the run path encodes with _jsonenc

        return (json.dumps(obj, indent=2) + "\n").encode()
    return (dumps(obj) + "\n").encode()


def _is_int(v: Any) -> bool:
    return type(v) is int


def _opt_str(d: dict[str, Any], key: str, what: str, limit: int = 4096) -> None:
    v = d.get(key)
    if v is not None and not (isinstance(v, str) and len(v) <= limit):
        raise ValueError(f"{what}: {key} is not a string")


def _opt_iso(d: dict[str, Any], key: str, what: str) -> None:
    v = d.get(key)
    if v is not None and not valid_iso(v):
        raise ValueError(f"{what}: {key} is not an ISO-8601 UTC time")


def _opt_dict(d: dict[str, Any], key: str, what: str) -> None:
    v = d.get(key)
    if v is not None and not isinstance(v, dict):
        raise ValueError(f"{what}: {key} is not an object")


def seconds(v: Any, what: str, *, positive: bool = False) -> float:
    """A number of seconds: finite, >= 0 (> 0 when `positive`), as the
    command line and the library take it (launcher/_args.py: every finite
    value is honoured; the owner clamps its own waits). Bools are not
    numbers here."""
    if type(v) not in (int, float):
        raise ValueError(f"{what} is not a number")
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"{what} is not a finite number of seconds") from None
    if not math.isfinite(f) or f < 0 or (positive and f == 0):
        raise ValueError(f"{what} must be a finite number of seconds {'> 0' if positive else '>= 0'}")
    return f


def check_identity(v: Any, what: str, *, full: bool = True) -> dict[str, Any]:
    """A process identity as ProcessIdentity.to_dict writes it. `full=False`
    accepts the `{"pid": N}` of a worker whose start time was not read."""
    if not isinstance(v, dict):
        raise ValueError(f"{what} is not an object")
    pid = v.get("pid")
    if type(pid) is not int or not 0 < pid <= PID_MAX:
        raise ValueError(f"{what}: pid is not a process id")
    if full or "start_time" in v:
        st = v.get("start_time")
        if type(st) is not int or st < 0:
            raise ValueError(f"{what}: start_time is not a clock-tick count")
        if not isinstance(v.get("boot_id"), str):
            raise ValueError(f"{what}: boot_id is not a string")
    for key in ("pidns", "pidfd_inode"):
        if v.get(key) is not None and not _is_int(v[key]):
            raise ValueError(f"{what}: {key} is not an integer")
    return v


def _argv(v: Any, what: str) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(a, str) for a in v):
        raise ValueError(f"{what}: argv is not a non-empty list of strings")
    return v


def _abs_path(v: Any, what: str, key: str) -> None:
    if v is None:
        return
    if not isinstance(v, str) or not v.startswith("/") or "\0" in v or "/../" in v + "/" or len(v) > 4096:
        raise ValueError(f"{what}: {key} is not an absolute path")


class RunInfo:
    """run.json: who and what, as the owner described the run."""

    __slots__ = ("raw", "run_id", "run_uid", "argv", "started_at", "worker", "supervisor", "backend",
                 "cgroup", "cgroup_dir", "boot_id", "grace", "kill_timeout")

    raw: dict[str, Any]
    run_id: str
    run_uid: str
    argv: list[str]
    started_at: str | None
    worker: dict[str, Any] | None
    supervisor: dict[str, Any] | None
    backend: str | None
    cgroup: str | None
    cgroup_dir: str | None
    boot_id: str | None
    grace: float | None
    kill_timeout: float | None


def parse_run_info(obj: Any, expect_id: str | None = None) -> RunInfo:
    what = "run.json"
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not a JSON object")
    rid, uid = obj.get("run_id"), obj.get("run_uid")
    if not valid_id(rid):
        raise ValueError(f"{what}: run_id is not a run id")
    if expect_id is not None and rid != expect_id:
        raise ValueError(f"{what} describes run {rid!r}, not {expect_id!r}")
    if not valid_uid(uid):
        raise ValueError(f"{what}: run_uid is not a run uid")
    info = RunInfo()
    info.raw, info.run_id, info.run_uid = obj, rid, uid
    info.argv = _argv(obj.get("argv"), what)
    _opt_iso(obj, "started_at", what)
    info.started_at = obj.get("started_at")
    w = obj.get("worker")
    info.worker = None if w is None else check_identity(w, f"{what}: worker", full=False)
    s = obj.get("supervisor")
    info.supervisor = None if s is None else check_identity(s, f"{what}: supervisor")
    b = obj.get("backend")
    if b is not None and (not isinstance(b, str) or b not in BACKENDS):
        raise ValueError(f"{what}: backend {str(b)[:40]!r} is not one of {', '.join(sorted(BACKENDS))}")
    info.backend = b
    for key in ("cgroup", "spawn_via", "state_dir", "boot_id"):
        _opt_str(obj, key, what)
    _abs_path(obj.get("cgroup_dir"), what, "cgroup_dir")
    info.cgroup, info.cgroup_dir, info.boot_id = obj.get("cgroup"), obj.get("cgroup_dir"), obj.get("boot_id")
    info.grace = None if obj.get("grace") is None else seconds(obj["grace"], f"{what}: grace")
    info.kill_timeout = (None if obj.get("kill_timeout") is None
                         else seconds(obj["kill_timeout"], f"{what}: kill_timeout", positive=True))
    return info


def _evidence(v: Any, what: str) -> None:
    """Each layer an object with observed true/false/null, `at` an ISO time
    or null, `via` a string or null. (Messages are built only on failure:
    `ls` checks thousands of records.)"""
    if v is None:
        return
    if type(v) is not dict:
        raise ValueError(f"{what}: evidence is not an object")
    for layer, ev in v.items():
        if type(ev) is not dict:
            raise ValueError(f"{what}: evidence layer {str(layer)[:40]!r} is not an object")
        o = ev.get("observed")
        if o is not None and o is not True and o is not False:
            raise ValueError(f"{what}: evidence layer {str(layer)[:40]!r}: observed is not true, false or null")
        at = ev.get("at")
        if at is not None and not valid_iso(at):
            raise ValueError(f"{what}: evidence layer {str(layer)[:40]!r}: at is not an ISO-8601 UTC time")
        via = ev.get("via")
        if via is not None and type(via) is not str:
            raise ValueError(f"{what}: evidence layer {str(layer)[:40]!r}: via is not a string")


def record_summary(rec: dict[str, Any], st: Any) -> dict[str, Any]:
    """summary.json for record `rec`, written as the file `st` (an os.stat_result)."""
    out: dict[str, Any] = {"of": [st.st_ino, st.st_size, st.st_mtime_ns]}
    for key in SUMMARY_FIELDS:
        if key in rec:
            out[key] = rec[key]
    peak = memory_peak(rec)
    if peak is not None:
        out["memory_peak_bytes"] = peak
    return out


def memory_peak(rec: dict[str, Any]) -> int | None:
    """The run's peak memory as its record (or summary.json) gives it, or
    None where it was not measured (`ls` shows it for ended runs)."""
    v = rec.get("memory_peak_bytes")
    if v is None:
        acct = rec.get("accounting")
        m = acct.get("memory_peak_bytes") if isinstance(acct, dict) else None
        v = m.get("value") if isinstance(m, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def parse_record(obj: Any, expect_id: str | None = None, *, summary: bool = False) -> dict[str, Any]:
    """A stop record as the owner writes it; returned as it is, once checked.
    With `summary`, only what a listing shows is checked (state, outcome,
    uid, exit status, argv, identity, timings, cpu): `ls` reads thousands;
    `status`, `wait` and adoption check the whole record."""
    what = "record.json"
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not a JSON object")
    state = obj.get("state")
    if not isinstance(state, str) or state not in STATES:
        raise ValueError(f"{what}: state {str(state)[:40]!r} is not one of {', '.join(sorted(STATES))}")
    out = obj.get("outcome")
    if out is not None and (not isinstance(out, str) or out not in OUTCOMES):
        raise ValueError(f"{what}: outcome {str(out)[:40]!r} is not one of {', '.join(sorted(OUTCOMES))}")
    if state in TERMINAL and out is None:
        raise ValueError(f"{what}: a {state} record has no outcome")
    stopping = obj.get("stopping")
    if stopping is not None and (state != "RUNNING" or not isinstance(stopping, str) or stopping not in OUTCOMES):
        raise ValueError(f"{what}: stopping {str(stopping)[:40]!r} is not the outcome of a stop under way")
    rid = obj.get("run_id")
    if rid is not None and not valid_id(rid):
        raise ValueError(f"{what}: run_id is not a run id")
    if expect_id is not None and rid is not None and rid != expect_id:
        raise ValueError(f"{what} is the record of run {rid!r}, not {expect_id!r}")
    uid = obj.get("run_uid")
    if not valid_uid(uid):
        raise ValueError(f"{what}: run_uid is not a run uid")
    for key in ("exit_code", "signal"):
        if obj.get(key) is not None and not _is_int(obj[key]):
            raise ValueError(f"{what}: {key} is not an integer")
    if obj.get("argv") is not None:
        _argv(obj["argv"], what)
    if obj.get("identity") is not None:
        check_identity(obj["identity"], f"{what}: identity")
    for key in ("containment", "timings", "cpu", "cleanup"):
        _opt_dict(obj, key, what)
    timings = obj.get("timings") or {}
    for key in ("spawned_at", "root_exit_at", "empty_at", "ended_at"):
        _opt_iso(timings, key, "record.json: timings")
    if summary:
        return obj
    _evidence(obj.get("evidence"), what)
    c = obj.get("containment") or {}
    if c.get("backend") is not None and (not isinstance(c["backend"], str) or c["backend"] not in BACKENDS):
        raise ValueError(f"{what}: containment.backend is not one of {', '.join(sorted(BACKENDS))}")
    for key in ("path", "sealed_reason", "placement"):
        _opt_str(c, key, "record.json: containment")
    for key in ("notes", "cancellations", "nested"):
        if obj.get(key) is not None and not isinstance(obj[key], list):
            raise ValueError(f"{what}: {key} is not a list")
    _opt_iso(obj, "record_written_at", what)
    return obj


def parse_ack(obj: Any, expect_op: str | None = None) -> dict[str, Any]:
    what = "acknowledgement"
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not a JSON object")
    op = obj.get("op_id")
    if not isinstance(op, str) or not 0 < len(op) <= MAX_OP_ID:
        raise ValueError(f"{what}: op_id is not an operation id")
    eff = obj.get("effect")
    if not isinstance(eff, str) or eff not in EFFECTS:
        raise ValueError(f"{what} of {op!r}: effect {str(eff)[:40]!r} is not one of {', '.join(sorted(EFFECTS))}")
    st = obj.get("state")
    if st is not None and (not isinstance(st, str) or st not in STATES):
        raise ValueError(f"{what} of {op!r}: state is not a run state")
    out = obj.get("outcome")
    if out is not None and (not isinstance(out, str) or out not in OUTCOMES):
        raise ValueError(f"{what} of {op!r}: outcome is not an outcome")
    uid = obj.get("run_uid")
    if uid is not None and not valid_uid(uid):
        raise ValueError(f"{what} of {op!r}: run_uid is not a run uid")
    for key in ("run_id", "detail"):
        _opt_str(obj, key, f"{what} of {op!r}")
    for key in ("requested_at", "acknowledged_at", "settled_at"):
        _opt_iso(obj, key, f"{what} of {op!r}")
    _opt_dict(obj, "by", f"{what} of {op!r}")
    return obj


def parse_nested(obj: Any) -> dict[str, Any]:
    """One line of a lead's `nested.ndjson` (a run nested in it, as _nested
    registers it): id, run_uid, cgroup (as /proc names it) and run_dir."""
    what = "nested.ndjson line"
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not a JSON object")
    if not valid_id(obj.get("id")):
        raise ValueError(f"{what}: id is not a run id")
    if not valid_uid(obj.get("run_uid")):
        raise ValueError(f"{what}: run_uid is not a run uid")
    _abs_path(obj.get("cgroup"), what, "cgroup")
    if obj.get("cgroup") is None:
        raise ValueError(f"{what}: no cgroup")
    _abs_path(obj.get("run_dir"), what, "run_dir")
    _opt_iso(obj, "at", what)
    return obj


# -- the inbox ---------------------------------------------------------------------

class Request:
    """One cancel request from the inbox, checked."""

    __slots__ = ("op_id", "run_uid", "requested_at", "grace", "by", "offset")

    def __init__(self, op_id: str, run_uid: str, requested_at: str | None, grace: float | None,
                 by: dict[str, Any] | None, offset: int) -> None:
        self.op_id = op_id
        self.run_uid = run_uid
        self.requested_at = requested_at
        self.grace = grace
        self.by = by
        self.offset = offset

    def to_dict(self) -> dict[str, Any]:
        """The line as the driver consumed it before requests were typed."""
        d: dict[str, Any] = {"op_id": self.op_id, "run_uid": self.run_uid or None,
                             "requested_at": self.requested_at, "by": self.by}
        if self.grace is not None:
            d["grace"] = self.grace
        return d

    def __repr__(self) -> str:
        return f"Request(op_id={self.op_id!r}, run_uid={self.run_uid!r}, grace={self.grace!r})"


class Rejected(ValueError):
    """An inbox line that is not a request we act on: why, where it started
    (byte offset in requests.ndjson), and its op id when one could be read
    (so the owner can answer the requester: `effect: unknown`)."""

    def __init__(self, reason: str, offset: int, op_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.offset = offset
        self.op_id = op_id

    def __repr__(self) -> str:
        return f"Rejected({self.reason!r}, offset={self.offset}, op_id={self.op_id!r})"


def valid_op_id(v: Any) -> str | None:
    if isinstance(v, str) and 0 < len(v) <= MAX_OP_ID and v.isprintable():
        return v
    return None


def parse_request(line: bytes, offset: int, run_uid: str | None = None, *,
                  require_uid: bool = True) -> Request:
    """One inbox line. `run_uid`, when given, must be the request's: an old
    request never acts on the next run of the same id. Without
    `require_uid`, a request with no run uid at all passes (run_uid "").
    Raises Rejected."""
    try:
        obj = loads(line, "request")
    except ValueError as e:
        raise Rejected(str(e), offset) from None
    if not isinstance(obj, dict):
        raise Rejected(f"request is a JSON {type(obj).__name__}, not an object", offset)
    op = valid_op_id(obj.get("op_id"))
    if op is None:
        raise Rejected(f"op_id is not a string of 1 to {MAX_OP_ID} printable characters", offset)
    uid = obj.get("run_uid")
    if uid is None and not require_uid:
        uid = ""
    elif not valid_uid(uid):
        raise Rejected("run_uid is missing or not a run uid", offset, op)
    if run_uid is not None and uid != run_uid:
        raise Rejected(f"refused: run uid {uid} is not the current run ({run_uid})", offset, op)
    at = obj.get("requested_at")
    if at is not None and not valid_iso(at):
        raise Rejected("requested_at is not an ISO-8601 UTC time", offset, op)
    grace = obj.get("grace")
    if grace is not None:
        try:
            grace = seconds(grace, "grace")
        except ValueError as e:
            raise Rejected(str(e), offset, op) from None
    by = obj.get("by")
    if by is not None and not isinstance(by, dict):
        raise Rejected("by is not an object", offset, op)
    return Request(op, uid, at, grace, by, offset)
