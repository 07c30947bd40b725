"""Workloads served by vLLM's offline API for the vLLM scenario fixtures (`scenarios.py`, kind `vllm`).

Stdlib only at import: `scenarios` and the tests read the workloads from here; `main()` runs in
the vLLM venv (phasescope installed there, the plugin armed by `PHASESCOPE_AGENT`) and prints
vLLM's own counters (`LLM.get_metrics()`) and what the run did as one JSON line after `RESULT_TAG`.

- `prefix-miss` (`prefix-miss-vllm`): `prefix_miss_workload()` served one prompt at a time (each to
  completion before the next, so every earlier prompt's whole pages are cached when a prompt is looked
  up, unless evicted).
- `itl` (`itl-spikes-vllm`): `itl_workload()` driven step by step through the engine (in-process, so one
  `LLMEngine.step()` is one engine step): long-output decoders, and a long prompt added every
  `ITL_EVERY_STEPS` steps, prefilled in chunks of the token budget next to their decodes.
- `silent` (`telemetry-silent-vllm`): `silent_workload()` served one prompt at a time, one every
  `SILENT_PACE_S`; after the first `SILENT_AFTER` prompts (between two requests) the adapter's KV snapshots
  and prefix counters are switched off (in-process, so the scheduler's hooks are in this process), as an
  adapter that lost its hooks would, while the remaining requests and their steps go on.
- `healthy` (`healthy-vllm`): `healthy_workload()` driven step by step through the engine (in-process): prompts
  behind a shared system prompt of whole pages, one added every `HEALTHY_EVERY_STEPS` steps, a pool far larger
  than the run needs (nothing evicted, nothing preempted), chunked prefill at a budget no prompt fills.

    python tests/builders/vllm_workload.py MODEL_DIR [--workload prefix-miss|itl|silent|healthy]
"""

from __future__ import annotations

import argparse
import json
import time

PAGE_TOKENS = 32  # vLLM --block-size
POOL_PAGES = 8  # usable KV pages (vLLM takes one more for its null block)
MAX_MODEL_LEN = 256
OUTPUT_TOKENS = 4
RESULT_TAG = "PHASESCOPE_VLLM_RESULT "

# itl: a model big enough on CPU that a prefill chunk costs several decode steps (the tiny config, widened)
ITL_MODEL = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4,
                 num_hidden_layers=4)
ITL_BUDGET = 256  # max_num_batched_tokens: a step's tokens, decodes included (chunked prefill)
ITL_DECODERS = 3  # requests decoding all along
ITL_DECODE_TOKENS = 240  # their outputs
ITL_LONG = 8  # long prompts, one every ITL_EVERY_STEPS engine steps
ITL_LONG_TOKENS = 400
ITL_LONG_OUTPUT = 2
ITL_EVERY_STEPS = 28

# silent: prompts served one at a time, one every SILENT_PACE_S; the adapter goes silent after SILENT_AFTER
SILENT_PROMPTS = 30
SILENT_AFTER = 6
SILENT_PACE_S = 0.5
SILENT_OUTPUT = 8

# healthy: HEALTHY_PROMPTS prompts (a 2-page system prompt + 8..24 tokens of their own), one every few steps, on the
# widened model of itl (a decode step reads its weights: ~20 ms on CPU, while a prefill token costs ~1.3 ms)
HEALTHY_PROMPTS = 24
HEALTHY_SYSTEM_TOKENS = 2 * PAGE_TOKENS
HEALTHY_OUTPUT = 64  # tokens per request: 24 x 63 = 1512 ITL samples (itl-spikes needs >= 500)
HEALTHY_EVERY_STEPS = 4  # one arrival every 4 engine steps: ~16 requests decoding at once
HEALTHY_POOL_PAGES = 256  # usable KV pages; the run holds at most ~2 + 17 x 3 of them
HEALTHY_MAX_SEQS = 24  # above the ~16 running at once: no request waits for a slot
HEALTHY_BUDGET = 32  # max_num_batched_tokens (chunked prefill): ~16 decodes + a prefill chunk of ~16 tokens


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


