"""What one run observed, and the one place its stop record is made.

`RunEvidence` holds every observation of a run as it is made: the evidence
layers, the worker's status and identity, timings, escapers, notes, the
seal, cleanup and nested runs. Other rooms write to it through its methods;
`record()` turns it, with the run's state, into the record dict that is
persisted (CONTRACT.md, "The stop record"). `from_record()` is the reverse,
for an adopter that resumes a run from its directory.

A layer is never inferred from another here: a default for a layer nobody
observed says so (`null` with the reason), it never reads as true or false.
"""
from __future__ import annotations

import os
import sys
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

    from ._escapes import EscapeWatch
    from ._state import Snapshot

from . import _nested
from ._identity import ProcessIdentity, boot_id, own_identity, own_pidns
from ._record import LAYERS, SCHEMA, evidence, not_measured, now_iso
from ._redispatch import redispatch_eligible
from ._tags import RUN_TAG, RunTag, prefix as tag_prefix


class RunEvidence:
    """Observations of one run. Plain attributes are read by every room;
    writes go through the methods below where a rule applies."""

    def __init__(self) -> None:
        self.layers: dict[str, dict[str, Any]] = {}
        self.times: dict[str, str | None] = {"spawned_at": None, "root_exit_at": None, "empty_at": None,
                                              "ended_at": None}
        self.exit_code: int | None = None
        self.signal: int | None = None
        self.identity: ProcessIdentity | None = None
        self.escapes: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.sealed: tuple[bool, str | None] = (False, "not sealed")
        self.placement: str | None = None
        self.spawn_via: str | None = None             # how the worker was started (the clone, its container entry)
        self.cleanup: dict[str, Any] = {}
        self.cpu: dict[str, int] | None = None
        self.nested_seen: list[dict[str, Any]] = []    # runs nested in this one, as the kernel showed them
        self.lead: dict[str, Any] | None = None       # the run this one is nested in
        self.adopted = False
        self.tag: RunTag | None = None                # the run directory's tag (bind_tags)
        self.linger: dict[str, Any] | None = None     # what lingered after the worker exited (_stop.py)
        self.accounting: dict[str, Any] | None = None  # the final snapshot (_usage.py, _accounting.py)
        self.limits: dict[str, Any] | None = None      # what was asked, what was applied, what was hit
        self.cgroup_v1: dict[str, Any] | None = None   # the run's own v1 cgroups, as made
        self.signal_cause: dict[str, Any] | None = None   # why a SIGKILL: an OOM kill is not a plain 9
        self.unsaved: list[str] = []                  # what the state directory could not take (not_saved)
        self.pending_wall: dict[str, Any] | None = None   # the wall's init, described before the worker runs

    # -- writing -------------------------------------------------------------

    def not_saved(self, what: str, err: OSError) -> None:
        """A write to the state directory failed. The run goes on and the stop
        happens all the same; the failure is kept (the CLI exits 125 with it,
        the library's record carries it in `notes`), once per kind of write."""
        why = f"{what}: {err.strerror or err}" if isinstance(err, OSError) else f"{what}: {err}"
        if not any(u.startswith(what + ":") for u in self.unsaved):
            self.unsaved.append(why)
            self.notes.append(f"not saved in the state directory: {why}")

    def set(self, layer: str, observed: bool | None, via: str, detail: Any = None,
            at: float | None = None) -> None:
        self.layers[layer] = evidence(observed, via, detail, at)

    def observed(self, layer: str) -> bool:
        return bool((self.layers.get(layer) or {}).get("observed"))

    def signal_step(self, kind: str, observed: bool | None, via: str, detail: Any) -> None:
        """One step of the stop (`term`, `kill`): the layer lists every step
        and is observed from the first step that was."""
        cur = self.layers.get("signal_sent")
        steps = list(cur["detail"]["steps"]) if cur and isinstance(cur.get("detail"), dict) else []
        steps.append({"kind": kind, "observed": observed, "via": via, "detail": detail, "at": now_iso()})
        ok = [s for s in steps if s["observed"]]
        if ok:
            self.layers["signal_sent"] = {"observed": True, "at": ok[0]["at"], "via": ok[0]["via"],
                                          "detail": {"steps": steps}}
        else:
            self.layers["signal_sent"] = {"observed": None, "at": None, "via": via, "detail": {"steps": steps}}

    def cancel_requested(self, op: str, req: dict[str, Any]) -> None:
        """The first applied cancel: its `requested_at` is kept for good."""
        self.set("cancel_requested", True, f"operation {op}", {"by": req.get("by")})
        self.layers["cancel_requested"]["at"] = req.get("requested_at") or self.layers["cancel_requested"]["at"]

    def root_exited(self, exit_code: int | None, signal: int | None, layer: dict[str, Any]) -> None:
        self.exit_code, self.signal = exit_code, signal
        self.layers["root_exit"] = layer
        self.times["root_exit_at"] = self.times.get("root_exit_at") or now_iso()

    def spawned(self, sp: Any, container: Any, req: Any, t0: float) -> None:
        """What is known right after the spawn: when, who (identity), where
        the kernel put it, and whether the tree's credentials are sealed."""
        self.times["spawned_at"] = now_iso(t0)
        self.spawn_via = getattr(sp, "via", None)
        try:
            self.identity = ProcessIdentity.read(sp.pid, sp.pidfd)
            if self.identity.pidns is None:
                # Exited already (its ns links go at exit, before the reap):
                # behind the wall its namespace is the init's, read earlier;
                # without one it is ours (cloned without CLONE_NEWPID).
                if getattr(sp, "init_ns", None):
                    self.identity.pidns = sp.init_ns
                elif getattr(sp, "wall", None) is None and sys.platform != "win32":
                    self.identity.pidns = own_pidns()
        except OSError as e:
            start = getattr(sp, "start_time", None)
            if start:
                # Behind the wall the worker is not our child and may be
                # reaped already: the init read its start time for us while
                # it was the init's unreaped child.
                self.identity = ProcessIdentity.of_spawn(sp.pid, start, sp.pidfd, getattr(sp, "init_pid", -1),
                                                         getattr(sp, "init_ns", None))
            else:
                # Our unreaped child's /proc entry exists even if it already
                # exited: failing here is an observation failure.
                self.notes.append(f"identity not read: {e}")
        self.placement = container.placed(sp.pid)
        expected = container.expected_placement() if hasattr(container, "expected_placement") else None
        if expected is not None:
            if self.placement is not None and self.placement != expected:
                # The worker moved itself at once: its identity goes with the
                # entry, so that its end can be proven (escapers_alive).
                self.escapes.append({"pid": sp.pid, "seen_in": self.placement, "at": now_iso(),
                                     "via": "/proc/<pid>/cgroup right after spawn",
                                     "identity": self.identity.to_dict() if self.identity is not None else None})
        self.sealed = container.seal_status(req)

    def run_info(self, run: Any, via: str | None) -> dict[str, Any]:
        """run.json: what another process needs to find, watch and adopt the
        run. What an adopter acts on is also put, the first time, in the
        tags it verifies (bind_tags): run.json is for readers."""
        c, ident = run.container, self.identity
        info = {
            "run_id": run.id, "run_uid": run.uid, "argv": run.argv,
            "started_at": self.times["spawned_at"],
            "worker": ident.to_dict() if ident else ({"pid": run.pid} if run.pid > 0 else None),
            "supervisor": own_identity(),
            "backend": c.backend, "cgroup": c.path, "cgroup_dir": getattr(c, "dir", None),
            "spawn_via": via, "state_dir": run.layout.path if run.layout else None,
            "boot_id": boot_id(), "grace": run.opts.grace, "kill_timeout": run.opts.kill_timeout,
            "wall": c.wall.describe() if getattr(c, "wall", None) is not None else self.pending_wall,
        }
        if getattr(run.opts, "die_with_owner", False):
            info["die_with_owner"] = True        # for whoever finishes it (contain janitor's note)
        if getattr(c, "identity", None) is not None:
            info["cgroup_identity"] = c.identity
        usage = getattr(run, "usage", None)
        if usage is not None and usage.cgroups is not None:
            # The run's own v1 cgroups: for `status` (live numbers) and for an
            # adopter, which removes them (_runcgroups.RunCgroups.attach checks them).
            info["cgroups_v1"] = usage.cgroups.describe()
        if c.backend in ("none", "subreaper"):
            info["pgid"] = c.pgid if c.pgid > 0 else None
        if getattr(c, "namespace", None) is not None:
            info["job"] = c.namespace        # Windows: where the job's name lives (_containers._attach_job)
        if getattr(run, "record_path", None):
            info["record_file"] = run.record_path
        if run.layout is not None and hasattr(c, "bind"):
            info["tag"] = self.bind_tags(run)
        return info

    def tag_holds(self, run: Any) -> bool:
        """Bring the tag up to date with what became known since run.json
        was written (the wall's init, the worker, the seal); True when the
        tag now holds it, so run.json need not be rewritten: an adopter acts
        on the tag alone, and readers find the worker in the live record.
        False where no tag can be kept (no xattrs, Windows) or it failed:
        then run.json carries it, as the only description there is."""
        if self.tag is None or run.layout is None:
            return False
        self.bind_tags(run)
        return self.tag.current()

    def bind_tags(self, run: Any) -> dict[str, Any]:
        """Tag the run directory (and through the container, its cgroup) with
        what a later owner may act on (_tags.py); keep the tag current with
        the worker and the seal once they are known. Returns run.json's `tag`."""
        c, ident = run.container, self.identity
        if self.tag is None:
            self.tag = RunTag(run.layout.path, {"v": 1, "run_id": run.id, "run_uid": run.uid,
                                                "boot_id": boot_id(), "backend": c.backend,
                                                "cgroup": getattr(c, "identity", None)})
            problem = c.bind(self.tag)
            if problem is not None:
                self.notes.append(problem)
        wall = getattr(c, "wall", None)
        wall_desc = wall.describe() if wall is not None else self.pending_wall
        problem = None
        if ident is not None:
            problem = self.tag.update(worker={"pid": ident.pid, "start_time": ident.start_time},
                                      sealed=self.sealed[0], wall=wall_desc)
        elif wall_desc is not None:
            problem = self.tag.update(wall=wall_desc)       # the init, before the worker exists
        if problem is not None and problem not in self.notes:
            self.notes.append(problem)
        return {"name": tag_prefix() + RUN_TAG, "problem": self.tag.problem}

    # -- the record ------------------------------------------------------------

    def record(self, *, run_id: str, run_uid: str, argv: list[str], snap: Snapshot, container: Any,
               watch: EscapeWatch | None, ops: list[str], pid: int, run_dir: str | None) -> dict[str, Any]:
        """The stop record as persisted. The only place one is made."""
        ev = {layer: self.layers[layer] for layer in LAYERS if layer in self.layers}
        ev.setdefault("cancel_requested", evidence(False, "cancel inbox", None) if run_dir else
                      not_measured("no run directory"))
        ev.setdefault("signal_sent", {"observed": False, "at": None, "via": "none",
                                      "detail": "nothing was signalled"})
        if pid > 0:
            ev.setdefault("root_exit", evidence(False, "process handle" if sys.platform == "win32" else "pidfd",
                                                "worker running"))
        elif self.adopted:
            ev.setdefault("root_exit", not_measured("the owner died before recording the worker's identity"))
        else:
            ev.setdefault("root_exit", not_measured("no worker"))
        if container is None or container.backend == "none":
            ev.setdefault("container_empty", not_measured("no kernel container (degraded mode)"))
        else:
            ev.setdefault("container_empty", evidence(False, "QueryInformationJobObject ActiveProcesses != 0"
                                                      if container.backend == "job-object" else
                                                      container.empty_via if container.backend == "subreaper" else
                                                      "cgroup.events populated 1", None)
                          if not snap.terminal else not_measured("not observed"))
        if (container is not None and container.backend in ("none", "subreaper") and snap.stopping
                and getattr(container, "last_alive", None)):
            # Degraded mode, stop not over: who is still alive (a later owner
            # goes on from the same identities).
            ev.setdefault("descendants_exit", {"observed": False, "at": now_iso(), "via": container.empty_via,
                                               "detail": container.seen_summary()})
        ev.setdefault("descendants_exit", not_measured("not yet observed"))
        if self.escapes:
            ev["escapes"] = {"observed": True, "at": self.escapes[0]["at"], "via": self.escapes[0]["via"],
                             "detail": self.escapes}
        elif watch is not None and container is not None:
            ev.setdefault("escapes", watch.evidence(container, snap.terminal))
        elif container is not None:
            ev.setdefault("escapes", container.escape_evidence())
        else:
            ev.setdefault("escapes", not_measured("no container"))
        containment: dict[str, Any] = {
            "backend": container.backend if container is not None else "none",
            "path": container.path if container is not None else None,
            "sealed": self.sealed[0],
            "sealed_reason": self.sealed[1],
            "placement": self.placement,
            "seal": getattr(container, "seal_detail", None),
            "walls": container.walls() if container is not None and hasattr(container, "walls") else [],
        }
        via = (getattr(container, "spawn_via", None) if container is not None else None) or self.spawn_via
        if via:
            containment["spawn_via"] = via
        rec: dict[str, Any] = {
            "schema": SCHEMA,
            "run_id": run_id,
            "run_uid": run_uid,
            "state": snap.state,
            # Why the run ended; null while it is RUNNING (CONTRACT.md), also
            # while a stop is under way: that stop's outcome-to-be is
            # `stopping` until the run ends (an adopter goes on from it).
            "outcome": snap.outcome if snap.state != "RUNNING" else None,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "argv": argv,
            "containment": containment,
            "evidence": ev,
            "identity": self.identity.to_dict() if self.identity else None,
            "timings": dict(self.times),
            "cpu": self.cpu,
            "cancellations": sorted(ops),
            "cleanup": self.cleanup or None,
            "notes": self.notes,
            "record_written_at": now_iso(),
        }
        if snap.state == "RUNNING" and snap.outcome is not None:
            rec["stopping"] = snap.outcome
        if self.linger is not None:
            rec["linger"] = self.linger
        rec["accounting"] = self.accounting if self.accounting is not None else {
            "value": None, "reason": "the final snapshot is taken once the container is observed empty"}
        rec["limits"] = self.limits if self.limits is not None else {"asked": {}, "applied": {}}
        if self.cgroup_v1 is not None:
            containment["cgroup_v1"] = self.cgroup_v1
        if self.signal_cause is not None:
            rec["signal_cause"] = self.signal_cause
        if self.adopted:
            rec["adopted_by"] = {"pid": os.getpid()}
        rec["nested"] = _nested.describe(self.nested_seen, run_dir)
        if self.lead is not None:
            rec["lead"] = self.lead
        # Derived last, from the record itself: what a scheduler reads before
        # it starts the next attempt in the same workspace (_redispatch.py).
        ev["redispatch_eligible"] = redispatch_eligible(rec)
        return rec

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "RunEvidence":
        """What an adopter knows of a run: its last record. Escapers it
        lists are re-checked at the end, like any escaper."""
        e = cls()
        e.adopted = True
        e.exit_code, e.signal = rec.get("exit_code"), rec.get("signal")
        e.layers = dict(rec.get("evidence") or {})
        esc = e.layers.pop("escapes", None) or {}
        if esc.get("observed") and isinstance(esc.get("detail"), list):
            e.escapes = list(esc["detail"])
        e.times.update(rec.get("timings") or {})
        e.cpu = rec.get("cpu")
        e.linger = rec.get("linger") if isinstance(rec.get("linger"), dict) else None
        e.notes = list(rec.get("notes") or [])
        c = rec.get("containment") or {}
        e.sealed = (bool(c.get("sealed")), c.get("sealed_reason"))
        e.placement = c.get("placement")
        e.spawn_via = c.get("spawn_via") if isinstance(c.get("spawn_via"), str) else None
        if rec.get("identity"):
            e.identity = ProcessIdentity.from_dict(rec["identity"])
        return e
