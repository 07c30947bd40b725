"""Imports flow one way, bottom to top; importing the probe loads nothing heavy.

Every import in the package is read from the source (lazy ones inside functions
too) and checked against the layer table below: a module may import only from
its own layer or the layers it names. The folders' import graph has no circle.
Importing the analyzers or the dashboard loads neither the probe nor the sidecar,
and importing the probe loads nothing heavy (checked on sys.modules of a fresh
interpreter). See docs/design.md "Layout".
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"agent": "phasescope.agent", "analyzers": "phasescope.analyzers",
           "exporters": "phasescope.exporters", "dashboard": "phasescope.dashboard", "cli": "phasescope.cli"}

# layer -> module prefixes it holds; first match wins, so the more specific prefixes come first
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # records, wire, addresses, the store's format, KV math: the floor, imports nothing of ours
    ("records", ("phasescope.agent.records",)),
    ("settings", ("phasescope.agent.settings",)),
    ("probe", ("phasescope.agent.probe",)),
    ("read", ("phasescope.agent.read",)),
    ("sidecar", ("phasescope.agent.sidecar",)),
    ("analyzers", ("phasescope.analyzers",)),
    ("exporters", ("phasescope.exporters",)),
    ("dashboard", ("phasescope.dashboard",)),
    ("package", ("phasescope.agent",)),  # the package's lazy attach re-export
    ("top", ("phasescope.cli",)),  # the command line and the demo
]
ALLOWED: dict[str, set[str]] = {
    "records": set(),
    "settings": {"records"},
    "probe": {"records", "settings"},
    "read": {"records"},
    "sidecar": {"records", "settings", "read"},
    "analyzers": {"records", "read"},
    "exporters": {"records", "read", "sidecar"},
    "dashboard": {"records", "read", "analyzers"},
    "package": {"probe"},
    "top": {"records", "settings", "probe", "read", "sidecar", "analyzers", "exporters", "dashboard", "package"},
}


def layer_of(module: str) -> str | None:
    for name, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = FOLDERS[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, lazy ones included."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` may name a submodule: check each name as one
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names] if not node.module else [(node.lineno, mod)]
    return out


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    assert [str(p) for p in sources() if layer_of(module_name(p)) is None] == []


def test_layer_table_catches_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a probe module importing the sidecar is reported."""
    assert layer_of("phasescope.agent.probe.probe") == "probe"
    assert layer_of("phasescope.agent.sidecar.store") not in ALLOWED["probe"] | {"probe"}
    assert layer_of("phasescope.cli.main") == "top"
    assert layer_of("phasescope.analyzers.diagnose") not in ALLOWED["read"] | {"read"}


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(path: Path) -> None:
    me = layer_of(module_name(path))
    assert me is not None
    bad = []
    for line, mod in imports_of(path):
        if not mod.startswith("phasescope."):
            continue
        other = layer_of(mod)
        if other is not None and other != me and other not in ALLOWED[me]:
            bad.append(f"{path.relative_to(ROOT)}:{line} ({me}) imports {mod} ({other})")
    assert bad == []


