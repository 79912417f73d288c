"""The Windows suite: run by a Windows CPython (tools/winlane.py runs it under
wine64). On any other platform every module skips at import, saying so."""
from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The embeddable build's ._pth file is the whole sys.path: add the checkout
# (launcher/) and this folder (_census, _child).
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)


@pytest.fixture
def helpers(tmp_path: "os.PathLike[str]") -> Iterator["Helpers"]:
    h = Helpers(str(tmp_path))
    try:
        yield h
    finally:
        h.cleanup()


class Helpers:
    """Starts nothing itself; remembers every marked helper so that the
    test ends them (by pid checked against creation time) even when it fails."""

    def __init__(self, d: str) -> None:
        self.dir = d

    def cleanup(self) -> None:
        if sys.platform != "win32":
            return
        import _census

        for n in os.listdir(self.dir):
            base, _, pid = n.rpartition(".")
            if pid.isdigit():
                try:
                    created = int(open(os.path.join(self.dir, n)).read())
                except (OSError, ValueError):
                    continue
                _census.kill(int(pid), created)
