"""Which container a run gets, and what its worker is started with.

The platform is chosen here, once per run: a cgroup v2 subtree on Linux
(`_platform/linux.py`), a Job Object on Windows (`_platform/windows.py`), or
the honest degraded mode (`_platform/none.py`). Backend modules are imported
only when chosen, so nothing Linux-only loads on Windows and the run path
imports only what it uses.
"""
from __future__ import annotations

import os
import sys
TYPE_CHECKING = False   # not typing.TYPE_CHECKING: `typing` stays off the run path
if TYPE_CHECKING:
    from typing import Any

    from ._options import Options
    from ._platform.posix import SpawnRequest

from . import _nested, _tags
from ._errors import ContainmentUnavailable
from ._options import user_account
from ._policy import policy_env


def chosen_backend(opts: Options, env: Any = os.environ) -> str:
    """The backend asked for: the option, else CONTAIN_BACKEND (from the
    supervisor's own environment), else auto."""
    if opts.backend != "auto" or opts.backend_chosen:
        return opts.backend
    return policy_env("CONTAIN_BACKEND", env) or "auto"


# What only Linux has. On Windows the backends below would import Linux-only
# modules (fcntl, pwd, the clone3 spawn) and fail with a traceback after the
# run directory was claimed; they are refused first, with the reason.
_LINUX_BACKENDS = {
    "cgroup2": "a cgroup v2 leaf",
    "pidns": "a PID-namespace wall",
    "subreaper": "the subreaper wall, PR_SET_CHILD_SUBREAPER",
    "none": "the degraded mode: process groups and a /proc scan",
}


def refused_here(opts: Options, env: Any = os.environ) -> str | None:
    """Why these options cannot run on this platform, or None. Checked
    before the run's id is claimed (_launch.start), so nothing is made:
    on Windows a Linux-only backend (--backend, CONTAIN_BACKEND, the
    library's backend=), --user, --seal and passed descriptors."""
    if sys.platform != "win32":
        return None
    backend = chosen_backend(opts, env)
    if backend in _LINUX_BACKENDS:
        return (f"backend {backend!r} ({_LINUX_BACKENDS[backend]}) exists only on Linux; on Windows the "
                "container is a Job Object (backend 'job-object' or 'auto')")
    if backend not in ("auto", "job-object"):
        return f"unknown backend {backend!r} (auto or job-object on Windows)"
    if opts.user is not None:
        return "--user is not available on Windows (running the worker as another user needs a logon token)"
    if opts.seal:
        return ("--seal is not available for Job Objects: the worker runs as the supervisor's user "
                "(a seal needs a restricted token; see docs/windows.md)")
    if opts.pass_fds:
        return "pass_fds is not available on Windows (only the three standard handles reach the worker)"
    return None


