"""The names and times contain writes (run ids, run uids, its cgroup
leaves, UTC times), checked without `re`: `re` costs `contain run` 1.5 ms
to import (see _jsonenc.py). ASCII only, and the whole string: nothing
after the last character, not even a newline (which `$` would allow).

A str subclass (a StrEnum member, numpy.str_: what a library caller may
pass as `id=`) is checked by its characters, as the patterns these replace
read it (`_text`); anything that is not a str is not a name.
"""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import TypeGuard

ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
ID_CHARS = ALNUM | frozenset("._-")
_UID_CHARS = ALNUM | frozenset("_-")


def _text(s: object) -> str | None:
    """`s` as a plain str (its own characters, whatever a subclass's
    __len__ or __iter__ says), or None if it is not a str."""
    if type(s) is str:
        return s
    return str.__str__(s) if isinstance(s, str) else None


def valid_id(s: object) -> TypeGuard[str]:
    """A run id: [A-Za-z0-9][A-Za-z0-9._-]{0,99}."""
    s = _text(s)
    return s is not None and 0 < len(s) <= 100 and s[0] in ALNUM and ID_CHARS.issuperset(s)


def valid_uid(s: object) -> TypeGuard[str]:
    """A run uid: [A-Za-z0-9_-]{1,64}."""
    s = _text(s)
    return s is not None and 0 < len(s) <= 64 and _UID_CHARS.issuperset(s)


_ISO_SHAPE = "0000-00-00T00:00:00"
_ASCII_DIGITS_TO_0 = str.maketrans("123456789", "000000000")


def valid_iso(s: object) -> TypeGuard[str]:
    """A UTC time as now_iso writes it: YYYY-MM-DDTHH:MM:SS[.1-9 digits]Z.
    (By its shape, every ASCII digit made 0: `ls` checks four per run.)"""
    s = _text(s)
    if s is None or not 20 <= len(s) <= 30 or s[-1] != "Z" or s[:19].translate(_ASCII_DIGITS_TO_0) != _ISO_SHAPE:
        return False
    frac = s[19:-1]
    return frac == "" or (frac[0] == "." and len(frac) >= 2 and frac.isascii() and frac[1:].isdigit())


_HEX = frozenset("0123456789abcdef")


def run_name(name: object) -> TypeGuard[str]:
    """A leaf this code names (cgroups.run_cgroup_name): (run|sub)-ID-UID8,
    ID of [A-Za-z0-9._-]{1,128}, UID8 eight lowercase hex digits."""
    name = _text(name)
    return name is not None and name[:4] in ("run-", "sub-") and 14 <= len(name) <= 141 and \
        name[-9] == "-" and _HEX.issuperset(name[-8:]) and ID_CHARS.issuperset(name[4:-9])