def itl_workload() -> list[tuple[str, list[int], int, int]]:
    """(name, prompt token ids, max tokens, engine step it is added before), in order of addition.

    dec0..dec2: 16-token prompts decoding ITL_DECODE_TOKENS tokens, added at step 0; long0..long7:
    ITL_LONG_TOKENS-token prompts of ITL_LONG_OUTPUT tokens, one added before step 8 + 28 k: each is
    prefilled in chunks of the budget left by the decodes (256 - 3 = 253, then 147), while dec0..dec2
    decode. No two prompts share a page: token ids cycle over the 1021 ids of the vocabulary past the 3
    special ones, so each prompt starts at its own offset of the cycle (1021 is prime: 48 + 400 k differ mod 1021).
    """
    ids = iter(i % 1021 + 3 for i in range(10**6))

    def fresh(n: int) -> list[int]:
        return [next(ids) for _ in range(n)]

    out = [(f"dec{i}", fresh(16), ITL_DECODE_TOKENS, 0) for i in range(ITL_DECODERS)]
    out += [(f"long{k}", fresh(ITL_LONG_TOKENS), ITL_LONG_OUTPUT, 8 + ITL_EVERY_STEPS * k) for k in range(ITL_LONG)]
    return out


def silent_workload() -> list[tuple[str, list[int]]]:
    """(name, prompt): s0..s29, a 64-token (2-page) shared system prompt then 24 tokens of their own (88)."""
    nxt = iter(range(3, 1024))

    def fresh(n: int) -> list[int]:
        return [next(nxt) for _ in range(n)]

    system = fresh(64)
    return [(f"s{i}", system + fresh(24)) for i in range(SILENT_PROMPTS)]


def healthy_workload() -> list[tuple[str, list[int], int, int]]:
    """(name, prompt token ids, max tokens, engine step it is added before), in order of addition.

    h0..h23: the HEALTHY_SYSTEM_TOKENS-token (2-page) system prompt then 8 + 5 i mod 17 fresh tokens of their
    own (8..24; 72..88 in all), HEALTHY_OUTPUT tokens each, h_i added before step HEALTHY_EVERY_STEPS x i. Every
    token id past the system prompt is used once (64 + 480 ids of the 1021 past the 3 special ones), so a
    prompt shares exactly the system prompt's 2 whole pages with the earlier ones.
    """
    nxt = iter(range(3, 1024))

    def fresh(n: int) -> list[int]:
        return [next(nxt) for _ in range(n)]

    system = fresh(HEALTHY_SYSTEM_TOKENS)
    return [(f"h{i}", system + fresh(8 + 5 * i % 17), HEALTHY_OUTPUT, HEALTHY_EVERY_STEPS * i)
            for i in range(HEALTHY_PROMPTS)]


def engine_args(workload: str = "prefix-miss") -> dict:
    """The `LLM(...)` arguments of a workload's run (recorded in the fixture's config)."""
    base = dict(load_format="dummy", skip_tokenizer_init=True, block_size=PAGE_TOKENS, enable_prefix_caching=True,
                enforce_eager=True, dtype="float32", disable_log_stats=False)
    if workload == "itl":
        return dict(base, max_model_len=512, hf_overrides=ITL_MODEL, max_num_seqs=ITL_DECODERS + 1,
                    max_num_batched_tokens=ITL_BUDGET, enable_chunked_prefill=True)
    if workload == "healthy":
        return dict(base, max_model_len=MAX_MODEL_LEN, hf_overrides=ITL_MODEL,
                    num_gpu_blocks_override=HEALTHY_POOL_PAGES + 1, max_num_seqs=HEALTHY_MAX_SEQS,
                    max_num_batched_tokens=HEALTHY_BUDGET, enable_chunked_prefill=True)
    if workload == "silent":
        return dict(base, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN)
    return dict(base, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=POOL_PAGES + 1, max_num_seqs=8,
                max_num_batched_tokens=MAX_MODEL_LEN)


