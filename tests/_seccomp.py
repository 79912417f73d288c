"""A seccomp filter from Python, for tests that need the kernel to behave
as an older or a stuck one would: make a system call fail with an errno
(close_range as before 5.9/5.11), or park it for a supervisor (execve held
at its entry, so a test can kill a child exactly there).

Only for a forked test process: the filter stays on the calling thread and
everything it starts, for good. x86_64 only (`supported()` says why not).
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
NR = {"execve": 59, "execveat": 322, "close_range": 436, "setresgid": 119}
_NR_SECCOMP = 317
_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_USER_NOTIF = 0x7FC00000
_PR_SET_NO_NEW_PRIVS = 38

NOTIFY = -1   # action: park the call for the listener


def supported() -> str | None:
    if platform.machine() != "x86_64":
        return f"seccomp helper knows x86_64 syscall numbers only, not {platform.machine()}"
    return None


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k)


def install(rules: dict[str, int]) -> int:
    """`rules`: syscall name -> errno to fail with, or NOTIFY. Returns the
    listener fd when a rule notifies, else -1."""
    prog = [_insn(0x20, 0, 0, 4),                       # A = arch
            _insn(0x15, 1, 0, AUDIT_ARCH_X86_64),       # arch ok: skip the next
            _insn(0x06, 0, 0, _RET_ALLOW),
            _insn(0x20, 0, 0, 0)]                       # A = nr
    items = list(rules.items())
    notify = any(v == NOTIFY for _k, v in items)
    for i, (name, action) in enumerate(items):
        ret = _RET_USER_NOTIF if action == NOTIFY else _RET_ERRNO | (action & 0xFFFF)
        prog.append(_insn(0x15, 0, 1, NR[name]))        # nr == name ? next : skip
        prog.append(_insn(0x06, 0, 0, ret))
    prog.append(_insn(0x06, 0, 0, _RET_ALLOW))
    return install_program(prog, notify)


def install_program(prog: list[bytes], notify: bool = False) -> int:
    """Install a filter of BPF instructions (`_insn`); the listener fd when
    `notify`, else -1."""
    code = b"".join(prog)
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    flags = _SECCOMP_FILTER_FLAG_NEW_LISTENER if notify else 0
    rc = libc.syscall(_NR_SECCOMP, _SECCOMP_SET_MODE_FILTER, flags, fbuf)
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"seccomp: {os.strerror(e)}")
    return int(rc) if notify else -1