def make_container(run_id: str, opts: Options, uid: str | None = None) -> Any:
    """The strongest container the options and the host allow (its cgroup
    named from the run uid, `uid`: _runcgroups.run_cgroup_name). Policy
    (CONTAIN_BACKEND, CONTAIN_CGROUP_BASE, the lead of a nested run) comes
    from the supervisor's own environment, never from the worker's `env=`:
    a job must not choose its own containment or join another run."""
    env = os.environ
    backend = chosen_backend(opts, env)
    if backend == "job-object" or (backend == "auto" and sys.platform == "win32"):
        if sys.platform != "win32":
            raise ContainmentUnavailable("Job Objects exist only on Windows")
        from ._platform import windows

        # A job's limits are written as it is made, while its handle can
        # still set them (winlimits.py); RunUsage records them.
        return windows.Container.create(run_id, getattr(opts, "limits", None), uid)
    weaker = None
    if backend in ("auto", "cgroup2"):
        from ._platform import linux

        parent = opts.parent_cgroup or inherited_parent(env)
        try:
            return linux.Container.create(run_id, env, parent_dir=parent, uid=uid)
        except ContainmentUnavailable as e:
            # A base the caller named is a choice, not a hint: when it cannot
            # be used the run fails (125) rather than run with less.
            if backend == "cgroup2" or (parent is None and policy_env("CONTAIN_CGROUP_BASE", env)):
                raise
            weaker = f"no cgroup container ({e.reason})"
    if backend in ("auto", "pidns") and opts.pidns is not False:
        # Without a cgroup of its own a caller can still have a container
        # that nothing can leave: the PID-namespace wall (pidns.py).
        from ._platform import pidns

        problem = pidns.available()
        if problem is None:
            c = pidns.Container(run_id)
            if weaker:
                c.weaker = (f"{weaker}: the PID-namespace wall alone (still REAPED when it empties; no "
                            "limits, and whole-tree CPU unknown: the init's rusage is only a lower bound)")
            return c
        if backend == "pidns":
            raise ContainmentUnavailable(f"PID-namespace wall unavailable: {problem}")
        weaker = f"{weaker or 'no cgroup container'}; no PID-namespace wall either ({problem})"
    elif backend == "pidns":
        raise ContainmentUnavailable("--backend pidns with --no-pidns: nothing left to contain the run")
    if backend in ("auto", "subreaper"):
        # No cgroup to write, no namespace to make (a default container):
        # the supervisor's own subtree still holds the tree while it lives.
        from ._platform import subreaper

        # Asked for by name, or allowed by subreaper=True (or PID 1): this
        # process becomes a child subreaper now, process-wide and for good.
        problem = (subreaper.available(opts) if backend == "auto" else None) or subreaper.become()
        if problem is None:
            held = subreaper.Container(run_id, uid, sole=opts.sole or opts.subreaper)
            if weaker:
                held.weaker = (f"{weaker}: the subreaper wall alone (the supervisor's subtree: still REAPED once no "
                            "child of the tree's is left; no limits, no cgroup accounting, and it ends with the "
                            "supervisor)")
            return held
        if backend == "subreaper":
            raise ContainmentUnavailable(f"subreaper wall unavailable: {problem}")
        weaker = f"{weaker or 'no cgroup container'}; no subreaper wall either ({problem})"
    if backend not in ("auto", "none"):
        raise ValueError(f"unknown backend {backend!r}")
    from ._platform import none

    degraded = none.Container(run_id)
    degraded.weaker = weaker      # auto got less than this host gives a root user: said on stderr
    return degraded


def inherited_parent(env: Any) -> str | None:
    """A run started from inside another run goes beside that run's worker
    (a nested run), so cancelling the lead stops it too."""
    d = policy_env(_nested.ENV_CGROUP, env)
    if d and os.path.isdir(d) and os.access(d, os.W_OK) and _in_cgroup2(str(d)):
        return str(d)
    return None


def _in_cgroup2(path: str) -> bool:
    """Whether `path` is below a cgroup2 mount (a worker's environment may
    name any directory: /etc made `contain run` die with a traceback)."""
    from ._platform.cgroups import hierarchies

    return any(path.startswith(h.mount.rstrip("/") + "/") for h in hierarchies())


class AttachResult:
    """What an adopter may act on, as verified (attach_container): the
    container (attached, proven removed, or not attached: `unattached` says
    why, and then nothing is signalled), the worker's identity and the seal
    as the run's tag vouches for them (None: the tag could not say), and
    notes for the record."""

    __slots__ = ("container", "unattached", "worker", "sealed", "run_uid", "notes")

    def __init__(self, container: Any, unattached: str | None = None) -> None:
        self.container, self.unattached = container, unattached
        self.worker: dict[str, Any] | None = None
        self.sealed: bool | None = None
        self.run_uid: str | None = None
        self.notes: list[str] = []


def _detached(path: Any, reason: str) -> AttachResult:
    from ._platform.cgattach import Detached

    return AttachResult(Detached(path if isinstance(path, str) else None, reason=reason), reason)


