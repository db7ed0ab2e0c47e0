"""The import graph keeps the architecture: layers that hold and no import cycles.

Every import counts, at the top of a module or inside a function or a TYPE_CHECKING block: a lazy
import is still a dependency. The graph is read from the source, so nothing is imported. One
exception: ``journeyman/__init__.py`` names, for type checkers only, what its ``journeyman.exports``
entry points provide at run time (``jm.LocalBackend``, ``jm.trainable``); the last test holds it to that.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"core": "journeyman", "integrations": "journeyman.integrations", "backend": "journeyman.backend"}

APPLICATION = ("journeyman.backend.app", "journeyman.backend.__main__")
"""May use both outer packages: the command line, the demo, the HTTP server."""


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT / folder)
            if "vllm_plugin" in relative.parts:  # runs inside the vLLM process, never imported by us
                continue
            parts = [part for part in relative.with_suffix("").parts if part != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()


def type_only_exports(tree: ast.Module) -> list[ast.ImportFrom]:
    """The imports in the top-level ``if TYPE_CHECKING:`` blocks of a module."""
    blocks = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    return [node for block in blocks for node in block.body if isinstance(node, ast.ImportFrom)]


def imports_of(name: str, path: Path) -> set[str]:
    """The journeyman modules (or packages) that ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    skip = set(map(id, type_only_exports(tree))) if name == "journeyman" else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            for alias in node.names:  # `from package import module` imports the module
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module)
    return {module for module in found if module == "journeyman" or module.startswith("journeyman.")}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str) -> str:
    for layer in ("journeyman.backend.app", "journeyman.backend.serving", "journeyman.backend.training"):
        if _within(module, layer):
            return layer
    if module == "journeyman.backend.__main__":
        return "journeyman.backend.app"
    for layer in ("journeyman.integrations", "journeyman.backend"):
        if _within(module, layer):
            return layer
    return "journeyman"


ALLOWED = {
    "journeyman": {"journeyman"},
    "journeyman.integrations": {"journeyman", "journeyman.integrations"},
    # the top of backend: LocalBackend (the seam), the embedded models, settings
    "journeyman.backend": {
        "journeyman", "journeyman.backend", "journeyman.backend.serving", "journeyman.backend.training",
    },
    "journeyman.backend.serving": {"journeyman", "journeyman.backend", "journeyman.backend.serving"},
    "journeyman.backend.training": {"journeyman", "journeyman.backend", "journeyman.backend.training"},
    "journeyman.backend.app": {
        "journeyman", "journeyman.integrations", "journeyman.backend", "journeyman.backend.serving",
        "journeyman.backend.training", "journeyman.backend.app",
    },
}  # fmt: skip
"""Which layers each layer may import. Serving and training may use the shared top of backend
(models, settings) but not LocalBackend, which joins them: see the next test."""


def test_every_layer_imports_only_what_is_below_it() -> None:
    broken = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if _layer(target) not in ALLOWED[_layer(module)]
    ]
    assert broken == []


def test_only_the_application_uses_local_backend() -> None:
    users = {
        module
        for module, targets in GRAPH.items()
        if {"journeyman.backend.local", "journeyman.backend"} & targets
        and _layer(module) != "journeyman.backend.app"
    }
    assert users <= {"journeyman.backend", "journeyman.backend.local"}  # the package's lazy re-export


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    graph = {module: {t for t in targets if t != _package_of(module)} for module, targets in GRAPH.items()}
    assert _cycles(graph) == []


def _package_of(module: str) -> str:
    """A package's lazy re-export of its own modules (``journeyman.backend.LocalBackend``) is not a
    cycle: the edge from a module to its own package is left out."""
    return module.rpartition(".")[0]


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"a"}}, [["a"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], cycle: list[list[str]]) -> None:
    assert _cycles(graph) == cycle


def test_the_graph_sees_relative_and_lazy_imports() -> None:
    """The checks above are only as good as the graph: it must hold the imports it is meant to judge."""
    assert "journeyman.backend.serving.router" in GRAPH["journeyman.backend.serving.gateway"]  # from .router
    assert "journeyman.backend.local" in GRAPH["journeyman.backend"]  # inside __getattr__
    assert "journeyman.plugins" in GRAPH["journeyman.gather"]  # from journeyman import plugins
    assert "journeyman.integrations.langfuse" in GRAPH["journeyman.backend.app.demo"]  # inside run()


def test_the_top_level_names_the_outer_packages_only_for_type_checkers() -> None:
    """``jm.LocalBackend`` and ``jm.trainable`` load through entry points; the TYPE_CHECKING imports
    that type them name exactly those entry points, so core still imports nothing outside it."""
    exports = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][
        "journeyman.exports"
    ]
    typed = {
        alias.name: f"{node.module}:{alias.name}"
        for node in type_only_exports(ast.parse((ROOT / "core" / "__init__.py").read_text()))
        for alias in node.names
    }
    assert set(typed) == set(exports)
    for name, target in typed.items():  # the package that re-exports it, or the module itself
        module, _, attribute = exports[name].partition(":")
        assert attribute == name and (target == exports[name] or module.startswith(target.partition(":")[0]))
