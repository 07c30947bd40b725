"""Advice is phrased for the runtime the probes measured (issue 23 item 5): the knobs it names exist there,
and a run's own labels (what it already does) are taken into account, also on a zero-code run whose only
label of its runtime is the probes' own."""

from __future__ import annotations

import shutil

import duckdb
import pytest

from phasescope.analyzers.diagnose import diagnose
from phasescope.analyzers.kvcache import kv_external_fragmentation
from phasescope.analyzers.prefill import chunk_suggestion, chunked_prefill
from phasescope.analyzers.queueing import queueing_suggestion


def _copy(scenario_db, tmp_path, name: str, runtime: str | None, drop: tuple[str, ...]) -> tuple[str, str]:
    """A copy of fixture `name` whose probes report `runtime` (None: unchanged) and without the labels `drop`."""
    src, run = scenario_db(name)
    path = str(tmp_path / f"{name}.duckdb")
    shutil.copy(src, path)
    con = duckdb.connect(path)
    if runtime is not None:
        con.execute("UPDATE sources SET runtime = ? WHERE runtime != 'sidecar'", [runtime])
    for key in drop:
        con.execute("DELETE FROM run_info WHERE key = ?", [key])
    con.close()
    return path, run


def _found(path: str, run: str) -> dict:
    con = duckdb.connect(path, read_only=True)
    try:
        return {f.id: f for f in diagnose(con, run)}
    finally:
        con.close()


def test_static_batch_generate_is_not_told_to_raise_a_step_budget(scenario_db, tmp_path):
    path, run = _copy(scenario_db, tmp_path, "queueing", "hf-generate", ("runtime", "max_batch_tokens"))
    f = _found(path, run)["ttft-queueing"]
    assert "static batch" in f.suggestion and "continuous batching" in f.suggestion
    assert "--max-num-batched-tokens" not in f.suggestion and "per-step token budget" not in f.suggestion
    assert f.evidence["runtime"] == "hf-generate"


def test_each_runtime_names_only_its_own_budget_knob():
    e = {"max_prefill_tokens_per_step": 512}
    assert "HF continuous batching max_batch_tokens" in queueing_suggestion({**e, "runtime": "hf-cb"}, True)
    assert "--max-num-batched-tokens" not in queueing_suggestion({**e, "runtime": "hf-cb"}, True)
    assert "max_batch_tokens" not in queueing_suggestion({**e, "runtime": "vllm"}, True)
    both = queueing_suggestion({**e, "runtime": ""}, True)  # unknown runtime: both spellings
    assert "--max-num-batched-tokens" in both and "max_batch_tokens" in both


def test_a_zero_code_hf_cb_run_is_known_to_chunk(scenario_db, tmp_path):
    """`phasescope run` on HF continuous batching: no demo labels, only the probes' runtime and the adapter's
    max_batch_tokens. The finding must not say 'enable chunked prefill' to a run that chunks at 4096."""
    path, run = _copy(scenario_db, tmp_path, "prefill-interference", None, ("runtime",))
    f = _found(path, run)["prefill-stalls-decode"]
    assert not f.suggestion.startswith("Enable chunked prefill")
    assert f.suggestion.startswith("Chunked prefill is on") and "(now 4096)" in f.suggestion
    assert "--max-num-batched-tokens" not in f.suggestion  # HF's knob only
    path, run = _copy(scenario_db, tmp_path, "prefill-interference", None, ("runtime", "max_batch_tokens"))
    assert _found(path, run)["prefill-stalls-decode"].suggestion.startswith("Chunked prefill is on")


def test_static_generate_has_no_chunked_prefill_to_enable():
    assert chunked_prefill({"runtime": "hf-generate"}) == (False, None)
    text = chunk_suggestion(256, False, None, "hf-generate")
    assert text.startswith("HF generate runs each static batch") and "continuous batching" in text
    assert not text.startswith("Enable chunked prefill")


def test_external_fragmentation_tells_one_story_to_a_paged_runtime(scenario):
    con, run = scenario("service-mix")  # HF continuous batching
    f = {x.id: x for x in diagnose(con, run)}["kv-external-fragmentation"]
    assert f.suggestion.startswith("Nothing to change for this run: HF continuous batching maps KV pages")
    assert "compaction would gain nothing" in f.expected_effect and "without preemption" not in f.expected_effect
    other = kv_external_fragmentation(con, run, labels={"runtime": "custom"})[0]
    assert "allocate in fewer, larger" in other.suggestion and "compaction would let them succeed" in other.expected_effect
