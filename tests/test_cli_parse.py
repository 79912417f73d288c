"""`contain run`'s argparse-free fast path gives argparse's answer or none.

_fast_run exists only to keep argparse off every run's start-up; it must
never accept something argparse would reject, nor read it differently.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from launcher import _cli, _cliparse

TOKENS = ["--", "--grace", "0", "1.5", "nan", "-1", "inf", "--id", "x", "my-run", "--seal", "--se",
          "-h", "--help", "--id=--", "--id=", "--grace=2", "--timeout", "3", "--kill-timeout=4",
          "--backend", "none", "auto", "cgroup2", "bogus", "--backend=none", "--record", "/tmp/r.json",
          "--user", "nobody", "--workspace", "/tmp", "--check-sockets", "--check-sockets=1", "--backend=job-object", "/bin/true", "-x", "a", "b", "--unknown",
          "--quiet", "--quiet=1", "--kill-timeout=0", "--timeout=0.5", "--kill-timeout"]


def _argparse(argv: list[str]) -> dict[str, object] | None:
    try:
        return vars(_cliparse.parser().parse_args(argv))
    except SystemExit:
        return None


def _check(argv: list[str]) -> None:
    fast = _cliparse.fast_run(argv)
    if fast is None:
        return                       # argparse decides, as before
    assert vars(fast) == _argparse(argv), argv


@pytest.mark.parametrize("argv", [
    ["run", "--", "/bin/true"],
    ["run", "/bin/true", "-x"],
    ["run", "--grace", "0", "--", "a", "--", "b"],
    ["run", "--grace=0", "a"],
    ["run", "--seal", "--id", "x", "--", "--grace"],
    ["run", "a", "--", "b"],
    ["run"],
    ["run", "--"],
    ["run", "--id", "a", "--id", "b", "--", "c"],
    ["run", "--backend", "none", "--timeout", "2.5", "--kill-timeout", "1", "--record", "f", "--user", "u",
     "--workspace", "w", "--", "c"],
    ["run", "--quiet", "--timeout", "0.001", "--", "c"],
    ["run", "--timeout", "0", "--", "c"], ["run", "--timeout=0s", "--grace", "5s", "--linger", "1m", "c"],
])
def test_plain_runs_take_the_fast_path_with_argparse_values(argv: list[str]) -> None:
    assert _cliparse.fast_run(argv) is not None
    _check(argv)


@pytest.mark.parametrize("argv", [
    ["run", "--help"], ["run", "-h"], ["run", "--se", "a"], ["run", "--id", "--", "x"], ["run", "--id=--", "x"],
    ["run", "--grace", "-1", "a"], ["run", "--grace", "nan", "a"], ["run", "--backend", "bogus", "a"],
    ["run", "--grace"], ["ls"], [], ["cancel", "x"],
    ["run", "--kill-timeout=0", "a"], ["run", "--timeout=-1", "a"],
])
def test_anything_unusual_is_left_to_argparse(argv: list[str]) -> None:
    assert _cliparse.fast_run(argv) is None


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=7))
def test_fast_path_agrees_with_argparse(rest: list[str]) -> None:
    _check(["run", *rest])
