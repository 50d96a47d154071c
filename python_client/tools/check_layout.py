#!/usr/bin/env python3
"""Checks the layout measures of the fuyou package (issue 21): no module over
500 lines, no import cycle among its modules (module-level and function-level
imports alike), no private module importing from the package's __init__
(``from fuyou import x``, ``import fuyou``, ``from . import x`` where x is not a
module of the package).

    .venv/bin/python python_client/tools/check_layout.py

Prints each module's line count and imports; exits 1 when a measure fails.
tests/python/test_layout.py runs the same checks under pytest."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parents[1] / "fuyou"
PACKAGE_NAME = "fuyou"
MAX_LINES = 500


def imports_of(path: Path, package: Path = PACKAGE, name: str = PACKAGE_NAME) -> Set[str]:
    """The package modules `path` imports, anywhere in the file ("" is __init__)."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from . import x / from .x import y
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    for alias in node.names:
                        mod = package / f"{alias.name}.py"
                        found.add(alias.name if mod.exists() else "")
            elif node.module and (node.module == name or node.module.startswith(name + ".")):
                rest = node.module.split(".")[1:]
                if rest:
                    found.add(rest[0])
                else:  # from fuyou import x: a module of the package, or a name of __init__
                    for alias in node.names:
                        mod = package / f"{alias.name}.py"
                        found.add(alias.name if mod.exists() else "")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == name:
                    found.add("")  # import fuyou: runs and reads __init__
                elif alias.name.startswith(name + "."):
                    found.add(alias.name.split(".")[1])
    return found


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Every elementary cycle found by a depth-first search (one per back edge)."""
    out, state, stack = [], {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if m not in graph:
                continue
            if state.get(m) == 1:
                out.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    return out


def measure(package: Path = PACKAGE, name: str = PACKAGE_NAME,
            max_lines: int = MAX_LINES) -> Tuple[List[str], List[str]]:
    """(one report line per module, the failures) for the package at `package`."""
    graph, report, failures = {}, [], []
    for path in sorted(package.glob("*.py")):
        module = "" if path.stem == "__init__" else path.stem
        lines = len(path.read_text().splitlines())
        deps = imports_of(path, package, name) - {module}
        graph[module] = deps
        report.append(f"{lines:5d}  {path.name:24s} -> "
                      f"{', '.join(sorted(d or '__init__' for d in deps))}")
        if lines > max_lines:
            failures.append(f"{path.name}: {lines} lines (> {max_lines})")
        if module and "" in deps:
            failures.append(f"{path.name} imports from the package's __init__")
    for cycle in cycles({k: v for k, v in graph.items() if k}):
        failures.append("import cycle: " + " -> ".join(cycle))
    return report, failures


def main() -> int:
    report, failures = measure()
    for line in report:
        print(line)
    for f in failures:
        print("FAIL", f)
    print("ok" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
