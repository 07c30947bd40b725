"""Run vLLM's offline `LLM` API on a random-weight tiny Llama with the phasescope plugin on.

Run with the vLLM venv's python; prints one JSON line: vLLM's own counters
(`LLM.get_metrics()`) for the workload. Usage:
    python vllm_llm_run.py MODEL_DIR [--tp N] [--blocks N] [--requests N]
Start method and in-process mode come from the environment
(VLLM_WORKER_MULTIPROC_METHOD, VLLM_ENABLE_V1_MULTIPROCESSING).
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=34)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()

    import os

    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "fork":
        # the CPU platform forces spawn while building the config; put fork back afterwards so
        # EngineCore and the workers really are forked children (the plugin's fork trap)
        from vllm.platforms.cpu import CpuPlatform

        original = CpuPlatform.check_and_update_config.__func__

        def keep_fork(cls, vllm_config):  # noqa: ANN001
            original(cls, vllm_config)
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

        CpuPlatform.check_and_update_config = classmethod(keep_fork)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, block_size=32,
              enable_prefix_caching=True, enforce_eager=True, max_model_len=512, dtype="float32",
              num_gpu_blocks_override=args.blocks, max_num_seqs=8, max_num_batched_tokens=512,
              tensor_parallel_size=args.tp, disable_log_stats=False)
    prefix = list(range(10, 210))
    prompts = [TokensPrompt(prompt_token_ids=prefix + [300 + i] * 40) for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)
    outs = llm.generate(prompts, params)
    metrics = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if value is None:  # histograms: keep sum and count
            metrics[m.name + "_sum"] = metrics.get(m.name + "_sum", 0.0) + float(getattr(m, "sum", 0.0))
            metrics[m.name + "_count"] = metrics.get(m.name + "_count", 0) + int(getattr(m, "count", 0))
        elif isinstance(value, (int, float)):
            metrics[m.name] = metrics.get(m.name, 0) + value
    metrics["client_output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)
    print("PHASESCOPE_RESULT " + json.dumps(metrics), flush=True)


if __name__ == "__main__":
    main()
