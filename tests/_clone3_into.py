"""clone3(CLONE_INTO_CGROUP) from Python, for the tests' own probes.

    python _clone3_into.py DIR CMD [ARG...]   child placed in DIR execs CMD
    python _clone3_into.py DIR                child placed in DIR exits 0

Prints one line: "clone3 ok <child pid> <wait status>" or "clone3 failed
<errno name>" or "open failed <errno name>". Exit 0 when the child was made.
This is the way out that a read-only cgroup mount does not close (the
permission check reads the inode, not the mount), so the seal tests try it.
"""
import ctypes
import errno
import os
import struct
import sys

CLONE_INTO_CGROUP = 0x200000000
SIGCHLD = 17
NR_CLONE3 = 435

target, cmd = sys.argv[1], sys.argv[2:]
try:
    fd = os.open(target, os.O_PATH | os.O_DIRECTORY)
except OSError as e:
    print("open failed", errno.errorcode.get(e.errno, e.errno), flush=True)
    sys.exit(3)
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
args = struct.pack("11Q", CLONE_INTO_CGROUP, 0, 0, 0, SIGCHLD, 0, 0, 0, 0, 0, fd)
buf = ctypes.create_string_buffer(args, len(args))
sys.stdout.flush()
pid = libc.syscall(NR_CLONE3, buf, ctypes.c_size_t(len(args)))
if pid == 0:
    if cmd:
        try:
            os.execvp(cmd[0], cmd)
        finally:
            os._exit(127)
    os._exit(0)
if pid < 0:
    print("clone3 failed", errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()), flush=True)
    sys.exit(2)
status = 0 if cmd else os.waitpid(pid, 0)[1]   # /bin/true-like children only; the caller's run() has a timeout
print("clone3 ok", pid, status, flush=True)
