"""_names' checks are the patterns they replace (anchored at both ends, ASCII
digits only), without `re` on the run path. The patterns live here only."""
from __future__ import annotations

import re

from hypothesis import given, settings, strategies as st

from launcher._names import run_name, valid_id, valid_iso, valid_uid

ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
UID = re.compile(r"[A-Za-z0-9_-]{1,64}")
ISO = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,9})?Z")
LEAF = re.compile(r"(run|sub)-[A-Za-z0-9._-]{1,128}-[0-9a-f]{8}")

# What the checks look at, plus what must fail them: newlines, non-ASCII
# letters and digits (Arabic-Indic three), upper-case hex.
CHARS = st.sampled_from(list("aZ09fF._-:TZ\n\u00e9\u0663 /"))


def mutated(base: str) -> st.SearchStrategy[str]:
    return st.lists(st.tuples(st.integers(0, len(base)), CHARS, st.booleans()), max_size=3).map(
        lambda edits: _apply(base, edits))


def _apply(s: str, edits: list[tuple[int, str, bool]]) -> str:
    for i, c, insert in edits:
        s = s[:i] + c + s[i + (0 if insert else 1):]
    return s


@settings(max_examples=3000)
@given(st.one_of(st.text(CHARS, max_size=40), mutated("2026-12-01T18:18:31.305303Z"),
                 mutated("2026-12-01T18:18:31Z"), mutated("run-20261201-181831-2f0f5f-0b9299c9"),
                 mutated("sub-a.b-1-deadbeef"), mutated("a" * 100), mutated("x" * 64)))
def test_each_check_is_its_pattern(s):
    assert valid_id(s) == bool(ID.fullmatch(s)), s
    assert valid_uid(s) == bool(UID.fullmatch(s)), s
    assert valid_iso(s) == bool(ISO.fullmatch(s)), s
    assert run_name(s) == bool(LEAF.fullmatch(s)), s


def test_what_is_not_a_str_is_not_a_name():
    for v in (None, 5, b"abc", ["abc"], 2.5):
        assert not (valid_id(v) or valid_uid(v) or valid_iso(v) or run_name(v))
