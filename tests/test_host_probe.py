"""The host's cgroup mounts and own cgroup are probed once per process
(issue 27's decision) and probed again when what was built on them fails:
a stale probe costs a retry, never a run."""
from __future__ import annotations

import json
import os

import pytest

import launcher
from launcher import _controllers
from launcher._platform import cgroups

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not cgroups.hierarchies(),
                                reason="needs root and a cgroup v2 mount")


def test_a_stale_probe_of_the_mounts_is_probed_again(tmp_path, monkeypatch):
    sd = str(tmp_path / "state")
    assert launcher.run(["/bin/true"], state_dir=sd).state == "REAPED"
    real = cgroups.host_view()
    # A cgroup2 mount that is gone (unmounted since the probe, say).
    monkeypatch.setattr(cgroups, "_host", (os.getpid(), [cgroups.Hierarchy(str(tmp_path / "gone"), "/", False)],
                                           real[1]))
    rec = launcher.run(["/bin/true"], state_dir=sd)
    assert rec.state == "REAPED", rec.to_dict()
    assert "cannot create" not in json.dumps(rec.to_dict()), "the run had its cgroup, not a fallback"
    assert [h.mount for h in cgroups.host_view()[0]] == [h.mount for h in real[0]], "probed again"
    assert not os.path.exists(tmp_path / "gone")


def test_a_stale_probe_of_the_v1_hierarchies_is_probed_again(tmp_path, monkeypatch):
    sd = str(tmp_path / "state")
    real = _controllers.host_v1_hierarchies(refresh=True)
    gone = _controllers.V1Hierarchy(["memory", "pids"], str(tmp_path / "gone"), "/")
    monkeypatch.setattr(_controllers, "_probed", (os.getpid(), [gone]))
    rec = launcher.run(["/bin/true"], state_dir=sd, accounting=True)     # v1 memory/pids wanted where there are any
    assert rec.state == "REAPED", rec.to_dict()
    assert "cannot create" not in json.dumps(rec.to_dict()), "the v1 cgroups were made where they are mounted"
    assert [h.mount for h in _controllers.host_v1_hierarchies()] == [h.mount for h in real], "probed again"
    assert not os.path.exists(tmp_path / "gone")
