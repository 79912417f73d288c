"""procscan.c under ThreadSanitizer and AddressSanitizer/UBSan.

The scan shares its work between threads that publish entries with
compare-and-swap and may outlive the call; these tests compile the C file
with a small driver (tests/native/procscan_stress.c) and run it while
processes come and go. Skipped where no compiler or sanitizer runtime is
installed.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NATIVE = ROOT / "launcher" / "_native"
DRIVER = ROOT / "tests" / "native" / "procscan_stress.c"
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None or not sys.platform.startswith("linux"), reason="needs a C compiler on Linux")


@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
def test_procscan_is_clean_under_sanitizer(sanitizer, tmp_path):
    exe = tmp_path / "stress"
    build = subprocess.run(
        [CC, "-g", "-O1", f"-fsanitize={sanitizer}", "-fno-sanitize-recover=all", "-pthread",
         f"-I{NATIVE}", str(DRIVER), str(NATIVE / "procscan.c"), "-o", str(exe)],
        capture_output=True, text=True,
    )
    if build.returncode != 0:
        pytest.skip(f"cannot build with -fsanitize={sanitizer}: {build.stderr.strip()[-300:]}")

    stop = threading.Event()

    def churn() -> None:  # exits during the scans, reaped by subprocess
        while not stop.is_set():
            subprocess.run(["true"], check=True)

    t = threading.Thread(target=churn)
    t.start()
    try:
        env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1", ASAN_OPTIONS="detect_leaks=0")
        r = subprocess.run([str(exe), "150"], capture_output=True, text=True, env=env, timeout=300)
    finally:
        stop.set()
        t.join(30)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    assert "Sanitizer" not in r.stderr, r.stderr[-3000:]
