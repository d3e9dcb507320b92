"""The shape rules of the engine (tests/test_engine_units.py) applied to the whole app: every
module of runs/ and controlplane/ (migrations aside) is at most 600 lines, every function at
most 80, and no two modules import each other, however indirectly, lazy and type-checking
imports included (issue 52). No database: pure reading of the source."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import assert_acyclic

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runs", "controlplane")


def modules() -> dict[str, Path]:
    """Each module's dotted name (a package's is its __init__'s) and its file."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The app's modules `name` imports anywhere in its text: `from a import b` is module a.b
    when that is a module, else a (its package's __init__)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    found.add(f"{base}.{alias.name}")
                elif base in known:
                    found.add(base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
    return found - {name}


def test_the_imports_function_reads_every_kind_of_import(tmp_path):
    """The checker itself: relative, lazy and package imports are all edges."""
    source = ROOT / "runs" / "views" / "__init__.py"
    assert "runs.views.bulk" in imports("runs.views", source, set(modules()))
    known = {"runs.a", "runs.b", "runs.c", "runs"}
    text = "from . import b\ndef f():\n    from runs.c import x\nimport runs.a\n"
    fake = tmp_path / "d.py"
    fake.write_text(text)
    assert imports("runs.d", fake, known) == {"runs.a", "runs.b", "runs.c"}


def test_no_module_of_the_app_imports_itself_through_others():
    """No import cycle in runs/ or controlplane/, lazy imports included: each module can be
    read (and type-checked, and imported) knowing only those it imports."""
    found = modules()
    graph = {name: imports(name, path, set(found)) for name, path in found.items()}
    assert_acyclic(graph)


def test_no_module_of_the_app_is_over_600_lines_nor_a_function_over_80():
    """Each piece reads on one screen or two: a module that outgrows it is several concerns,
    a function that does, several steps."""
    long = []
    for path in modules().values():
        where = str(path.relative_to(ROOT))
        text = path.read_text()
        if (lines := len(text.splitlines())) > 600:
            long.append(f"{where}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > 80:
                    long.append(f"{where}: {node.name}, {size} lines")
    assert not long, long
