"""launcher/_args.py: the library's argument checks (pure; no process)."""
from __future__ import annotations

import decimal
import fractions
import math
import os
import pathlib

import pytest

from launcher._args import (check_argv, check_optional_seconds, check_run_numbers, check_seconds,
                            parse_seconds)


# -- argv -----------------------------------------------------------------------

@pytest.mark.parametrize("argv, want", [
    (["true"], ["true"]),
    (("sh", "-c", "exit 3"), ["sh", "-c", "exit 3"]),
    ([b"/bin/echo", b"caf\xc3\xa9"], ["/bin/echo", "café"]),
    ([b"\xff"], [os.fsdecode(b"\xff")]),                   # surrogateescape, as the kernel sees it
    ([pathlib.Path("/bin/true")], ["/bin/true"]),
    (["echo", ""], ["echo", ""]),                         # an empty argument is an argument
])
def test_argv_takes_what_subprocess_takes(argv, want):
    got = check_argv(argv)
    assert got == want and all(type(a) is str for a in got)


@pytest.mark.parametrize("argv", ["true", b"true", bytearray(b"true"), pathlib.Path("/bin/true")])
def test_argv_that_is_one_string_is_refused_not_split_into_letters(argv):
    """launcher.run("true") used to run `t` (the str iterated)."""
    with pytest.raises(TypeError, match=r"argv must be a sequence .*not a single"):
        check_argv(argv)


@pytest.mark.parametrize("argv, kind", [({"true"}, "set"), ({"true": 1}, "dict"), (iter(["true"]), "list_iterator"),
                                        (None, "NoneType"), (3, "int")])
def test_argv_that_is_no_sequence_is_refused(argv, kind):
    with pytest.raises(TypeError, match=rf"argv must be a sequence .*not {kind}"):
        check_argv(argv)


def test_argv_empty_is_refused():
    for empty in ([], ()):
        with pytest.raises(ValueError, match="argv must not be empty"):
            check_argv(empty)


@pytest.mark.parametrize("bad, kind", [(3, "int"), (None, "NoneType"), (["x"], "list"), (1.5, "float")])
def test_argv_elements_must_be_strings(bad, kind):
    with pytest.raises(TypeError, match=rf"argv\[1\] must be str, bytes or os.PathLike, not {kind}"):
        check_argv(["echo", bad])


@pytest.mark.parametrize("bad", ["a\0b", b"a\0b"])
def test_argv_with_a_nul_is_refused(bad):
    with pytest.raises(ValueError, match=r"argv\[1\] contains a NUL"):
        check_argv(["echo", bad])


def test_argv_takes_any_sequence():
    class Argv:
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> str:
            if i >= 2:
                raise IndexError(i)
            return ["echo", "hi"][i]

    import collections.abc

    collections.abc.Sequence.register(Argv)
    assert check_argv(Argv()) == ["echo", "hi"]


# -- seconds --------------------------------------------------------------------

@pytest.mark.parametrize("value, want", [(0, 0.0), (5, 5.0), (0.25, 0.25), (fractions.Fraction(1, 4), 0.25),
                                         (decimal.Decimal("2.5"), 2.5), (1e12, 1e12), (10**15, 1e15)])
def test_seconds_take_finite_real_numbers(value, want):
    got = check_seconds(value, "grace")
    assert got == want and type(got) is float


def test_big_finite_values_are_kept_not_clamped():
    """A finite grace or timeout is honoured whatever its size: the waits
    are the callers' to clamp, not the value."""
    assert check_seconds(1e300, "grace") == 1e300
    assert check_optional_seconds(float(2**53), "timeout", positive=True) == float(2**53)


@pytest.mark.parametrize("value", ["5", b"5", True, False, None, [5], object()])
def test_seconds_that_are_not_numbers_are_a_type_error_naming_the_argument(value):
    with pytest.raises(TypeError, match=r"^grace must be a (real )?number of seconds, not "):
        check_seconds(value, "grace")


def test_a_complex_number_is_a_type_error():
    with pytest.raises(TypeError, match="grace must be a real number of seconds"):
        check_seconds(1j, "grace")


@pytest.mark.parametrize("value, words", [
    (math.nan, "a finite number of seconds, not nan"),
    (math.inf, "a finite number of seconds, not inf"),
    (-math.inf, "a finite number of seconds, not -inf"),
    (decimal.Decimal("NaN"), "a finite number of seconds, not nan"),
    (decimal.Decimal("sNaN"), "a finite number of seconds"),
    (10**400, "a finite number of seconds"),
    (-1, "0 or more seconds, not -1"),
    (-0.5, "0 or more seconds, not -0.5"),
])
def test_seconds_out_of_range_are_a_value_error_naming_the_argument(value, words):
    with pytest.raises(ValueError, match=r"^grace must be " + words.replace("(", r"\(")):
        check_seconds(value, "grace")


