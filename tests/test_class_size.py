"""No class in phasescope's own modules runs past 300 lines (the project's style rule; issue 24).

A class is measured from its `class` line (decorators included) to its last line, blank lines,
comments and docstrings included: what a reader has to hold. A class that grows past the limit is
split along a real seam (the sidecar's Ingest and Sessions, the probe's Probe and its parts), not
trimmed of its comments.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("agent", "analyzers", "exporters", "dashboard", "cli")
MAX_CLASS_LINES = 300


def class_sizes(source: str, filename: str = "<source>") -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every class in `source`, nested ones too."""
    out: list[tuple[str, int, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                name = f"{prefix}{child.name}"
                out.append((name, first, child.end_lineno - first + 1))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(source, filename), "")
    return out


def package_files() -> list[Path]:
    files = [p for folder in PACKAGE_FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 50, files  # the walk found the package (a wrong ROOT would pass vacuously)
    return files


def test_checker_measures_classes() -> None:
    src = "import x\n\n@dec\nclass A:\n    class B:\n        x = 1\n\n        y = 2\n    z = 3\n\n\nclass C: pass\n"
    assert class_sizes(src) == [("A", 3, 7), ("A.B", 5, 4), ("C", 12, 1)]
    big = "class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES
    assert class_sizes(big) == [("Big", 1, MAX_CLASS_LINES + 1)]


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_class_past_limit(path: Path) -> None:
    too_long = [f"{name} (line {line}): {n} lines" for name, line, n in class_sizes(path.read_text(), str(path))
                if n > MAX_CLASS_LINES]
    assert not too_long, f"{path.relative_to(ROOT)}: classes past {MAX_CLASS_LINES} lines: {too_long}"