def trusted_facts(run_dir: str, info: dict[str, Any], *, acting: bool) -> tuple[dict[str, Any] | None, str]:
    """What the run's owner recorded for a later owner: the run directory's
    tag when there is one (_tags.py), else run.json. Returns (facts, where
    they came from); facts None means refused, the second item says why.
    `acting`: an adopter, for which a missing tag that this process could
    have written means the directory was not left as its owner described it."""
    tag = _tags.read(run_dir, _tags.RUN_TAG)
    if tag.value is not None:
        return tag.value, "tag"
    if acting and tag.supported and _tags.can_write(run_dir):
        return None, (f"the run directory carries no {_tags.prefix()}{_tags.RUN_TAG} tag, which its owner "
                      "writes before anything runs: run.json alone is not trusted with a stop")
    facts: dict[str, Any] = {"run_uid": info.get("run_uid"), "backend": info.get("backend"),
                             "cgroup": info.get("cgroup_identity"), "worker": info.get("worker"),
                             "pgid": info.get("pgid"), "boot_id": info.get("boot_id"), "wall": info.get("wall")}
    return facts, f"run.json (no tag: {tag.why})"


def check_cgroup(run_dir: str, run_id: str, info: dict[str, Any], *, acting: bool = False,
                 env: Any = None) -> Any:
    """Verify the cgroup a run directory names before reading or acting on
    it (cgattach.verify): returns a cgattach.CgroupCheck (`status` live,
    removed, refused or unseen). For `ls`/`status` live views pass
    acting=False, read `dir` (or through `fd`) only when `status == "live"`,
    and close() it."""
    from ._platform.cgattach import CgroupCheck, CgroupIdentity, verify
    from ._platform.cgroups import expected_base

    facts, source = trusted_facts(run_dir, info, acting=acting)
    if facts is None:
        return CgroupCheck("refused", reason=source)
    try:
        recorded = facts.get("cgroup")
        ident = CgroupIdentity(recorded if isinstance(recorded, dict) else {})
    except ValueError as e:
        return CgroupCheck("refused", reason=f"{source}: {e}")
    # An absent cgroup tag is a refusal wherever this process could read one:
    # an adopter that may write tags, a root reader (trusted.* reads need
    # CAP_SYS_ADMIN; without it they read as absent, xattr(7)).
    need_tag = _tags.can_write(run_dir) if acting else os.geteuid() == 0
    check = verify(ident, run_id=run_id, base=expected_base(env if env is not None else os.environ),
                   run_key=_tags.dir_key(run_dir), run_uid=facts.get("run_uid"), need_tag=need_tag)
    if source != "tag":
        check.notes.append(f"cgroup identity from {source}")
    return check


