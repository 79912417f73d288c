"""What `contain run` says about a run on stderr, besides the worker's own
output (which it never touches).

    weaker_line(reason)      `auto` could not give the container a root user
                             with cgroup v2 gets here: what it used instead,
                             and where to look (`--quiet` hides it)
    stopped_leftovers(rec)   whether the stop had to signal something after
                             the worker exited on its own
    oom_line(rec)            the OOM killer acted in the run: said always,
                             not only with -v (the worker's output rarely says it)
    summary(rec, paths)      one line: how the run ended, what was stopped
                             (how many, which), what lingered, the state, and
                             where the record is (`-v`; and on a terminal
                             whenever leftovers were stopped)

Everything here is read from the record as written: the line says what the
record says, never more.
"""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any, Sequence

_NAMES_SHOWN = 3


def weaker_line(reason: str, backend: str = "none") -> str:
    if backend in ("pidns", "subreaper"):
        how = f"using backend {backend}"  # the reason says what the wall alone gives
    else:
        how = f"using backend {backend} (process group and /proc scan: nothing proves the tree gone, never REAPED)"
    return f"{reason}; {how}. `contain doctor` says what this host needs for a cgroup container"


def _steps(rec: dict[str, Any]) -> list[dict[str, Any]]:
    ss = ((rec.get("evidence") or {}).get("signal_sent") or {}).get("detail")
    steps = ss.get("steps") if isinstance(ss, dict) else None
    return [s for s in steps if isinstance(s, dict)] if isinstance(steps, list) else []


def _stopped_something(step: dict[str, Any]) -> bool:
    """A step that was sent and found something to stop: one whose census
    saw no process (the wall's init alone, about to go) stopped nothing,
    and saying "stopped 0 leftover processes" after every trivial run on a
    terminal was noise (issue 31). A census that could not be taken counts."""
    if not step.get("observed"):
        return False
    d = step.get("detail")
    seen = d.get("seen") if isinstance(d, dict) else None
    return not (isinstance(seen, dict) and seen.get("count") == 0)


def stopped_leftovers(rec: dict[str, Any]) -> bool:
    return rec.get("outcome") in ("exited", "signaled") and any(_stopped_something(s) for s in _steps(rec))


def _signame(n: Any) -> str:
    from . import _signals as signal

    try:
        return signal.signal_name(int(n))
    except (TypeError, ValueError):
        return f"signal {n}"


def _how(rec: dict[str, Any]) -> str:
    code, sig = rec.get("exit_code"), rec.get("signal")
    worker = (f"worker died of {_signame(sig)}" if sig is not None else
              f"worker exited {code}" if code is not None else "worker status unknown")
    outcome = rec.get("outcome")
    if outcome in ("exited", "signaled"):
        return worker
    if outcome == "spawn_failed":
        return "the worker could not start"
    return f"{str(outcome).replace('_', ' ')} ({worker})" if outcome else worker


def _processes(seen: Any) -> str:
    if not isinstance(seen, dict) or not isinstance(seen.get("count"), int):
        return "the tree"
    n = seen["count"]
    names = [str(p.get("comm")) for p in seen.get("processes") or [] if isinstance(p, dict) and p.get("comm")]
    shown = ", ".join(names[:_NAMES_SHOWN]) + (", ..." if n > _NAMES_SHOWN and names else "")
    return f"{n} process{'es' if n != 1 else ''}" + (f" ({shown})" if shown else "")


def oom_line(rec: dict[str, Any]) -> str | None:
    """One line when the record counted OOM kills in the run, else None."""
    hit = ((rec.get("limits") or {}).get("hit") or {}).get("oom_kill")
    if not isinstance(hit, dict) or hit.get("observed") is not True:
        return None
    d = hit.get("detail")
    n = d.get("count") if isinstance(d, dict) else None
    who = (f"{n} process{'es' if n != 1 else ''}" if isinstance(n, int) and n > 0 else "a process")
    applied = ((rec.get("limits") or {}).get("applied") or {}).get("memory_max_bytes")
    limit = applied.get("value") if isinstance(applied, dict) else None
    cause = (rec.get("signal_cause") or {}).get("cause")
    worker = "; the worker was one of them (SIGKILL)" if cause == "oom_kill" else ""
    return (f"run {rec.get('run_id')}: the kernel's OOM killer killed {who} in the run"
            + (f" (--memory-max {limit} bytes)" if isinstance(limit, int) else "") + worker)


def summary(rec: dict[str, Any], paths: Sequence[str]) -> str:
    parts = [f"run {rec.get('run_id')}: {_how(rec)}"]
    lg = rec.get("linger")
    if isinstance(lg, dict):
        parts.append(f"{_processes(lg.get('seen'))} lingered {lg.get('lingered_s')} s of {lg.get('asked_s')} "
                     f"({'left on their own' if lg.get('ended_by') == 'emptied' else 'then stopped'})")
    steps = [s for s in _steps(rec) if _stopped_something(s)]
    if steps:
        d = steps[0].get("detail")
        first: dict[str, Any] = d if isinstance(d, dict) else {}
        how = (str(first.get("signal", "SIGTERM")) if steps[0].get("kind") == "term" else "SIGKILL")
        if steps[0].get("kind") == "term" and any(s.get("kind") == "kill" for s in steps):
            how += ", then SIGKILL"
        what = _processes(first.get("seen"))
        if stopped_leftovers(rec):
            what = what.replace(" process", " leftover process", 1) if what[:1].isdigit() else "the leftovers"
        parts.append(f"stopped {what} with {how}")
    esc = ((rec.get("evidence") or {}).get("escapes") or {}).get("detail")
    killed = [e for e in esc if isinstance(e, dict) and e.get("killed")] if isinstance(esc, list) else []
    if killed:
        parts.append(f"killed {len(killed)} process{'es' if len(killed) != 1 else ''} that had left the container"
                     + ("" if all(e.get("gone") for e in killed) else " (not all proven gone)"))
    elif not steps and rec.get("outcome") in ("exited", "signaled"):
        parts.append("nothing was left to stop")
    parts.append(str(rec.get("state")))
    if paths:
        parts.append("record: " + ", ".join(paths))
    return "; ".join(parts)
