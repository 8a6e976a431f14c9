"""The package's shape: a root of entry points only, no import cycle between its
modules, and measure/ below the engine."""
import ast
from pathlib import Path

import sarathi_rt

ROOT = Path(sarathi_rt.__file__).parent
ENTRY_POINTS = {"__init__", "__main__", "cli", "launch", "llm", "sampling", "workloads"}
# measure/ holds a run's records; what drives an engine to get them is harness/, above it.
ABOVE_MEASURE = ("sarathi_rt.engine", "sarathi_rt.models", "sarathi_rt.harness", "sarathi_rt.server")


def _module_name(path: Path) -> str:
    parts = ("sarathi_rt",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Modules of the package that `path` imports anywhere: late imports in function
    bodies (a cycle hidden in a function is still a cycle) and imports under
    `if TYPE_CHECKING:` included (a module that names a type of the layer above it for
    its annotations depends on that layer as much as one that imports it to run)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def statements(nodes: list[ast.stmt]):  # type: ignore[no-untyped-def]
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from statements(getattr(node, field, []))

    found = set()
    for stmt in statements(ast.parse(path.read_text()).body):
        if isinstance(stmt, ast.ImportFrom):
            base = stmt.module or ""
            if stmt.level:
                anchor = package.split(".")[:len(package.split(".")) - stmt.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in stmt.names]
        else:
            targets = [a.name for a in stmt.names]
        for target in targets:
            # importing a.b.c runs a.b's __init__ too, unless a.b is the importer's own package
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                    found.add(prefix)
    return found


def test_package_root_holds_only_entry_points() -> None:
    modules = {p.stem for p in ROOT.glob("*.py")}
    assert modules <= ENTRY_POINTS and len(modules) <= 8, sorted(modules - ENTRY_POINTS)


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, set(paths)) for name, path in paths.items()}


def test_no_import_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path[path.index(nxt):] + [node, nxt])
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_measure_imports_nothing_above_it() -> None:
    graph = _graph()
    found = {name: sorted(t for t in targets if t.startswith(ABOVE_MEASURE))
             for name, targets in graph.items()
             if name.startswith("sarathi_rt.measure")}
    assert not any(found.values()), {name: targets for name, targets in found.items() if targets}
