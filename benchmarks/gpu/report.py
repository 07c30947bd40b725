"""Markdown tables of vllm_h200.py results files (benchmarks/results/vllm_h200_*.json).

    python benchmarks/gpu/report.py benchmarks/results/vllm_h200_1b.json [...] > benchmarks/results/vllm_h200.md
"""

from __future__ import annotations

import json
import sys


def _pct(x: float) -> str:
    return f"{x * 100:+.2f}%"


def _ci(v: list) -> str:
    return f"[{v[0] * 100:+.2f}%, {v[1] * 100:+.2f}%]"


def _num(x: object) -> str:
    if isinstance(x, float) and not x.is_integer():
        return f"{x:.3f}"
    return "-" if x is None else f"{x:g}"


def timing_rows(ph: dict) -> list[str]:
    rows = []
    for phase in ("truth", "pressure"):
        t = (ph.get(phase, {}).get("compare") or {}).get("timing")
        if not t or "all" not in t:
            continue
        for mode, s in [("all", t["all"])] + sorted(t.get("by_graph_mode", {}).items()):
            steps = t["steps_by_graph_mode"].get(mode) if mode != "all" else t["ref_steps"]
            rows.append(f"| {phase} | {mode} | {steps} | {s['n']} | {s['ref_ms_median']:.3f} | "
                        f"{_pct(s['rel_diff_median'])} | {s['abs_rel_diff_p95'] * 100:.2f}% | "
                        f"{s['abs_rel_diff_max'] * 100:.2f}% | {s['abs_diff_us_median']:.0f} | "
                        f"{s['within_2pct']}/{s['n']} |")
    return rows


def _cpu(cpu: dict) -> str:
    """CPU ms per step, condition / plain, of the EngineCore and the frontend ("-" where not recorded)."""
    parts = [f"{side} {v[0]:.3f} / {v[1]:.3f}" for side, v in cpu.items()]
    return "; ".join(parts) or "-"


def cost_rows(c: dict) -> list[str]:
    """One row per batch and pair (armed vs plain, vLLM's stats vs plain)."""
    rows = []
    for bs in sorted((k for k in c if k.startswith("bs")), key=lambda k: int(k[2:])):
        for name, label in (("armed_vs_plain", "phasescope armed"), ("stats_vs_plain", "vLLM's own stats"),
                            ("cond_d_vs_plain", "D: armed, made last (PHASESCOPE_BENCH_COND_D)")):
            s = c[bs].get(name)
            if s:
                tok = s["throughput_tok_s_median"]
                step = s["p50_step_ms_median"]
                rows.append(f"| {bs[2:]} | {label} | {tok[0]:.0f} / {tok[1]:.0f} | {_pct(s['throughput_loss_median'])} "
                            f"{_ci(s['throughput_loss_median_ci95'])} | {_pct(s['throughput_loss_mean'])} "
                            f"{_ci(s['throughput_loss_mean_ci95'])} | {step[0]:.3f} / {step[1]:.3f} | "
                            f"{_pct(s['p50_step_change_median'])} {_ci(s['p50_step_change_median_ci95'])} | "
                            f"{_cpu(s.get('cpu_ms_per_step_median') or {})} |")
    return rows


FIDELITY = [("prefix_queried_tokens", "prefix queried tokens"), ("prefix_hit_tokens", "prefix hit tokens"),
            ("preemptions", "preemptions"), ("prompt_tokens", "prompt tokens"),
            ("generation_tokens", "generation tokens"), ("finished_requests", "finished requests"),
            ("ttft_count", "TTFT count"), ("ttft_sum_s", "TTFT sum, s"), ("e2e_count", "E2E count"),
            ("e2e_sum_s", "E2E sum, s"), ("itl_count", "ITL samples"), ("itl_sum_s", "ITL sum, s"),
            ("steps", "engine steps")]


def fidelity_rows(ph: dict) -> tuple[list[str], list[str]]:
    fid = {p: (ph.get(p, {}).get("compare") or {}).get("fidelity") for p in ("truth", "pressure", "interference")}
    fid = {p: f for p, f in fid.items() if f}
    if not fid:
        return [], []
    head = ["| figure | " + " | ".join(f"{p}: phasescope / vLLM" for p in fid) + " |", "|---|" + "---|" * len(fid)]
    rows = []
    for k, label in FIDELITY:
        cells = []
        for f in fid.values():
            d = f.get(k, {})
            mark = "equal" if d.get("equal") else (f"{d['rel_diff'] * 100:+.3f}%" if "rel_diff" in d else "")
            cells.append(f"{_num(d.get('phasescope'))} / {_num(d.get('vllm'))} ({mark})")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for p in fid:
        k = (ph[p].get("compare") or {}).get("kv")
        if k and k.get("usage_sequence_equal") is not None:
            cells.append(f"{'equal' if k['usage_sequence_equal'] else 'DIFFERS'}: {k['snapshots']} snapshots, "
                         f"{k['vllm_stats']} SchedulerStats ({k['vllm_stats_while_running']} while running)")
        else:
            cells.append("not compared")
    rows.append("| KV usage of every step vs vLLM's `kv_cache_usage` | " + " | ".join(cells) + " |")
    return head, rows


def tables(name: str, res: dict) -> str:
    v = res["versions"]
    model = res.get("model", "").rstrip("/").rsplit("/", 1)[-1]
    out = [f"### `{name}`: {model}, vLLM {v.get('vllm')}, torch {v.get('torch')}, {v.get('gpu')}", ""]
    ph = res["phases"]
    rows = timing_rows(ph)
    if rows:
        out += ["Timing truth: the probe's sampled GPU time of a step against vLLM-side CUDA events around the same "
                "`execute_model` + `sample_tokens` (graph mode: how vLLM's model runner ran the step)", "",
                "| phase | graph mode | steps | timed | ref ms p50 | probe/ref − 1, p50 | abs, p95 | abs, max | "
                "abs µs p50 | within 2% |", "|---|---|---|---|---|---|---|---|---|---|", *rows, ""]
    c = (ph.get("cost", {}).get("compare") or {}).get("cost")
    if c:
        out += [f"Cost: three engines in one process (phasescope armed, plain, vLLM's own stats) serving identical "
                f"blocks, the order alternating by round, {c['rounds']} rounds, 256 output tokens per request; 95% "
                "intervals (bootstrap of the median, t of the mean)", "",
                "| batch | condition vs plain | tok/s it / plain | throughput loss, median [CI] | mean [CI] | "
                "p50 step ms it / plain | p50 step change, median [CI] | CPU ms per step it / plain |",
                "|---|---|---|---|---|---|---|---|",
                *cost_rows(c)]
        labels = (ph["cost"]["compare"].get("probe") or {}).get("engine_labels") or {}
        if labels.get("kv_snapshot_mean_us"):
            out.append(f"\nThe armed engine's KV snapshots cost {labels['kv_snapshot_mean_us']} µs per step (mean).")
        out.append("")
    head, rows = fidelity_rows(ph)
    if rows:
        out += ["Fidelity: phasescope's store against vLLM's own `LLM.get_metrics()` of the same run", "", *head,
                *rows, ""]
    return "\n".join(out)


def main() -> None:
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            print(tables(path.rsplit("/", 1)[-1], json.load(f)))


if __name__ == "__main__":
    main()
