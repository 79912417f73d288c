"""Nested runs: runs started from inside another run (the lead).

A lead's worker gets two variables in its environment:

    CONTAIN_RUN_CGROUP   the lead's run cgroup directory
    CONTAIN_RUN_DIR      the lead's run directory in the state directory

A run started with them (through the library or `contain run`) makes its
container as `sub-<id>-<hex>` inside the lead's run cgroup, beside the lead
worker's `main` leaf, so processes only ever live in leaves (cgroup-v2.rst,
"No Internal Process Constraint") and one `cgroup.kill` of the lead stops the
whole subtree. It also appends one line about itself to the lead's
`nested.ndjson`, so the lead can name it (run uid, run directory) when it ends.

The kernel's view decides which nested runs ended with the lead: the `sub-*`
directories present when the lead's stop began, or when it ended. The
registry only adds what a cgroup name cannot carry. A nested run whose owner
lived in the lead's tree is killed with it: its own record may stay RUNNING
(shown orphaned by `contain ls`); the lead's record says it ended with the lead.
"""
from __future__ import annotations

import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

from ._policy import policy_env
from ._record import now_iso

ENV_CGROUP = "CONTAIN_RUN_CGROUP"
ENV_DIR = "CONTAIN_RUN_DIR"
REGISTRY = "nested.ndjson"

_HEX = frozenset("0123456789abcdef")


def run_id_of(dirname: str) -> str | None:
    """The run id in a nested container's name (`sub-<id>-<8 hex>`)."""
    # `sub-<id>-<8 hex>`, checked without a regex: compiling one costs more
    # than `contain run`'s whole use of this module.
    head, sep, tail = dirname.rpartition("-")
    if not (sep and head.startswith("sub-") and len(head) > 4 and len(tail) == 8 and set(tail) <= _HEX):
        return None
    return head[4:]


