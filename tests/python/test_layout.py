"""The fuyou package's layout (issue 21): no import cycle between its modules
(imports inside functions count), no private module importing from the
package's __init__, no module over 500 lines. The checks are
python_client/tools/check_layout.py's; the synthetic packages show they fail
when such an import comes back."""

from __future__ import annotations

import importlib.util
import pathlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location(
        "check_layout", ROOT / "python_client" / "tools" / "check_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_layout = _checker()


def _package(tmp_path: Path, files: dict) -> Path:
    pkg = tmp_path / "fuyou"
    pkg.mkdir()
    for name, text in files.items():
        (pkg / name).write_text(text)
    return pkg


def test_the_package_has_no_cycle_no_init_import_and_no_long_module():
    _report, failures = check_layout.measure()
    assert failures == []


def test_the_checker_sees_every_module_of_the_package():
    report, _failures = check_layout.measure()
    names = {line.split()[1] for line in report}
    assert {"__init__.py", "optimizer.py", "_checkpoint.py", "_sharded.py"} <= names


def test_a_cycle_hidden_in_a_function_fails(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "_checkpoint.py": "from . import _sharded\n",
        "_sharded.py": "def f():\n    from ._checkpoint import g\n    return g\n",
    })
    _report, failures = check_layout.measure(pkg)
    assert any(f.startswith("import cycle:") and "_sharded" in f and "_checkpoint" in f
               for f in failures), failures


@pytest.mark.parametrize("line", [
    "from fuyou import AdamW\n",
    "from . import AdamW\n",
    "import fuyou\n",
    "def f():\n    from fuyou import AdamW\n",
])
def test_a_private_module_importing_from_init_fails(tmp_path, line):
    pkg = _package(tmp_path, {"__init__.py": "AdamW = 1\n", "_mode.py": line})
    _report, failures = check_layout.measure(pkg)
    assert failures == ["_mode.py imports from the package's __init__"]


def test_importing_a_sibling_module_by_name_is_not_an_init_import(tmp_path):
    pkg = _package(tmp_path, {"__init__.py": "", "_a.py": "from . import _b\nfrom fuyou import _b\n",
                              "_b.py": ""})
    _report, failures = check_layout.measure(pkg)
    assert failures == []


def test_a_module_over_the_line_limit_fails(tmp_path):
    pkg = _package(tmp_path, {"__init__.py": "", "_big.py": "x = 1\n" * 501})
    _report, failures = check_layout.measure(pkg)
    assert failures == ["_big.py: 501 lines (> 500)"]


# ------------------------------------------------ daemon/: who includes whom
DAEMON = pathlib.Path(__file__).resolve().parents[2] / "daemon"


def daemon_include_edges():
    """(folder, included folder) for every #include "<folder>/..." between the
    daemon's own folders, tests left out (they may reach across)."""
    folders = {p.name for p in DAEMON.iterdir() if p.is_dir()}
    edges = {}
    for path in DAEMON.rglob("*"):
        if path.suffix not in (".h", ".cc") or path.stem.endswith("_test") or path.parent == DAEMON:
            continue
        here = path.relative_to(DAEMON).parts[0]
        for line in path.read_text().splitlines():
            m = re.match(r'\s*#include "([a-z_]+)/', line)
            if m and m.group(1) in folders and m.group(1) != here:
                edges.setdefault((here, m.group(1)), str(path.relative_to(DAEMON)))
    return edges


def readme_layers():
    """The "Who includes whom" listing of daemon/README.md: folder -> folders."""
    text = (DAEMON / "README.md").read_text()
    block = text.split("## Who includes whom", 1)[1].split("```", 2)[1]
    layers = {}
    for line in block.splitlines():
        if "──►" not in line:
            continue
        left, right = line.split("──►", 1)
        right = re.sub(r"\([^)]*\)", "", right)
        layers[left.strip()] = {name.strip() for name in right.split(",") if name.strip()}
    return layers


def test_every_daemon_include_is_in_the_readme_listing_and_the_folders_form_no_cycle():
    edges = daemon_include_edges()
    layers = readme_layers()
    assert edges, "no include between the daemon's folders found: the check reads nothing"
    unlisted = {f"{a} -> {b} ({where})" for (a, b), where in edges.items() if b not in layers.get(a, set())}
    assert not unlisted, f"includes the daemon/README.md listing does not allow: {sorted(unlisted)}"
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    seen, done = set(), set()

    def visit(node, path):
        assert node not in seen or node in done, f"include cycle among daemon folders: {path + [node]}"
        if node in done:
            return
        seen.add(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
