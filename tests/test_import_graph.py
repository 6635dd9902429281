"""The mlxcel package's internal imports form no cycle.

Every import counts: module level, inside functions, under ``if TYPE_CHECKING``. A cycle that only
a function-level import closes still ties two modules together (the stage process once imported
its exit switch back from the server launcher that starts it).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlxcel"

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root`` (a package directory)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    # ``from a import b`` imports module a.b when there is one, else a name defined in a
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def import_graph(root: Path) -> Graph:
    """Edges to the package's own modules only; a submodule that is not a file resolves to its parent."""
    modules = module_files(root)
    graph: Graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, package, modules):
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, grey = on the current path)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "grey"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "grey":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = "black"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def describe(graph: Graph, cycle: list[str]) -> str:
    return "\n".join(f"  {a} (line {graph[a][b]}) imports {b}" for a, b in zip(cycle, cycle[1:]))


def test_mlxcel_imports_have_no_cycle():
    graph = import_graph(PACKAGE)
    assert {"mlxcel.commands.serve", "mlxcel.process", "mlxcel.entrypoints", "mlxcel.entrypoints.stage"} <= graph.keys()
    assert "mlxcel.loading_process" in graph["mlxcel.entrypoints.stage"]  # the graph does see imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in mlxcel:\n" + describe(graph, cycle)


def test_process_plumbing_imports_no_role():
    """Roles import mlxcel.process and mlxcel.loading_process; those import none of them (nor the table)."""
    from mlxcel.entrypoints import ROLES

    graph = import_graph(PACKAGE)
    for plumbing in ("mlxcel.process", "mlxcel.loading_process"):
        assert not {role.module for role in ROLES.values()} & graph[plumbing].keys(), plumbing
        assert "mlxcel.entrypoints" not in graph[plumbing], plumbing


def test_a_cycle_closed_inside_a_function_is_found(tmp_path):
    """The shape of the old stage_server <-> launch cycle, with relative and absolute imports."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "launch.py").write_text("from pkg import sub\nfrom pkg.sub.stage import run\n")
    (pkg / "sub" / "stage.py").write_text("def run():\n    from ..launch import ExitSwitch\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.stage"] == {"pkg.launch": 2}
    assert graph["pkg.launch"] == {"pkg.sub": 1, "pkg.sub.stage": 2}
    cycle = find_cycle(graph)
    assert cycle == ["pkg.launch", "pkg.sub.stage", "pkg.launch"]
    assert describe(graph, cycle) == ("  pkg.launch (line 2) imports pkg.sub.stage\n"
                                      "  pkg.sub.stage (line 2) imports pkg.launch")
    (pkg / "sub" / "stage.py").write_text("def run():\n    from pkg import process\n")
    (pkg / "process.py").write_text("import os\n")
    assert find_cycle(import_graph(pkg)) is None
