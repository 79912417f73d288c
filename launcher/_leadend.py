"""A lead's end hook (Run.end_hooks): the runs nested in it are finished
by adoption (_adopt.finish_nested), which is loaded only for a run that saw
one, so that the run driver's start-up does not pay for the adopter (the
CLI's and the library's run path)."""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from ._run import Run


def end_hook(run: "Run") -> None:
    if not run.facts.nested_seen or run.layout is None:
        return
    from ._adopt import finish_nested

    finish_nested(run)
