"""Checks of the library's arguments, the same rules as the command line's.

The library is called by programs, so a wrong argument is a bug in the
caller: say which argument and what was wrong, with the TypeError or
ValueError that Python itself would raise (subprocess.Popen's wording where
it has one), before anything is claimed, created or spawned.

Kept free of imports beyond `os`: `contain run` calls these on every start.
"""
from __future__ import annotations

import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any


def check_argv(argv: Any) -> list[str]:
    """`argv` as the list of str the spawn takes.

    A non-empty sequence (list, tuple, or any other Sequence) whose elements
    are str, bytes or os.PathLike, as subprocess accepts; bytes are decoded
    with os.fsdecode (surrogateescape), as the kernel sees them. A str,
    bytes or path-like on its own is refused: `run("true")` would otherwise
    iterate the string and run `t`. subprocess takes a lone string as the
    program's name only because it also has shell=True; we have no shell."""
    if isinstance(argv, (str, bytes, bytearray, os.PathLike)):
        raise TypeError(f"argv must be a sequence of arguments such as [{argv!r}], not a single "
                        f"{type(argv).__name__}: a string would be split into characters")
    if not isinstance(argv, (list, tuple)):
        from collections.abc import Sequence   # off the fast path: lists and tuples never get here

        if not isinstance(argv, Sequence):
            raise TypeError(f"argv must be a sequence (list or tuple) of str, bytes or os.PathLike, "
                            f"not {type(argv).__name__}")
    if len(argv) == 0:
        raise ValueError("argv must not be empty: nothing to run")
    out = []
    for i, a in enumerate(argv):
        if isinstance(a, str):
            s = a
        elif isinstance(a, (bytes, os.PathLike)):
            s = os.fsdecode(a)        # a PathLike returning neither str nor bytes raises TypeError here
        else:
            raise TypeError(f"argv[{i}] must be str, bytes or os.PathLike, not {type(a).__name__}")
        if "\0" in s:
            raise ValueError(f"argv[{i}] contains a NUL character, which no argument can carry")
        out.append(s)
    return out


def check_env(env: Any) -> dict[str, str]:
    """`env=` as the worker's environment: a mapping of str (or bytes, or
    os.PathLike values) to the same, as subprocess takes it. A name with
    '=' (it would be read as another variable), a NUL anywhere (the string
    would end there) or a value that is not a string is refused, as
    subprocess refuses it, instead of being written out changed."""
    items = getattr(env, "items", None)
    if items is None:
        raise TypeError(f"env must be a mapping of names to values, not {type(env).__name__}")
    out: dict[str, str] = {}
    for k, v in items():
        if not isinstance(k, (str, bytes)):
            raise TypeError(f"env: a name must be str or bytes, not {type(k).__name__} {k!r}")
        if not isinstance(v, (str, bytes, os.PathLike)):
            raise TypeError(f"env[{k!r}] must be str, bytes or os.PathLike, not {type(v).__name__}")
        name, value = os.fsdecode(k), os.fsdecode(v)
        if "=" in name or "\0" in name:
            raise ValueError(f"illegal environment variable name {k!r}")
        if "\0" in value:
            raise ValueError(f"env[{k!r}] contains a NUL character, which no variable can carry")
        out[name] = value
    return out


