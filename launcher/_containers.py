"""Which container a run gets, and what its worker is started with.

The platform is chosen here, once per run: a cgroup v2 subtree on Linux
(`_platform/linux.py`), a Job Object on Windows (`_platform/windows.py`), or
the honest degraded mode (`_platform/none.py`). Backend modules are imported
only when chosen, so nothing Linux-only loads on Windows and the run path
imports only what it uses.
"""
from __future__ import annotations

import os
import sys
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

    from ._options import Options
    from ._platform.posix import SpawnRequest

from . import _nested
from ._errors import ContainmentUnavailable
from ._options import resolve_user


def make_container(run_id: str, opts: Options) -> Any:
    """The strongest container the options and the host allow."""
    env = opts.env if opts.env is not None else os.environ
    backend = opts.backend if opts.backend != "auto" else env.get("CONTAIN_BACKEND", "auto")
    if backend == "job-object" or (backend == "auto" and sys.platform == "win32"):
        if sys.platform != "win32":
            raise ContainmentUnavailable("Job Objects exist only on Windows")
        from ._platform import windows

        return windows.Container.create(run_id)
    weaker = None
    if backend in ("auto", "cgroup2"):
        from ._platform import linux

        parent = opts.parent_cgroup or inherited_parent(env)
        try:
            return linux.Container.create(run_id, env, parent_dir=parent)
        except ContainmentUnavailable as e:
            # A base the caller named is a choice, not a hint: when it cannot
            # be used the run fails (125) rather than run with less.
            if backend == "cgroup2" or (parent is None and env.get("CONTAIN_CGROUP_BASE")):
                raise
            weaker = f"no cgroup container ({e.reason})"
    elif backend != "none":
        raise ValueError(f"unknown backend {backend!r}")
    from ._platform import none

    c = none.Container(run_id)
    c.weaker = weaker      # auto got less than this host gives a root user: said on stderr
    return c


def inherited_parent(env: Any) -> str | None:
    """A run started from inside another run goes beside that run's worker
    (a nested run), so cancelling the lead stops it too."""
    d = env.get(_nested.ENV_CGROUP)
    if d and os.path.isdir(d) and os.access(d, os.W_OK):
        return str(d)
    return None


def attach_container(info: dict[str, Any], root_pid: int) -> Any:
    """The container of a run whose owner is gone, from its run.json: the
    cgroup re-attached by path, or (degraded mode) the worker's group."""
    if info.get("backend") == "cgroup2" and info.get("cgroup_dir"):
        from ._platform import linux

        if os.path.isdir(info["cgroup_dir"]):
            return linux.Container.attach(info["cgroup_dir"])
        # e.g. a nested run whose lead's stop killed its owner and removed
        # its cgroup with the lead's subtree.
        return linux.Container.removed(info["cgroup_dir"])
    from ._platform import none

    c = none.Container(str(info.get("run_id")))
    c.pgid = c.root_pid = root_pid
    return c


def spawn_request(argv: list[str], opts: Options, container: Any, run_id: str,
                  run_dir: str | None) -> SpawnRequest:
    """What the worker is started with: the caller's environment plus the
    variables a nested run needs, credentials, and the container's own
    preparation (the seal)."""
    from ._platform import posix

    env = dict(opts.env if opts.env is not None else os.environ)
    if container.backend == "cgroup2":
        env[_nested.ENV_CGROUP] = container.dir
    env["CONTAIN_RUN_ID"] = run_id
    if run_dir is not None:
        env[_nested.ENV_DIR] = run_dir
    uid = gid = -1
    groups: list[int] = []
    if opts.user is not None:
        uid, gid, groups = resolve_user(opts.user)
    req = posix.SpawnRequest(argv, env=env, cwd=opts.cwd, stdio=opts.stdio, new_pgroup=opts.new_pgroup,
                             uid=uid, gid=gid, groups=groups)
    container.prepare(req, opts)
    return req
