"""The limits a run may ask for (`--memory-max`, `--pids-max`, `--cpu-max`),
parsed and validated; _runcgroups.py applies them. The CLI turns a
ValueError here into a usage error (exit 2).
"""
from __future__ import annotations

TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

# Which controller each limit needs.
LIMIT_CONTROLLER = {"memory_max": "memory", "pids_max": "pids", "cpu_max": "cpu"}

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_BYTES = r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*"


def parse_bytes(text: str) -> int:
    """`--memory-max`: bytes, with an optional K, M, G or T suffix (powers of
    1024, as systemd's MemoryMax= and docker's --memory read them; "KiB",
    "MiB"... and a trailing "B" are accepted too)."""
    import re     # lazy: only a run with --memory-max parses a size (`re` costs 1.5 ms, _jsonenc.py)

    m = re.fullmatch(_BYTES, str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 268435456, 256M, 1.5G)")
    value = int(float(m.group(1)) * _SUFFIX[m.group(2).upper()]) if "." in m.group(1) else \
        int(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value <= 0:
        raise ValueError("--memory-max must be more than 0 bytes")
    if value >= 1 << 62:
        raise ValueError(f"--memory-max {text!r} is larger than the kernel accepts")
    return value


def parse_pids(text: str) -> int:
    """`--pids-max`: a count of tasks (threads count, cgroup-v2.rst "PID")."""
    try:
        n = int(str(text).strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number of tasks") from None
    if n < 1 or n >= 1 << 31:
        raise ValueError("--pids-max must be between 1 and 2147483647")
    return n


class CpuMax:
    """`--cpu-max`: a bandwidth limit, kept as the kernel's (quota, period) in µs.

    Spelled either as a number of CPUs ("0.5", "2", "150%"), with the kernel's
    default period of 100 ms, or in cgroup v2's own syntax "QUOTA PERIOD"
    (both in µs, as in cpu.max). A bare integer means CPUs, never µs: "50000"
    would be fifty thousand CPUs, so anything above 4096 CPUs is refused as a
    likely mix-up."""

    __slots__ = ("quota_us", "period_us", "spelled")

    PERIOD_DEFAULT = 100_000

    def __init__(self, quota_us: int, period_us: int, spelled: str = "") -> None:
        if not 1000 <= period_us <= 1_000_000:
            raise ValueError("--cpu-max: the period must be 1000..1000000 µs")
        if quota_us < 1000:
            raise ValueError("--cpu-max: the quota must be at least 1000 µs (0.01 CPU at 100 ms)")
        self.quota_us = quota_us
        self.period_us = period_us
        self.spelled = spelled or f"{quota_us} {period_us}"

    @property
    def cpus(self) -> float:
        return round(self.quota_us / self.period_us, 6)

    def to_dict(self) -> dict[str, Any]:
        return {"quota_us": self.quota_us, "period_us": self.period_us, "cpus": self.cpus,
                "spelled": self.spelled}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CpuMax) and (self.quota_us, self.period_us) == (other.quota_us, other.period_us)

    def __repr__(self) -> str:
        return f"CpuMax({self.quota_us}, {self.period_us})"


def parse_cpu_max(text: str) -> CpuMax:
    s = str(text).strip()
    parts = s.split()
    if len(parts) == 2:
        if parts[0] == "max":
            raise ValueError("--cpu-max 'max ...' is no limit: leave the option out")
        try:
            return CpuMax(int(parts[0]), int(parts[1]), s)
        except ValueError as e:
            if "--cpu-max" in str(e):
                raise
            raise ValueError(f"--cpu-max {text!r}: 'QUOTA PERIOD' takes two integers (µs)") from None
    if len(parts) != 1:
        raise ValueError(f"--cpu-max {text!r}: a number of CPUs (0.5, 2, 150%) or 'QUOTA PERIOD' in µs")
    try:
        cpus = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise ValueError(f"--cpu-max {text!r}: a number of CPUs (0.5, 2, 150%) or 'QUOTA PERIOD' in µs") from None
    if not 0 < cpus <= 4096:
        raise ValueError(f"--cpu-max {text!r}: between 0.01 and 4096 CPUs")
    return CpuMax(round(cpus * CpuMax.PERIOD_DEFAULT), CpuMax.PERIOD_DEFAULT, s)


class Limits:
    """What the caller asked for. None: not asked."""

    __slots__ = ("memory_max", "pids_max", "cpu_max")

    def __init__(self, memory_max: int | None = None, pids_max: int | None = None,
                 cpu_max: CpuMax | None = None) -> None:
        self.memory_max = memory_max
        self.pids_max = pids_max
        self.cpu_max = cpu_max

    def asked(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.memory_max is not None:
            out["memory_max_bytes"] = self.memory_max
        if self.pids_max is not None:
            out["pids_max"] = self.pids_max
        if self.cpu_max is not None:
            out["cpu_max"] = self.cpu_max.to_dict()
        return out

    def controllers(self) -> list[str]:
        return [LIMIT_CONTROLLER[k] for k in ("memory_max", "pids_max", "cpu_max") if getattr(self, k) is not None]

    def __bool__(self) -> bool:
        return bool(self.controllers())


