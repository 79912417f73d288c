"""`contain run`'s start-up stays off the heavy stdlib modules.

The CLI target (issue 11: `contain run -- /bin/true` within 1.3x a plain
`subprocess.call`) leaves about 6 ms for everything `contain` adds to a
bare interpreter; `re`, `enum`, `json`, `collections`, `functools`,
`typing` and the stdlib `signal` wrapper would take all of it
(docs/performance.md). A real run, in a fresh interpreter, must not load
any of them beyond what that interpreter loads for `pass` (a host's .pth
hooks may import some into every interpreter: those are not ours).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

HEAVY = {"re", "enum", "json", "collections", "functools", "typing", "signal", "subprocess", "threading",
         "dataclasses", "inspect", "ast", "tokenize", "pathlib", "tempfile", "random", "hashlib", "shutil"}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import os, sys
import launcher._cli
sys.argv = ["contain", "run", "--", "/bin/true"]
rc = launcher._cli.main()
os.write(int(os.environ["PROBE_FD"]), repr((rc, sorted(sys.modules))).encode())
"""


def _modules(code: str, env: dict[str, str]) -> tuple[object, set[str]]:
    r, w = os.pipe()
    try:
        p = subprocess.run([sys.executable, "-c", code], env=dict(env, PROBE_FD=str(w)), pass_fds=(w,), timeout=60,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(w)
        w = -1
        with os.fdopen(r, "rb") as f:
            r = -1
            data = f.read()
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    import ast as _ast      # the test's own process: not the one measured

    rc, mods = _ast.literal_eval(data.decode())
    return rc, set(mods)


def test_a_plain_run_imports_none_of_the_heavy_modules():
    state = tempfile.mkdtemp(prefix="contain-startup-")
    try:
        env = dict(os.environ, PYTHONPATH=ROOT, CONTAIN_STATE_DIR=state)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        _, floor = _modules("import os, sys; os.write(int(os.environ['PROBE_FD']), repr((0, sorted(sys.modules))).encode())", env)
        rc, loaded = _modules(PROBE, env)
        assert rc == 0
        added = (loaded - floor) & HEAVY
        assert not added, f"`contain run` imported {sorted(added)} (see docs/performance.md, 'Start-up')"
        # It did run: the record is there and says the worker exited 0.
        runs = [n for n in os.listdir(os.path.join(state, "runs")) if not n.startswith(".")]
        assert len(runs) == 1
        with open(os.path.join(state, "runs", runs[0], "record.json")) as f:
            rec = json.load(f)
        assert rec["exit_code"] == 0 and rec["state"] in ("REAPED", "EXITED")
    finally:
        subprocess.run([sys.executable, "-m", "launcher", "gc", "--keep", "0"],
                       env=dict(os.environ, PYTHONPATH=ROOT, CONTAIN_STATE_DIR=state),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        shutil.rmtree(state, ignore_errors=True)