def check_path(value: Any, name: str) -> str:
    """A path option (`cwd`): str, bytes or os.PathLike without a NUL."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise TypeError(f"{name} must be str, bytes or os.PathLike, not {type(value).__name__}")
    s = os.fsdecode(value)
    if "\0" in s:
        raise ValueError(f"{name} contains a NUL character, which no path can carry")
    return s


def check_seconds(value: Any, name: str, *, positive: bool = False) -> float:
    """A finite number of seconds, >= 0 (or > 0 with `positive`), as float.

    bool is refused (True is 1 to Python, but `grace=True` is a mistake), so
    is a str such as "5" (the command line parses text; the library takes
    numbers). Any other real number (int, float, Fraction, Decimal, numpy's
    numbers) is accepted. Every finite value must be honoured however large:
    callers clamp their own waits; a big grace is never shortened here."""
    if isinstance(value, bool) or isinstance(value, (str, bytes, bytearray)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__} {value!r}")
    if not isinstance(value, (int, float)):
        import numbers        # off the fast path: ints and floats never get here

        if not isinstance(value, numbers.Number):
            raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    try:
        v = float(value)
    except (OverflowError, ValueError):   # an int beyond float's range; Decimal's signalling NaN
        raise ValueError(f"{name} must be a finite number of seconds, not {value!r}") from None
    except TypeError:         # complex, or a Number that has no real value
        raise TypeError(f"{name} must be a real number of seconds, not {type(value).__name__} {value!r}") from None
    problem = _problem(v, positive)
    if problem is not None:
        hint = " (None means no limit)" if name == "timeout" and v == float("inf") else ""
        raise ValueError(f"{name} must be {problem}, not {_num(v)}{hint}")
    return v


def check_optional_seconds(value: Any, name: str, *, positive: bool = False) -> float | None:
    """None (no limit), or what check_seconds accepts."""
    return None if value is None else check_seconds(value, name, positive=positive)


def check_run_numbers(*, grace: Any, timeout: Any = None,
                      kill_timeout: Any = None) -> tuple[float, float | None, float | None]:
    """The three numbers of a run, checked together as `Options` takes them:
    grace >= 0 (0 is SIGKILL at once), timeout None or > 0, kill_timeout
    None (the default) or > 0. A timeout of 0 would cancel the run before
    its worker ran and GNU timeout reads 0 as "no timeout": both readings
    surprise someone, so 0 is refused rather than guessed. kill_timeout 0
    could never see the container empty (cgroup.kill does not wait)."""
    return (check_seconds(grace, "grace"),
            check_optional_seconds(timeout, "timeout", positive=True),
            check_optional_seconds(kill_timeout, "kill_timeout", positive=True))


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_seconds(text: str, *, positive: bool = False) -> float:
    """The command line's form: seconds (`1.5`) or a number with `s`, `m`,
    `h` or `d` (`90s`, `1.5m`, `2h`, `1d`), as GNU `timeout` reads them,
    by the same rules. Raises ValueError with the message a usage error
    shows after "argument --NAME: "."""
    t = text.strip()
    scale = 1.0
    if t[-1:] in _UNITS:
        scale, t = _UNITS[t[-1]], t[:-1]
    try:
        v = float(t) * scale if t.strip() == t else float("x")
    except ValueError:
        raise ValueError(f"not a number of seconds (or a number with s, m, h or d): {text!r}") from None
    problem = _problem(v, positive)
    if problem is not None:
        raise ValueError(f"must be {problem}: {text!r}")
    return v


def parse_timeout(text: str) -> float | None:
    """`--timeout`: as parse_seconds, and 0 means no timeout (GNU `timeout 0`)."""
    v = parse_seconds(text)
    return None if v == 0 else v


def _problem(v: float, positive: bool) -> str | None:
    """What `v` fails to be, as words after "must be", or None."""
    if v != v or v in (float("inf"), float("-inf")):
        return "a finite number of seconds"
    if positive and v <= 0:
        return "more than 0 seconds"
    if v < 0:
        return "0 or more seconds"
    return None


def _num(v: float) -> str:
    """-1.0 reads as -1 in a message; nan, inf and odd values as Python writes them."""
    if v != v or v in (float("inf"), float("-inf")) or abs(v) >= 1e15 or v != int(v):
        return repr(v)
    return str(int(v))


_WAIT_CHUNK = 3600.0       # seconds: below threading.TIMEOUT_MAX on every platform


def wait_event(event: Any, timeout: float | None) -> bool:
    """`event.wait(timeout)` for any timeout check_seconds accepts: Python's
    own raises OverflowError above threading.TIMEOUT_MAX (about 292 years
    here, 49 days on Windows), so a long one is waited in chunks."""
    if timeout is None:
        while not event.wait(_WAIT_CHUNK):
            pass
        return True
    import time

    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bool(event.is_set())
        if event.wait(min(left, _WAIT_CHUNK)):
            return True
