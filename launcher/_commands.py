"""Commands other than `run`: `cmd_<name>(args) -> exit status`."""
from __future__ import annotations

import argparse
import json
import sys


def cmd_doctor(args: argparse.Namespace) -> int:
    """What this host can contain, and how strongly. Exit 1 when no kernel
    container can be made (only degraded mode is left)."""
    from ._doctor import capabilities, render

    caps = capabilities()
    if args.json:
        sys.stdout.write(json.dumps(caps, indent=2) + "\n")
    else:
        sys.stdout.write(render(caps))
    return 0 if caps.get("containment_possible") else 1
