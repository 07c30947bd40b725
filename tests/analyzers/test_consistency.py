"""One report never contradicts itself and follows the run's configuration (every scenario fixture)."""

from __future__ import annotations

import re
import shutil

import pytest

from builders.scenarios import SCENARIOS
from phasescope.analyzers.diagnose import diagnose
from phasescope.analyzers.prefill import chunked_prefill
from phasescope.analyzers.runinfo import read_run_info, record_run_info

RAISE_BUDGET = re.compile(r"raise the per-step token budget", re.I)
LOWER_BUDGET = re.compile(r"(lower it to ~\d+ tokens|chunk of ~\d+ tokens)", re.I)
ENABLE_CHUNKED = re.compile(r"enable chunked prefill", re.I)
MORE_KV = re.compile(r"(raise the KV budget|raise --gpu-memory-utilization|raise the batch(?! only once))", re.I)
LESS_KV = re.compile(r"(lower the KV budget|cap the KV budget)", re.I)


def contradictions(findings, labels) -> list[str]:
    text = {f.id: f.suggestion for f in findings}
    out = []
    if any(RAISE_BUDGET.search(t) for t in text.values()) and any(LOWER_BUDGET.search(t) for t in text.values()):
        out.append("per-step token budget both raised and lowered")
    if any(MORE_KV.search(t) for t in text.values()) and any(LESS_KV.search(t) for t in text.values()):
        out.append("KV memory both raised and lowered")
    chunked, _ = chunked_prefill(labels)
    if chunked and any(ENABLE_CHUNKED.search(t) for t in text.values()):
        out.append("enables chunked prefill on a run that has it")
    for fid, t in text.items():
        if re.search(r"~0\b", t):
            out.append(f"{fid}: advises ~0")
    return out


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_scenario_report_contradicts_itself_or_its_labels(scenario, name):
    con, run_id = scenario(name)
    labels = read_run_info(con, run_id)
    findings = diagnose(con, run_id)
    assert contradictions(findings, labels) == [], [f.suggestion for f in findings]


def test_queueing_next_to_stalled_decode_does_not_raise_the_budget(scenario):
    # service-mix: the demo's default workload stalls decode; pin that queueing advice then keeps the budget
    from phasescope.analyzers.diagnose import reconcile
    from phasescope.analyzers.findings import Finding

    q = Finding(id="ttft-queueing", title="t", severity="warning",
                evidence={"query": "q", "max_prefill_tokens_per_step": 256},
                suggestion="x", expected_effect="e", reference="r")
    from phasescope.analyzers.queueing import queueing_suggestion

    q = Finding(**{**q.__dict__, "suggestion": queueing_suggestion(q.evidence, True) + " Offered load ..."})
    stall = Finding(id="prefill-stalls-decode", title="s", severity="warning", evidence={"query": "q"},
                    suggestion="lower it to ~64 tokens", expected_effect="e", reference="r")
    out = {f.id: f for f in reconcile([stall, q])}
    assert RAISE_BUDGET.search(q.suggestion)
    assert not RAISE_BUDGET.search(out["ttft-queueing"].suggestion)
    assert "keep the per-step token budget" in out["ttft-queueing"].suggestion
    assert out["ttft-queueing"].suggestion.endswith(" Offered load ...")


@pytest.mark.parametrize("labels,expect", [
    ({"runtime": "vllm", "enable_chunked_prefill": "True", "max_num_batched_tokens": "8192"}, "lower it to ~"),
    ({"runtime": "vllm", "enable_chunked_prefill": "False"}, "Enable chunked prefill"),
    ({"runtime": "vllm", "enable_chunked_prefill": "True", "max_num_batched_tokens": "16"}, "already on"),
])
def test_prefill_advice_reads_the_runs_chunked_prefill_labels(scenario_db, tmp_path, labels, expect):
    src, run_id = scenario_db("prefill-interference")
    path = str(tmp_path / "labelled.duckdb")
    shutil.copy(src, path)
    con0 = __import__("duckdb").connect(path)
    con0.execute("DELETE FROM run_info WHERE key IN ('runtime', 'max_batch_tokens')")
    con0.close()
    record_run_info(path, run_id, labels)
    import duckdb

    con = duckdb.connect(path, read_only=True)
    try:
        f = {x.id: x for x in diagnose(con, run_id)}["prefill-stalls-decode"]
    finally:
        con.close()
    assert expect in f.suggestion
    if labels.get("enable_chunked_prefill") == "True":
        assert "Enable chunked prefill" not in f.suggestion
