"""A state directory that cannot hold the run's tag (ramfs: no extended
attributes at all). run.json is written once before the spawn wherever the
tag can be kept, and the tag alone names the worker and the wall's init
for an adopter. Where it cannot, run.json must still name them, or a run
whose supervisor died could not be stopped as what it is.

Real kernel: a ramfs mounted in a mount namespace of the test's own (gone
with it), real `contain run` and `contain cancel` processes, the supervisor
SIGKILLed, survival by the test's own /proc scan.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _proc import contain_cmd, holders, kill_holders, needs_mount, ramfs_state_script, run_in_ramfs_namespace


_WAIT_LIVE = r"""
import json, os, sys, time
d = sys.argv[1]
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    try:
        if json.load(open(os.path.join(d, "record.json"))).get("identity"):
            sys.exit(0)
    except (OSError, ValueError):
        pass
    time.sleep(0.02)
sys.exit(1)
"""


@needs_mount
@pytest.mark.timeout(90)
def test_state_dir_without_xattrs_keeps_the_worker_in_run_json_and_an_orphan_is_still_stopped(box, tmp_path):
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    run_dir = f"{mnt}/state/runs/nox"
    contain = " ".join(contain_cmd())
    script = ramfs_state_script(mnt) + f"""
{contain} run --id nox --grace 0.2 -- sh -c 'setsid sleep 300 & exec sleep 300' &
sup=$!
{sys.executable} -c '{_WAIT_LIVE}' {run_dir} || exit 97
cp {run_dir}/run.json {out}/run.json
cp {run_dir}/record.json {out}/live.json
kill -9 $sup
wait $sup
{contain} cancel nox --wait --json --op-id adopt > {out}/cancel.json
echo $? > {out}/cancel.rc
"""
    try:
        p = run_in_ramfs_namespace(script, box.env, timeout=80)
        assert p.returncode == 0, (p.returncode, p.stderr)
        info = json.loads((out / "run.json").read_text())
        live = json.loads((out / "live.json").read_text())
        # No tag could be kept: run.json is the only description an adopter
        # has, so it was rewritten with the worker (and the wall's init).
        assert info["worker"] and info["worker"]["pid"] == live["identity"]["pid"], (info, live)
        assert info["worker"]["start_time"] == live["identity"]["start_time"]
        pidns = [w for w in live["containment"]["walls"] if w.get("kind") == "pidns"]
        if pidns:
            assert info.get("wall") and info["wall"]["init"]["pid"] == pidns[0]["init_pid"], info
        assert (out / "cancel.rc").read_text().strip() == "0", p.stderr
        ack = json.loads((out / "cancel.json").read_text())
        assert ack["effect"] == "cancelled" and ack["state"] in ("REAPED", "EXITED"), ack
        assert holders(box.token) == [], "the adopter left the tree running"
    finally:
        kill_holders(box.token)
