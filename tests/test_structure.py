"""The shape of the code, pinned the way test_exports.py pins the API:
each room keeps its private names to itself, no import cycle hides inside a
function, and the seal checks every module the package imports (STYLE.md,
"Rooms"). Rooms have no line budget, neither a file nor the run's driver:
the caps this file once enforced (450 lines a file, 300 for the Run class)
split rooms by count, not by concern (issue 28)."""
from __future__ import annotations

import ast
import os
import pathlib

import launcher

PKG = pathlib.Path(launcher.__file__).resolve().parent


def _modules() -> dict[str, ast.Module]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        out[name] = ast.parse(p.read_text(), str(p))
    return out


MODULES = _modules()


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names."""
    if node.level == 0:
        return node.module or ""
    pkg = mod.split(".")
    is_pkg = (PKG.parent / pathlib.Path(*pkg) / "__init__.py").exists()
    base = pkg if is_pkg else pkg[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_blocks(tree: ast.Module) -> set[int]:
    """Line numbers inside `if TYPE_CHECKING:` blocks (annotations only)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for sub in node.body:
                for n in ast.walk(sub):
                    if hasattr(n, "lineno"):
                        lines.add(n.lineno)
    return lines


def _imports(mod: str, tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """(imported launcher module, node) for every runtime import in `mod`,
    function-local ones included."""
    skip = _type_checking_blocks(tree)
    found = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            target = _resolve(mod, node)
            if target.startswith("launcher"):
                found.append((target, node))
                for alias in node.names:      # `from . import _state` imports a module
                    sub = f"{target}.{alias.name}"
                    if sub in MODULES:
                        found.append((sub, node))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("launcher"):
                    found.append((alias.name, node))
    return [(t, n) for t, n in found if t in MODULES]


def test_no_module_imports_another_modules_private_names() -> None:
    bad = []
    for mod, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _resolve(mod, node).startswith("launcher"):
                for alias in node.names:
                    target = f"{_resolve(mod, node)}.{alias.name}"
                    if alias.name.startswith("_") and not alias.name.startswith("__") and target not in MODULES:
                        bad.append(f"{mod}:{node.lineno} imports {alias.name} from {_resolve(mod, node)}")
    assert not bad, "\n".join(bad)


def _private_names(tree: ast.Module) -> set[str]:
    """Underscore names a module defines: functions, classes, methods,
    attributes assigned anywhere in it, and module-level names."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_"):
            names.add(node.value)      # __slots__ entries
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_uses_another_modules_private_attributes() -> None:
    """`x._name` where `_name` belongs to another room: what a room needs
    from another becomes a public method of the room that owns it."""
    own = {mod: _private_names(tree) for mod, tree in MODULES.items()}
    bad = []
    for mod, tree in MODULES.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in own[mod]:
                continue
            owners = [m for m, names in own.items() if node.attr in names]
            if owners:
                bad.append(f"{mod}:{node.lineno} uses {node.attr} of {', '.join(owners)}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_even_inside_functions() -> None:
    graph = {mod: {t for t, _ in _imports(mod, tree) if t != mod} for mod, tree in MODULES.items()}
    # A package's __init__ is imported by its submodules' imports; the
    # package itself is a namespace, not a room.
    for mod in graph:
        graph[mod] = {t for t in graph[mod] if t != "launcher" and not mod.startswith(t + ".")}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_checks_see_what_they_claim_to() -> None:
    """The checks above are not vacuous: they find the modules, the driver's
    imports and the private names they are meant to police."""
    assert {"launcher._run", "launcher._stop", "launcher._inbox", "launcher._adopt"} <= set(MODULES)
    run_imports = {t for t, _ in _imports("launcher._run", MODULES["launcher._run"])}
    assert "launcher._stop" in run_imports and "launcher._state" in run_imports
    assert "_cancel_grace" in _private_names(MODULES["launcher._run"])
    assert os.path.basename(str(PKG)) == "launcher"


# Modules only users import (launcher.ray: `ray` is loaded by its import, so
# listing ray in LATER_IMPORTS would only make every sealed spawn of a process
# without Ray walk Ray's 6,000 files).
USER_ONLY_MODULES = {"launcher.ray"}


def test_user_only_modules_are_imported_by_no_module_of_the_package() -> None:
    importers = [(mod, target) for mod, tree in MODULES.items() for target, _ in _imports(mod, tree)
                 if target in USER_ONLY_MODULES and mod != target]
    assert not importers, importers
    assert USER_ONLY_MODULES <= set(MODULES)


def test_the_seal_checks_every_module_the_package_imports_outside_itself() -> None:
    """The seal checks the files of every module the supervisor may still
    import after the spawn (_platform/sealing.LATER_IMPORTS): each module
    outside the package that the package names in an import statement,
    function-local ones included (a writable one, imported lazily at the
    stop, would run a sealed worker's code as root)."""
    from launcher._platform import sealing

    named: set[str] = set()
    for mod, tree in MODULES.items():
        if mod.startswith("launcher._native.build"):
            continue                                 # the build script: never loaded by a supervisor
        skip = _type_checking_blocks(tree)
        if mod in USER_ONLY_MODULES:
            # Imported by users only, never by the engine: whatever it
            # imports at its top is loaded before any spawn of the process
            # that imports it, never later. Its function-local imports count.
            skip |= {n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                named.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                named.add(node.module.split(".")[0])
    named -= {"launcher", "__future__"}
    missing = named - set(sealing.LATER_IMPORTS) - set(sealing.NOT_ON_THIS_PLATFORM)
    assert not missing, f"add to sealing.LATER_IMPORTS: {sorted(missing)}"
