"""The netlink process connector's wire format, for the fork ledger (_ledger.py).

`listen()` subscribes a socket; `events(buf, n)` turns what one recv read
into (what, a, b, timestamp_ns) tuples: forks as (PROC_EVENT_FORK, parent
tgid, child tgid, ts), threads left out; exits as (PROC_EVENT_EXIT, tgid,
parent tgid, ts) for a thread-group leader and (THREAD_EXIT, tgid, parent
tgid, ts) for any other thread. The parent is the exiting task's
`real_parent` at its exit (0 where the kernel's event has no such field,
before 4.18): it tells the ledger which reaper a member had once it was
orphaned, whatever order the events came in. The layout is the kernel's include/uapi/linux/cn_proc.h and
connector.h, as pyroute2's `pyroute2/netlink/connector/cn_proc.py` reads it;
the socket is the standard library's because `import pyroute2` costs 130-155
ms here (benchmarks/bench_ledger.py).
"""
from __future__ import annotations

import errno
import os
import select
import _socket
import struct
import time
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Iterator

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_NONE = 0x0
PROC_EVENT_FORK = 0x1
PROC_EVENT_EXIT = 0x80000000
THREAD_EXIT = 0x1_0000_0000              # not a kernel value: a non-leader thread's exit
NLMSG_DONE = 3
NLMSG_ERROR = 2

_NLMSGHDR = struct.Struct("=IHHII")       # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")        # idx, val, seq, ack, len, flags
_EVENT = struct.Struct("=IIQ")            # what, cpu, timestamp_ns (CLOCK_MONOTONIC)
_FORK = struct.Struct("=IIII")            # parent_pid, parent_tgid, child_pid, child_tgid
_EXIT = struct.Struct("=II")              # process_pid, process_tgid
_EXIT_PARENT = struct.Struct("=IIIIII")    # ... exit_code, exit_signal, parent_pid, parent_tgid (4.18)
_ACK = struct.Struct("=I")                # err
_HDR = _NLMSGHDR.size + _CN_MSG.size      # 36: where the proc_event starts
_DATA = _HDR + _EVENT.size                # 52: where the event's data starts


class LedgerUnavailable(Exception):
    """The process connector cannot be used here; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def listen(ack_timeout: float = 0.2) -> _socket.socket:
    """A netlink socket subscribed to the process connector's fork and exit
    events, non-blocking. Raises LedgerUnavailable."""
    try:
        sock = _socket.socket(_socket.AF_NETLINK, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC, NETLINK_CONNECTOR)
    except OSError as e:
        raise LedgerUnavailable(f"socket(AF_NETLINK, NETLINK_CONNECTOR): {os.strerror(e.errno or 0)}") from e
    try:
        _bigger_buffer(sock)
        try:
            sock.bind((0, CN_IDX_PROC))
        except OSError as e:
            raise LedgerUnavailable(f"bind to the process connector: {os.strerror(e.errno or 0)}") from e
        token = (os.getpid() << 8 ^ time.monotonic_ns()) & 0x7FFFFFFF
        # The unfiltered form (4 bytes) is the one every kernel acks;
        # the acknowledgement is itself an event, which a filter drops.
        _control(sock, struct.pack("=I", PROC_CN_MCAST_LISTEN), token)
        err = _wait_ack(sock, token, ack_timeout)
        if err is None:
            raise LedgerUnavailable("the process connector did not acknowledge (another PID or user "
                                    "namespace than the initial one?)")
        if err:
            raise LedgerUnavailable(f"process connector refused to listen: {os.strerror(err)}")
        # Since 6.6 a listener may ask for some events only: forks and
        # exits are all the ledger reads. Older kernels ignore this form.
        _control(sock, struct.pack("=II", PROC_CN_MCAST_LISTEN, PROC_EVENT_FORK | PROC_EVENT_EXIT), token + 2)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def events(buf: bytearray, n: int) -> Iterator[tuple[int, int, int, int]]:
    """The process-level forks, and the exits, in the first `n` bytes of `buf`."""
    off = 0
    while off + _DATA <= n:
        ln = _NLMSGHDR.unpack_from(buf, off)[0]
        if ln < _DATA or off + ln > n:
            break
        what, _cpu, ts = _EVENT.unpack_from(buf, off + _HDR)
        if what == PROC_EVENT_FORK and ln >= _DATA + _FORK.size:
            _pp, ptgid, cpid, ctgid = _FORK.unpack_from(buf, off + _DATA)
            if cpid == ctgid:                      # a process, not a thread
                yield what, ptgid, ctgid, ts
        elif what == PROC_EVENT_EXIT and ln >= _DATA + _EXIT.size:
            pid, tgid = _EXIT.unpack_from(buf, off + _DATA)
            parent = _EXIT_PARENT.unpack_from(buf, off + _DATA)[5] if ln >= _DATA + _EXIT_PARENT.size else 0
            yield (what if pid == tgid else THREAD_EXIT), tgid, parent, ts
        off += (ln + 3) & ~3


def _bigger_buffer(sock: _socket.socket) -> None:
    """A fork storm on the host must not overflow the queue between two
    drains: ask for 8 MiB (SO_RCVBUFFORCE needs CAP_NET_ADMIN)."""
    size = 8 << 20
    try:
        sock.setsockopt(_socket.SOL_SOCKET, 33, size)      # SO_RCVBUFFORCE
    except OSError:
        try:
            sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVBUF, size)
        except OSError:
            pass


def _control(sock: _socket.socket, payload: bytes, token: int) -> None:
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, token, token, len(payload), 0) + payload
    sock.sendto(_NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, token, os.getpid()) + cn, (0, 0))


def _wait_ack(sock: _socket.socket, token: int, timeout: float) -> int | None:
    """The err of our acknowledgement (ack == token + 1), None on timeout.
    Acknowledgements go to every listener: ours is the one with our token."""
    deadline = time.monotonic() + timeout
    buf = bytearray(64 * 1024)
    p = select.poll()
    p.register(sock.fileno(), select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not p.poll(int(left * 1000) + 1):
            return None
        try:
            n = sock.recv_into(buf)
        except OSError as e:
            if e.errno in (errno.ENOBUFS, errno.EINTR):
                continue
            raise LedgerUnavailable(f"recv: {os.strerror(e.errno or 0)}") from e
        off = 0
        while off + _DATA <= n:
            ln, typ = _NLMSGHDR.unpack_from(buf, off)[:2]
            if ln < _HDR:
                break
            if typ == NLMSG_ERROR:
                err = -struct.unpack_from("=i", buf, off + 16)[0]
                if err:
                    return err
            else:
                _idx, _val, _seq, ack = _CN_MSG.unpack_from(buf, off + _NLMSGHDR.size)[:4]
                what = _EVENT.unpack_from(buf, off + _HDR)[0]
                if what == PROC_EVENT_NONE and ack == token + 1:
                    return int(_ACK.unpack_from(buf, off + _DATA)[0])
            off += (ln + 3) & ~3
