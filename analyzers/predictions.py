"""Testable predictions of findings, and the verdict of a re-run that checks one (issue 29).

A finding that quantifies its effect states, through `predict`, one metric: its value in the recorded
run, the value predicted after one runtime change, an interval, and that change as the runtime's own knob
(a vLLM flag, or an HF continuous-batching config field). A finding that names a direction but no number
has no prediction (`NOT_PREDICTED` says why) and is not counted in the verification table.

`verdict` compares two arms of re-runs of the same workload (the recorded configuration, and the one with
the change) with a Welch 95% interval of the difference of their means:

- `keep`: the target metric improved (the interval excludes zero, on the good side) and the measured
  effect is within `tolerance` (20%) of the predicted effect;
- `keep-but-mispredicted`: it improved, by more than `tolerance` away from the prediction;
- `revert`: no significant gain, or harm.

Pure: no I/O; the re-runs are `cli/verify.py`'s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from .findings import Finding
from .runinfo import runtime_of

# what each metric is, its unit, and which way is better (all of these: lower)
METRICS: dict[str, tuple[str, str]] = {
    "itl_p99_ms": ("p99 inter-token latency", "ms"),
    "kv_internal_fragmentation": ("mean slack inside used KV pages", "fraction"),
    "preemptions": ("preemptions in the run", "count"),
    "prefix_missed_tokens": ("prompt tokens the prefix cache did not serve at first admission", "tokens"),
}

# relative error of each prediction model, the half-width of its stated interval: measured by the verify suite
# (docs/verify.md, `python benchmarks/verify_suite.py`); revised there when the suite says otherwise
MODEL_ERROR: dict[str, float] = {"itl_p99_ms": 0.25, "kv_internal_fragmentation": 0.25, "preemptions": 0.0,
                                 "prefix_missed_tokens": 0.1}

# where the verify suite could not confirm a model within its stated error, what is known of its error instead
# (issue 29: "where that is not possible, the finding's text states its known error"); the finding's text quotes it
KNOWN_ERROR: dict[str, str] = {
    "itl_p99_ms": "not confirmed by re-runs on CPU: in the verify suite (docs/verify.md) the re-runs' p99 ITL on "
                  "2 shared cores is set by host scheduling stalls, not by the prefill sharing the step, and varies "
                  "~10x between runs of the same workload, so the measured effect's 95% interval spans zero "
                  "(verdict revert, interval not converged); treat the predicted p99 as an estimate of the compute "
                  "part only",
}

NOT_PREDICTED: dict[str, str] = {
    "prefill-stalls-decode": "predicts the co-scheduled step time at the suggested chunk, a figure that has no steps "
                             "left to measure once prefills are chunked: verified through itl-spikes-prefill's p99 ITL",
    "ttft-queueing": "names where capacity is missing (budget, replicas, admission), not one change with a number",
    "preemption-recompute": "states the cost of recompute, not the effect of one change",
    "kv-external-fragmentation": "the effect of compaction on allocation failures is not modelled",
    "kv-headroom-low": "a warning on headroom, not a change with a predicted number",
    "prefix-hit-collapse": "the hit rate after a prefix layout change depends on the application's prompts",
}


@dataclass(frozen=True)
class Prediction:
    """One finding's testable claim: `metric` (a key of METRICS, in its unit) was `current` in the run and is
    predicted to be `predicted` (interval `low`..`high`) after `change` (the runtime's knob -> value)."""

    finding_id: str
    run_id: str | None
    metric: str
    current: float
    predicted: float
    low: float
    high: float
    change: dict[str, Any]
    runtime: str
    model_error: float

    @property
    def predicted_effect(self) -> float:
        """predicted - current, in the metric's unit (negative: an improvement)."""
        return self.predicted - self.current

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict(finding: Finding, labels: Mapping[str, str] | None = None) -> Prediction | None:
    """The finding's prediction, or None when it states no number (`NOT_PREDICTED`)."""
    e, runtime = finding.evidence, runtime_of(dict(labels or {})) or "unknown"
    if finding.id == "itl-spikes-prefill" and e.get("predicted_itl_p99_ms") is not None:
        chunk = int(e["suggested_chunk_tokens"])
        if runtime == "vllm":
            change: dict[str, Any] = {"--max-num-batched-tokens": chunk}
            if not e.get("chunked_prefill"):
                change["--enable-chunked-prefill"] = True
        else:
            change = {"max_batch_tokens": chunk}
        return _make(finding, "itl_p99_ms", float(e["itl_p99_ms"]), float(e["predicted_itl_p99_ms"]), change, runtime)
    if finding.id == "kv-internal-fragmentation" and e.get("suggested_page_size") != e.get("page_size"):
        change = _page_change(runtime, int(e["page_size"]), int(e["suggested_page_size"]), labels)
        # the model's effect (from the requests' lengths) applied to the measured slack of the run
        now = float(e["internal_fragmentation_mean"])
        after = now + float(e["predicted_waste_suggested"]) - float(e["predicted_waste_current"])
        return _make(finding, "kv_internal_fragmentation", now, max(after, 0.0), change, runtime)
    if finding.id == "kv-near-cap" and e.get("max_seqs_without_preemption") and e.get("preemptions"):
        # the sequence cap of its suggestion: that many p95-long sequences fit the cache, so none is preempted
        # (a longer one still may: the p95, not the longest, sizes the cap)
        fit = int(e["max_seqs_without_preemption"])
        change = {"--max-num-seqs": fit} if runtime == "vllm" else {"max_requests_per_batch": fit}
        return _make(finding, "preemptions", float(e["preemptions"]), 0.0, change, runtime)
    if finding.id == "prefix-miss-sub-page" and e.get("suggested_page_size_tokens") and e.get("page_size_tokens"):
        # the page its suggestion names serves the whole pages of each lookup's shared prefix (the finding's
        # `smaller_page_saved_tokens`, counted per first admission from the lookups' shared lengths)
        change = _page_change(runtime, int(e["page_size_tokens"]), int(e["suggested_page_size_tokens"]), labels)
        now = float(e["missed_tokens"])
        return _make(finding, "prefix_missed_tokens", now, max(now - float(e["smaller_page_saved_tokens"]), 0.0),
                     change, runtime)
    return None


def _page_change(runtime: str, page: int, choice: int, labels: Mapping[str, str] | None) -> dict[str, Any]:
    """The runtime's knob for pages of `choice` tokens instead of `page`. The change keeps the cache's memory: as
    many tokens in smaller pages (vLLM sizes its pool from memory; HF CB is told `num_pages`, scaled)."""
    if runtime == "vllm":
        return {"--block-size": choice}
    pages = _int((labels or {}).get("num_pages"))
    return {"page_size": choice, **({"num_pages": pages * page // choice} if pages else {})}


def why_not_predicted(finding_id: str) -> str:
    """Why `finding_id` carries no prediction."""
    return NOT_PREDICTED.get(finding_id, "this finding names a direction, not a number")


def _make(f: Finding, metric: str, current: float, predicted: float, change: dict[str, Any],
          runtime: str) -> Prediction:
    err = MODEL_ERROR[metric]
    half = abs(predicted - current) * err  # the interval is on the effect: a 25% error of the predicted change
    return Prediction(f.id, f.run_id, metric, current, predicted, predicted - half, predicted + half, change,
                      runtime, err)


def _int(v: object) -> int | None:
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return None


# two-sided 95% Student t critical values by degrees of freedom (1..30; the normal 1.96 beyond): one quantile
# table instead of a scipy dependency for it
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t95(df: float) -> float:
    """Two-sided 95% t critical value for `df` degrees of freedom (rounded down: the wider interval)."""
    if not df >= 1:
        return _T95[0]
    return _T95[int(df) - 1] if df < 31 else 1.96


def welch_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(mean(b) - mean(a), low, high): the difference of means with its Welch 95% interval (each arm >= 2)."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("each arm needs at least 2 runs for an interval")
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1)
    sa, sb = va / len(a), vb / len(b)
    se = math.sqrt(sa + sb)
    if se == 0.0:
        return mb - ma, mb - ma, mb - ma
    df = (sa + sb) ** 2 / ((sa ** 2 / (len(a) - 1) if sa else 0.0) + (sb ** 2 / (len(b) - 1) if sb else 0.0))
    h = t95(df) * se
    return mb - ma, mb - ma - h, mb - ma + h


@dataclass(frozen=True)
class Verification:
    """A prediction checked by re-runs: `baseline` and `changed` hold the metric of each run (same unit),
    `effect` = mean(changed) - mean(baseline) with its 95% interval, `expected` the predicted effect on these
    re-runs (`expected_effect`), `error` = |effect - expected| / |effect| (None when nothing measurable changed)."""

    prediction: Prediction
    baseline: list[float]
    changed: list[float]
    effect: float
    effect_low: float
    effect_high: float
    expected: float
    error: float | None
    verdict: str  # "keep" | "keep-but-mispredicted" | "revert"
    runs: dict[str, list[str]] = field(default_factory=dict)  # arm -> run ids, for the raw rows

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["prediction"] = self.prediction.to_dict()
        return out


def expected_effect(p: Prediction, baseline: list[float]) -> float:
    """The predicted effect on the re-runs: the prediction's relative change applied to the baseline arm's mean.
    The re-runs serve the same workload on the machine at hand, whose speed may differ from the recorded run's;
    a relative effect carries over, an absolute one in ms would not. Equals `p.predicted_effect` when the baseline
    re-runs measure what the recorded run did."""
    mean = sum(baseline) / len(baseline)
    return (p.predicted / p.current - 1.0) * mean if p.current else p.predicted_effect


def verdict(p: Prediction, baseline: list[float], changed: list[float], tolerance: float = 0.2,
            runs: dict[str, list[str]] | None = None) -> Verification:
    """Keep, keep-but-mispredicted or revert (module docstring); lower is better for every METRICS entry."""
    effect, lo, hi = welch_interval(baseline, changed)
    expected = expected_effect(p, baseline)
    error = abs(effect - expected) / abs(effect) if effect else None
    if hi < 0:
        word = "keep" if error is not None and error <= tolerance else "keep-but-mispredicted"
    else:
        word = "revert"
    return Verification(p, list(baseline), list(changed), effect, lo, hi, expected, error, word, dict(runs or {}))
