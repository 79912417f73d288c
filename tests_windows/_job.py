"""A Container and a Waiter on its port, as the owner loop will hold them."""
from __future__ import annotations

import os
import sys
import time
from typing import Any

from launcher._platform import windows, winsync

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "_child.py")


def child(*args: str) -> list[str]:
    return [sys.executable, CHILD, *args]


class Job:
    def __init__(self, d: str, name: str = "t") -> None:
        self.dir = d
        self.c = windows.Container.create(f"{name}-{os.getpid()}")
        self.w = winsync.Waiter(self.c.port, job=self.c.key)
        self._logs: list[Any] = []

    def spawn(self, argv: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None) -> windows.Spawned:
        log = open(os.path.join(self.dir, f"worker-{len(self._logs)}.log"), "w")
        self._logs.append(log)
        fd = log.fileno()
        sp = self.c.spawn(windows.Request(argv, cwd=cwd, env=env, stdio=(-1, fd, fd)))
        self.w.watch_process(self.c.process)
        return sp

    def wait_root(self, timeout: float = 30.0) -> int | None:
        """The worker's exit code once its handle is signalled; None at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            running, code = self.c.root_status()
            if not running:
                return code
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.w.wait(left)

    def wait_empty(self, timeout: float = 15.0) -> bool:
        """ActiveProcesses == 0 observed by query, waking on the port."""
        deadline = time.monotonic() + timeout
        while self.c.populated():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.w.wait(left)
        return True

    def close(self) -> None:
        try:
            if self.c.job and self.c.populated():
                self.c.kill()
                self.wait_empty()
        finally:
            self.w.close()
            self.c.remove()
            for log in self._logs:
                log.close()

    def log(self, i: int = 0) -> str:
        with open(os.path.join(self.dir, f"worker-{i}.log"), errors="replace") as f:
            return f.read()
