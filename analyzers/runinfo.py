"""Run labels: `run_info(run_id, key, value)` rows the analyzers read when present.

The probe sends the model geometry, GPU name and TP size itself (agent/probe/labels.py),
and adapters their runtime's knobs; offline files (and scenario fixtures) get more with
`record_run_info`. Live runs should label every run — the config values an experiment varies (`kv_dtype`,
`kv_budget_gib`, `max_num_seqs`, `tp`, ...) plus the model and GPU keys below —
so that `phasescope compare` and the roofline / planner rules have them.

Well-known keys (all values are stored as text):
- model: `model_layers`, `model_heads`, `model_kv_heads`, `model_head_dim`,
  `model_hidden`, `model_intermediate`, `model_vocab`, `model_params`,
  `model_dtype`, `model_tied_embeddings`
- GPU: `gpu_name` (an NVML name or a key of `gpus.GPUS`), `gpu_mem_bytes`
- deployment: `tp` (ranks), `kv_dtype`, `max_num_seqs`, `context_tokens`
- workload: `shared_prefix_tokens` (tokens every prompt shares), `prefix_position`
  ("first" or "last")
- `oom_total` (out-of-memory errors the server counted)

Schema addition (to move into agent/schema.py):
    CREATE TABLE IF NOT EXISTS run_info (run_id VARCHAR, key VARCHAR, value VARCHAR,
                                         PRIMARY KEY (run_id, key))
"""

from __future__ import annotations

from typing import Any, Mapping

import duckdb

from phasescope.agent.records.schema import RUN_INFO_DDL  # one definition, in the store schema


def record_run_info(target: str | duckdb.DuckDBPyConnection, run_id: str,
                    labels: Mapping[str, Any] | None = None, **kv: Any) -> None:
    """Write (or overwrite) labels of `run_id` into a DuckDB file no agent holds, or a writable connection."""
    items = {**(labels or {}), **kv}
    con = duckdb.connect(target) if isinstance(target, str) else target
    try:
        con.execute(RUN_INFO_DDL)
        for key, value in items.items():
            con.execute("INSERT OR REPLACE INTO run_info VALUES (?, ?, ?)", [run_id, str(key), _text(value)])
    finally:
        if isinstance(target, str):
            con.close()


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def has_run_info(con: duckdb.DuckDBPyConnection) -> bool:
    return bool(con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'run_info'").fetchone()[0])


def read_run_info(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, str]:
    """Labels of one run ({} when the table or the run is absent)."""
    if not has_run_info(con):
        return {}
    rows = con.execute("SELECT key, value FROM run_info WHERE run_id = ? ORDER BY key", [run_id]).fetchall()
    return dict(rows)


def as_number(value: str | None) -> float | None:
    """A label as a number (None when absent or not numeric)."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


# run label -> the vLLM flag that sets it (the vLLM plugin labels runs with these keys)
VLLM_FLAGS = {
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--max-num-seqs": "max_num_seqs",
    "--block-size": "block_size",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--num-gpu-blocks-override": "num_gpu_blocks",
    "--enable-chunked-prefill": "enable_chunked_prefill",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--enforce-eager": "enforce_eager",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--max-model-len": "max_model_len",
    "--tensor-parallel-size": "tp",
}


def with_flag_values(text: str, labels: Mapping[str, str]) -> str:
    """On a vLLM run, each vLLM flag `text` names gets the run's value after it, and after the value the text
    suggests when there is one: "--max-num-seqs (now 8)", "--max-num-seqs 4 (now 8)" (so the flag and its
    value stay one exact command-line fragment)."""
    if labels.get("runtime") != "vllm":
        return text
    import re

    for flag, key in VLLM_FLAGS.items():
        if key in labels and f"{flag} (now" not in text:
            text = re.sub(re.escape(flag) + r"(?![\w-])( [0-9][\w.]*| fp8\w*| auto\b)?",
                          lambda m, f=flag, k=key: f"{f}{m.group(1) or ''} (now {labels[k]})", text, count=1)
    return text


# runtime names as the probes (sources.runtime) and the demo's labels give them -> one name
RUNTIME_ALIASES = {"cb": "hf-cb", "generate": "hf-generate"}
PAGED_RUNTIMES = ("vllm", "hf-cb")  # map KV pages through a page table: no contiguous run is ever needed


def runtime_of(labels: Mapping[str, Any] | None) -> str:
    """The run's runtime: vllm, hf-cb, hf-generate, module, or '' when unknown (diagnose fills the `runtime`
    label from the probes' own when the run has none)."""
    rt = str((labels or {}).get("runtime") or "").strip().lower()
    return RUNTIME_ALIASES.get(rt, rt)


def budget_knob(runtime: str, value: int | None = None) -> str:
    """The per-step token budget's name in `runtime` (with `value` when given)."""
    v = "" if value is None else str(value)
    vllm = f"vLLM --max-num-batched-tokens{' ' + v if v else ''}"
    hf = f"HF continuous batching max_batch_tokens{'=' + v if v else ''}"
    return {"vllm": vllm, "hf-cb": hf}.get(runtime, f"{vllm}; {hf}")