def scan(container: Any) -> list[dict[str, Any]]:
    """Every nested container now under `container` (a cgroup2 Container),
    depth first: nested runs of nested runs are included."""
    if getattr(container, "backend", None) != "cgroup2" or not getattr(container, "dir", None):
        return []
    found: list[dict[str, Any]] = []
    stack = [container.dir]
    while stack:
        d = stack.pop()
        try:
            entries = [e.name for e in os.scandir(d) if e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for name in sorted(entries, reverse=True):
            rid = run_id_of(name)
            if rid is None:
                continue
            path = os.path.join(d, name)
            found.append({"id": rid, "cgroup": container.hierarchy.cg_path(path), "cgroup_dir": path})
            stack.append(path)
    return found


def merge(seen: list[dict[str, Any]], more: list[dict[str, Any]]) -> list[dict[str, Any]]:
    have = {s["cgroup"] for s in seen}
    return seen + [m for m in more if m["cgroup"] not in have]


def join_lead(container: Any, env: Any, info: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """If `container` was made inside the run named by `env`, this run is
    nested: (the record's `lead`, None or why the lead was not told)."""
    lead_dir = policy_env(ENV_CGROUP, env)
    if container is None or container.backend != "cgroup2" or not lead_dir:
        return None, None
    if os.path.dirname(container.dir) != os.path.normpath(lead_dir):
        return None, None
    lead = {"run_id": env.get("CONTAIN_RUN_ID"), "cgroup": container.hierarchy.cg_path(os.path.dirname(container.dir))}
    return lead, register(env, dict(info, cgroup=container.path))


def register(env: Any, info: dict[str, Any]) -> str | None:
    """Tell the lead (from `env`) about this nested run. None, or why not.
    The lead's directory comes from the environment (input): only a regular
    file of a run directory is appended to, never through a link."""
    lead_dir = policy_env(ENV_DIR, env)
    if not lead_dir:
        return "no CONTAIN_RUN_DIR in the environment: the lead names this run by its cgroup only"
    from ._layout import RunDir
    from ._safefs import UnsafePath

    try:
        # The lead's directory, verified as any run directory is (ours, no
        # link followed); the line is checked before it is written.
        RunDir(lead_dir).append_nested(dict(info, at=now_iso()))
    except (OSError, UnsafePath, ValueError) as e:
        return f"the lead at {lead_dir} was not told: {getattr(e, 'problem', None) or e}"
    return None


def describe(seen: list[dict[str, Any]], lead_run_dir: str | None) -> list[dict[str, Any]]:
    """The `nested` list of the lead's record: each nested run that ended
    with it, with what its own record said at the lead's end."""
    if not seen:
        return []              # (no registry read: the common case, on every record)
    registry = _registry(lead_run_dir, len(seen))[0]
    out = []
    for s in seen:
        reg = registry.get(s["cgroup"], {})
        item: dict[str, Any] = {"id": reg.get("id", s["id"]), "cgroup": s["cgroup"],
                                "run_uid": reg.get("run_uid"), "run_dir": reg.get("run_dir")}
        rec = _read_record(reg.get("run_dir"))
        if rec is not None and rec.get("run_uid") == reg.get("run_uid"):
            item["state_at_lead_end"] = rec.get("state")
            item["outcome_at_lead_end"] = rec.get("outcome")
        else:
            item["state_at_lead_end"] = None
            item["outcome_at_lead_end"] = None
        out.append(item)
    return out


def registered(lead_run_dir: str, lead_cgroup: str | None,
               limit: int = 10_000) -> tuple[list[dict[str, Any]], list[str]]:
    """Every run registered as nested in this one (at any depth) whose
    registration holds up (`valid_registration`), and a note for each one
    that does not. The registry is written by processes of the lead's tree:
    a forged line must not make the lead adopt (and stop) anything else."""
    found, notes = _registry(lead_run_dir, limit, lead_cgroup)
    return list(found.values()), notes


def valid_registration(reg: dict[str, Any], lead_run_dir: str, lead_cgroup: str | None) -> str | None:
    """None, or why a registration cannot be a run nested in this lead: its
    cgroup must be a `sub-<its id>-<hex>` below the lead's run cgroup, and its
    run directory `<its id>` beside the lead's (the same state directory)."""
    rid, cg, run_dir = reg.get("id"), reg.get("cgroup"), reg.get("run_dir")
    if not isinstance(rid, str) or not isinstance(cg, str):
        return "no id or cgroup"
    if lead_cgroup is not None:
        if os.path.normpath(cg) != cg or not cg.startswith(lead_cgroup.rstrip("/") + "/"):
            return f"its cgroup {cg} is not below the lead's {lead_cgroup}"
        if run_id_of(os.path.basename(cg)) != rid:
            return f"its cgroup {cg} is not named for run {rid}"
    if run_dir is not None:
        if not isinstance(run_dir, str) or os.path.basename(os.path.normpath(run_dir)) != rid:
            return f"its run directory {run_dir!r} is not named for run {rid}"
        here = os.path.realpath(os.path.dirname(os.path.normpath(lead_run_dir)))
        if os.path.realpath(os.path.dirname(os.path.normpath(run_dir))) != here:
            return f"its run directory {run_dir} is outside the lead's state directory {here}"
    return None


def _registry(lead_run_dir: str | None, limit: int,
              lead_cgroup: str | None = None) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """cgroup path -> registration, from the lead's registry and those of the
    nested runs it names (a run nested two deep registers with its own lead);
    registrations that do not hold up are left out, with a note."""
    from ._layout import RunDir

    found: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    todo = [lead_run_dir] if lead_run_dir else []
    visited: set[str] = set()
    while todo and len(visited) <= limit:
        d = todo.pop()
        if d in visited:
            continue
        visited.add(d)
        # Written by the lead's tree: every line checked (_runfiles.parse_nested), bounded.
        for r in RunDir(d).read_nested(limit):
            why = valid_registration(r, lead_run_dir or d, lead_cgroup)
            if why is not None:
                if len(notes) < 20:
                    notes.append(f"nested registration {str(r.get('id'))[:100]!r} ignored: {why}")
                continue
            found[r["cgroup"]] = r
            if r.get("run_dir"):
                todo.append(str(r["run_dir"]))
    return found, notes


def _read_record(run_dir: str | None) -> dict[str, Any] | None:
    if not run_dir:
        return None
    from ._layout import RunDir

    try:
        return RunDir(run_dir).read_record()
    except Exception:       # noqa: BLE001 - another run's record: unreadable is "not known"
        return None
