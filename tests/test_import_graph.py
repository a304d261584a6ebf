"""No import circles in kestrel/: the graph of its modules' imports of each other is acyclic.

Every import statement counts, wherever it sits (module level, `if TYPE_CHECKING:`, inside a function), so a circle
cannot be dodged by moving one side of it into a function. An import of `a.b.c` is an edge to `a.b.c` only: the
parent packages it runs first are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kestrel"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, package: list[str], modules: set[str]) -> set[str]:
    """The modules of `modules` that an import statement in `package` names (`from p import x`: `p.x` when that is a
    module, else `p`)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & modules
    base = node.module or ""
    if node.level:
        base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
    return {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names} & modules


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of the package at `root` it imports."""
    files = {_module_name(path, root): path for path in root.rglob("*.py")}
    modules, graph = set(files), {}
    for module, path in files.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        graph[module] = {name for node in ast.walk(ast.parse(path.read_text(), str(path)))
                         if isinstance(node, (ast.Import, ast.ImportFrom))
                         for name in _imported(node, package, modules)} - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None when it is acyclic (iterative depth-first search)."""
    state: dict[str, int] = {}          # 1: on the current path, 2: finished
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            successor = next(stack[-1], None)
            if successor is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(successor) == 1:
                return [*path[path.index(successor):], successor]
            elif successor not in state:
                state[successor] = 1
                path.append(successor)
                stack.append(iter(sorted(graph[successor])))
    return None


def test_find_cycle_finds_a_circle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_in_functions_and_type_checking_blocks_count(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from .. import a\n")
    (root / "a.py").write_text("def f():\n    from .b import g\n")
    (root / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import c\n")
    (root / "sub" / "c.py").write_text("import pkg.a\n")
    graph = import_graph(root)
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.sub.c"},
                     "pkg.sub.c": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]


def test_relative_imports_resolve_to_modules():
    graph = import_graph()
    assert "kestrel.cookbook.anchors" in graph["kestrel.cookbook.planner"]
    assert "kestrel.engine.args" in graph["kestrel.cookbook.recipes"]


def test_kestrel_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])
