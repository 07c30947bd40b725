"""The committed verification suite (docs/verify.md, benchmarks/results/verify/): every case's verdict recomputed
from the raw rows of both arms' runs, in numpy, without the analyzers' SQL (issue 29's acceptance)."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

from phasescope.analyzers.predictions import Prediction, verdict

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "verify"
DOC = ROOT / "docs" / "verify.md"


def _results() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]


def value_from_rows(metric: str, rows: dict[str, list]) -> float:
    """One run's metric from its raw rows (cli/verify.py RAW_SQL), by docs/definitions.md."""
    if metric == "preemptions":
        return float(sum(int(x) for x in rows["preemptions"]))
    if metric == "kv_internal_fragmentation":
        live, used, size = (np.asarray(rows[c], dtype=float) for c in ("live_tokens", "used_pages", "page_size_tokens"))
        keep = used > 0
        return float(np.mean(1 - live[keep] / (used[keep] * size[keep])))
    if metric == "itl_p99_ms":  # a gap of k tokens is k samples of gap / k
        gap, tokens = np.asarray(rows["gap_ns"], dtype=float), np.asarray(rows["tokens"], dtype=int)
        return float(np.quantile(np.repeat(gap / 1e6 / tokens, tokens), 0.99))
    if metric == "prefix_missed_tokens":  # each first admission's prompt tokens the cache did not serve
        return float(sum(int(n) - int(h) for n, h in zip(rows["prompt_tokens"], rows["hit_tokens"])))
    raise AssertionError(f"no raw-row definition for {metric}")


CASES = _results()


def test_the_suite_has_eight_cases_on_both_runtimes():
    runtimes = {r["prediction"]["runtime"] for r in CASES}
    assert len(CASES) >= 8 and {"vllm"} < runtimes, [(r["case"], r["prediction"]["runtime"]) for r in CASES]


@pytest.mark.parametrize("r", CASES, ids=[f"{r['case']}--{r['prediction']['finding_id']}" for r in CASES])
def test_each_verdict_follows_from_the_raw_rows_of_both_arms(r):
    p = r["prediction"]
    assert "raw" in r, "the result keeps no raw rows: re-run the case with benchmarks/verify_suite.py --cases"
    values = {}
    for arm in ("baseline", "changed"):
        assert len(r["raw"][arm]) == len(r[arm]) == len(r["runs"][arm]) >= 2
        values[arm] = [value_from_rows(p["metric"], rows) for rows in r["raw"][arm]]
        assert values[arm] == pytest.approx(r[arm], rel=1e-6, abs=1e-9), arm
    again = verdict(Prediction(**p), values["baseline"], values["changed"])
    assert again.verdict == r["verdict"]
    assert again.effect == pytest.approx(r["effect"], rel=1e-6, abs=1e-9)
    assert (again.error is None) == (r["error"] is None)
    if again.error is not None:
        assert again.error == pytest.approx(r["error"], rel=1e-6, abs=1e-9)
    # no harmful keep: a keep's whole interval is on the good side (lower is better for every metric)
    if r["verdict"].startswith("keep"):
        assert r["effect_high"] < 0


def test_the_table_holds_every_case_and_its_verdict():
    doc = DOC.read_text()
    for r in CASES:
        row = next((ln for ln in doc.splitlines() if ln.startswith(f"| {r['case']} / {r['prediction']['finding_id']} |")),
                   None)
        assert row is not None, r["case"]
        assert f"| {r['verdict']}" in row and f"| {r['prediction']['runtime']} |" in row
    assert f"Cases: {len(CASES)} (" in doc


def test_value_from_rows_definitions():
    assert value_from_rows("preemptions", {"request_id": ["a", "b"], "preemptions": [2, 0]}) == 2.0
    rows = {"live_tokens": [10, 0, 30], "used_pages": [1, 0, 2], "page_size_tokens": [32, 32, 32]}
    assert value_from_rows("kv_internal_fragmentation", rows) == pytest.approx(np.mean([1 - 10 / 32, 1 - 30 / 64]))
    # 99 gaps of 1 ms and one gap of 2 tokens over 100 ms: 101 samples, the top two 50 ms
    rows = {"gap_ns": [1_000_000] * 99 + [100_000_000], "tokens": [1] * 99 + [2]}
    assert value_from_rows("itl_p99_ms", rows) == pytest.approx(50.0)
    rows = {"request_id": ["a", "b", "c"], "prompt_tokens": [60, 60, 30], "hit_tokens": [0, 32, 16]}
    assert value_from_rows("prefix_missed_tokens", rows) == 60 + 28 + 14
    assert os.path.isdir(RESULTS)
