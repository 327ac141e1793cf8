"""The layers of the package, held (docs/architecture.md): what importing each layer loads, in a fresh
interpreter, and no import cycles between packages or modules, read from the source."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import hybridpar
from support.harness import limit

SRC = Path(hybridpar.__file__).parent
RUNTIME = ("hybridpar.mesh", "hybridpar.launch", "hybridpar.spatial", "hybridpar.parallel")
ABOVE_RUNTIME = ("hybridpar.train", "hybridpar.calibrate", "hybridpar.cli", "hybridpar.demo")

# what importing a module must not load (a name, or a package and everything in it)
NOT_LOADED = {
    "hybridpar.ir": ("torch", "hybridpar.plan", *RUNTIME, *ABOVE_RUNTIME, "hybridpar.models", "hybridpar.data"),
    "hybridpar.ir.check": ("torch", "hybridpar.plan", *RUNTIME, *ABOVE_RUNTIME),
    "hybridpar.plan": ("torch", *RUNTIME, *ABOVE_RUNTIME, "hybridpar.models", "hybridpar.data", "hybridpar.ir.meta",
                       "hybridpar.ir.analysis"),
    "hybridpar.plan.io": ("torch", *RUNTIME, *ABOVE_RUNTIME),
    "hybridpar.plan.validate": ("torch", *RUNTIME, *ABOVE_RUNTIME),
    "hybridpar.dims": ("torch", "hybridpar.plan"),
    "hybridpar.geometry": ("torch", "hybridpar.plan"),
    "hybridpar.simulate": ("torch", *RUNTIME, *ABOVE_RUNTIME),
    "hybridpar.ir.analysis": ("hybridpar.plan", *RUNTIME, *ABOVE_RUNTIME, "hybridpar.models", "hybridpar.data"),
    "hybridpar.models": (*RUNTIME, *ABOVE_RUNTIME, "hybridpar.data"),
    "hybridpar.data": (*RUNTIME, *ABOVE_RUNTIME, "hybridpar.plan", "hybridpar.models"),
    "hybridpar.spatial": ("hybridpar.plan", "hybridpar.parallel", *ABOVE_RUNTIME, "hybridpar.models", "hybridpar.data"),
    "hybridpar.parallel": ("hybridpar.plan", *ABOVE_RUNTIME, "hybridpar.models", "hybridpar.data"),
    "hybridpar.parallel.apply": ("hybridpar.plan", *ABOVE_RUNTIME, "hybridpar.models", "hybridpar.data"),
    "hybridpar.train": ("torch", "hybridpar.calibrate", "hybridpar.cli", "hybridpar.demo"),
    "hybridpar.train.trainer": ("hybridpar.calibrate", "hybridpar.cli", "hybridpar.demo"),
    "hybridpar.cli": ("torch",),  # a command reads its flags and its config before torch loads (seconds)
}


def _loaded(module: str) -> list[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit(120), check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("module", sorted(NOT_LOADED))
def test_a_layer_loads_nothing_above_it(module):
    loaded = _loaded(module)
    found = [name for name in loaded for banned in NOT_LOADED[module]
             if name == banned or name.startswith(banned + ".")]
    assert not found, f"import {module} loads {found[:5]}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = SRC.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """The hybridpar modules a file imports, at the top or inside a function alike."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("hybridpar.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hybridpar":
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if _is_module(name) else node.module)
    return out - {"hybridpar"}


def _graph(key) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        source = key(_module_name(path))
        graph.setdefault(source, set())
        graph[source] |= {key(target) for target in _imports(path)} - {source}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its nodes in order, the first repeated at the end), or ``None``."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_between_packages():
    assert _cycle(_graph(_package)) is None


def test_no_import_cycle_between_modules():
    assert _cycle(_graph(lambda name: name)) is None


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
