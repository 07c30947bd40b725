"""The prefix-miss workload served by vLLM's offline `LLM` API (scenario `prefix-miss-vllm`).

Stdlib only at import: `scenarios` and the tests read the workload from here; `main()` runs in
the vLLM venv (phasescope installed there, the plugin armed by `PHASESCOPE_AGENT`), serves the
prompts one at a time (each to completion before the next, so every earlier prompt's whole
pages are cached when a prompt is looked up, unless evicted) and prints vLLM's own counters
(`LLM.get_metrics()`) as one JSON line after `RESULT_TAG`.

    python -m phasescope.agent.vllm_workload MODEL_DIR
"""

from __future__ import annotations

import argparse
import json

PAGE_TOKENS = 32  # vLLM --block-size
POOL_PAGES = 8  # usable KV pages (vLLM takes one more for its null block)
MAX_MODEL_LEN = 256
OUTPUT_TOKENS = 4
RESULT_TAG = "PHASESCOPE_VLLM_RESULT "


def prefix_miss_workload() -> list[tuple[str, list[int]]]:
    """(name, prompt token ids), served in order, one at a time. Every token is fresh unless stated.

    a1..a5: a 24-token shared prefix (shorter than a page of 32) then 40 tokens of their own (64);
    d0: a 96-token (3-page) document then 20 tokens (116); d1: the document then 20 tokens (3 pages hit);
    d2: the document, the first 10 of d1's own 20 tokens, then 20 (126: 3 pages hit, 10 tokens shared
    inside the next page); burst: 250 tokens, 8 pages with its outputs, every page of the pool, so every
    cached page is evicted; d3: the document then 20 tokens (its 3 pages evicted before this reuse).
    """
    nxt = iter(range(3, 1024))  # the tiny model's vocabulary; 0-2 are special

    def fresh(n: int) -> list[int]:
        return [next(nxt) for _ in range(n)]

    short, doc = fresh(24), fresh(96)
    out = [(f"a{i}", short + fresh(40)) for i in range(1, 6)]
    d1_own = fresh(20)
    out += [("d0", doc + fresh(20)), ("d1", doc + d1_own), ("d2", doc + d1_own[:10] + fresh(20)),
            ("burst", fresh(250)), ("d3", doc + fresh(20))]
    return out


def engine_args() -> dict:
    """The `LLM(...)` arguments of the run (recorded in the fixture's config)."""
    return dict(load_format="dummy", skip_tokenizer_init=True, block_size=PAGE_TOKENS, enable_prefix_caching=True,
                enforce_eager=True, max_model_len=MAX_MODEL_LEN, dtype="float32",
                num_gpu_blocks_override=POOL_PAGES + 1, max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN,
                disable_log_stats=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m phasescope.agent.vllm_workload")
    ap.add_argument("model", help="model folder (config.json; weights are random: load_format dummy)")
    args = ap.parse_args(argv)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, **engine_args())
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0)
    outputs = 0
    for _, prompt in prefix_miss_workload():
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        outputs += sum(len(o.outputs[0].token_ids) for o in outs)
    metrics: dict = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            metrics[m.name] = metrics.get(m.name, 0) + value
    metrics["client_output_tokens"] = outputs
    print(RESULT_TAG + json.dumps({"vllm_version": vllm.__version__, "metrics": metrics}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
