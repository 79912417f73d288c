"""Nested runs: runs started inside a run live in child cgroups of its run
directory, so cancelling the lead stops its whole subtree while a sibling
lead's subtree goes on."""
from __future__ import annotations

import json
import os
import secrets
import sys
import time

import launcher
from conftest import TOKEN_VAR, kill_token, pids_with_token

LEAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "lead.py")
NESTED = ("lib", "cli", "deep", "deeper")


def _record(state_dir: str, run_id: str) -> dict:
    with open(os.path.join(state_dir, "runs", run_id, "record.json")) as f:
        return json.load(f)  # type: ignore[no-any-return]


def _wait_started(state_dir: str, ids: list[str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    for rid in ids:
        while True:
            try:
                if _record(state_dir, rid).get("identity"):
                    break
            except (OSError, ValueError):
                pass
            assert time.monotonic() < deadline, f"nested run {rid} did not start"
            time.sleep(0.02)


def _layout(run_dir: str) -> list[tuple[str, list[int]]]:
    """Every cgroup under `run_dir` with the pids in it."""
    out = []
    for d, _subdirs, _files in os.walk(run_dir):
        with open(os.path.join(d, "cgroup.procs")) as f:
            out.append((os.path.relpath(d, run_dir), [int(x) for x in f.read().split()]))
    return out


def test_cancelling_a_lead_stops_its_subtree_while_a_sibling_finishes(contained: dict) -> None:
    sd = contained["state_dir"]
    p1, p2 = f"a{secrets.token_hex(3)}", f"b{secrets.token_hex(3)}"
    token2 = secrets.token_hex(8)
    env2 = dict(contained["env"], **{TOKEN_VAR: token2})
    try:
        lead1 = launcher.spawn([sys.executable, LEAD, p1, "60"], id=p1, grace=0.5, env=contained["env"])
        lead2 = launcher.spawn([sys.executable, LEAD, p2, "2"], id=p2, env=env2)
        _wait_started(sd, [f"{p1}-{n}" for n in NESTED] + [f"{p2}-{n}" for n in NESTED])

        # The no-internal-processes layout: processes only in `main` leaves,
        # nested runs beside the lead worker's leaf (and inside `deep`'s run).
        lead_dir = lead1.record().containment.path
        run_dir = os.path.join(contained["cgroup_base"], os.path.basename(lead_dir))
        tree = dict(_layout(run_dir))
        for rel, pids in tree.items():
            leaf = os.path.basename(rel).startswith("main")
            assert leaf or pids == [], f"{rel} holds processes but is not a leaf"
            if leaf:
                assert not any(r.startswith(rel + os.sep) for r in tree), f"{rel} has children"
        top = {r.split(os.sep)[0] for r in tree if r != "."}
        assert {f"sub-{p1}-{n}" for n in ("lib", "cli", "deep")} == \
            {"-".join(t.split("-")[:-1]) for t in top if t.startswith("sub-")}
        assert any(r.startswith("main") for r in top)
        deep = _record(sd, f"{p1}-deep")["containment"]["path"]
        assert _record(sd, f"{p1}-deeper")["containment"]["path"].startswith(deep + "/sub-")
        assert _record(sd, f"{p1}-lib")["lead"]["run_id"] == p1

        ack = lead1.cancel(op_id="stop-lead-1")
        assert ack.effect == "cancel_requested"
        rec1 = lead1.wait(timeout=20)
        assert (rec1.state, rec1.outcome) == ("REAPED", "cancelled")
        assert pids_with_token(contained["token"]) == [], "the lead's subtree survived its cancel"
        named = {n["id"]: n for n in rec1.to_dict()["nested"]}
        assert set(named) == {f"{p1}-{n}" for n in NESTED}
        assert named[f"{p1}-lib"]["run_uid"] == _record(sd, f"{p1}-lib")["run_uid"]
        assert not os.path.exists(run_dir)

        # The sibling subtree was untouched and finishes on its own.
        rec2 = lead2.wait(timeout=30)
        assert (rec2.state, rec2.outcome, rec2.exit_code) == ("REAPED", "exited", 0)
        for n in NESTED:
            r = _record(sd, f"{p2}-{n}")
            assert (r["state"], r["outcome"], r["exit_code"]) == ("REAPED", "exited", 0), (n, r["outcome"])
        assert rec2.to_dict()["nested"] == [], "nested runs that ended first did not end with the lead"
        assert pids_with_token(token2) == []

        # Nested runs end with their lead, and their own records say so: the
        # lead observed its whole subtree empty (theirs included) and
        # finished each run whose owner died with it, by a durable cancel
        # and adoption. Nothing is left RUNNING for someone else to find.
        for n in NESTED:
            r = _record(sd, f"{p1}-{n}")
            # cancelled: finished by the lead, or by its own supervisor turning
            # the lead's SIGTERM into a cancel; signaled: that SIGTERM reached
            # the nested worker first and its supervisor saw it die; exited
            # with no status: its supervisor died first (the lead's init sends
            # SIGTERM to every member at once) and the lead's adopter found
            # the worker gone, its status with it. Either way the run ended,
            # observed empty, and is not left RUNNING.
            assert r["state"] == "REAPED" and r["outcome"] in ("cancelled", "signaled", "exited"), \
                (n, r["state"], r["outcome"])
            if r["outcome"] == "exited":
                assert r["exit_code"] is None and r["signal"] is None, "an unknown status is not a code"
            assert named[f"{p1}-{n}"]["state_at_lead_end"] == "REAPED", named[f"{p1}-{n}"]
    finally:
        kill_token(token2)
