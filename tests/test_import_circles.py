"""Imports run one way (issue 50): no circle among the package's modules, counting imports inside functions too
(a lazy import still ties two modules into one that cannot be read, tested or changed apart)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("agent", "analyzers", "cli", "dashboard", "exporters")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["phasescope", *parts])


def imports_of(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """The package's modules that module `name` (file `path`) imports, anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import mod` names a module; `from mod import name` names something in it
            targets = [f"{stem}.{a.name}" for a in node.names] + [stem]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a package's own __init__ is not a cycle
                out.add(t)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def package_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    known = set(files) | {"phasescope"}
    return {name: {t for t in imports_of(path, name, known) if t in files} for name, path in files.items()}


def test_no_import_circle_in_the_package():
    graph = package_graph()
    assert len(graph) > 100  # the whole package was read
    assert "phasescope.agent.read.base" in graph["phasescope.agent.read.itl"]  # imports resolve, relative ones too
    assert circles(graph) == []


def test_a_circle_is_found():
    # the check itself: a planted circle (as agent/read had: queries -> itl -> queries) is reported
    graph = package_graph()
    graph["phasescope.agent.read.base"] = graph["phasescope.agent.read.base"] | {"phasescope.agent.read.itl"}
    assert ["phasescope.agent.read.base", "phasescope.agent.read.itl"] in circles(graph)
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
