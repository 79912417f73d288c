"""Build the `launcher._native._ct` extension (cffi API mode).

Every `NAME.c` in this folder is compiled into the one extension; its
declarations for Python live beside it in `NAME.cdef` (cffi's parser takes no
preprocessor lines) and its C prototypes in `NAME.h`. Adding a module means
adding those three files: this builder never needs editing.
"""
import os
import pathlib

import cffi

HERE = pathlib.Path(__file__).resolve().parent


def _ours(pattern: str) -> list[pathlib.Path]:
    # Names starting with "_" are generated (cffi writes _ct.c here when
    # this file is run as a script): never sources.
    return sorted(p for p in HERE.glob(pattern) if not p.name.startswith("_"))


ffibuilder = cffi.FFI()
ffibuilder.cdef("\n".join(p.read_text() for p in _ours("*.cdef")))
ffibuilder.set_source(
    "launcher._native._ct",
    "\n".join(f'#include "{p.name}"' for p in _ours("*.h")),
    # Relative paths: setuptools builds from the project root.
    sources=[os.path.relpath(p) for p in _ours("*.c")],
    include_dirs=[os.path.relpath(HERE)],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    # procscan.c reads /proc with a few threads.
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
