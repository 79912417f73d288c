"""Build the `launcher._native._ct` extension (cffi API mode).

Each module `NAME` is three files in this folder: `NAME.c`, its C prototypes
in `NAME.h`, and its declarations for Python in `NAME.cdef` (cffi's parser
takes no preprocessor lines). A platform builds only its own modules
(`MODULES`): the Linux ones use clone3, cgroupfs and /proc, the Windows ones
the Win32 API, and neither compiles on the other. So on each platform `lib`
carries only what that platform can do; code for the other platform checks
`sys.platform` before it touches `lib`.

`make(platform)` describes the extension for a platform without building
it, so tools/winbuild.py can emit the Windows C source on Linux and
cross-compile it (cffi's emit_c_code), as `pip install .` on Windows would.
"""
from __future__ import annotations

import os
import pathlib
import sys

import cffi

HERE = pathlib.Path(__file__).resolve().parent

MODULES = {
    "linux": ("cgroup", "child", "clone", "fds", "init", "procscan", "shed", "spawn", "wall"),
    "win32": ("jobobject", "winproc", "winsync"),
}

# MSVC on Windows (what setuptools uses there); GCC or Clang on Linux.
# tools/winbuild.py passes its own flags to mingw-w64.
_COMPILE = {
    "linux": {"extra_compile_args": ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
              # procscan.c reads /proc with a few threads.
              # Bind every symbol at load: the CLONE_VM spawn child must not
              # run the lazy binder (clone.c).
              "extra_link_args": ["-pthread", "-Wl,-z,now"]},
    "win32": {"extra_compile_args": ["/O2", "/W3"],
              # winsync.c: GetSecurityInfo, EqualSid, OpenProcessToken.
              "libraries": ["kernel32", "advapi32"]},
}


def host_platform() -> str:
    if sys.platform.startswith("linux"):
        return "linux"
    if sys.platform == "win32":
        return "win32"
    raise RuntimeError(f"contain builds on Linux and Windows only, not {sys.platform}")


def _check_every_module_is_listed() -> None:
    # A new NAME.c that no platform lists would be silently left out.
    # Names starting with "_" are generated (cffi's _ct.c): never sources.
    listed = {m for mods in MODULES.values() for m in mods}
    found = {p.stem for p in HERE.glob("*.c") if not p.name.startswith("_")}
    if found != listed:
        raise RuntimeError(f"launcher/_native: modules on disk {sorted(found)} != listed in MODULES {sorted(listed)}")


def make(platform: str) -> cffi.FFI:
    """The extension as built for `platform` ("linux" or "win32")."""
    _check_every_module_is_listed()
    mods = MODULES[platform]
    ffi = cffi.FFI()
    ffi.cdef("\n".join((HERE / f"{m}.cdef").read_text() for m in mods))
    ffi.set_source(
        "launcher._native._ct",
        "\n".join(f'#include "{m}.h"' for m in mods),
        # Relative paths: setuptools builds from the project root.
        sources=[os.path.relpath(HERE / f"{m}.c") for m in mods],
        include_dirs=[os.path.relpath(HERE)],
        **_COMPILE[platform],
    )
    return ffi


ffibuilder = make(host_platform())

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
