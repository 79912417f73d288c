"""The stop record and its evidence: what was observed, never more.

A layer's `observed` is True or False only when the observation was made;
an observation that could not be made (permission denied, I/O error, a
deadline) is `None` with the reason in `detail`. Nothing here turns one into
the other.
"""
from __future__ import annotations

import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Iterator, Mapping

from ._state import TERMINAL_STATES

SCHEMA = "contain.stop-record/1"

LAYERS = (
    "cancel_requested",
    "signal_sent",
    "root_exit",
    "descendants_exit",
    "container_empty",
    "escapes",
    "workspace_quiescent",
    "sockets_closed",
    "locks_released",
    "redispatch_eligible",
)


_iso_second: tuple[float, str] = (float("nan"), "")     # the last second formatted, and its text


def now_iso(t: float | None = None) -> str:
    """UTC ISO-8601 with microseconds, from a wall-clock time. (A stop
    stamps a dozen times; the seconds' text is formatted once per second.)"""
    global _iso_second
    t = time.time() if t is None else t
    sec = t // 1
    last, text = _iso_second
    if sec != last:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        _iso_second = (sec, text)
    return text + f".{int(t % 1 * 1e6):06d}Z"


class Unknown:
    """A failed observation: its own value, never a False or a missing key."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __bool__(self) -> bool:
        raise TypeError(f"an unknown observation has no truth value ({self.reason})")

    def __repr__(self) -> str:
        return f"Unknown({self.reason!r})"


def evidence(observed: bool | None, via: str, detail: Any = None, at: float | None = None) -> dict[str, Any]:
    """One evidence layer as stored. `observed=None` needs a reason in detail."""
    if observed is None and detail is None:
        raise ValueError("an unobserved layer must say why")
    return {
        "observed": observed,
        "at": now_iso(at) if observed is not None or at is not None else None,
        "via": via,
        "detail": detail,
    }


def not_measured(reason: str) -> dict[str, Any]:
    return {"observed": None, "at": None, "via": "none", "detail": reason}


def _plain(v: Any) -> Any:
    """A deep copy of JSON-shaped data as json.loads(json.dumps(v)) would
    make it (tuples become lists), without importing `json` (_jsonenc.py).
    Keys that are not strings take that round trip itself."""
    if isinstance(v, dict):
        if not all(type(k) is str for k in v):
            import json

            return json.loads(json.dumps(v))
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    # A subclass of a JSON scalar (a caller's StrEnum argv or id, an
    # IntEnum, numpy.str_) comes back as the plain value, as from JSON.
    if isinstance(v, str) and type(v) is not str:
        return str.__str__(v)
    if isinstance(v, int) and type(v) is not int and type(v) is not bool:
        return int.__int__(v)
    if isinstance(v, float) and type(v) is not float:
        return float.__float__(v)
    return v


class _View:
    """Read-only attribute access over a stored JSON object."""

    __slots__ = ("_d",)

    def __init__(self, d: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_d", d)

    def __getattr__(self, name: str) -> Any:
        try:
            v = self._d[name]
        except KeyError:
            raise AttributeError(name) from None
        return _View(v) if isinstance(v, dict) else v

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("records are read-only")

    def __getitem__(self, key: str) -> Any:
        v = self._d[key]
        return _View(v) if isinstance(v, dict) else v

    def __contains__(self, key: str) -> bool:
        return key in self._d

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def get(self, key: str, default: Any = None) -> Any:
        v = self._d.get(key, default)
        return _View(v) if isinstance(v, dict) else v

    def to_dict(self) -> dict[str, Any]:
        """A deep copy, as JSON would give it back."""
        out = _plain(self._d)
        assert isinstance(out, dict)
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _View) and self._d == other._d

    def __reduce__(self) -> Any:
        # (pickle would look for __setstate__ through __getattr__, before _d exists)
        return (type(self), (_plain(self._d),))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._d!r})"


class StopRecord(_View):
    """The persisted stop record of one run (CONTRACT.md, "The stop record").

    `state` is the strength of what was proven; `outcome` why the run ended.
    Fields are attributes; `to_dict()` gives the JSON object."""

    __slots__ = ()

    @property
    def state(self) -> str:
        return str(self._d["state"])

    @property
    def terminal(self) -> bool:
        return self._d["state"] in TERMINAL_STATES

    @property
    def returncode(self) -> int | None:
        """The worker's status as `subprocess` gives it: its exit code, or
        -N when signal N killed it; None when neither is known (a run not
        ended, a worker that never started)."""
        sig, code = self._d.get("signal"), self._d.get("exit_code")
        if isinstance(sig, int) and not isinstance(sig, bool) and sig > 0:
            return -sig
        return code if isinstance(code, int) and not isinstance(code, bool) else None

    def layer(self, name: str) -> bool | Unknown:
        """One evidence layer's observation: True or False as observed, or
        `Unknown(reason)` when it could not be observed (or was not
        measured). `Unknown` has no truth value: `if rec.layer(x):` raises
        instead of reading a failed observation as false."""
        ev = (self._d.get("evidence") or {}).get(name)
        if ev is None:
            return Unknown(f"layer {name!r} not measured in this run")
        if ev.get("observed") is None:
            detail = ev.get("detail")
            return Unknown(detail if isinstance(detail, str) else f"{name}: not observed ({detail!r})")
        return bool(ev["observed"])


class CancelRecord(_View):
    """The acknowledgement of one cancel operation (`cancellations/<op>.json`)."""

    __slots__ = ()