def test_importing_the_probe_loads_nothing_heavy() -> None:
    """The probe side loads on the server's hot path: no duckdb, prometheus_client, rich, pandas (the
    listed modules: the original check, kept as it was; `test_every_probe_module_loads_nothing_heavy` below
    covers all of them)."""
    code = (
        "import sys\n"
        "import phasescope.agent, phasescope.agent.probe\n"
        "import phasescope.agent.probe.adapters.base, phasescope.agent.probe.adapters.hf_generate\n"
        "import phasescope.agent.probe.adapters.hf_cb, phasescope.agent.probe.cuda_timing\n"
        "import phasescope.agent.probe.labels, phasescope.agent.records.kvmath, phasescope.agent.probe.sender\n"
        "heavy = ('duckdb', 'prometheus_client', 'rich', 'pandas', 'streamlit', 'opentelemetry', 'pyarrow')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def room_of(path: Path) -> str:
    """The folder a module lives in, as the layout names rooms: agent/'s sub-folders (records, probe, read,
    sidecar) are rooms of their own, deeper folders (probe/adapters) belong to theirs, every other top-level
    folder (analyzers, exporters, dashboard, cli) is one room; agent/'s own modules (settings.py) are the room
    `agent`, and its package file, the probe's front door (`from phasescope.agent import attach`, loaded on
    first use), is a room of its own: nothing of ours imports it."""
    parts = path.relative_to(ROOT).parts
    if parts == ("agent", "__init__.py"):
        return "agent/__init__"
    if parts[0] == "agent" and len(parts) > 2:
        return f"agent/{parts[1]}"
    return parts[0]


def room_of_module(module: str) -> str | None:
    """The room of an imported module name (None: not one of ours)."""
    for folder, package in FOLDERS.items():
        if module == package or module.startswith(package + "."):
            rest = module[len(package):].lstrip(".").split(".")
            if folder == "agent" and rest[0] and (ROOT / "agent" / rest[0]).is_dir():
                return f"agent/{rest[0]}"
            return folder
    return None


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one node (or a node with an edge to itself), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm, recursive: the graph has a dozen nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in edges.get(v, ()):
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def room_edges() -> tuple[dict[str, set[str]], dict[tuple[str, str], str]]:
    """room -> rooms its modules import (lazy imports too), and one import line per edge (for the message)."""
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for path in sources():
        me = room_of(path)
        for line, mod in imports_of(path):
            other = room_of_module(mod)
            if other is not None and other != me:
                edges.setdefault(me, set()).add(other)
                why.setdefault((me, other), f"{path.relative_to(ROOT)}:{line} imports {mod}")
    return edges, why


def test_circle_finder_finds_a_circle() -> None:
    """The checker itself: read <-> sidecar (the circle this layout removed) and a longer one are found."""
    assert circles({"agent/read": {"agent/sidecar"}, "agent/sidecar": {"agent/read", "agent/records"}}) == [
        ["agent/read", "agent/sidecar"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    assert room_of(ROOT / "agent" / "probe" / "adapters" / "vllm.py") == "agent/probe"
    assert room_of(ROOT / "agent" / "settings.py") == "agent"
    assert room_of(ROOT / "agent" / "__init__.py") == "agent/__init__"
    assert room_of_module("phasescope.agent.records.events") == "agent/records"
    assert room_of_module("phasescope.agent.settings") == "agent"
    assert room_of_module("phasescope.cli.main") == "cli"
    assert room_of_module("duckdb") is None


def test_no_import_circle_between_folders() -> None:
    edges, why = room_edges()
    found = circles(edges)
    assert found == [], [why[(a, b)] for group in found for a in group for b in group if (a, b) in why]
    # and the floor and the roof are where the layout puts them
    assert edges.get("agent/records", set()) == set()
    assert not any("cli" in targets for targets in edges.values())
    assert not any("agent/__init__" in targets for targets in edges.values())


def module_edges() -> dict[str, set[str]]:
    """module -> the package's modules it imports (lazy imports too). `from pkg import name` counts `pkg.name`
    where that is a module, else `pkg`; an import of a module's own package (__init__) is not an edge."""
    files = {module_name(p): p for p in sources()}
    edges: dict[str, set[str]] = {}
    for me, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            for a in node.names:  # imports_of gives `pkg` alone for these: a submodule named here is an edge too
                sub = f"{_absolute(me, path, node)}.{a.name}"
                if sub in files:
                    edges.setdefault(me, set()).add(sub)
        for _, mod in imports_of(path):
            while mod and mod not in files:
                mod = mod.rpartition(".")[0]
            if mod and mod != me and not me.startswith(mod + "."):
                edges.setdefault(me, set()).add(mod)
    return edges


def _absolute(me: str, path: Path, node: ast.ImportFrom) -> str:
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    if not node.level:
        return node.module or ""
    base = package.split(".")
    return ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))


def test_no_import_circle_between_modules() -> None:
    """Issue 50: inside a folder too, imports run one way (agent/read had queries -> itl -> queries, cli had
    explain -> sweep -> sweep_server -> explain)."""
    edges = module_edges()
    assert "phasescope.agent.read.base" in edges["phasescope.agent.read.itl"]  # relative imports resolve
    assert "phasescope.analyzers.sweep" in edges["phasescope.cli.sweep_result"]  # `from pkg import module` too
    assert circles(edges) == []
    planted = {**edges, "phasescope.agent.read.base": edges.get("phasescope.agent.read.base", set())
               | {"phasescope.agent.read.itl"}}
    assert ["phasescope.agent.read.base", "phasescope.agent.read.itl"] in circles(planted)


def run_and_list_modules(imports: list[str]) -> list[str]:
    """sys.modules of a fresh interpreter after importing `imports`."""
    code = "import importlib, json, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in imports) + \
        "print(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def module_names(folder: str) -> list[str]:
    """The importable modules under `folder` (not the `phasescope run` bootstrap: importing it attaches)."""
    return sorted(module_name(p) for p in (ROOT / folder).rglob("*.py") if "bootstrap" not in p.parts)


def test_analyzers_and_dashboard_load_neither_the_probe_nor_the_sidecar() -> None:
    """Every analyzer module, the dashboard package and every phasescope module the dashboard's modules import
    (read from their source: running app.py would start Streamlit) load no probe, sidecar, exporter, CLI or
    torch."""
    app_imports = sorted({mod for path in (ROOT / "dashboard").rglob("*.py") for _, mod in imports_of(path)
                          if mod.startswith("phasescope.") and not mod.startswith("phasescope.dashboard")})
    assert "phasescope.analyzers.diagnose" in app_imports  # the reader above works
    loaded = run_and_list_modules(module_names("analyzers") + ["phasescope.dashboard"] + app_imports)
    assert "phasescope.analyzers.diagnose" in loaded
    forbidden = ("phasescope.agent.probe", "phasescope.agent.sidecar", "phasescope.exporters", "phasescope.cli",
                 "torch")
    assert [m for m in loaded if m.startswith(forbidden)] == []


def test_the_forbidden_list_catches_the_sidecar() -> None:
    """The check above can fail: importing an exporter does load the sidecar's package (its Batch records
    in sidecar/fanout.py), though not the server itself."""
    loaded = run_and_list_modules(["phasescope.exporters.prometheus"])
    assert "phasescope.agent.sidecar.fanout" in loaded
    assert "phasescope.agent.sidecar.server" not in loaded


def test_every_probe_module_loads_nothing_heavy() -> None:
    """Every module of the probe's room (adapters included) and of the records floor: no duckdb, pyarrow,
    pandas, prometheus_client, OpenTelemetry, rich, streamlit or psutil, and nothing of ours above the probe."""
    loaded = run_and_list_modules(["phasescope.agent"] + module_names("agent/probe") + module_names("agent/records"))
    heavy = ("duckdb", "prometheus_client", "rich", "pandas", "streamlit", "opentelemetry", "pyarrow", "psutil")
    assert sorted({m.split(".")[0] for m in loaded} & set(heavy)) == []
    ours = ("phasescope.agent.sidecar", "phasescope.agent.read", "phasescope.analyzers", "phasescope.exporters",
            "phasescope.dashboard", "phasescope.cli")
    assert [m for m in loaded if m.startswith(ours)] == []


def test_attach_and_the_bootstrap_load_no_torch() -> None:
    """`import phasescope.agent` and the zero-code bootstrap run in every Python process `phasescope run`
    starts: they import no torch (only CUDA timing does, once a model is on a GPU)."""
    loaded = run_and_list_modules(["phasescope.agent", "phasescope.agent.probe.probe",
                                   "phasescope.agent.probe.autoattach", "phasescope.agent.probe.adapters.hf_cb",
                                   "phasescope.agent.probe.adapters.vllm_plugin"])
    assert "phasescope.agent.probe.probe" in loaded
    assert [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "vllm", "numpy")] == []
    # and `from phasescope.agent import attach` still resolves, lazily
    code = "import sys\nimport phasescope.agent as a\nassert 'phasescope.agent.probe' not in sys.modules\n" \
           "from phasescope.agent import attach\nprint(attach.__module__)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "phasescope.agent.probe.probe"
