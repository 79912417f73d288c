"""The library keeps `subprocess`'s manners where they mean the same thing
(CONTRACT.md, "Library"): `run(check=, capture_output=, text=, input=)`
with `returncode`, `stdout`, `stderr` beside the stop record; `check=True`
raises a `CalledProcessError` (a timeout: a `TimeoutExpired`) carrying the
record; a missing program is a `SpawnFailed` that is an `OSError` with its
errno; `Worker.poll()`, `.returncode`, `.send_signal()`, `.terminate()`,
`.kill()`. Real runs; survivors by our own /proc scan. Before, none of
these existed (run() refused PIPE, Worker had no poll, SpawnFailed was no
OSError)."""
from __future__ import annotations

import errno
import pickle
import signal
import subprocess
import time

import anyio
import pytest

import launcher
from _proc import wait_gone


def test_run_captures_output_as_subprocess_run_does(cgroup_base, state_dir, env, token):
    rec = launcher.run(["sh", "-c", "printf 'out\\r\\n'; printf err >&2; exit 3"], capture_output=True, env=env)
    assert isinstance(rec, launcher.StopRecord) and isinstance(rec, launcher.CompletedRun)
    assert rec.returncode == 3 and rec.exit_code == 3 and rec.state == "REAPED"
    assert rec.stdout == b"out\r\n" and rec.stderr == b"err"
    assert rec.args == ["sh", "-c", "printf 'out\\r\\n'; printf err >&2; exit 3"]
    assert "stdout" not in rec.to_dict()                    # the record is the record
    text = launcher.run(["sh", "-c", "cat; printf 'a\\r\\nb'"], input="héllo\n", capture_output=True,
                        text=True, encoding="utf-8", env=env)
    assert text.stdout == "héllo\na\nb" and text.stderr == "" and text.returncode == 0
    raw = launcher.run(["cat"], input=b"\x00\xff", stdout=subprocess.PIPE, env=env)
    assert raw.stdout == b"\x00\xff" and raw.stderr is None
    assert wait_gone(token, 10) == []


def test_returncode_is_negative_for_a_signal(cgroup_base, state_dir, env):
    rec = launcher.run(["sh", "-c", "kill -9 $$"], env=env)
    assert rec.returncode == -9 and rec.signal == 9


def test_check_raises_called_process_error_carrying_the_record(cgroup_base, state_dir, env):
    with pytest.raises(subprocess.CalledProcessError) as e:
        launcher.run(["sh", "-c", "echo no >&2; exit 4"], check=True, capture_output=True, env=env)
    assert isinstance(e.value, launcher.RunFailed) and isinstance(e.value, launcher.LauncherError)
    assert e.value.returncode == 4 and e.value.stderr == b"no\n"
    assert e.value.record.state == "REAPED" and e.value.record.exit_code == 4
    assert launcher.run(["true"], check=True, env=env).returncode == 0
    again = pickle.loads(pickle.dumps(e.value))              # crosses processes (Ray) intact
    assert again.returncode == 4 and again.record.exit_code == 4


def test_check_raises_timeout_expired_on_the_runs_timeout(cgroup_base, state_dir, env, token):
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as e:
        launcher.run(["sh", "-c", "echo started; sleep 300"], timeout=0.5, grace=0.2, check=True,
                     capture_output=True, text=True, env=env)
    assert time.monotonic() - t0 < 60
    assert isinstance(e.value, launcher.RunTimedOut) and e.value.timeout == 0.5
    assert e.value.record.outcome == "timed_out" and e.value.record.state == "REAPED"
    assert e.value.stdout == "started\n"
    assert wait_gone(token, 10) == []
    rec = launcher.run(["sleep", "300"], timeout=0.3, grace=0.2, env=env)   # without check: the record, as before
    assert rec.outcome == "timed_out"


def test_a_missing_program_is_an_oserror_with_its_errno(cgroup_base, state_dir, env):
    with pytest.raises(OSError) as e:
        launcher.run(["/nonexistent/program"], env=env)
    assert isinstance(e.value, launcher.SpawnFailed) and e.value.errno == errno.ENOENT
    assert e.value.filename and "nonexistent" in str(e.value) and "[Errno" not in str(e.value)
    assert pickle.loads(pickle.dumps(e.value)).errno == errno.ENOENT


def test_worker_poll_returncode_terminate_kill_send_signal(cgroup_base, state_dir, env, token):
    w = launcher.spawn(["sh", "-c", "trap 'exit 42' USR1; sleep 300 & wait"], env=env, grace=0.3)
    try:
        assert w.poll() is None and w.returncode is None
        time.sleep(0.3)
        w.send_signal(signal.SIGUSR1)
        rec = w.wait(30)
        assert w.poll() == 42 and w.returncode == 42 and rec.returncode == 42
        assert rec.state == "REAPED"                       # the sleep it left is stopped with the tree
    finally:
        w.stop(grace=0)
    for stop, want in ((launcher.Worker.terminate, -signal.SIGTERM), (launcher.Worker.kill, -signal.SIGKILL)):
        w = launcher.spawn(["sleep", "300"], env=env, grace=0.3)
        try:
            stop(w)
            w.wait(30)
            assert w.returncode == want, (stop, w.record().to_dict())
            w.kill()                                          # after the end: nothing, as Popen
        finally:
            w.stop(grace=0)
    assert wait_gone(token, 10) == []


def test_capture_output_refuses_stdout_as_subprocess_does(state_dir):
    with pytest.raises(ValueError, match="capture_output"):
        launcher.run(["true"], capture_output=True, stdout=subprocess.DEVNULL)
    with pytest.raises(ValueError, match="input"):
        launcher.run(["true"], input=b"x", stdin=subprocess.DEVNULL)


