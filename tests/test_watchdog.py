"""tests/_watchdog.py, the suite's guard against a test that blocks for
ever where pytest-timeout cannot reach it: driven here on a session of its
own whose tests block SIGALRM (so their timeout never fires), in this
process and in a forked child."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from _proc import holders, kill_holders, new_token

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_test_its_timeout_cannot_stop_is_dumped_and_killed_and_the_session_goes_on(tmp_path) -> None:
    token = new_token()
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {HERE!r})
        import _watchdog

        def pytest_configure(config):
            config.pluginmanager.register(_watchdog.Plugin(config), "contain-watchdog")

        def pytest_unconfigure(config):
            config.pluginmanager.get_plugin("contain-watchdog").close()
    """))
    (tmp_path / "test_stuck.py").write_text(textwrap.dedent("""
        import os, signal, subprocess, time
        import pytest

        @pytest.mark.timeout(1)
        def test_stuck_in_this_process():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            subprocess.Popen(["sleep", "1000"]).wait()
            raise AssertionError("its process was killed")

        @pytest.mark.forked
        @pytest.mark.timeout(1)
        def test_stuck_in_a_forked_child():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(1000)

        def test_after_them():
            pass
    """))
    env = dict(os.environ, CONTAIN_WATCHDOG_GRACE_S="2", CONTAIN_WATCHDOG_AFTER_KILL_S="5",
               CONTAIN_TEST_TOKEN=token)
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90)
    finally:
        left = holders(token)
        kill_holders(token)
    out = p.stdout + p.stderr
    assert "watchdog: test_stuck.py::test_stuck_in_this_process has run" in out, out
    assert "watchdog: test_stuck.py::test_stuck_in_a_forked_child has run" in out, out
    assert "in test_stuck_in_a_forked_child" in out, "no stack of the forked child"
    assert "wchan" in out and "sleep 1000" in out, out
    assert "2 failed, 1 passed" in p.stdout, out
    assert left == [], "a process of the stuck test outlived the watchdog"
