"""A default container, made by the test around a function: what `docker run`
and a Kubernetes pod give a process by default, as far as contain can tell.

- a mount namespace of its own, private, where every cgroup filesystem is
  read-only (per mount: MS_REMOUNT|MS_BIND|MS_RDONLY, never the superblock:
  the host's hierarchy keeps its options), a cgroup namespace, and, as
  Docker's masked paths do, /dev/null and empty tmpfs over some of /proc
  (which makes the kernel refuse any new proc mount to an unprivileged
  user namespace: mount_too_revealing);
- a PID namespace of its own with a fresh /proc, its PID 1 either the test's
  function (`pid1=True`: contain as the entrypoint) or a reaper loop of ours
  with the function as its child (a CI step or `kubectl exec`);
- Docker's capability set (no CAP_SYS_ADMIN, CAP_NET_ADMIN, CAP_SYS_PTRACE);
- the refusals of Docker's default seccomp profile that matter to a process
  launcher: clone3 answers ENOSYS "so that libc falls back to clone"; clone
  with any namespace flag, unshare, setns, mount and the new mount API
  answer EPERM.

Made from a forked process of the test's (it forks twice more: the pod's
PID 1, and where asked its child), so nothing of it reaches the test runner.
The function's return value comes back pickled; an exception comes back as
its text. Test-side only; nothing here uses the code under test.
"""
from __future__ import annotations

import ctypes
import errno
import os
import pickle
import platform
import signal
import struct
import sys
import time
import traceback
from typing import Any, Callable

import _seccomp

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18

# Docker's default capabilities (moby oci/caps/defaults.go).
DOCKER_CAPS = {0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31}  # chown dac_override fowner fsetid kill setgid
# setuid setpcap net_bind_service net_raw sys_chroot mknod audit_write setfcap
CAP_SYS_ADMIN = 21

# What Docker masks (moby oci/defaults.go): files get /dev/null, directories an empty read-only tmpfs.
MASKED = ["/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
          "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi"]
READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]

# Docker's refusals (moby profiles/seccomp/default.json): EPERM unless allowed;
# clone3 ENOSYS; clone allowed only without namespace flags.
REFUSED = ["unshare", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig",
           "fsmount", "fspick", "mount_setattr"]
_NR_X86_64 = {"clone": 56, "clone3": 435, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166,
              "pivot_root": 155, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
              "fsmount": 432, "fspick": 433, "mount_setattr": 442}
CLONE_NS_FLAGS = 0x7E020000   # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET: Docker's mask for clone


def why_not() -> str | None:
    """Why this host cannot make such a container for a test, or None."""
    if _seccomp.supported():
        return _seccomp.supported()
    if os.geteuid() != 0:
        return "making the container's namespaces and mounts needs root"
    return None


_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(src.encode() if src else None, target.encode(), fstype.encode() if fstype else None,
                       ctypes.c_ulong(flags), data.encode() if data else None), f"mount {target}")


def docker_seccomp() -> None:
    """Docker's default profile's answers for the calls above (x86_64)."""
    ins = _seccomp._insn
    prog = [ins(0x20, 0, 0, 4), ins(0x15, 1, 0, _seccomp.AUDIT_ARCH_X86_64), ins(0x06, 0, 0, _seccomp._RET_ALLOW),
            ins(0x20, 0, 0, 0),
            ins(0x15, 0, 1, _NR_X86_64["clone3"]), ins(0x06, 0, 0, _seccomp._RET_ERRNO | errno.ENOSYS)]
    for name in REFUSED:
        prog += [ins(0x15, 0, 1, _NR_X86_64[name]), ins(0x06, 0, 0, _seccomp._RET_ERRNO | errno.EPERM)]
    prog += [ins(0x15, 0, 3, _NR_X86_64["clone"]),
             ins(0x20, 0, 0, 16),                              # A = low 32 bits of args[0], the flags
             ins(0x45, 0, 1, CLONE_NS_FLAGS),                  # any namespace flag: EPERM
             ins(0x06, 0, 0, _seccomp._RET_ERRNO | errno.EPERM),
             ins(0x06, 0, 0, _seccomp._RET_ALLOW)]
    _seccomp.install_program(prog)


def drop_caps(keep: set[int]) -> None:
    """Keep only `keep` of this process's capabilities (and bounding set)."""
    pr_capbset_drop = 24
    for c in range(64):
        if c not in keep:
            _libc.prctl(pr_capbset_drop, c, 0, 0, 0)      # EINVAL past the last cap: fine
    mask = sum(1 << c for c in keep)
    hdr = struct.pack("Ii", 0x20080522, 0)                # _LINUX_CAPABILITY_VERSION_3, this process
    buf = ctypes.create_string_buffer(24)
    _check(_libc.syscall(125, hdr, buf), "capget")
    eff0, perm0, inh0, eff1, perm1, inh1 = struct.unpack("6I", buf.raw)
    lo, hi = mask & 0xFFFFFFFF, mask >> 32
    new = struct.pack("6I", eff0 & lo, perm0 & lo, inh0 & lo, eff1 & hi, perm1 & hi, inh1 & hi)
    _check(_libc.syscall(126, hdr, new), "capset")