@pytest.mark.anyio
async def test_async_worker_has_popens_manners_too(cgroup_base, state_dir, env, token, anyio_backend):
    """As anyio's Process: `args`, `returncode`, `poll()`, `send_signal()`,
    `terminate()`, `kill()`. Before, an AsyncWorker had none of them."""
    argv = ["sh", "-c", "trap 'exit 42' USR1; sleep 300 & wait"]
    async with launcher.open_worker(argv, env=env, grace=0.3) as w:
        assert w.args == argv and w.poll() is None and w.returncode is None
        await anyio.sleep(0.3)
        w.send_signal(signal.SIGUSR1)
        rec = await w.wait()
        assert w.poll() == 42 and w.returncode == 42 and rec.state == "REAPED"
    for how, want in (("terminate", -signal.SIGTERM), ("kill", -signal.SIGKILL)):
        async with launcher.AsyncSupervisor(env=env, grace=0.3) as sup:
            w = await sup.spawn(["sleep", "300"])
            getattr(w, how)()
            await w.wait()
            assert w.returncode == want, (how, w.record().to_dict())
            w.kill()                                          # after the end: nothing, as Popen
    assert wait_gone(token, 10) == []


def test_an_unknown_keyword_names_the_function_called(state_dir):
    """Before: "Options.__init__() got an unexpected keyword argument", a
    private class the caller never named."""
    with pytest.raises(TypeError, match=r"^launcher\.run\(\) got an unexpected keyword argument 'shell'"):
        launcher.run(["true"], shell=True)
    with pytest.raises(TypeError, match=r"^launcher\.spawn\(\) got an unexpected keyword argument 'bufsize'"):
        launcher.spawn(["true"], bufsize=1)
    with launcher.Supervisor() as sup:
        with pytest.raises(TypeError, match=r"^launcher\.Supervisor\.spawn\(\) got an unexpected keyword"):
            sup.spawn(["true"], shell=True)


def test_records_have_a_short_repr_and_their_fields_in_dir(cgroup_base, state_dir, env):
    """Before: repr of a record was its whole JSON (about 9 KB) and dir()
    showed none of its fields."""
    w = launcher.spawn(["sh", "-c", "exit 3"], env=env)
    rec = w.wait(30)
    assert len(repr(rec)) < 200 and "state='REAPED'" in repr(rec) and "exit_code=3" in repr(rec)
    for field in ("state", "outcome", "exit_code", "evidence", "timings", "run_id"):
        assert field in dir(rec)
    w2 = launcher.spawn(["sleep", "300"], env=env, grace=0.3)
    ack = w2.cancel()
    assert len(repr(ack)) < 200 and "effect=" in repr(ack)
    w2.wait(30)


def _same_script(run, popen) -> list:
    """One small script, written once against subprocess's names; run with
    subprocess itself and with launcher, the results must be the same."""
    out: list = []
    r = run(["sh", "-c", "cat; echo err >&2; exit 3"], input="hi\n", capture_output=True, text=True)
    out.append(("run", r.returncode, r.stdout, r.stderr))
    r = run(["sh", "-c", "printf '\\x00\\xff'"], capture_output=True)
    out.append(("bytes", r.returncode, r.stdout, r.stderr))
    try:
        run(["sh", "-c", "echo no >&2; exit 4"], check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        out.append(("check", e.returncode, e.stderr))
    try:
        run(["sleep", "30"], timeout=0.5, check=True)
    except subprocess.TimeoutExpired as e:
        out.append(("timeout", round(e.timeout, 1)))
    try:
        run(["/nonexistent/program"])
    except OSError as e:
        out.append(("missing", e.errno))
    p = popen(["sh", "-c", "trap 'exit 42' USR1; while :; do sleep 0.05; done"])
    out.append(("poll", p.poll()))
    time.sleep(0.3)
    p.send_signal(signal.SIGUSR1)
    p.wait(30)
    out.append(("signalled", p.returncode, p.poll()))
    p = popen(["sleep", "30"])
    p.terminate()
    p.wait(30)
    out.append(("terminate", p.returncode))
    return out


def test_the_same_script_against_subprocess_and_launcher(cgroup_base, state_dir, env, token):
    """The issue's compatibility check: what a subprocess user writes works
    unchanged with launcher and gives the same results."""
    want = _same_script(subprocess.run, subprocess.Popen)
    got = _same_script(lambda a, **k: launcher.run(a, env=env, grace=0.3, **k),
                       lambda a: launcher.spawn(a, env=env, grace=0.3))
    assert got == want
    assert wait_gone(token, 10) == []


@pytest.mark.anyio
async def test_run_process_has_anyios_names_and_defaults(cgroup_base, state_dir, env, token, anyio_backend):
    """`await launcher.run_process(...)` as `anyio.run_process`: input,
    captured stdout/stderr, check=True by default; a cancelled caller stops
    the whole tree. Before, the async API had no such call."""
    r = await launcher.run_process(["sh", "-c", "cat; echo e >&2"], input=b"hi", env=env)
    assert (r.returncode, r.stdout, r.stderr, r.state) == (0, b"hi", b"e\n", "REAPED")
    with pytest.raises(subprocess.CalledProcessError) as ei:
        await launcher.run_process(["sh", "-c", "exit 3"], env=env)
    assert ei.value.returncode == 3 and ei.value.record.state == "REAPED"
    r = await launcher.run_process(["sh", "-c", "exit 3"], check=False, stdout=None, env=env)
    assert r.returncode == 3 and r.stdout is None
    with anyio.move_on_after(1.0):
        await launcher.run_process(["sh", "-c", "setsid sleep 300 & sleep 300"], env=env, grace=0.3)
    assert wait_gone(token, 20) == []
