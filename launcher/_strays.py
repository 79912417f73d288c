"""The leftovers of a supervisor killed between its claim and its first
run.json: the cgroups it made and never described (docs/protocol.md,
"Retention"). _gc removes such a run's directory a minute after the claim,
and calls remove_strays first."""
from __future__ import annotations

import os

from . import _safefs as F
from ._controllers import read_file, v1_base_for, v1_hierarchies
from ._procfs import cgroups_of
from ._names import run_name
from ._runfiles import loads


def remove_strays(run_id: str, uid: str) -> str | None:
    """Remove the cgroups a run's supervisor made and never described: it
    was killed after its claim and before its run.json named them (_gc
    removes such a run's directory a minute later). They are found by name
    (cgroups.run_cgroup_name, from the uid its journal gives), where this process's
    policy would put them, and only removed while empty: nothing was ever
    started in them. A cgroup that holds a process is left, and the reason
    returned (then the run is not one that never started)."""
    name = f"run-{run_id}-{uid[:8]}"
    if not run_name(name):
        return None                  # not a name a run of ours has (a forged journal)
    dirs: list[str] = []
    from ._platform.cgroups import expected_base

    base = expected_base(os.environ)      # None: no cgroup v2 base here
    if base is not None:
        dirs += [os.path.join(base, name, "main"), os.path.join(base, name)]
    try:
        own = cgroups_of("self")
    except OSError:
        own = {}
    for h in v1_hierarchies():
        parent, _why, _is_base = v1_base_for(h, os.environ, own)
        if parent is not None:
            try:
                dirs.append(os.path.join(h.fs_path(parent), name))
            except ValueError:
                pass
    dirs = [d for d in dirs if os.path.isdir(d)]
    for d in dirs:
        held = read_file(os.path.join(d, "cgroup.procs"))
        if held is None or held.split():
            return f"{d} {'holds processes' if held else 'cannot be read'}: left"
    for d in dirs:
        try:
            os.rmdir(d)
        except FileNotFoundError:
            pass
        except OSError as e:
            return f"{d}: {os.strerror(e.errno or 0)}"
    return None


def claimed_uid(fd: int) -> str | None:
    """The run uid of the journal's first line (`claimed`), if it says one."""
    try:
        j = os.open("journal.ndjson", F.O_READ, dir_fd=fd)
    except OSError:
        return None
    try:
        first = os.read(j, 512).split(b"\n", 1)[0]
    except OSError:
        return None
    finally:
        os.close(j)
    try:
        line = loads(first, "journal.ndjson")
    except ValueError:
        return None
    uid = line.get("run_uid") if isinstance(line, dict) and line.get("event") == "claimed" else None
    return uid if isinstance(uid, str) and len(uid) == 16 else None
