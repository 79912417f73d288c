"""The `signal` module of the run path: the C module `_signal` that the
stdlib's `signal` wraps, with the same functions and constants.

`signal` turns its constants, handlers and masks into IntEnums when it is
imported, which imports `enum`, functools and collections: 2.3 ms of every
`contain run`'s start-up (see _state.py). Here handlers and masks are
plain ints, equal to the stdlib's members (compare with `==`), and a
signal's name comes from `name_of`.
"""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:       # typeshed describes `signal`, not `_signal`: the same functions
    import signal as _signal
    from signal import *  # noqa: F403
else:
    from _signal import *  # noqa: F403

    import _signal

_names: dict[int, str] | None = None


def name_of(signum: object) -> str | None:
    """SIGTERM for 15, as `signal.Signals(15).name` says; None for a number
    with no name. Of two names for one number (SIGIOT and SIGABRT) the
    first in sorted order, as enum's `_convert_` picks for `Signals`."""
    global _names
    names = _names
    if names is None:
        # Built whole, then published: an owner thread that names a signal
        # while another builds the table must never read a part of it.
        names = {}
        src = vars(_signal)
        for k in sorted(src, key=lambda k: (src[k], k) if isinstance(src[k], int) else (0, k)):
            if (k.isupper() and k.startswith("SIG") and not k.startswith("SIG_")) or k.startswith("CTRL_"):
                names.setdefault(src[k], k)
        _names = names
    return names.get(signum) if isinstance(signum, int) else None


def signal_name(signum: object) -> str:
    """SIGTERM for 15; "signal N" for a number with no name here."""
    return name_of(signum) or f"signal {signum}"
