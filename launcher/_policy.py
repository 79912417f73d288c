"""Whose environment may set policy.

Every CONTAIN_* variable that chooses a path or a policy (CONTAIN_STATE_DIR,
CONTAIN_CGROUP_BASE, CONTAIN_CGROUP_V1_BASE, CONTAIN_CGROUP_V1,
CONTAIN_BACKEND, CONTAIN_LEDGER, CONTAIN_KEEP_RUNS, and the nesting pair
CONTAIN_RUN_CGROUP / CONTAIN_RUN_DIR) is read through `policy_env`: from the
supervisor's own environment, never from a worker's `env=`, and not at all
when this process holds privilege its caller may not have (setuid, setgid,
file capabilities: the caller's environment must not steer it).
"""
from __future__ import annotations

import os
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from collections.abc import Mapping

AT_SECURE = 23        # include/uapi/linux/auxvec.h

_secure: bool | None = None


def _at_secure() -> bool:
    """AT_SECURE from /proc/self/auxv (os.getauxval is not in Python): set
    when the kernel gave this process privilege at exec (setuid, setgid,
    file capabilities)."""
    global _secure
    if _secure is None:
        import struct

        try:
            with open("/proc/self/auxv", "rb") as f:
                data = f.read()
            fmt = "@LL"
            n = len(data) - len(data) % struct.calcsize(fmt)
            _secure = any(k == AT_SECURE and v != 0 for k, v in struct.iter_unpack(fmt, data[:n]))
        except OSError:
            _secure = False
    return _secure


def elevated() -> bool:
    """Whether this process holds privilege its caller may not have: then
    the caller's environment must not choose paths or policy."""
    if not hasattr(os, "geteuid"):
        return False          # Windows: no setuid; an elevated token is the caller's own choice
    return os.getuid() != os.geteuid() or os.getgid() != os.getegid() or _at_secure()


def policy_env(name: str, env: Mapping[str, str] = os.environ) -> str | None:
    """A CONTAIN_* setting from the supervisor's own environment, or None
    when the process is elevated (elevated()); an empty value is None."""
    if elevated():
        return None
    return env.get(name) or None


