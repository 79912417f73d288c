"""How the worker ended, as its owner observed it: one type for every platform."""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any


class RootExit:
    """How the worker ended, as observed: its status (None where it could
    not be known) and the `root_exit` evidence layer saying how."""

    __slots__ = ("how", "exit_code", "signal", "layer")

    def __init__(self, how: str | None, exit_code: int | None, signal: int | None, layer: dict[str, Any]) -> None:
        self.how = how          # "exited", "signaled", or None (status unknown)
        self.exit_code = exit_code
        self.signal = signal
        self.layer = layer
