"""_names' checks are the patterns they replace (anchored at both ends, ASCII
digits only), without `re` on the run path. The patterns live here only."""
from __future__ import annotations

import enum
import os
import re
from typing import Iterator

import pytest
from hypothesis import given, settings, strategies as st

import launcher
from launcher import _names
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


class Job(enum.StrEnum):
    NIGHTLY = "nightly-1"


class Tagged(str):
    """A str subclass that misreports itself: the check reads its characters."""

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[str]:
        return iter("a")


def test_a_run_id_that_is_a_str_subclass_names_the_run_as_its_characters_do() -> None:
    # ID_RE.match read a str subclass's characters; _names' `type(s) is str`
    # refused every StrEnum member and numpy.str_ as "not a run id".
    assert _names.valid_id(Job.NIGHTLY) and _names.valid_uid(Job.NIGHTLY)
    assert _names.valid_iso(type("T", (str,), {})("2026-12-01T18:38:49.123Z"))
    assert _names.run_name(type("N", (str,), {})("run-nightly-1-0123abcd"))
    # ... and by its own characters, whatever its __len__/__iter__ claim.
    assert not _names.valid_id(Tagged("bad id/../x"))
    assert not _names.valid_uid(Tagged("x" * 65))
    for not_str in (None, 1, b"abc", ["abc"]):
        assert not _names.valid_id(not_str) and not _names.valid_uid(not_str)
        assert not _names.valid_iso(not_str) and not _names.run_name(not_str)


@pytest.mark.timeout(60)
def test_the_library_runs_under_an_id_given_as_a_str_enum_member(contained: dict) -> None:
    # launcher.run(argv, id=Job.NIGHTLY) ran before 31adc00; after it the
    # claim raised ValueError "invalid run id 'nightly-1'" for a valid id.
    rec = launcher.run(["true"], id=Job.NIGHTLY, env=contained["env"])
    assert rec.terminal and rec.exit_code == 0, rec.to_dict()
    assert rec.to_dict()["run_id"] == "nightly-1"
    assert os.path.isdir(os.path.join(contained["state_dir"], "runs", "nightly-1"))
    again = launcher.run(["true"], id=Job.NIGHTLY, env=contained["env"])    # the ended run's id is free again
    assert again.terminal and again.exit_code == 0, again.to_dict()


@pytest.mark.forked
@pytest.mark.timeout(60)
def test_threads_that_name_a_signal_first_at_once_all_get_its_name() -> None:
    # _signals.name_of filled its module-wide table in place on first use
    # and took a non-empty table as complete: a library caller's second
    # owner thread, naming SIGTERM while the first was still filling it,
    # got None, and its record said "signal 15 sent" for SIGTERM
    # (signal.Signals(15).name, before 31adc00, had no such window).
    # Forked: a tiny switch interval and a reloaded module are ours only.
    import importlib
    import sys
    import threading

    from launcher import _signals

    sys.setswitchinterval(1e-6)
    wrong: list[object] = []
    for _ in range(500):
        importlib.reload(_signals)             # a fresh table, as in a new process
        start = threading.Barrier(6)
        got: list[object] = []

        def name() -> None:
            start.wait(10)
            got.append(_signals.signal_name(15))

        threads = [threading.Thread(target=name) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        wrong += [g for g in got if g != "SIGTERM"]
        assert len(got) == 6
    assert wrong == [], f"{len(wrong)} of 3000 namings were wrong: {wrong[:3]}"


class Arg(enum.StrEnum):
    TRUE = "true"


class IntLike(int):
    pass


class FloatLike(float):
    pass


@pytest.mark.timeout(60)
def test_to_dict_gives_json_types_for_arguments_given_as_str_subclasses(contained: dict) -> None:
    # to_dict() was json.loads(json.dumps(record)): plain str, int, float.
    # Its copy without json kept the caller's StrEnum argv (and run id) as
    # they came, so yaml.safe_dump, `type(x) is str` and pickling against
    # a program without the enum all broke on a record of the same run.
    import pickle

    from launcher._record import StopRecord

    rec = launcher.run([Arg.TRUE], id=Job.NIGHTLY, env=contained["env"])
    d = rec.to_dict()
    assert d["argv"] == ["true"] and type(d["argv"][0]) is str
    assert d["run_id"] == "nightly-1" and type(d["run_id"]) is str
    # Every scalar a subclass of a JSON type comes back as that type.
    d = StopRecord({"a": [Job.NIGHTLY, IntLike(15), FloatLike(1.5), True, None, 2]}).to_dict()
    assert [type(x) for x in d["a"]] == [str, int, float, bool, type(None), int] and d["a"][:3] == ["nightly-1", 15, 1.5]
    assert b"Job" not in pickle.dumps(rec.to_dict())