def attach_container(run_dir: str, run_id: str, info: dict[str, Any]) -> AttachResult:
    """The container of a run whose owner is gone, as its owner recorded it
    for a later owner (trusted_facts), re-verified: a cgroup only if it is
    the recorded one, below our base, tagged for this run; a degraded run's
    members only by pid and start time. run.json is compared, never obeyed."""
    if sys.platform == "win32":
        return _attach_job(run_id, info)
    facts, source = trusted_facts(run_dir, info, acting=True)
    if facts is None:
        return _detached(None, source)     # run.json's path is not even worth recording
    notes = [] if source == "tag" else [f"adoption facts from {source}"]
    if source == "tag":
        for key, recorded in (("run_uid", info.get("run_uid")), ("backend", info.get("backend")),
                              ("cgroup", info.get("cgroup_identity")), ("worker", info.get("worker"))):
            if key == "worker" and recorded is None:
                continue        # run.json is written before the spawn; the tag alone names the worker
            if key == "worker" and isinstance(recorded, dict) and isinstance(facts.get("worker"), dict):
                recorded = {k: recorded.get(k) for k in facts["worker"]}
            if recorded != facts.get(key):
                notes.append(f"run.json's {key} differs from what the owner tagged the run directory with: "
                             "run.json ignored")
    backend = facts.get("backend")
    if backend == "cgroup2":
        from ._platform import linux
        from ._platform.cgattach import Detached

        check = check_cgroup(run_dir, run_id, info, acting=True)
        notes += check.notes
        path = (facts.get("cgroup") or {}).get("cgroup") if isinstance(facts.get("cgroup"), dict) else None
        wall = facts.get("wall") if isinstance(facts.get("wall"), dict) else None
        if check.status == "live":
            cg = linux.Container.attach(check)
            if wall is not None:
                cg.adopt_wall(wall)
            res = AttachResult(cg)
        elif check.status == "removed":
            # A removed cgroup proves its own emptiness, not the wall's: a
            # root member can move the init itself out of it (it is pid 1
            # there). The wall is re-attached and observed on its own.
            d = Detached(path, removed=check.how)
            if wall is not None:
                d.adopt_wall(wall)
            res = AttachResult(d)
        else:
            res = _detached(path, f"cgroup {check.status}: {check.reason}")
    elif backend == "pidns":
        from ._platform import pidns

        res = AttachResult(pidns.Container.adopt(run_id, facts.get("wall")))
    elif backend in ("none", "subreaper"):
        from ._platform import none

        # The subreaper wall is its supervisor's subtree: it ends with it. An
        # adopter is no ancestor of the tree, so it has what degraded mode
        # has: the identities the owner persisted, re-read.
        c = none.Container.adopt(run_id, facts, _may_have_spawned(run_dir), run_dir)
        if backend == "subreaper":
            notes.append("adopted as degraded mode: the subreaper wall (the supervisor's subtree) ended with "
                         "its supervisor, so nothing proves the tree gone")
        if source == "tag":
            c.bind(_tags.RunTag(run_dir, facts))   # a later owner finds what this one found
        res = AttachResult(c, c.unknown)           # no member known: nothing to act on, UNCONFIRMED at once
        notes.append(c.adopted or "")
    else:
        return _detached(None, f"adopting a {backend!r} run is not supported here")
    res.notes = notes + res.notes
    w = facts.get("worker")
    res.worker = dict(w, boot_id=facts.get("boot_id")) if isinstance(w, dict) else None
    res.run_uid = facts.get("run_uid") if isinstance(facts.get("run_uid"), str) else None
    if source == "tag":
        res.sealed = facts.get("sealed") is True
    return res


def _may_have_spawned(run_dir: str) -> bool:
    """Whether a degraded run's owner may have cloned its worker: its
    journal has the line written just before the clone (or the one after
    it), or cannot be read whole. False only when it says the owner never
    got that far (killed while making the container or the fork ledger)."""
    from ._layout import RunDir
    from ._safefs import UnsafePath

    try:
        data = RunDir(run_dir).read_bytes("journal.ndjson", 1 << 16)
    except (OSError, UnsafePath):
        return True
    return data is None or b'"event":"spawning"' in data or b'"event":"spawned"' in data


