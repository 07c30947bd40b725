"""vLLM V1 adapter: records from vLLM's scheduler, block pool, workers and output processor (vllm 0.32; 0.24 on
GPU), one module per process it runs in:

- `engine`: EngineCore process (`Scheduler` instance): request lifecycle, prefix lookups, the step's KV snapshot;
  `kvaccount`: its paged-KV figures kept incrementally from the block pool's own counts; `budget`: the adapter's
  own time per step against a share of the step time, and the detail it lowers when over;
- `worker`: each TP rank's worker (`Worker` instance): one `Step` per engine step, timed around
  `execute_model` + `sample_tokens`;
- `frontend`: the `OutputProcessor` (API server or `LLM`): token and finish times where vLLM measures them;
- `install`: the one-shot class catchers; `common`: channels, failures, the guarded self-timed wrapper, clocks;
  `labels`: run labels from the `VllmConfig`; `wrappers`: the registry of every wrapper installed, which `pause`
  (a benchmark's control, never armed by the plugin on its own) takes off and puts back. The vLLM plugin entry
  points are in `adapters/vllm_plugin.py`.

Everything is wrapped on instances; the classes are touched only to catch their first instance and are put back
at once. Every wrapper is guarded: an exception is counted as a probe error, logged once, and vLLM runs on
untouched; a part of vLLM this adapter cannot read is disarmed alone and counted (`failures()`, run label
`adapter_missing`). Imports nothing from vLLM at module import; `install()` does.
"""

from __future__ import annotations

from ....settings import ENV_RUN_ID
from .budget import ENV_BUDGET, LEVELS
from .common import (
    RUNTIME, WARMUP_PREFIX, channel, close_channels, engine_lead_us, failures, is_abort as _is_abort,
    mono_of_wall, reset_after_fork, run_id, wall_minus_mono_ns, wrap,
)
from .engine import ENV_KV_EVERY, ENV_PREFIX_TABLE, ENV_TOKENS_AT, EngineHooks
from .frontend import FrontendHooks
from .install import _HOOKED, _catch_first, install
from .kvaccount import ENV_PAGE_SAMPLE, cached_pages, pool_stats
from .labels import CONFIG_LABELS, _model_name, block_size_rule, config_labels, engine_side_labels
from ....records.events import short_id
from .worker import StepShaper, WorkerHooks, split_tokens, step_shape

__all__ = [
    "CONFIG_LABELS", "ENV_BUDGET", "ENV_KV_EVERY", "ENV_PAGE_SAMPLE", "ENV_PREFIX_TABLE", "ENV_RUN_ID", "ENV_TOKENS_AT",
    "LEVELS", "RUNTIME", "WARMUP_PREFIX", "EngineHooks", "FrontendHooks", "StepShaper", "WorkerHooks", "_HOOKED",
    "_catch_first", "_is_abort", "_model_name", "block_size_rule", "cached_pages", "channel", "close_channels",
    "config_labels", "engine_lead_us", "engine_side_labels", "failures", "install", "mono_of_wall", "pool_stats",
    "reset_after_fork", "run_id", "self_cost_us", "short_id", "split_tokens", "step_shape", "wall_minus_mono_ns", "wrap",
]


def self_cost_us() -> dict:
    """The engine hooks' own sampled time per engine step by part (us), and the KV walks' and lowering state."""
    out: dict = {}
    for h in _HOOKED.values():
        if isinstance(h, EngineHooks):
            b = h.budget
            out = dict(b.cost_us(), level=b.level, budget=b.share, measured_steps=b.measured,
                       share_used=round(b.hook_ns / b.step_ns, 5) if b.step_ns else None)
            if h.kv is not None:
                out.update(kv_walks=h.kv.walks, kv_recount_off=h.kv.recount_off)
    return out
