"""The docs are tested (issue 23 item 7): every path the README and the docs cite exists; every command block
of the README and of docs/*.md runs here, or says (a `docs-test: needs ...` mark) why it cannot (a server, a
GPU, the network); the read API has its page and it lists every endpoint and named query; the vLLM example
works with XDG_RUNTIME_DIR unset; the runbooks name only declared options; the README stays a front page
(issue 50: <= 250 lines, its images committed)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("*/README.md")),
        *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))]
PATH = re.compile(r"(?<![\w./$-])((?:agent|analyzers|exporters|dashboard|cli|deploy|docs|tests|benchmarks|\.ci)"
                  r"(?:/[\w.-]+)+)")
MD = re.compile(r"(?<![\w/.-])([\w-]+(?:/[\w.-]+)*\.md)\b")
BLOCK = re.compile(r"(?P<mark><!-- docs-test: (?P<why>[^>]*) -->\n\s*)?```(?:bash|sh)\n(?P<body>.*?)```", re.S)


def cited(doc: str) -> set[str]:
    text = (ROOT / doc).read_text()
    out = {m.rstrip(".,:;)") for m in PATH.findall(text)}
    out |= {m for m in MD.findall(text)}
    return {p for p in out if not any(c in p for c in "*<>=")}


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_path_exists(doc):
    base = (ROOT / doc).parent
    missing = sorted(p for p in cited(doc) if not (ROOT / p).exists() and not (base / p).exists())
    assert not missing, f"{doc} cites {missing}"


def test_the_code_cites_only_docs_that_exist():
    """A bare .md name the code gives (DESIGN.md was one, and is not in the repository) is a file of the
    repository; paths with folders are other projects' (OpenTelemetry's docs/...) or checked above."""
    ours = {p.name for p in ROOT.glob("**/*.md") if ".git" not in p.parts}
    missing = set()
    for path in ROOT.glob("**/*.py"):
        if any(part in (".git", "data") or part.startswith(".") for part in path.relative_to(ROOT).parts[:-1]):
            continue
        if path.name == "test_docs.py":
            continue
        for md in MD.findall(path.read_text(errors="replace")):
            if "/" not in md and md not in ours:
                missing.add(f"{path.relative_to(ROOT)}: {md}")
    assert not missing, sorted(missing)


BLOCK_DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))]


def blocks() -> list[tuple[str, str | None, str]]:
    """(doc:line, why not run or None, body) of every bash block of the README and docs/*.md."""
    out = []
    for doc in BLOCK_DOCS:
        text = (ROOT / doc).read_text()
        out += [(f"{doc}:{text[:m.start()].count(chr(10)) + 1}", m["why"], m["body"]) for m in BLOCK.finditer(text)]
    return out


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(images) >= 2 and all((ROOT / i).is_file() and (ROOT / i).stat().st_size > 10_000 for i in images)
    assert all(f"docs/{p.name}" in text for p in ROOT.glob("docs/*.md"))  # every page of docs/ is linked


def test_every_readme_block_runs_or_says_why_not():
    marked = [why for _, why, _ in blocks() if why]
    assert all(w.startswith("needs ") for w in marked), marked
    assert len([b for b in blocks() if not b[1]]) >= 4  # the blocks test_readme_block runs


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """What the README's runnable blocks refer to: phasescope.duckdb and other.duckdb (recorded runs),
    config.json (an HF config), exports/ (a store rolled out to Parquet)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from builders.scenarios import DATA_DIR, load

    d = tmp_path_factory.mktemp("readme")
    load(os.path.join(DATA_DIR, "queueing"), str(d / "phasescope.duckdb"))
    load(os.path.join(DATA_DIR, "healthy"), str(d / "other.duckdb"))
    shutil.copy(ROOT / "tests" / "data" / "healthy" / "config.json", d / "scenario.json")
    (d / "config.json").write_text('{"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, '
                                   '"hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256, '
                                   '"torch_dtype": "bfloat16", "model_type": "llama"}')
    rolled = str(d / "rolled.duckdb")
    shutil.copy(d / "phasescope.duckdb", rolled)
    from phasescope.agent.sidecar.retention import Retention, RetentionPolicy
    from phasescope.agent.sidecar.store import Store

    store = Store(rolled)
    Retention(store, RetentionPolicy(max_age_s=1e-3, export_dir=str(d / "exports"), host="h1")).roll()
    store.close()
    return d


@pytest.mark.parametrize("line,body", [(n, b) for n, why, b in blocks() if not why], ids=lambda x: str(x)[:20])
def test_readme_block(workdir, line, body):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    for cmd in (c for c in body.splitlines() if c.strip() and not c.lstrip().startswith("#")):
        out = subprocess.run(["bash", "-c", cmd], cwd=workdir, capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, f"{line}: {cmd}\n{out.stderr[-2000:]}"


def test_read_api_page_lists_every_endpoint_and_query():
    from phasescope.agent.read.queries import QUERIES
    from phasescope.agent.sidecar import readapi

    page = (ROOT / "docs" / "read-api.md").read_text()
    for name in QUERIES:
        assert f"| `{name}` |" in page, name
    for path in re.findall(r"GET (/[\w/<>]+)", readapi.__doc__):
        assert path.split("<")[0] in page, path


def test_the_vllm_example_works_with_xdg_runtime_dir_unset():
    text = (ROOT / "README.md").read_text()
    serve = next(ln for ln in text.splitlines() if "vllm serve MODEL" in ln)
    agent = next(ln for ln in text.splitlines() if ln.startswith("phasescope agent --db vllm.duckdb"))
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    address = r"(unix:\S*?\$\(id -u\)\S*)"
    probe_side, agent_side = (subprocess.run(["bash", "-c", f'echo "{re.search(before + address, ln)[1]}"'], env=env,
                                             capture_output=True, text=True).stdout.strip()
                              for before, ln in (("PHASESCOPE_AGENT=", serve), ("--listen ", agent)))
    assert probe_side == agent_side == f"unix:/tmp/phasescope-{os.getuid()}/agent.sock"


def test_runbooks_name_only_declared_options():
    from phasescope.agent import settings as S
    from phasescope.analyzers.runinfo import VLLM_FLAGS

    text = (ROOT / "exporters" / "alerts.tmpl.yml").read_text()
    words = {w for rb in re.findall(r'runbook: "([^"]*)"', text) for w in re.findall(r"\b[a-z]+(?:_[a-z0-9]+)+\b", rb)}
    declared = {f.name for cls in (S.AgentSettings, S.ProbeSettings) for f in S.fields_of(cls)}
    vllm = set(VLLM_FLAGS.values()) | {"gpu_memory_utilization", "max_model_len"}  # vLLM's own config names
    geometry = {"num_kv_heads", "tp_size"}  # the KV-head replication rule's terms (docs/definitions.md)
    assert words - declared - vllm - geometry == set()
    settings_doc = (ROOT / "docs" / "settings.md").read_text()
    for w in words & declared:
        assert f"| `{w}` |" in settings_doc, w
