"""Whether the vLLM adapter leaves vLLM's objects on CPython's attribute fast path (agent/probe/shadow.py: why).

Run with the vLLM venv's python. Builds vLLM's real V1 `Scheduler` (with its KV cache manager, block pool and free
queue) and `OutputProcessor` twice, plain and armed (the adapter's catchers), pauses and resumes the armed ones
(pause.py), and prints one JSON line: for each object, whether its instance `__dict__` is materialized (the
slow path) in the plain and in the armed build, and the wrappers installed. Detected through the garbage
collector's view of the object (a materialized dict is a referent; inline values are not), so the check itself
never touches `__dict__`.
"""

from __future__ import annotations

import gc
import json
import pathlib

MODEL = pathlib.Path(__file__).resolve().parent / "tiny-llama"  # config.json only: nothing is loaded


def materialized(obj: object) -> bool:
    """Whether `obj`'s instance dict exists as a dict object (CPython 3.11/3.12: the slow attribute path)."""
    return any(type(r) is dict for r in gc.get_referents(obj))


def build() -> dict[str, object]:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    mc = ModelConfig(model=str(MODEL), skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=512)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512, enable_chunked_prefill=True,
                         is_encoder_decoder=False)
    cc = CacheConfig(block_size=16, enable_prefix_caching=True)
    cfg = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    kvc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32))])
    cc.num_gpu_blocks = 64
    proc = OutputProcessor(None, log_stats=False)
    sched = Scheduler(vllm_config=cfg, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(cfg),
                      block_size=16, log_stats=False)
    kvm = sched.kv_cache_manager
    return {"scheduler": sched, "kv_cache_manager": kvm, "block_pool": kvm.block_pool,
            "free_block_queue": kvm.block_pool.free_block_queue, "output_processor": proc}


def main() -> None:
    from phasescope.agent.probe.adapters import vllm as adapter
    from phasescope.agent.probe.adapters.vllm import pause, wrappers

    plain = build()
    adapter.install()
    armed = build()
    hooked = sorted({f"{type(o).__name__}.{name}" for o, name, *_ in wrappers.WRAPPERS})
    before = {k: materialized(o) for k, o in armed.items()}
    pause.set_paused(True)
    pause.set_paused(False)
    out = {"plain": {k: materialized(o) for k, o in plain.items()}, "armed": before,
           "after_pause": {k: materialized(o) for k, o in armed.items()}, "hooked": hooked}
    print("PHASESCOPE_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
