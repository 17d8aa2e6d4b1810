"""The package's layering (docs/architecture.md, "The layers"): core, data and systems
import no flwr and nothing above them, and no two modules of the package import each
other, directly or through others (an import cycle).

Imports are read from the source (``ast``), at any depth: an import inside a function is an
import of the module that holds it, so a lazy import does not hide a dependency; a string
that is the full name of a package module (``importlib.import_module(REPRODUCTIONS[name])``,
a lazy export table) counts as an import of it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fmtl_flower

PACKAGE = Path(fmtl_flower.__file__).resolve().parent
ROOT = PACKAGE.name
#: The bottom layers, lowest first: each may import itself and the ones before it.
BOTTOM = ("core", "data", "systems")


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = _modules()


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _enclosing(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports_of(module: str) -> tuple[set[str], set[str]]:
    """(package modules, top-level outside packages) that ``module`` imports anywhere but
    under ``if TYPE_CHECKING:``."""
    path, is_package = MODULES[module]
    inside, outside = set(), set()
    tree = ast.parse(path.read_text(), str(path))
    skip = _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value in MODULES:
            names = [node.value]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node)
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` mod
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        for name in names:
            if name == ROOT or name.startswith(ROOT + "."):
                target = _enclosing(name)
                if target and target != module:
                    inside.add(target)
            else:
                outside.add(name.partition(".")[0])
    return inside, outside


GRAPH = {m: imports_of(m)[0] for m in MODULES}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in BOTTOM else None


def _leaf_helper(module: str) -> bool:
    """A private top-level helper (``fmtl_flower._name``) that imports nothing of the package
    and no flwr: it sits below every layer."""
    inside, outside = imports_of(module)
    return module.split(".")[-1].startswith("_") and module.count(".") == 1 and not inside \
        and "flwr" not in outside


def test_bottom_layers_import_no_flwr_and_nothing_above_them():
    found = []
    for module in MODULES:
        layer = _layer(module)
        if layer is None:
            continue
        allowed = BOTTOM[: BOTTOM.index(layer) + 1]
        inside, outside = imports_of(module)
        found += [f"{module} imports flwr" for _ in ("flwr" in outside and [1] or [])]
        found += [f"{module} imports {t}" for t in sorted(inside)
                  if _layer(t) not in allowed and not _leaf_helper(t)]
    assert found == []


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in GRAPH:
        if start in index:
            continue
        work = [(start, iter(sorted(GRAPH[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(GRAPH[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycle_in_the_package():
    assert _cycles() == []


def test_the_checks_see_what_they_look_for():
    """The reader finds lazy imports and the cycle finder finds a planted cycle."""
    inside, outside = imports_of(f"{ROOT}.cli")  # cli imports its commands lazily
    assert f"{ROOT}.engine" in inside and "argparse" in outside
    assert f"{ROOT}.experiments.mocha_fig1" in imports_of(f"{ROOT}.experiments")[0]
    assert "flwr" in imports_of(f"{ROOT}.strategies.mocha")[1]
    saved = GRAPH[f"{ROOT}.core.rng"]
    try:
        GRAPH[f"{ROOT}.core.rng"] = saved | {f"{ROOT}.core.ofmtl"}  # ofmtl imports rng
        assert [f"{ROOT}.core.ofmtl", f"{ROOT}.core.rng"] in _cycles()
    finally:
        GRAPH[f"{ROOT}.core.rng"] = saved


def _closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += GRAPH[m]
    return seen


def test_the_flower_free_loop_reaches_no_flwr():
    """``centralized`` (MOCHA and the pooled model without Flower) and everything it imports,
    at any depth, import no flwr (it imported the FedEM client for its label helper)."""
    reach = _closure(f"{ROOT}.centralized")
    assert sorted(m for m in reach if "flwr" in imports_of(m)[1]) == []


if __name__ == "__main__":  # python -m tests.test_layering: the graph in one line
    print(f"modules {len(GRAPH)}, import edges {sum(map(len, GRAPH.values()))}, "
          f"cycles {len(_cycles())}")
