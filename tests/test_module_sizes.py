"""The house as parts: no module of the core or of a first-party plugin over 600 lines, no function over 100.

A module that grows past the limit holds more than one concern: split it into
files whose names say what they hold. A function is measured from its ``def``
line to its last line, docstring included (its decorators are declarations,
not body: a click command's options are left out). Tests are not measured.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def _sources() -> Iterator[Path]:
    packages = [ROOT / "twinkle_core", *sorted(ROOT.glob("plugins/*/twinkle_*"))]
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            if "tests" not in path.relative_to(ROOT).parts:
                yield path


def _long_functions(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                yield f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}() has {lines} lines"


def test_the_sources_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert "twinkle_core/sampler/facade.py" in names and any(n.startswith("plugins/twinkle_torch/") for n in names)
    assert not any("/tests/" in n for n in names)


def test_no_module_is_over_600_lines() -> None:
    offenders = []
    for path in _sources():
        count = len(path.read_text().splitlines())
        if count > MAX_MODULE_LINES:
            offenders.append(f"{path.relative_to(ROOT)}: {count} lines")
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines (split them by concern):\n" + "\n".join(offenders)


def test_no_function_is_over_100_lines() -> None:
    offenders = [line for path in _sources() for line in _long_functions(path)]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)
