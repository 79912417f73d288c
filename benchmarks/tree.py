"""A process tree for the stop benchmark: `python tree.py N`.

The root forks N-1 descendants and then waits, so the tree holds exactly N
live processes:
- N//2 daemons: a child calls setsid() and forks the daemon, then exits, so
  the daemon is in a session of its own (killpg misses it) and is an orphan
  re-parented away from the root (psutil's children(recursive=True) from the
  root misses it);
- the rest are plain children in the root's process group.
Every process only pause()s. Each descendant writes one byte to a pipe once it
is in place; when all N-1 bytes are in, the root prints "ready <N>" on stdout.

Forks are from a small Python parent with the garbage collector frozen, so the
children share almost every page with it (no exec of N interpreters).
"""
import gc
import os
import signal
import sys


def _stay(w: int) -> None:
    """In a descendant: report readiness, then wait for a signal forever."""
    os.write(w, b".")
    os.close(w)
    while True:
        signal.pause()


def main() -> None:
    n = int(sys.argv[1])
    if n < 1:
        raise SystemExit("tree.py: N must be >= 1")
    n_daemons = n // 2
    n_plain = n - 1 - n_daemons
    r, w = os.pipe()
    gc.disable()
    gc.freeze()
    intermediates = []
    for _ in range(n_plain):
        if os.fork() == 0:
            os.close(r)
            _stay(w)
    for _ in range(n_daemons):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.setsid()
            if os.fork() == 0:
                _stay(w)
            os._exit(0)
        intermediates.append(pid)
    os.close(w)
    for pid in intermediates:
        os.waitpid(pid, 0)
    need = n - 1
    while need > 0:
        got = os.read(r, min(need, 65536))
        if not got:
            raise SystemExit("tree.py: a descendant died before it was ready")
        need -= len(got)
    os.close(r)
    sys.stdout.write(f"ready {n}\n")
    sys.stdout.flush()
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
