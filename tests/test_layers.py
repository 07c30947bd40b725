"""Imports flow one way, bottom to top; importing the probe loads nothing heavy.

Every import in the package is read from the source (lazy ones inside functions
too) and checked against the layer table below: a module may import only from
its own layer or the layers it names. See README.md "Layout".
"""

from __future__ import annotations

import ast
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
    "analyzers": {"records", "probe", "read", "sidecar"},
    "exporters": {"records", "probe", "read", "sidecar", "analyzers"},
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
    """The probe side loads on the server's hot path: no duckdb, prometheus_client, rich, pandas."""
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
