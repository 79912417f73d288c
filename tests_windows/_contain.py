"""`contain` for the Windows suite: `python.exe _contain.py ARGS...` is the
command line `contain ARGS...` (the embeddable build's ._pth file is the
whole sys.path, so the checkout is added here, as conftest.py does)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from launcher._cli import console  # noqa: E402

console()
