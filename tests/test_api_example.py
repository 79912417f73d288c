"""The worked example in docs/api.md runs, unchanged, and prints what the
document says it prints."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import children_of, pids_with_token

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "api.md")


def _blocks(marker: str) -> tuple[str, str]:
    """The python block after `<!-- test: marker -->`, and the plain block
    after it (the expected output)."""
    with open(DOC) as f:
        text = f.read()
    at = text.index(f"<!-- test: {marker} -->")
    code = re.search(r"```python\n(.*?)```", text[at:], re.S)
    assert code is not None
    rest = text[at + code.end():]
    out = re.search(r"```\n(.*?)```", rest, re.S)
    assert out is not None
    return code.group(1), out.group(1)


def test_agent_runtime_example(contained: dict, tmp_path: os.PathLike) -> None:
    code, expected = _blocks("agent-runtime")
    script = os.path.join(tmp_path, "agent_runtime.py")
    with open(script, "w") as f:
        f.write(code)
    p = subprocess.run([sys.executable, script], env=contained["env"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout == expected
    assert pids_with_token(contained["token"]) == []
    assert children_of(os.getpid()) == []
    # The acknowledgement is in the layout, where any later reader finds it.
    ack = os.path.join(contained["state_dir"], "runs", "agent-crawl", "cancellations",
                       "runtime-7f3a-cancel-crawl.json")
    assert os.path.exists(ack)
