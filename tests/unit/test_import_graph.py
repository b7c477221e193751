"""No import loop in turbine/: a module never imports, directly or through others, one that imports
it back. Every import counts (top-level, inside functions, under TYPE_CHECKING), since a loop through
any of them is still two modules that need each other. Read statically (ast), so that it holds for
code a test never runs (the GPU paths)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The module names an import statement names (for `from a import b`: a, and a.b in case b is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = package[: len(package) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [source, *(f"{source}.{alias.name}" for alias in node.names)]


def import_graph(root: Path = ROOT) -> nx.DiGraph:
    paths = {module_name(p, root): p for p in (root / "turbine").rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(paths)
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph.add_edges_from((module, target) for target in imported(module, path, node)
                                     if target in paths and target != module)
    return graph


def test_no_module_in_turbine_imports_one_that_imports_it_back():
    graph = import_graph()
    assert graph.number_of_nodes() > 150 and graph.has_edge("turbine.frontend.http.api", "turbine.frontend.app")
    loops = [sorted(group) for group in nx.strongly_connected_components(graph) if len(group) > 1]
    assert loops == [], "import loops:\n" + "\n".join(" <-> ".join(group) for group in loops)


def test_a_loop_is_found(tmp_path):
    """The check itself: two modules that import each other make a loop."""
    package = tmp_path / "turbine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from turbine import b\n")
    (package / "b.py").write_text("def f():\n    from turbine.a import x\n")
    graph = import_graph(tmp_path)
    assert [sorted(g) for g in nx.strongly_connected_components(graph) if len(g) > 1] == [["turbine.a", "turbine.b"]]


# The frontend's layers, lowest first: a module imports only from its own layer or lower ones (the
# stage folders in the order a request meets them: turbine/frontend/README.md).
FRONTEND_LAYERS = (
    ("deltas", "errors", "metrics", "request_id", "event_stream"),  # what crosses the stages
    ("models",),  # what the frontend knows per served model
    ("postprocess",),
    ("preprocess",),  # plans the postprocess stage's parsers
    ("dispatch",),
    ("pipeline",),  # dispatch -> postprocess -> format, and what every writer counts
    ("apis",),
    ("app",),  # the frontend's state
    ("http",),
    ("server", "args", "__main__"),
)


def frontend_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["turbine", "frontend"] or len(parts) < 3:
        return None
    return next(i for i, names in enumerate(FRONTEND_LAYERS) if parts[2] in names)


def test_the_frontends_layers_import_only_downward():
    graph = import_graph()
    upward = [f"{a} -> {b}" for a, b in graph.edges()
              if frontend_layer(a) is not None and frontend_layer(b) is not None and frontend_layer(b) > frontend_layer(a)]
    assert upward == [], "imports into a later layer:\n" + "\n".join(sorted(upward))