def test_zero_is_refused_only_where_it_cannot_mean_what_it_says():
    assert check_seconds(0, "grace") == 0.0                    # SIGKILL at once
    for name in ("timeout", "kill_timeout"):
        with pytest.raises(ValueError, match=rf"^{name} must be more than 0 seconds, not 0$"):
            check_seconds(0, name, positive=True)
        with pytest.raises(ValueError, match=rf"^{name} must be more than 0 seconds"):
            check_seconds(-0.0, name, positive=True)


def test_an_infinite_timeout_points_at_none():
    with pytest.raises(ValueError, match=r"None means no limit"):
        check_optional_seconds(math.inf, "timeout", positive=True)
    assert check_optional_seconds(None, "timeout", positive=True) is None


def test_run_numbers_checked_together():
    assert check_run_numbers(grace=5, timeout=None, kill_timeout=10) == (5.0, None, 10.0)
    assert check_run_numbers(grace=0) == (0.0, None, None)
    with pytest.raises(ValueError, match="^timeout must be more than 0"):
        check_run_numbers(grace=1, timeout=0)
    with pytest.raises(ValueError, match="^kill_timeout must be"):
        check_run_numbers(grace=1, kill_timeout=math.nan)
    with pytest.raises(TypeError, match="^grace must be a number of seconds, not str '5'"):
        check_run_numbers(grace="5")


# -- the command line's text form ------------------------------------------------

@pytest.mark.parametrize("text, positive, want", [("0", False, 0.0), ("1.5", True, 1.5), (" 2 ", False, 2.0),
                                                  ("1e3", True, 1000.0), ("90s", True, 90.0), ("1.5m", True, 90.0),
                                                  ("2h", True, 7200.0), ("1d", True, 86400.0), ("0s", False, 0.0)])
def test_parse_seconds(text, positive, want):
    assert parse_seconds(text, positive=positive) == want


@pytest.mark.parametrize("text, positive, message", [
    ("x", False, "not a number of seconds (or a number with s, m, h or d): 'x'"),
    ("", False, "not a number of seconds (or a number with s, m, h or d): ''"),
    ("5 s", False, "not a number of seconds (or a number with s, m, h or d): '5 s'"),
    ("m", False, "not a number of seconds (or a number with s, m, h or d): 'm'"),
    ("5w", False, "not a number of seconds (or a number with s, m, h or d): '5w'"),
    ("-1m", False, "must be 0 or more seconds: '-1m'"),
    ("infh", False, "must be a finite number of seconds: 'infh'"),
    ("nan", False, "must be a finite number of seconds: 'nan'"),
    ("-inf", True, "must be a finite number of seconds: '-inf'"),
    ("-1", False, "must be 0 or more seconds: '-1'"),
    ("0", True, "must be more than 0 seconds: '0'"),
    ("-0", True, "must be more than 0 seconds: '-0'"),
])
def test_parse_seconds_says_what_is_wrong(text, positive, message):
    with pytest.raises(ValueError) as e:
        parse_seconds(text, positive=positive)
    assert str(e.value) == message


def test_a_timeout_of_0_means_no_timeout_as_gnu_timeout():
    from launcher._args import parse_timeout

    assert parse_timeout("0") is None and parse_timeout("0m") is None
    assert parse_timeout("1m") == 60.0


def test_args_stays_off_the_heavy_imports():
    """_args is imported on every `contain run`: no import beyond os at
    module level (numbers and collections.abc only for odd arguments)."""
    import ast

    import launcher._args as mod

    with open(mod.__file__) as f:
        tree = ast.parse(f.read())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top for a in n.names}
    assert names <= {"annotations", "os"}, names


# -- the library applies them -------------------------------------------------------
# (real runs: the checks are where the library takes the arguments, not only here)

@pytest.mark.parametrize("argv, kind", [("true", TypeError), (b"true", TypeError), (["true", 5], TypeError),
                                        ([], ValueError)])
def test_the_library_refuses_bad_argv_before_anything_runs(state_dir, argv, kind):
    import launcher

    with pytest.raises(kind):
        launcher.run(argv)
    with pytest.raises(kind):
        launcher.spawn(argv)
    assert not os.path.isdir(os.path.join(state_dir, "runs")) or os.listdir(os.path.join(state_dir, "runs")) in (
        [], [".claim.lock"]), "a refused argv claimed a run"


