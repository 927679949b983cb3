"""Imports point one way: no cycle between the package's modules, function-level imports included.

A lazy import hides a cycle from Python but not from a reader (policy/ppo/library ⇄ serve was one).
The only exception is a package's ``__init__`` and its own submodules (a factory that imports the
implementation it returns, which in turn imports the package's shared names).
"""

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "dynamix_byteps"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Module → module it imports, for every import statement anywhere in the package's files."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            else:
                continue
            for target in targets:
                if target in files and target != module:
                    graph.add_edge(module, target)
    return graph


def _own_package(a: str, b: str) -> bool:
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_the_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert graph.has_edge("dynamix_byteps.policy.ppo.serve", "dynamix_byteps.policy.ppo.policy_format")
    assert graph.has_edge("dynamix_byteps.policy.ppo.library", "dynamix_byteps.policy.ppo.policy_format")
    assert graph.number_of_edges() > 200


def test_no_import_cycle_outside_a_package_and_its_own_submodules():
    graph = import_graph()
    graph.remove_edges_from([(a, b) for a, b in graph.edges if _own_package(a, b)])
    cycles = list(nx.simple_cycles(graph, length_bound=6))
    assert not cycles, "import cycles (make one side import a third module both can use): " + "; ".join(
        " → ".join(c + [c[0]]) for c in cycles[:10])
