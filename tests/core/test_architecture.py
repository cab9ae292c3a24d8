"""The house rules of workflow_scripts/, read from the code: packages by stage on floors, every import pointing down
or along its own package, no circle, no entry script imported by another module, no module over 600 lines
(no strategy name compared outside train/parallel/: tests/train/test_strategies.py)."""

import ast
from pathlib import Path

import pytest
from conftest import REPO

from workflow_scripts import FLOORS

PACKAGE = REPO / "workflow_scripts"
MODULES = {
    ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): path
    for path in PACKAGE.rglob("*.py")
}


def imports(path: Path) -> set[str]:
    """The workflow_scripts modules ``path`` imports, at any depth (function-local imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("workflow_scripts"):
            for alias in node.names:  # `from workflow_scripts.core import settings` imports the module settings
                name = f"{node.module}.{alias.name}"
                found.add(name if name in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("workflow_scripts")}
    return found - {"workflow_scripts"}


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def floor(module: str) -> int:
    return FLOORS.index(module.split(".")[1]) if module.count(".") else -1


def is_entry(path: Path) -> bool:
    return 'if __name__ == "__main__":' in path.read_text()


def test_every_package_is_on_a_floor():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(FLOORS)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down_or_along(module):
    upward = sorted(m for m in GRAPH[module] if floor(m) > floor(module))
    assert not upward, f"{module} imports from a higher floor: {upward} (floors, lowest first: {FLOORS})"


def test_no_circle():
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(GRAPH.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join([*path[path.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_no_entry_script_is_imported():
    entries = {name for name, path in MODULES.items() if is_entry(path)}
    imported = sorted((m, e) for m, deps in GRAPH.items() for e in deps & entries)
    assert not imported, f"entry scripts imported by other modules: {imported}"


def test_no_module_over_600_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 600}
    assert not long