def _metrics(llm) -> dict:
    """vLLM's own metrics (`LLM.get_metrics()`), summed over label sets: counters and gauges by name,
    histograms as `<name>_count` and `<name>_sum` (seconds)."""
    out: dict = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            out[m.name] = out.get(m.name, 0) + value
        elif isinstance(getattr(m, "count", None), int) and isinstance(getattr(m, "sum", None), (int, float)):
            out[m.name + "_count"] = out.get(m.name + "_count", 0) + m.count
            out[m.name + "_sum"] = out.get(m.name + "_sum", 0.0) + m.sum
    return out


def _serve_one_at_a_time(llm, prompts: list[list[int]], params, between=None) -> int:
    from vllm.inputs import TokensPrompt

    outputs = 0
    for i, prompt in enumerate(prompts):
        if between is not None:
            between(i)
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        outputs += sum(len(o.outputs[0].token_ids) for o in outs)
    return outputs


def _serve_stepped(llm, work: list[tuple[str, list[int], int, int]]) -> dict:
    """Drive the engine step by step, adding each request before its stated step; returns what it served."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    pending = list(work)
    step, outputs, added = 0, 0, {}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            name, prompt, max_tokens, _ = pending.pop(0)
            engine.add_request(name, TokensPrompt(prompt_token_ids=prompt),
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
            added[name] = step
        for out in engine.step():
            if out.finished:
                outputs += len(out.outputs[0].token_ids)
        step += 1
    return {"client_output_tokens": outputs, "engine_steps": step, "added_at_step": added}


def _serve_silent(llm) -> dict:
    """Serve silent_workload() paced, switching the adapter's KV snapshots and prefix counters off after
    SILENT_AFTER prompts (between two requests: the engine is idle)."""
    from vllm import SamplingParams

    from phasescope.agent.probe.adapters import vllm as adapter

    hooks = [h for h in adapter._HOOKED.values() if isinstance(h, adapter.EngineHooks)]
    if len(hooks) != 1:
        raise RuntimeError(f"expected the scheduler's hooks in this process (in-process engine), got {len(hooks)}")
    t0 = time.monotonic()
    silenced = {"at": t0}

    def between(i: int) -> None:
        # prompt i starts no earlier than SILENT_PACE_S x i after the start, and those after the silence no earlier
        # than SILENT_PACE_S x (i - SILENT_AFTER + 1) after it: the last starts >= 24 x 0.5 s after the silence
        if i == SILENT_AFTER:
            hooks[0].snapshot = lambda *a, **k: None
            hooks[0]._emit_prefix = lambda *a, **k: None
            silenced["at"] = time.monotonic()
            silenced["after_s"] = round(silenced["at"] - t0, 3)
        start = t0 + i * SILENT_PACE_S if i < SILENT_AFTER else silenced["at"] + (i - SILENT_AFTER + 1) * SILENT_PACE_S
        time.sleep(max(0.0, start - time.monotonic()))

    params = SamplingParams(max_tokens=SILENT_OUTPUT, ignore_eos=True, temperature=0)
    outputs = _serve_one_at_a_time(llm, [p for _, p in silent_workload()], params, between)
    return {"client_output_tokens": outputs, "silenced_after_s": silenced["after_s"],
            "served_s": round(time.monotonic() - t0, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/builders/vllm_workload.py")
    ap.add_argument("model", help="model folder (config.json; weights are random: load_format dummy)")
    ap.add_argument("--workload", default="prefix-miss", choices=("prefix-miss", "itl", "silent", "healthy"))
    args = ap.parse_args(argv)

    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, **engine_args(args.workload))
    if args.workload == "itl":
        served = _serve_stepped(llm, itl_workload())
    elif args.workload == "healthy":
        served = _serve_stepped(llm, healthy_workload())
    elif args.workload == "silent":
        served = _serve_silent(llm)
    else:
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0)
        served = {"client_output_tokens": _serve_one_at_a_time(llm, [p for _, p in prefix_miss_workload()],
                                                               params)}
    metrics = _metrics(llm)
    metrics["client_output_tokens"] = served.pop("client_output_tokens")
    print(RESULT_TAG + json.dumps({"vllm_version": vllm.__version__, "metrics": metrics, **served}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
