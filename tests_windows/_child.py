"""Helper processes for the Windows suite: `python.exe _child.py ROLE ARGS...`.

Every helper that must be found again marks itself (_census.mark: a file
`<tag>.<pid>` with its creation time) so the test's own census can decide
whether it survived. Roles that report write `<tag>.result` (or a JSON
file) beside their mark.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# The embeddable build's ._pth file is the whole sys.path: add ours.
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import _census  # noqa: E402

LONG = 60.0
DETACHED_PROCESS = 0x00000008
CREATE_NEW_PROCESS_GROUP = 0x00000200
CREATE_BREAKAWAY_FROM_JOB = 0x01000000
CREATE_NO_WINDOW = 0x08000000


def me(*args: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), *args]


def start(args: list[str], flags: int = 0) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, creationflags=flags, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True)


def result(d: str, tag: str, text: str) -> None:
    with open(os.path.join(d, f"{tag}.result"), "a") as f:
        f.write(text + "\n")


def role_sleep(d: str, tag: str, seconds: str = str(LONG)) -> int:
    _census.mark(d, tag)
    time.sleep(float(seconds))
    return 0


def role_tree(d: str, tag: str, how: str, code: str) -> int:
    """The worker of the README example: start a grandchild meant to outlive
    it (`detached`: DETACHED_PROCESS, no console; `newgroup`; `plain`), wait
    until it has marked itself, then exit with `code`."""
    _census.mark(d, tag)
    flags = {"detached": DETACHED_PROCESS, "newgroup": CREATE_NEW_PROCESS_GROUP, "plain": 0}[how]
    start(me("sleep", d, f"{tag}-gc"), flags)
    deadline = time.monotonic() + 30
    while not _census.marks(d, f"{tag}-gc") and time.monotonic() < deadline:
        time.sleep(0.02)
    return int(code)


def role_pair(d: str, tag: str) -> int:
    """A worker that stays, with a child that stays."""
    _census.mark(d, tag)
    start(me("sleep", d, f"{tag}-gc"))
    time.sleep(LONG)
    return 0


def role_breakaway(d: str, tag: str) -> int:
    """Ask to leave the job for a child; say what happened."""
    _census.mark(d, tag)
    try:
        p = start(me("sleep", d, f"{tag}-out"), CREATE_BREAKAWAY_FROM_JOB)
        result(d, tag, f"created {p.pid}")
    except OSError as e:
        result(d, tag, f"refused {getattr(e, 'winerror', None)}")
    time.sleep(LONG)
    return 0


def role_nest(d: str, tag: str) -> int:
    """Make a job of our own that allows breakaway, both kinds, put
    ourselves in it (nested in the launcher's), then try both ways out: a
    plain child (silent breakaway) and an explicit CREATE_BREAKAWAY_FROM_JOB."""
    from ctypes import wintypes as w

    k = ctypes.WinDLL("kernel32", use_last_error=True)
    k.CreateJobObjectW.restype = w.HANDLE
    k.GetCurrentProcess.restype = w.HANDLE
    k.SetInformationJobObject.argtypes = [w.HANDLE, ctypes.c_int, ctypes.c_void_p, w.DWORD]
    k.AssignProcessToJobObject.argtypes = [w.HANDLE, w.HANDLE]
    _census.mark(d, tag)
    job = k.CreateJobObjectW(None, None)
    info = (ctypes.c_byte * 144)()   # JOBOBJECT_EXTENDED_LIMIT_INFORMATION (x64)
    ctypes.c_uint32.from_buffer(info, 16).value = 0x800 | 0x1000   # LimitFlags: BREAKAWAY_OK | SILENT_BREAKAWAY_OK
    ok_set = k.SetInformationJobObject(job, 9, info, ctypes.sizeof(info))
    ok_assign = k.AssignProcessToJobObject(job, k.GetCurrentProcess())
    result(d, tag, f"nested set={ok_set} assign={ok_assign} err={ctypes.get_last_error()}")
    start(me("sleep", d, f"{tag}-in"))
    try:
        start(me("sleep", d, f"{tag}-in"), CREATE_BREAKAWAY_FROM_JOB)
        result(d, tag, "explicit-created")
    except OSError as e:
        result(d, tag, f"explicit-refused {getattr(e, 'winerror', None)}")
    time.sleep(LONG)
    return 0


def role_ignore_break(d: str, tag: str) -> int:
    signal.signal(signal.SIGBREAK, signal.SIG_IGN)
    _census.mark(d, tag)
    time.sleep(LONG)
    return 0


def role_on_break(d: str, tag: str) -> int:
    def h(signum: int, frame: object) -> None:
        result(d, tag, "break")
        os._exit(3)

    signal.signal(signal.SIGBREAK, h)
    _census.mark(d, tag)
    time.sleep(LONG)
    return 0


def role_exit(code: str) -> int:
    # ExitProcess takes a UINT: 259 and NTSTATUS values pass unchanged.
    k = ctypes.WinDLL("kernel32")
    k.ExitProcess.argtypes = [ctypes.c_uint]
    sys.stdout.flush()
    k.ExitProcess(int(code))
    return 0


def role_spin(ms: str) -> int:
    end = time.perf_counter() + int(ms) / 1000
    x = 0
    while time.perf_counter() < end:
        x += 1
    return 0


def role_lockhold(path: str) -> int:
    from launcher._platform import winfs

    lk = winfs.OwnerLock.acquire(path)
    print("locked" if lk is not None else "busy", flush=True)
    time.sleep(LONG)
    return 0


def role_append(path: str, tag: str, n: str) -> int:
    from launcher._platform import winfs

    for i in range(int(n)):
        winfs.append_line(path, f"{tag} {i} {'x' * 200}\n".encode())
    return 0


def role_poke(name: str, delay: str) -> int:
    from launcher._platform import winsync

    time.sleep(float(delay))
    print(winsync.poke(name), flush=True)
    return 0


def role_supervisor(d: str, tag: str) -> int:
    """What `contain` does, in a process the test will kill: a Container
    holding a worker and its child; no one calls kill() or remove()."""
    from launcher._platform import windows

    _census.mark(d, f"{tag}-sup")
    c = windows.Container.create(tag)
    c.spawn(windows.Request(me("pair", d, tag)))
    _census.wait_marks(d, f"{tag}-gc", 1)
    print("ready", flush=True)
    time.sleep(LONG)
    return 0


def role_console_stop(d: str, mode: str, grace: str) -> int:
    """Run in a console of its own (CREATE_NEW_CONSOLE): a worker that
    ignores CTRL_BREAK (`ignore_break`) or exits on it (`on_break`);
    terminate(), wait `grace` for the worker, then kill(). Writes what
    happened to console_stop.json."""
    from launcher._platform import windows, winsync

    c = windows.Container.create("console")
    c.spawn(windows.Request(me(mode, d, "cw")))
    w = winsync.owner_waiter(c, "console-stop-test")
    out: dict[str, object] = {}
    try:
        procs = _census.wait_marks(d, "cw", 1)
        out["marked"] = len(procs)
        _via, detail = c.terminate()
        out["terminate"] = c.last_terminate
        out["reached"], out["missed"] = detail["reached"], detail["not_reached"]
        deadline = time.monotonic() + float(grace)
        while c.root_status()[0] and time.monotonic() < deadline:
            w.wait(deadline - time.monotonic())
        running, code = c.root_status()
        out["exited_in_grace"] = not running
        out["exit_code"] = code
        out["result"] = open(os.path.join(d, "cw.result")).read() if os.path.exists(os.path.join(d, "cw.result")) else None
        c.kill()
        deadline = time.monotonic() + 15
        while c.populated() and time.monotonic() < deadline:
            w.wait(deadline - time.monotonic())
        out["populated_after_kill"] = c.populated()
        out["alive_after_kill"] = [p for p, t in procs.items() if _census.alive(p, t)]
    finally:
        w.close()
        c.remove()
        with open(os.path.join(d, "console_stop.json"), "w") as f:
            json.dump(out, f)
    return 0


def role_ctrl(d: str) -> int:
    """Run in a console of its own: does a console control event wake a
    Waiter blocked with no timeout, and does CPython's handler still run?"""
    from launcher._platform import winsync

    seen: list[int] = []

    def h(signum: int, frame: object) -> None:
        seen.append(signum)

    signal.signal(signal.SIGINT, h)
    w = winsync.Waiter()
    w.forward_console_ctrl()
    k = ctypes.WinDLL("kernel32", use_last_error=True)

    def fire() -> None:
        time.sleep(0.3)
        ok = k.GenerateConsoleCtrlEvent(0, 0)   # CTRL_C_EVENT to every process of this console
        with open(os.path.join(d, "ctrl.sent"), "w") as f:
            f.write(f"{ok} {ctypes.get_last_error()}")

    threading.Thread(target=fire, daemon=True).start()
    t0 = time.monotonic()
    w.wait(20)
    elapsed = time.monotonic() - t0
    time.sleep(0.2)   # let the interpreter run its handler
    out = {"elapsed": elapsed, "ctrls": w.seen["ctrls"], "last_ctrl": w.last_ctrl, "python_handler": seen}
    w.close()
    with open(os.path.join(d, "ctrl.json"), "w") as f:
        json.dump(out, f)
    return 0


def role_ctrl_c_contain(d: str, state: str, record: str) -> int:
    """Run in a console of its own: `contain run` a sleeping worker, then
    Ctrl-C (CTRL_C_EVENT to every process of this console, as a terminal's
    ^C). The worker leads its own process group, which ignores it; contain
    must cancel the run and end as a run cancelled by SIGINT (130)."""
    signal.signal(signal.SIGINT, lambda n, f: None)     # ^C is for contain, not for us
    contain = [sys.executable, os.path.join(HERE, "_contain.py")]
    env = dict(os.environ, CONTAIN_STATE_DIR=state)
    p = subprocess.Popen([*contain, "run", "--grace", "0.5", "--record", record, "--", *me("sleep", d, "cc")],
                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, object] = {"marked": len(_census.wait_marks(d, "cc", 1))}
    k = ctypes.WinDLL("kernel32", use_last_error=True)
    time.sleep(0.3)
    out["sent"] = [k.GenerateConsoleCtrlEvent(0, 0), ctypes.get_last_error()]
    try:
        out["rc"] = p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        out["rc"] = None
    with open(os.path.join(d, "ctrl_c.json"), "w") as f:
        json.dump(out, f)
    return 0


def role_alloc(mb: str) -> int:
    b = bytearray(int(mb) << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    time.sleep(0.5)
    return 0


def role_try_spawn(d: str, tag: str) -> int:
    """Try to start one child (a marked sleeper); say whether it was made."""
    _census.mark(d, tag)
    try:
        p = start(me("sleep", d, f"{tag}-child"))
        result(d, tag, f"created {p.pid}")
    except OSError as e:
        result(d, tag, f"refused {getattr(e, 'winerror', None)} {e}")
    return 0


def role_try_alloc(d: str, tag: str, mb: str) -> int:
    """Try to commit and touch `mb` MiB; say whether it could."""
    _census.mark(d, tag)
    try:
        b = bytearray(int(mb) << 20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        result(d, tag, f"allocated {len(b)}")
    except MemoryError:
        result(d, tag, "refused MemoryError")
    return 0


def role_steal(d: str, tag: str, up: str = "1") -> int:
    """The worker that keeps its job alive past its supervisor: it opens its
    parent (`contain`, the same user; with `up` 2 its grandparent) with
    PROCESS_DUP_HANDLE, copies out every handle value that is a job holding
    this process, and keeps them; then a child that stays, and it stays.
    `<tag>.result` says how many job handles it holds ("stole N")."""
    from ctypes import wintypes as w

    k32 = ctypes.WinDLL("kernel32", use_last_error=True)
    k32.OpenProcess.restype = w.HANDLE
    k32.OpenProcess.argtypes = [w.DWORD, w.BOOL, w.DWORD]
    k32.GetCurrentProcess.restype = w.HANDLE
    k32.DuplicateHandle.argtypes = [w.HANDLE, w.HANDLE, w.HANDLE, ctypes.POINTER(w.HANDLE), w.DWORD, w.BOOL,
                                    w.DWORD]
    k32.IsProcessInJob.argtypes = [w.HANDLE, w.HANDLE, ctypes.POINTER(w.BOOL)]
    k32.CloseHandle.argtypes = [w.HANDLE]
    PROCESS_DUP_HANDLE, DUPLICATE_SAME_ACCESS = 0x0040, 0x2
    parents = {pid: ppid for pid, (ppid, _exe) in _census.snapshot().items()}
    parent = os.getpid()
    for _ in range(int(up)):
        parent = parents[parent]
    src = k32.OpenProcess(PROCESS_DUP_HANDLE, False, parent)
    me_h = k32.GetCurrentProcess()
    kept = []
    if src:
        for value in range(4, 0x4000, 4):
            dup = w.HANDLE()
            if not k32.DuplicateHandle(src, w.HANDLE(value), me_h, ctypes.byref(dup), 0, False,
                                       DUPLICATE_SAME_ACCESS):
                continue
            inside = w.BOOL()
            if k32.IsProcessInJob(me_h, dup, ctypes.byref(inside)) and inside.value:
                kept.append(dup)
            else:
                k32.CloseHandle(dup)
    result(d, tag, f"stole {len(kept)}")
    _census.mark(d, tag)
    start(me("sleep", d, f"{tag}-gc"))
    time.sleep(LONG)
    return 0


def role_steal_below(d: str, tag: str) -> int:
    """A worker whose child steals the job handle out of `contain` (its
    grandparent) and stays; the worker itself exits once `<tag>.go` exists."""
    _census.mark(d, tag)
    start(me("steal", d, f"{tag}-thief", "2"))
    deadline = time.monotonic() + LONG
    while not os.path.exists(os.path.join(d, f"{tag}.go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    return 3


ROLES = {n[5:]: f for n, f in list(globals().items()) if n.startswith("role_")}

if __name__ == "__main__":
    sys.exit(ROLES[sys.argv[1]](*sys.argv[2:]))