def _prepare_mounts(mask_proc: bool) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # This namespace's /proc: the PID namespace's own, as a container has.
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    with open("/proc/self/mountinfo") as f:
        lines = f.read().splitlines()
    for line in lines:
        left, _, right = line.partition(" - ")
        fstype = right.split()[0]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        mp = left.split()[4].replace("\\040", " ")
        opts = left.split()[5].split(",")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        flags |= (MS_NOSUID if "nosuid" in opts else 0) | (MS_NODEV if "nodev" in opts else 0)
        flags |= MS_NOEXEC if "noexec" in opts else 0
        _mount(None, mp, None, flags)
    if mask_proc:
        for p in MASKED:
            if os.path.isdir(p):
                _mount("tmpfs", p, "tmpfs", MS_RDONLY)
            elif os.path.exists(p):
                _mount("/dev/null", p, None, MS_BIND)
        for p in READONLY:
            if os.path.exists(p):
                _mount(p, p, None, MS_BIND | MS_REC)
                _mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def run(fn: Callable[[], Any], *, pid1: bool = False, mask_proc: bool = True, seccomp: bool = True,
        caps: set[int] | None = DOCKER_CAPS, cgroupns: bool = True, timeout: float = 90.0,
        pod_pid_file: str | None = None) -> Any:
    """fn() in a default container; its return value. Call from a forked
    test (the namespaces are unshared in the calling process's children
    only). `pod_pid_file`: where the pod's PID 1 writes its pid as the
    host sees it (for a visitor: `nsenter -t PID -p`)."""
    r, w = os.pipe()
    outer = os.fork()
    if outer == 0:
        # A child of its own, so the test process keeps its namespaces.
        os.close(r)
        code = 1
        try:
            _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID | (CLONE_NEWCGROUP if cgroupns else 0)), "unshare")
            pod = os.fork()               # PID 1 of the new PID namespace
            if pod == 0:
                _pod(fn, w, pid1=pid1, mask_proc=mask_proc, seccomp=seccomp, caps=caps)
            if pod_pid_file is not None:
                with open(pod_pid_file + ".tmp", "w") as f:
                    f.write(str(pod))
                os.rename(pod_pid_file + ".tmp", pod_pid_file)
            _, status = os.waitpid(pod, 0)
            code = os.waitstatus_to_exitcode(status)
        except BaseException:
            os.write(w, pickle.dumps(("error", traceback.format_exc())))
        finally:
            os._exit(code if code >= 0 else 1)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    os.set_blocking(r, False)
    import select

    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(outer, signal.SIGKILL)   # its PID namespace dies with its init
            os.waitpid(outer, 0)
            os.close(r)
            raise TimeoutError(f"the container's function did not return within {timeout} s")
        select.select([r], [], [], left)
        try:
            got = os.read(r, 1 << 16)
        except BlockingIOError:
            continue
        if not got:
            break
        chunks.append(got)
    os.close(r)
    os.waitpid(outer, 0)
    data = b"".join(chunks)
    if not data:
        raise RuntimeError("the container's function returned nothing (it died)")
    kind, value = pickle.loads(data)
    if kind == "error":
        raise RuntimeError(f"in the container:\n{value}")
    return value


def _pod(fn: Callable[[], Any], w: int, *, pid1: bool, mask_proc: bool, seccomp: bool,
         caps: set[int] | None) -> None:
    try:
        _prepare_mounts(mask_proc)
        if caps is not None:
            drop_caps(caps)
        if seccomp:
            docker_seccomp()
        if not pid1:
            # The pod's PID 1 is some other program (a shell, `sleep
            # infinity`): it reaps what reparents to it, and the function
            # runs as its child, as a CI step or `kubectl exec` does.
            child = os.fork()
            if child == 0:
                _result(fn, w)
            os.close(w)
            while True:
                try:
                    pid, status = os.waitpid(-1, 0)
                except ChildProcessError:
                    os._exit(0)
                if pid == child:
                    os._exit(0)
        _result(fn, w)
    except BaseException:
        os.write(w, pickle.dumps(("error", traceback.format_exc())))
        os._exit(1)


def _result(fn: Callable[[], Any], w: int) -> None:
    # What launcher probes once per process was probed outside, by the test
    # process this child is a fork of: a program started in a container
    # probes in there. (The pidns backend's probe: a wall the host allowed.)
    from launcher._platform import pidns

    pidns._available.clear()
    try:
        out = ("ok", fn())
    except BaseException:
        out = ("error", traceback.format_exc())
    data = pickle.dumps(out)
    while data:
        n = os.write(w, data)
        data = data[n:]
    os.close(w)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def in_container_info() -> dict[str, Any]:
    """What the container looks like from inside (for the harness's own test)."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    return {"pid": os.getpid(), "seccomp": status.get("Seccomp", "").strip(),
            "cap_eff": int(status.get("CapEff", "0").strip(), 16), "machine": platform.machine()}