def test_any_finite_wait_and_grace_work_and_others_are_refused(contained):
    """Worker.wait(1e300) waits (Python's own Event.wait would raise
    OverflowError); a NaN grace is a ValueError naming it, not a stop that
    never ends; Supervisor(grace=...) is checked the same way."""
    import launcher

    w = launcher.spawn(["sleep", "0.2"], env=contained["env"])
    assert w.wait(timeout=1e300).state == "REAPED"
    w = launcher.spawn(["sleep", "30"], env=contained["env"])
    try:
        with pytest.raises(ValueError, match="grace"):
            w.cancel(grace=float("nan"))
        with pytest.raises(ValueError, match="timeout"):
            w.wait(timeout=-1)
    finally:
        w.cancel(grace=0)
        assert w.wait(30).state == "REAPED"
    with pytest.raises(ValueError, match="grace"):
        launcher.Supervisor(grace=float("inf"))


@pytest.mark.parametrize("op_id", ["", "x" * 201])
def test_an_empty_or_oversized_op_id_is_refused_not_read_as_none_given(contained, op_id):
    """op_id="" (a caller's unset variable) used to mint a fresh operation on
    every call: two cancels with "the same" id were two operations. The CLI
    refuses `--op-id ''` (exit 2); the library raises, before any request."""
    import launcher

    w = launcher.spawn(["sleep", "30"], env=contained["env"])
    try:
        with pytest.raises(ValueError, match="operation id"):
            w.cancel(op_id=op_id)
        with pytest.raises(ValueError, match="operation id"):
            w.stop(op_id=op_id)
        with pytest.raises(ValueError, match="operation id"):
            launcher.cancel(w.id, op_id=op_id, state_dir=contained["state_dir"])
        assert not w.done(), "a refused op id stopped the run"
        assert not os.path.exists(os.path.join(contained["state_dir"], "runs", w.id, "requests.ndjson")), \
            "a refused op id was written to the inbox"
    finally:
        w.cancel(grace=0)
        assert w.wait(30).state == "REAPED"


def test_record_file_follows_the_rules_of_record(contained, tmp_path):
    """record_file= is the library's --record: a path that cannot take a
    record is refused before anything runs; a device is written in place
    (and stays a device), its failure said once in the record it failed to
    take; a regular file gets the final record."""
    import stat as st_

    import launcher

    with pytest.raises(OSError):
        launcher.run(["true"], env=contained["env"], record_file=str(tmp_path / "no" / "such" / "dir.json"))
    runs = os.path.join(contained["state_dir"], "runs")
    assert not os.path.isdir(runs) or [n for n in os.listdir(runs) if not n.startswith(".")] == [], \
        "a refused record_file claimed a run"
    rec = launcher.run(["true"], env=contained["env"], record_file="/dev/full")
    assert rec.state == "REAPED"
    said = [n for n in rec.to_dict()["notes"] if "record_file" in n]
    assert len(said) == 1 and "/dev/full" in said[0], rec.to_dict()["notes"]
    import json as json_

    with open(os.path.join(contained["state_dir"], "runs", rec.run_id, "record.json")) as f:
        assert said[0] in json_.load(f)["notes"], "record.json does not say it"
    assert st_.S_ISCHR(os.stat("/dev/full").st_mode)
    out = tmp_path / "rec.json"
    rec = launcher.run(["true"], env=contained["env"], record_file=str(out))
    import json

    assert json.loads(out.read_text())["run_id"] == rec.run_id and json.loads(out.read_text())["state"] == "REAPED"


def test_a_stats_json_that_cannot_be_written_is_said_in_the_library_record(contained, tmp_path):
    """A stats path that cannot be written is refused before anything runs
    (OSError, as record_file= is). One that stops being writable during the
    run (here the worker makes a directory of it): the CLI says it on stderr
    (and exits 125); a library caller has no stderr to read: the record's
    notes say it, once, and the run is still REAPED."""
    import launcher

    d = tmp_path / "stats-dir"
    d.mkdir()
    marker = tmp_path / "ran"
    with pytest.raises(OSError) as ei:                 # a directory: refused up front
        launcher.run(["touch", str(marker)], env=contained["env"], stats_json=str(d))
    assert "stats_json" in str(ei.value) and not marker.exists()
    later = tmp_path / "becomes-a-dir"
    rec = launcher.run(["mkdir", str(later)], env=contained["env"], stats_json=str(later))
    assert rec.state == "REAPED"
    said = [n for n in rec.to_dict()["notes"] if "--stats-json" in n]
    assert len(said) == 1 and str(later) in said[0], rec.to_dict()["notes"]
    good = tmp_path / "stats.ndjson"
    rec = launcher.run(["true"], env=contained["env"], stats_json=str(good))
    assert not [n for n in rec.to_dict()["notes"] if "--stats-json" in n]
    assert len(good.read_text().splitlines()) == 1
