"""The public API is a list, decided on purpose (STYLE.md, "Layers")."""
from __future__ import annotations

import ast
import importlib
import os

import pytest

import launcher

PUBLIC = [
    "AccessDenied",
    "AsyncSupervisor",
    "AsyncWorker",
    "CancelRecord",
    "CompletedRun",
    "ContainmentUnavailable",
    "Effect",
    "LauncherError",
    "Outcome",
    "ProcessGone",
    "ProcessInfo",
    "RunConflict",
    "RunFailed",
    "RunNotFound",
    "RunTimedOut",
    "SpawnFailed",
    "State",
    "StopRecord",
    "Supervisor",
    "Unknown",
    "Unsupported",
    "Worker",
    "cancel",
    "capabilities",
    "open_worker",
    "run",
    "run_process",
    "scan_processes",
    "spawn",
]

# Named by the API but built on other branches (procscan, doctor): they must
# resolve as soon as their module exists, and are skipped until then.
PENDING_MODULES = {"._scan", "._doctor"}

HERE = os.path.dirname(os.path.abspath(launcher.__file__))


def _landed(mod: str) -> bool:
    # Look in this tree only: an editable install of another checkout can
    # make importlib find a module this tree does not have.
    return os.path.exists(os.path.join(HERE, mod.lstrip(".") + ".py"))


def test_public_names_are_pinned() -> None:
    assert launcher.__all__ == sorted(PUBLIC)
    assert sorted(launcher._EXPORTS) == sorted(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_name_resolves(name: str) -> None:
    mod = launcher._EXPORTS[name]
    if mod in PENDING_MODULES and not _landed(mod):
        pytest.skip(f"launcher{mod} is not on this branch yet")
    obj = getattr(launcher, name)
    assert obj is not None
    assert getattr(importlib.import_module(mod, "launcher"), name) is obj


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        launcher.no_such_thing  # noqa: B018


def test_init_only_reexports() -> None:
    """__init__.py holds imports, the export table and the lazy lookup: no
    code of its own that a refactor could break."""
    with open(os.path.join(HERE, "__init__.py")) as f:
        tree = ast.parse(f.read())
    # TYPE_CHECKING: a local flag instead of typing's, to keep `typing` off
    # the `contain run` import path; deleted once the imports below it ran.
    allowed_assign = {"__version__", "_EXPORTS", "__all__", "TYPE_CHECKING"}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue                                   # the docstring
        if isinstance(node, ast.Assign):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            assert names <= allowed_assign, names
            continue
        if isinstance(node, ast.Delete):
            assert [t.id for t in node.targets if isinstance(t, ast.Name)] == ["TYPE_CHECKING"]
            continue
        if isinstance(node, ast.If):                   # if TYPE_CHECKING: imports only
            assert all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body)
            continue
        if isinstance(node, ast.FunctionDef):
            assert node.name in ("__getattr__", "__dir__")
            continue
        raise AssertionError(f"unexpected statement in __init__.py: {ast.dump(node)[:80]}")


def test_type_checking_block_names_every_landed_export() -> None:
    """Type checkers see what users get: every export whose module exists is
    imported under TYPE_CHECKING."""
    with open(os.path.join(HERE, "__init__.py")) as f:
        tree = ast.parse(f.read())
    seen = set()
    for node in tree.body:
        if isinstance(node, ast.If):
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom):
                    seen.update(a.asname or a.name for a in imp.names)
    landed = {n for n, m in launcher._EXPORTS.items() if _landed(m)}
    assert landed <= seen, landed - seen


def test_py_typed_is_shipped() -> None:
    assert os.path.isfile(os.path.join(HERE, "py.typed"))


@pytest.mark.parametrize("name", ["State", "Outcome", "Effect"])
def test_public_enums_are_the_engines_names(name: str) -> None:
    """launcher.State/Outcome/Effect are StrEnums; the engine uses _state's
    str constants (no `enum` on the run path). Same members, same values,
    and a record's plain string equals its member."""
    import enum

    from launcher import _state

    public = getattr(launcher, name)
    assert issubclass(public, enum.StrEnum)
    assert {m.name: m.value for m in public} == _state.names(getattr(_state, name))
    for value in _state.names(getattr(_state, name)).values():
        assert public(value) == value
