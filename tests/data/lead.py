"""A lead worker that starts nested runs, through the library and through
`contain run` (as `python -m launcher run`), one of them nested two deep.

    python lead.py PREFIX SECONDS

Each nested workload sleeps SECONDS; the lead waits for all of them and
exits 0."""
import subprocess
import sys

import launcher

prefix, secs = sys.argv[1], sys.argv[2]
cli = [sys.executable, "-m", "launcher", "run", "--grace", "1"]
lib = launcher.spawn(["sleep", secs], id=f"{prefix}-lib")
procs = [
    subprocess.Popen(cli + ["--id", f"{prefix}-cli", "--", "sleep", secs]),
    subprocess.Popen(cli + ["--id", f"{prefix}-deep", "--"] + cli + ["--id", f"{prefix}-deeper", "--", "sleep", secs]),
]
lib.wait()
sys.exit(max(p.wait() for p in procs))
