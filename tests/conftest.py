"""Shared fixtures: a tiny random-weight Llama and an in-process sidecar on a temp socket."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from ci_guard import (pytest_make_collect_report, pytest_runtest_makereport,  # noqa: F401 (hooks: CI=true skips fail)
                      pytest_sessionfinish, pytest_terminal_summary)
from hang import cpu_share, timeout_scale
from suite_order import SLOWEST_FILES_FIRST


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest files first (SLOWEST_FILES_FIRST; the rest keep their order). Then the timeouts: each test's
    (pytest-timeout: `timeout` in pyproject, or its own mark) only ends a hang; a machine that gives this worker
    a fraction of a core (measured here, once, by spinning 1 s) stretches every test by about its inverse, so
    the timeouts are stretched by as much (issue 31: no verdict depends on load)."""
    rank = {f: i for i, f in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: in-file order kept
    scale = timeout_scale(cpu_share())
    if hasattr(config, "workeroutput"):  # an xdist worker: its controller prints it (pytest_testnodedown)
        config.workeroutput["timeout_scale"] = scale
    else:
        _say(config, f"phasescope: test timeouts x{scale:.1f} (this machine's CPU share)")
    if scale <= 1.0:
        return
    default = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        limit = float(mark.args[0] if mark and mark.args else (mark.kwargs.get("timeout", default) if mark else default))
        if limit > 0:
            item.add_marker(pytest.mark.timeout(limit * scale), append=False)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # xdist's controller, as each worker ends
    scale = getattr(node, "workeroutput", {}).get("timeout_scale")
    if scale is not None:
        _say(node.config, f"phasescope: {node.gateway.id}'s test timeouts x{scale:.1f} (its CPU share at the start)")


def _say(config: pytest.Config, line: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(line)


@pytest.fixture(autouse=True)
def _umask_kept():
    """The process's umask after each test is the one before it. `phasescope agent` sets 0o077 for its own
    process (cli/main.py); a test that runs it in-process once left a worker's later folders 0700, and a
    test that hands a folder to another uid then failed or passed by test order (issue 27)."""
    before = os.umask(0o022)
    os.umask(before)
    yield
    os.umask(before)


@pytest.fixture(scope="session")
def tiny_llama():
    """A 2-layer random-weight Llama (GQA: 4 heads, 2 KV heads), eval mode, CPU."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        pad_token_id=0, eos_token_id=None,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture
def short_tmp():
    """A short temp folder (Unix socket paths are limited to ~107 bytes)."""
    d = tempfile.mkdtemp(prefix="ps-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sidecar(short_tmp):
    """A running in-process sidecar writing short_tmp/store.duckdb on short_tmp/agent.sock."""
    from phasescope.agent.sidecar import Sidecar

    sc = Sidecar(os.path.join(short_tmp, "store.duckdb"), listen=[f"unix:{short_tmp}/agent.sock"],
                 batch_interval_s=0.05).start()
    yield sc
    sc.stop()