def _attach_job(run_id: str, info: dict[str, Any]) -> AttachResult:
    """Windows: the job of a run whose owner is gone, opened by its name
    (winsync.job_name of the run uid; windows.Container.open). There are no
    tags on Windows: the run uid, the job's name and the worker's identity
    are run.json's, so what is opened is checked before it is acted on: the
    name must be the one the run uid gives, the worker, if it still runs
    (pid + creation time), must be in that job, and the limits guard is
    probed again on the opened handle (a job whose descriptor lets this
    user allow breakaway is never REAPED). No job of that name: no handle to
    it is left anywhere, so KILL_ON_JOB_CLOSE ended the tree when the last
    one closed (winhost.JobGone: EXITED, the emptiness not observed). A job
    made anonymous (before named jobs) cannot be opened: winhost.Orphaned,
    UNCONFIRMED with the reason."""
    from ._platform import winhost, winproc
    from ._platform.winsync import job_name

    backend = info.get("backend")
    path = info.get("cgroup") if isinstance(info.get("cgroup"), str) else None
    uid = info.get("run_uid") if isinstance(info.get("run_uid"), str) else None
    w = info.get("worker")
    notes = ["adoption facts from run.json (Windows keeps no tags)"]
    why: str | None = None
    container: Any = None
    if backend != "job-object":
        why = f"adopting a {backend!r} run is not supported on Windows"
    else:
        try:
            name = job_name(uid) if uid else None
        except ValueError:
            name = None
        if name is None or path != name:
            why = None if path is None or path.startswith("anonymous job") else \
                f"run.json names the job {str(path)[:100]!r}, not the one its run uid gives: not opened"
        else:
            try:
                from ._platform import windows

                container = windows.Container.open(run_id, name)
            except OSError as e:
                if getattr(e, "winerror", None) == 2:     # ERROR_FILE_NOT_FOUND, and only that
                    where, why = _job_namespace(name, info.get("job"))
                    if why is None:
                        container = winhost.JobGone(name, where)
                else:
                    why = f"the run's job {name} could not be opened: {e}"
    if container is not None and isinstance(w, dict):
        # The worker, if it still runs, is the witness that this is the run's job.
        try:
            h = winproc.open_identity(int(w.get("pid")), int(w.get("start_time")))  # type: ignore[arg-type]
        except (OSError, TypeError, ValueError):
            h = None
        if h is not None:
            winproc.close_handle(h)
        if h is not None and isinstance(container, winhost.JobGone):
            container = None
            why = (f"no job named {path} exists, yet the run's worker (pid {w.get('pid')}) still runs: "
                   "KILL_ON_JOB_CLOSE would have ended it, so run.json does not describe its job")
        elif h is not None:
            where = container.placed(int(w["pid"]))
            if where != container.path:
                container.remove()
                container = None
                why = (f"the job named {path} does not hold the run's worker (IsProcessInJob: {where}): "
                       "not the run's job, not acted on")
            else:
                container.verified = True
                notes.append(f"the worker (pid {w['pid']}) is in the job opened by name: it is the run's job")
    if container is not None and not isinstance(container, winhost.JobGone) and not container.verified:
        # Nothing but run.json says this job is the run's, and a same-user
        # worker can rewrite run.json to name an empty job of its own: the
        # job observed empty then proves nothing about the tree (EXITED).
        container.unverified = ("the job opened by name is the run's only by run.json's word: its worker was "
                                "gone when the adopter came, so nothing witnessed that this job holds the run, "
                                "and a same-user worker can rewrite run.json")
    if container is None:
        res = AttachResult(winhost.Orphaned(path, why), why or "its Job Object is gone with its owner")
    else:
        res = AttachResult(container)
    res.notes = notes
    res.worker = dict(w, boot_id=info.get("boot_id")) if isinstance(w, dict) else None
    res.run_uid = uid
    return res


def _job_namespace(name: str, job: Any) -> tuple[str | None, str | None]:
    """OpenJobObjectW found no job named `name` (ERROR_FILE_NOT_FOUND). That
    says no handle to it is left only if the name was looked up where the
    owner made it: `Local\\` is per session, and an AppContainer's is a
    directory of its own, so from elsewhere a live, held job reads as
    missing. Returns (where the lookup was made, for the record; why the
    absence proves nothing, or None). A run whose owner recorded no
    namespace (run.json `job`, from before it was recorded) is read as
    before, and the record says the namespace was not checked."""
    from ._platform.winsync import in_app_container, local_directory, session_id

    if not isinstance(job, dict) or job.get("name") != name or type(job.get("session")) is not int:
        return "(the session it was made in is not recorded, so not compared)", None
    rec: int = job["session"]
    try:
        here, boxed = session_id(), in_app_container()
    except OSError as e:
        return None, f"this process's session could not be read ({e}): its lookup of {name} proves nothing"
    if here is None:
        return None, f"this process's session could not be read: its lookup of {name} proves nothing"
    if here != rec:
        return None, (f"the job was made in session {rec} and looked up from session {here}: `Local\\` names are "
                      f"per session, so a job of that name held in session {rec} cannot be seen from here; run "
                      f"`contain cancel` in session {rec}")
    if boxed is not False:
        return None, ("this process is in an AppContainer (or its token could not say): its `Local\\` is not the "
                      f"session's, so its lookup of {name} proves nothing")
    directory = local_directory(rec)
    if job.get("directory") != directory:
        return None, (f"the job's name was made in {str(job.get('directory'))[:120]!r}, not in session {rec}'s "
                      f"{directory}, where this process looks names up: its lookup proves nothing")
    return f"in session {rec} ({directory}), where it was made", None


