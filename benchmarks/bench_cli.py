"""`contain run -- /bin/true`, whole process, against a plain Python
`subprocess.call(['/bin/true'])`, medians over alternating runs.

    python benchmarks/bench_cli.py [--repeats 40]

The `contain` command is made here as `pip install .` makes it: on POSIX
`bin/contain` with this interpreter written over its `#!python` (setup.py),
on Windows pip's console script. An installed `contain` on PATH is not
used: it may import another copy of `launcher`, or be a wrapper (a pyenv
shim is a bash script that costs more than the whole run). For reference,
pip's console-script wrapper is measured too, as this pip writes it (pip's
own template, read from pip) and as pip before 25.0 wrote it, with `import
re` (pip#13166; `re` and the `enum` it imports are 3-4 ms that the run path
itself never loads), and `python -m launcher`.
Every contender runs with the same environment (PYTHONPATH = this checkout).

Both sides are also measured under `python -S` (site-packages on PYTHONPATH
instead): a host's .pth hooks (an editable install's finder, a sandbox's CA
hook) import modules such as typing, re and pathlib into *every*
interpreter, which makes both sides slower by the same amount and the
ratio look better than on a plain install. The target is checked on the
installed `contain`; the -S pair shows what the hooks hide.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

TARGET = 1.2   # issue 27 (was 1.3, issue 2): contain run -- /bin/true at most 1.2x the plain call

# What pip before 25.0 (distlib's template) writes for a console script.
OLD_PIP_SCRIPT = """# -*- coding: utf-8 -*-
import re
import sys
from launcher._cli import console
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(console())
"""


def pip_script() -> str:
    """The body pip writes today, from pip itself (its PipScriptMaker
    overrides distlib's template); distlib's where this pip has no override."""
    try:
        from pip._internal.operations.install.wheel import PipScriptMaker

        return PipScriptMaker.script_template % {"module": "launcher._cli", "import_name": "console",
                                                 "func": "console"}
    except (ImportError, AttributeError, KeyError, TypeError):
        return OLD_PIP_SCRIPT


def installed_script() -> str:
    """The body of the `contain` that `pip install .` puts on PATH here."""
    if sys.platform == "win32":
        return pip_script()
    with open(os.path.join(C.ROOT, "bin", "contain")) as f:
        first, rest = f.read().split("\n", 1)
    assert first == "#!python", first
    return rest


def console_script(name: str = "contain", python: str | None = None, body: str | None = None) -> str:
    d = os.path.join(C.RESULTS, "bin")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, name)
    with open(path, "w") as f:
        f.write(f"#!{python or sys.executable}\n" + (body if body is not None else installed_script()))
    os.chmod(path, 0o755)
    return path


def _time(argv: list[str], env: dict[str, str]) -> float:
    """Wall time of one process, from posix_spawn to its reaping."""
    t0 = time.perf_counter()
    pid = os.posix_spawn(argv[0], argv, env)
    _, status = os.waitpid(pid, 0)
    dt = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{argv} exited {os.waitstatus_to_exitcode(status)}")
    return dt


def run(repeats: int = 40) -> dict[str, Any]:
    import sysconfig

    script = console_script()
    script_pip = console_script("contain-pip", body=pip_script())
    script_old = console_script("contain-oldpip", body=OLD_PIP_SCRIPT)
    script_s = console_script("contain-S", f"{sys.executable} -S")
    state = tempfile.mkdtemp(prefix="contain-bench-state-")
    env = C.child_env(CONTAIN_STATE_DIR=state)
    env_s = dict(env, PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], sysconfig.get_paths()["purelib"],
                                                  sysconfig.get_paths()["platlib"]]))
    py = sys.executable
    plain = "import subprocess; subprocess.call(['/bin/true'])"
    contenders = {
        "python -c pass (interpreter floor)": ([py, "-c", "pass"], env),
        "python -c subprocess.call(['/bin/true'])": ([py, "-c", plain], env),
        "contain run -- /bin/true (as pip installs it)": ([script, "run", "--", "/bin/true"], env),
        "python -m launcher run -- /bin/true": ([py, "-m", "launcher", "run", "--", "/bin/true"], env),
        "contain run -- /bin/true (pip's console-script wrapper)": ([script_pip, "run", "--", "/bin/true"], env),
        "contain run -- /bin/true (console script of pip < 25.0)": ([script_old, "run", "--", "/bin/true"], env),
        "python -S -c subprocess.call(['/bin/true'])": ([py, "-S", "-c", plain], env_s),
        "contain run -- /bin/true (as installed, python -S)": ([script_s, "run", "--", "/bin/true"], env_s),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    load = [C.loadavg()]
    try:
        for argv, e in contenders.values():      # warm the page cache once
            _time(argv, e)
        names = list(contenders)
        for i in range(repeats):
            for k in names[i % len(names):] + names[:i % len(names)]:
                times[k].append(_time(*contenders[k]))
        runs = os.listdir(os.path.join(state, "runs"))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    load.append(C.loadavg())
    s = {k: C.summary(v) for k, v in times.items()}
    base = s["python -c subprocess.call(['/bin/true'])"]
    which = shutil.which("contain")
    out = {
        "repeats": repeats,
        "medians": s,
        "ratio_console_script": C.ratio(s["contain run -- /bin/true (as pip installs it)"], base),
        "ratio_python_m": C.ratio(s["python -m launcher run -- /bin/true"], base),
        "ratio_pip_wrapper": C.ratio(s["contain run -- /bin/true (pip's console-script wrapper)"], base),
        "ratio_pip_wrapper_before_25": C.ratio(s["contain run -- /bin/true (console script of pip < 25.0)"], base),
        "pip_wrapper_imports_re": "import re" in pip_script(),
        "ratio_python_S": C.ratio(s["contain run -- /bin/true (as installed, python -S)"],
                                  s["python -S -c subprocess.call(['/bin/true'])"]),
        "overhead_ms_console_script": round(s["contain run -- /bin/true (as pip installs it)"]["median_ms"]
                                            - base["median_ms"], 3),
        "loadavg_start_end": load,
        "target": TARGET,
        "runs_recorded": len(runs),
        "console_script": script,
        "contain_on_path": which,
        "note": "state dir on " + C.fs_type(tempfile.gettempdir()),
    }
    out["target_met"] = out["ratio_console_script"] is not None and out["ratio_console_script"] <= TARGET
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=40)
    a = ap.parse_args()
    print("; ".join(C.ensure_ready()))
    r = run(a.repeats)
    for k, v in r["medians"].items():
        print(f"{k:<48} {v['median_ms']:8.2f} ms")
    print(f"ratio (installed contain) {r['ratio_console_script']}  target <= {TARGET}; "
          f"under python -S {r['ratio_python_S']}; load {r['loadavg_start_end']}")
    os.makedirs(C.RESULTS, exist_ok=True)
    with open(os.path.join(C.RESULTS, "cli.json"), "w") as f:
        json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
