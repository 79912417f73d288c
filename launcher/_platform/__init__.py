"""The platform, chosen once (STYLE.md, "Layers").

`host` is the module holding this platform's pieces of the owner loop
(posixwait.py on Linux, winhost.py on Windows):
`Root` (the worker as the owner watches it), `Wakeups` (the in-process and
cross-process wake-ups of an owner), `wait_ready` (block on those and the
container until the next deadline). The containers themselves are chosen
per run in _containers.py.
"""
import sys

if sys.platform == "win32":
    from . import winhost as host
else:
    from . import posixwait as host

__all__ = ["host"]