def spawn_request(argv: list[str], opts: Options, container: Any, run_id: str,
                  run_dir: str | None) -> SpawnRequest:
    """What the worker is started with: the caller's environment plus the
    variables a nested run needs, credentials, and the container's own
    preparation (the seal)."""
    env = dict(opts.env if opts.env is not None else os.environ)
    if container.backend == "cgroup2":
        env[_nested.ENV_CGROUP] = container.dir
    env["CONTAIN_RUN_ID"] = run_id
    if run_dir is not None:
        env[_nested.ENV_DIR] = run_dir
    if container.backend == "job-object":
        from ._platform import winproc

        wreq = winproc.Request(argv, env=env, cwd=opts.cwd, stdio=opts.stdio, pass_fds=opts.pass_fds)
        container.prepare(wreq, opts)         # refuses --user and --seal
        return wreq                            # type: ignore[return-value]
    from ._platform import posix

    uid = gid = -1
    groups: list[int] = []
    if opts.user is not None:
        uid, gid, groups, names = user_account(opts.user)
        for k, v in names.items():
            # The account's own, as su(1) gives them; an explicit env= of a
            # library caller that names one keeps it.
            if opts.env is None or k not in opts.env:
                if v is None:
                    env.pop(k, None)
                else:
                    env[k] = v
    req = posix.SpawnRequest(argv, env=env, cwd=opts.cwd, stdio=opts.stdio, new_pgroup=opts.new_pgroup,
                             uid=uid, gid=gid, groups=groups, pass_fds=opts.pass_fds)
    container.prepare(req, opts)
    if opts.die_with_owner:
        _die_with_owner(req, container)
    if run_dir is not None and req.mount_proc and getattr(container, "hides_state_dir", False):
        # <state>/runs/<id>: the whole state directory, every run of the user's.
        req.hide = os.path.dirname(os.path.dirname(run_dir))
        from ._platform.pidns import replaceable_link

        problem = replaceable_link(req.hide)
        if problem:
            raise ContainmentUnavailable(f"state directory {req.hide}: {problem}")
    return req


def _die_with_owner(req: SpawnRequest, container: Any) -> None:
    """die_with_owner: the wall's init is given this process's pidfd and
    exits when it polls readable, and the kernel then kills every member of
    its namespace (init.c). Without the wall nothing the kernel enforces
    ends the tree with its owner (PR_SET_PDEATHSIG fires on the death of
    the spawning thread, not the process, and reaches only the worker, not
    what it forks or a setsid grandchild), so the run is refused rather
    than promised."""
    if not req.pidns:
        raise ContainmentUnavailable(
            f"--die-with-owner needs the PID-namespace wall, which the {container.backend} backend here does "
            "not have (--no-pidns, or a backend without it): nothing would end the tree when its owner dies")
    from ._platform.wall import owner_pidfd

    try:
        req.owner_pidfd = owner_pidfd()
    except OSError as e:
        raise ContainmentUnavailable(f"--die-with-owner: pidfd_open of this process failed: {e}") from e
