"""contain on a Ray cluster (`pip install 'contain[ray]'`; docs/ray.md).

    import launcher.ray as cray
    cray.install()                 # a janitor on every node (detached actors), new nodes too
    @ray.remote
    def tool(argv):
        return cray.run(argv, grace=1.0)   # launcher.run's options, die_with_owner on: a dict with "node"
    cray.runs()                    # every node's runs, each naming its node

This is the only module of the package that imports `ray`, and nothing
else imports it: `import launcher` never loads Ray.

- `run` starts the command with `launcher.spawn` in the task's own process
  (the Ray worker is the run's owner) and waits in short slices, because
  `ray.cancel(ref)` raises KeyboardInterrupt in the task's thread without a
  signal (a blocking wait would never see it). On that interrupt (or
  TaskCancelledError, or any error) the run is cancelled with its grace
  (the intent is written first, as every cancel), waited to its final
  record, and the interrupt is re-raised: the task ends cancelled. A second
  interrupt skips the rest of the grace.
- `die_with_owner=True` by default: when the Ray worker dies (ray.cancel
  with force=True, ray.kill, Ray's OOM killer, `ray stop`), the kernel ends
  the tree, and the node's janitor writes the final record.
- `install()` places one detached actor per alive node
  (`contain-janitor-<node id>`, namespace "contain", num_cpus=0, pinned to
  its node) that runs `python -m launcher janitor` on that node's state
  directory and starts it again whenever it exits, and one detached watcher
  (`contain-janitor-watch`) that calls `install()` every WATCH_S seconds, so
  nodes that join later get their janitor too. Every call is idempotent
  (named actors, get_if_exists).
- State directory per node: the host's default (CONTAIN_STATE_DIR if set).
  Ray numbers the raylet sockets of the nodes one session starts on one
  host (`raylet`, `raylet.1`, ...): the first node uses the default, each
  further node on that host `<default>-ray-<first 16 hex of its node id>`,
  so that nodes sharing a host keep their runs apart (`node_state_dir`).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import deque
from functools import lru_cache
from typing import Any, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import launcher

from ._completed import decode, encode
from ._options import DEFAULT_GRACE
from ._statedir import location

NAMESPACE = "contain"
JANITOR_PREFIX = "contain-janitor-"
WATCHER = "contain-janitor-watch"
# How often the task's thread returns to the interpreter while it waits:
# ray.cancel's KeyboardInterrupt is seen within this.
SLICE_S = 0.1
# How often the watcher looks for nodes without a janitor.
WATCH_S = 10.0
# A janitor that exits is started again after RESTART_S, doubling up to
# RESTART_MAX_S while it keeps exiting within a minute.
RESTART_S = 1.0
RESTART_MAX_S = 60.0
# The host's default state directory's Ray-node siblings.
NODE_DIR_INFIX = "-ray-"


# -- where a node's runs live -------------------------------------------------------

def _this_node() -> str:
    return str(ray.get_runtime_context().get_node_id())


_SOCKETS: dict[str, str] = {}


def _raylet_socket(node_id: str) -> str:
    """The node's raylet socket path, as Ray fixed it when the node started
    (asked of the GCS once per process and node: ray.nodes() lists every
    node, too much to ask per task on a large cluster)."""
    known = _SOCKETS.get(node_id)
    if known is None:
        for n in ray.nodes():
            if n.get("NodeID") == node_id:
                known = _SOCKETS[node_id] = str(n.get("RayletSocketName") or "")
    if known is None:
        raise RuntimeError(f"Ray node {node_id} is not in ray.nodes(): its state directory cannot be told")
    return known


def node_state_dir(node_id: str | None = None, *, raylet_socket: str | None = None) -> str:
    """The state directory of the runs of Ray node `node_id` (this task's
    node by default): the host's default, unless the node is not the first
    node its Ray session started on this host (its raylet socket is not
    `raylet`), then `<default>-ray-<node id[:16]>`. The rule reads only
    what Ray fixed when the node started, so it never changes while the
    node lives, and run() and the node's janitor agree."""
    node_id = node_id or _this_node()
    if raylet_socket is None:
        raylet_socket = _raylet_socket(node_id)
    base = location()
    if os.path.basename(raylet_socket) in ("", "raylet"):
        return base
    return f"{base}{NODE_DIR_INFIX}{node_id[:16]}"


def _alive_nodes() -> list[dict[str, Any]]:
    return [dict(n) for n in ray.nodes() if n.get("Alive")]


# -- run ----------------------------------------------------------------------------------

