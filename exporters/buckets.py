"""Histogram bucket boundaries: vLLM's, the OpenTelemetry GenAI conventions', and ours.

Prometheus histograms use supersets of vLLM's lists (checked against vLLM's
`v1/metrics/loggers.py`), so dashboards and alerts written for vLLM keep working
on `le` values they already know. OTLP histograms use exactly the boundaries
the GenAI semantic conventions recommend (`docs/gen-ai/gen-ai-metrics.md`).
All latencies are in seconds.
"""

from __future__ import annotations

from typing import Iterable

# --- vLLM (prometheus stat logger) ---
VLLM_TTFT_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TPOT_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)  # also its inter-token latency buckets
VLLM_E2E_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
              480.0, 960.0, 1920.0, 7680.0)  # also its queue / prefill / decode time buckets

# --- OpenTelemetry GenAI semantic conventions (recommended ExplicitBucketBoundaries) ---
SEMCONV_TTFT_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
SEMCONV_TPOT_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
SEMCONV_REQUEST_DURATION_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                              40.96, 81.92)
SEMCONV_TOKEN_USAGE = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216,
                       67108864)


def union(*lists: Iterable[float]) -> tuple[float, ...]:
    """Sorted union of boundary lists (a superset of each)."""
    return tuple(sorted({float(b) for lst in lists for b in lst}))


# --- what the Prometheus exporter uses (supersets; small values added for fast GPUs) ---
TTFT_S = union(VLLM_TTFT_S, SEMCONV_TTFT_S)
TPOT_S = union((0.001, 0.0025, 0.005), VLLM_TPOT_S, SEMCONV_TPOT_S)
ITL_S = TPOT_S
REQUEST_DURATION_S = union(VLLM_E2E_S, SEMCONV_REQUEST_DURATION_S)
PHASE_TIME_S = union((0.001, 0.005), REQUEST_DURATION_S)  # queue, prefill and decode time of a request
STEP_S = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15,
          0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)  # one forward of the model
TOKEN_USAGE = tuple(float(b) for b in SEMCONV_TOKEN_USAGE)
SKEW_RATIO = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)  # TP step skew, max/median - 1
