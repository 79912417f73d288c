# cffi has no pyproject-only form for API-mode modules yet (cffi#55), and
# pyproject cannot choose the `contain` command per platform.
import sys

from setuptools import setup

if sys.platform == "win32":
    # Windows needs pip's .exe launcher, which only a console script gets.
    command = {"entry_points": {"console_scripts": ["contain = launcher._cli:console"]}}
else:
    # A script of our own (bin/contain): pip's console-script wrapper imports
    # `re` before pip 25.0, a sixth of what `contain run` may cost over a
    # plain subprocess.call (docs/performance.md, "Start-up").
    # (No console scripts, said explicitly: pyproject.toml declares them dynamic.)
    command = {"scripts": ["bin/contain"], "entry_points": {"console_scripts": []}}
    # cffi builds the extension against the stable ABI here (_ct.abi3.so):
    # the wheel says so, and installs on every CPython from 3.11 on. (On
    # Windows cffi builds _ct.cp3XX-win_amd64.pyd, one Python's.)
    command["options"] = {"bdist_wheel": {"py_limited_api": "cp311"}}

setup(cffi_modules=["launcher/_native/build.py:ffibuilder"], **command)