def run(argv: Sequence[str], *, grace: float = DEFAULT_GRACE, timeout: float | None = None,
        die_with_owner: bool = True, stdin: Any = None, stdout: Any = None, stderr: Any = None,
        input: Any = None, capture_output: bool = False, check: bool = False, text: bool | None = None,
        encoding: str | None = None, errors: str | None = None, **options: Any) -> dict[str, Any]:
    """`launcher.run` inside a Ray task or actor: the stop record as a dict
    (`to_dict()`), with "node" (this node's id), "args", "returncode",
    "stdout" and "stderr" (as subprocess.run gives them; None when not
    captured). Options are launcher.run's; `die_with_owner` is on unless
    asked off; `state_dir` defaults to `node_state_dir()`. `check=True`
    raises launcher.RunFailed / RunTimedOut (each carrying the record).
    `ray.cancel` of the task stops the run with `grace`, then the task ends
    cancelled (the KeyboardInterrupt is re-raised once the stop is over)."""
    node = _this_node()
    options.setdefault("state_dir", node_state_dir(node))
    if die_with_owner:
        options["die_with_owner"] = True
    if capture_output:
        if stdout is not None or stderr is not None:
            raise ValueError("stdout and stderr arguments may not be used with capture_output")
        stdout = stderr = subprocess.PIPE
    if input is not None:
        if stdin is not None:
            raise ValueError("stdin and input arguments may not both be used")
        stdin = subprocess.PIPE
    text_mode = bool(text or encoding or errors)
    data = encode(input, text_mode, encoding, errors)
    piped = any(s == subprocess.PIPE for s in (stdin, stdout, stderr) if type(s) is int)
    out: Any = None
    err: Any = None
    w = launcher.spawn(argv, grace=grace, timeout=timeout, stdin=stdin, stdout=stdout, stderr=stderr, **options)
    try:
        if piped:
            out, err = _communicate(w, data)
        rec = _wait(w)
    except BaseException:
        # ray.cancel (KeyboardInterrupt in this thread, TaskCancelledError),
        # or anything else: the run is stopped with its grace before the
        # error goes on, so the task ends cancelled with the tree gone.
        _stop(w, grace)
        raise
    finally:
        w.close()
    if text_mode:
        out, err = decode(out, encoding, errors), decode(err, encoding, errors)
    done = launcher.CompletedRun(rec, list(argv), out, err)
    if check:
        if done.get("outcome") == "timed_out":
            raise launcher.RunTimedOut(done.args, timeout if timeout is not None else float("nan"), out, err, done)
        done.check_returncode()
    result = done.to_dict()
    result.update({"node": node, "args": list(argv), "returncode": done.returncode, "stdout": out, "stderr": err})
    return result


def _communicate(w: Any, data: bytes | None) -> tuple[Any, Any]:
    first = True
    while True:
        try:
            out, err = w.communicate(data if first else None, timeout=SLICE_S)
            return out, err
        except TimeoutError:
            first = False


def _wait(w: Any) -> Any:
    while True:
        try:
            return w.wait(SLICE_S)
        except TimeoutError:
            continue


def _stop(w: Any, grace: float) -> None:
    """Cancel with the grace (the intent is written before any signal), wait
    for the final record; one more interrupt skips the rest of the grace.
    A further one leaves this wait: the run's owner is this process's
    reactor, which goes on stopping it (and, with die_with_owner, the
    kernel ends the tree if this process dies)."""
    if w.done():
        return
    w.cancel(grace=grace)
    skipped = False
    while not w.done():
        try:
            _wait(w)
        except (KeyboardInterrupt, Exception) as e:
            if isinstance(e, TimeoutError):
                continue
            if skipped:
                raise
            skipped = True
            w.cancel(grace=0)


# -- the janitors --------------------------------------------------------------------

def _janitor_env(state_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env["CONTAIN_STATE_DIR"] = state_dir
    # The janitor imports the launcher this actor imported.
    here = os.path.dirname(os.path.dirname(os.path.abspath(launcher.__file__)))
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _parent_death_signal() -> Any:
    """A preexec_fn that asks the kernel to SIGTERM the janitor when the
    thread that started it (the actor's keeper thread) dies with the actor."""
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    return preexec


class Janitor:
    """One node's janitor: `python -m launcher janitor` on the node's state
    directory, started again whenever it exits."""

    def __init__(self, node_id: str, raylet_socket: str) -> None:
        self.node_id = node_id
        self.state_dir = node_state_dir(node_id, raylet_socket=raylet_socket)   # as this node's run() sees it
        self.started = 0
        self.exits: list[dict[str, Any]] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        threading.Thread(target=self.keep, name="contain-janitor-keeper", daemon=True).start()

    def keep(self) -> None:
        delay = RESTART_S
        preexec = _parent_death_signal()
        while True:
            began = time.monotonic()
            try:
                proc = subprocess.Popen([sys.executable, "-m", "launcher", "janitor"], env=_janitor_env(self.state_dir),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, preexec_fn=preexec)
            except OSError as e:
                code: int | None = None
                tail = f"could not start: {e}"
            else:
                with self.lock:
                    self.proc = proc
                    self.started += 1
                assert proc.stderr is not None
                lines: deque[bytes] = deque(maxlen=20)      # a janitor that runs for weeks: its last words only
                for line in proc.stderr:
                    lines.append(line)
                proc.stderr.close()
                code, tail = proc.wait(), b"".join(lines).decode(errors="replace")[-2000:]
            with self.lock:
                self.exits = (self.exits + [{"returncode": code, "stderr": tail,
                                             "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}])[-10:]
            delay = RESTART_S if time.monotonic() - began > 60 else min(delay * 2, RESTART_MAX_S)
            time.sleep(delay)

    def info(self) -> dict[str, Any]:
        with self.lock:
            proc = self.proc
            return {"node": self.node_id, "state_dir": self.state_dir, "actor_pid": os.getpid(),
                    "janitor_pid": proc.pid if proc is not None and proc.poll() is None else None,
                    "started": self.started, "exits": list(self.exits)}


class Watcher:
    """Gives every node that joins the cluster its janitor (install())."""

    def __init__(self) -> None:
        threading.Thread(target=self.watch, name="contain-janitor-watch", daemon=True).start()

    def watch(self) -> None:
        while True:
            time.sleep(WATCH_S)
            try:
                _place()
            except Exception:                 # a GCS hiccup: the next round tries again
                pass

    def ping(self) -> bool:
        return True


@lru_cache(maxsize=None)
def _actor_classes() -> tuple[Any, Any]:
    return ray.remote(Janitor), ray.remote(Watcher)


def _place() -> list[Any]:
    """A janitor actor on every alive node (get_if_exists: one per node
    whoever asks); their handles."""
    janitor, _ = _actor_classes()
    actors: list[Any] = []
    for n in _alive_nodes():
        node_id = str(n["NodeID"])
        actors.append(janitor.options(
            name=JANITOR_PREFIX + node_id, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_restarts=-1, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id, str(n.get("RayletSocketName") or "")))
    return actors


def install(*, watch: bool = True, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Idempotent: a janitor actor on every alive node that has none (and,
    with `watch`, the watcher that does this again every WATCH_S for nodes
    that join). Returns each node's janitor's info() (GetTimeoutError if
    they do not all answer within `timeout`)."""
    actors = _place()
    if watch:
        _, watcher = _actor_classes()
        watcher.options(name=WATCHER, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                        num_cpus=0, max_restarts=-1).remote()
    return list(ray.get([a.info.remote() for a in actors], timeout=timeout))


def janitors() -> list[Any]:
    """The janitor actors of the alive nodes that have one."""
    out = []
    for n in _alive_nodes():
        try:
            out.append(ray.get_actor(JANITOR_PREFIX + str(n["NodeID"]), namespace=NAMESPACE))
        except ValueError:
            pass
    return out


def uninstall() -> None:
    """Remove the watcher and every janitor actor (their janitors get
    SIGTERM from the kernel as the actors die)."""
    for name in [WATCHER] + [JANITOR_PREFIX + str(n["NodeID"]) for n in ray.nodes()]:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass


# -- reading runs cluster-wide ----------------------------------------------------------

def _node_runs(node_id: str, raylet_socket: str) -> list[dict[str, Any]]:
    import json

    state_dir = node_state_dir(node_id, raylet_socket=raylet_socket)
    proc = subprocess.run([sys.executable, "-m", "launcher", "ls", "--json"], env=_janitor_env(state_dir),
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    if proc.returncode != 0:
        return [{"node": node_id, "state_dir": state_dir, "error": proc.stderr.decode(errors="replace")[-2000:]}]
    rows = json.loads(proc.stdout or b"[]")
    for row in rows:
        row["node"] = node_id
        row["state_dir"] = state_dir
    return list(rows)


def runs() -> list[dict[str, Any]]:
    """Every alive node's runs (`contain ls --json` on that node, by a task
    pinned there): one dict per run, each with "node" and "state_dir". A
    node whose listing failed gives one dict with "error" instead."""
    remote = ray.remote(_node_runs)
    refs = [remote.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(str(n["NodeID"]), soft=False))
            .remote(str(n["NodeID"]), str(n.get("RayletSocketName") or ""))
            for n in _alive_nodes()]
    return [row for rows in ray.get(refs) for row in rows]
