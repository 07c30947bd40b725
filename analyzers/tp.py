"""Tensor-parallel ranks: KV imbalance, stragglers, KV-head replication."""

from __future__ import annotations

from phasescope.agent.records import kvrollup
from phasescope.agent.records.kvmath import kv_imbalance
from phasescope.agent.read.queries import STEP_MS

from phasescope.agent.read.thresholds import T
from .findings import Finding, ref
from .geometry import ModelGeometry
from .kvplan import kv_bytes_per_token, kv_bytes_per_token_per_rank, replication_factor
from .sql import model_parallel_size, rows, world_size

KV_RANK_SQL = """SELECT k.rank, avg(kv_bytes) AS kv_bytes_mean, max(kv_bytes) AS kv_bytes_max,
           max(used_pages / total_pages) AS block_usage_max
    FROM kv_snapshots k JOIN sources s USING (source_id) WHERE s.run_id = $run AND total_pages > 0
    GROUP BY k.rank ORDER BY k.rank"""


def kv_by_rank(con, run_id: str) -> tuple[list[dict], str]:
    """KV_RANK_SQL's rows and the SQL that gave them: from the ten-second KV rollup when it describes every
    snapshot of the run (records/kvrollup.py: the same sums, counts and maxima; a mean is sum / count, equal to
    ~1e-15 relative), else from the snapshots."""
    wm = kvrollup.usable(con, run_id)
    if wm is None:
        return rows(con, KV_RANK_SQL, run_id), KV_RANK_SQL
    sql = f"""SELECT rank, sum(kv_sum) / nullif(sum(kv_n), 0) AS kv_bytes_mean, max(kv_max) AS kv_bytes_max,
               max(block_max) AS block_usage_max
        FROM ({kvrollup.cells('$run', wm)}) GROUP BY rank HAVING sum(n) > 0 ORDER BY rank"""
    return rows(con, sql, run_id), sql


def tp_kv_imbalance(con, run_id: str, *, max_imbalance: float = T["max_imbalance"], critical_imbalance: float = 0.3,
                    **_: object) -> list[Finding]:
    """Fires when max_r / mean_r - 1 of the ranks' mean KV bytes is >= `max_imbalance`, over the ranks of one
    model replica (rank // TP x PP: data-parallel engines are compared by the sweep's dp-skew, never as TP ranks;
    a vLLM engine reports its KV once, so a vLLM run has one rank per replica and no TP imbalance); with several
    replicas, the most unbalanced one."""
    ranks, sql = kv_by_rank(con, run_id)
    mp = model_parallel_size(con, run_id)
    groups: dict[int, list[dict]] = {}
    for r in ranks:
        groups.setdefault(r["rank"] // mp, []).append(r)
    groups = {g: rs for g, rs in groups.items() if len(rs) >= 2}
    if not groups:
        return []
    replica, ranks = max(groups.items(), key=lambda g: kv_imbalance([r["kv_bytes_mean"] for r in g[1]]))
    means = [r["kv_bytes_mean"] for r in ranks]
    imb = kv_imbalance(means)
    if imb < max_imbalance:
        return []
    hot = max(ranks, key=lambda r: r["kv_bytes_mean"])
    e = {"ranks": len(ranks), "kv_imbalance": imb, "hottest_rank": hot["rank"],
         "kv_bytes_mean_by_rank": {r["rank"]: r["kv_bytes_mean"] for r in ranks},
         "block_usage_max_by_rank": {r["rank"]: r["block_usage_max"] for r in ranks}, "query": sql}
    if len(groups) > 1 or world_size(con, run_id) > mp:
        e["replica"] = replica
    return [Finding(
        summary=f"TP rank {hot['rank']} holds {imb:.0%} more KV than the mean of {len(ranks)} ranks: it fills first.",
        action=(f"Check how heads are split across ranks and size the KV budget for the hottest rank: balanced "
                f"ranks admit ~{imb / (1 + imb):.0%} more tokens."),
        id="tp-kv-imbalance",
        title=f"KV cache unbalanced across TP ranks (rank {hot['rank']} holds {imb:.0%} above the mean)",
        severity="critical" if imb >= critical_imbalance else "warning",
        evidence=e,
        suggestion=("Check how heads are split across ranks (KV heads not divisible by the TP size, replicated KV "
                    "heads, uneven expert or pipeline placement) and size the KV budget per card for the hottest "
                    "rank, not from the node total; leave KV headroom on every card."),
        expected_effect=(f"The hottest rank fills first: capacity is set by rank {hot['rank']}, which holds "
                         f"{imb:.0%} more KV than the mean. Balanced ranks would admit ~{imb / (1 + imb):.0%} more "
                         "tokens before the first rank reaches its cap."),
        reference=ref("Tensor parallelism"),
        run_id=run_id,
        thresholds={"max_imbalance": max_imbalance, "critical_imbalance": critical_imbalance},
    )]


# the skew's p50 and p95 as one list quantile (one copy and selection of the steps, not two; the same order
# statistics and interpolation, so the same numbers), in the evidence's order
SKEW_COLUMNS = """steps, skew[1] AS step_skew_p50, skew[2] AS step_skew_p95, straggler_rank, straggler_share,
           wait_ms_mean, median_ms_mean"""

# above `max_rows` steps, every $k-th step id ($k = 1 keeps all) bounds the cost;
# every rank of a sampled step is kept, so skews and the straggler share are unbiased estimates
_SKEW_STEPS = f"""st AS (
        SELECT t.step_id, t.rank, {STEP_MS} AS ms FROM steps t JOIN sources s USING (source_id)
        WHERE s.run_id = $run AND t.step_id % $k = 0)"""
# from `per` (a step's max_ms, median_ms and slowest rank): the straggler and the skew figures
_SKEW_FIGURES = """m AS (SELECT mode(slowest) AS straggler FROM per),
    a AS (SELECT count(*) AS steps, quantile_cont(max_ms / median_ms - 1, [0.5, 0.95]) AS skew,
                 any_value(m.straggler) AS straggler_rank,
                 count(*) FILTER (WHERE slowest = m.straggler) / count(*) AS straggler_share,
                 avg(max_ms - median_ms) AS wait_ms_mean, avg(median_ms) AS median_ms_mean
          FROM per, m)"""
SKEW_SQL = f"""WITH {_SKEW_STEPS},
    per AS MATERIALIZED (SELECT step_id, max(ms) AS max_ms, median(ms) AS median_ms, arg_max(rank, ms) AS slowest
            FROM st GROUP BY step_id HAVING count(*) > 1),
    {_SKEW_FIGURES}
    SELECT {SKEW_COLUMNS} FROM a"""


# the same figures when no step has more than two rank rows (TP 2): a step's median is lo + (hi - lo) * 0.5,
# DuckDB's own interpolation of quantile_cont at 0.5 over two values (the product by 0.5 is exact, so a fused
# multiply-add gives the same bits; agent/read/queries.py's rank_steps reads it so too), from min and max: no
# holistic aggregate per step. `max_n` says whether it held (> 2: SKEW_SQL is run instead).
SKEW_TWO_SQL = f"""WITH {_SKEW_STEPS},
    g AS MATERIALIZED (SELECT count(*) AS n, max(ms) AS max_ms, min(ms) + (max(ms) - min(ms)) * 0.5 AS median_ms,
                              arg_max(rank, ms) AS slowest
                       FROM st GROUP BY step_id),
    per AS (SELECT * FROM g WHERE n > 1),
    {_SKEW_FIGURES}
    SELECT {SKEW_COLUMNS}, (SELECT max(n) FROM g) AS max_n FROM a"""


def step_skew(con, run_id: str, k: int, world: int) -> tuple[dict, str]:
    """SKEW_SQL's row over every `k`-th step id, and the SQL that gave it: SKEW_TWO_SQL when the run has
    `world` == 2 ranks and no step more than two rank rows (the same figures without a median per step)."""
    if world == 2:
        e = rows(con, SKEW_TWO_SQL, run_id, k=k)[0]
        if (e.pop("max_n") or 0) <= 2:
            return e, SKEW_TWO_SQL
    return rows(con, SKEW_SQL, run_id, k=k)[0], SKEW_SQL


def tp_straggler(con, run_id: str, *, max_skew: float = T["max_skew"], min_straggler_share: float = T["min_straggler_share"],
                 min_steps: int = 10, max_rows: int = 1_000_000, **_: object) -> list[Finding]:
    """Fires when the median step skew (max_r / median_r - 1 of step time) is >= `max_skew` and one rank
    is the slowest in >= `min_straggler_share` of the steps (sampled above `max_rows` step rows). Ranks of one model
    replica only: with data-parallel engines (world > TP x PP) step ids of two engines are unrelated steps, and
    this rule reads nothing (per-engine skew is not built yet)."""
    world = world_size(con, run_id)
    if world < 2 or model_parallel_size(con, run_id) != world:
        return []
    n = con.execute("SELECT count(*) FROM steps t JOIN sources s USING (source_id) WHERE s.run_id = ?",
                    [run_id]).fetchone()[0]
    k = max(1, -(-n // max_rows))
    e, sql = step_skew(con, run_id, k, world)
    e["sampled_one_step_in"] = k
    if (e["steps"] or 0) < min_steps or e["step_skew_p50"] < max_skew or e["straggler_share"] < min_straggler_share:
        return []
    e["query"] = sql
    return [Finding(
        summary=(f"TP rank {e['straggler_rank']} is the slowest in {e['straggler_share']:.0%} of {e['steps']} steps; "
                 f"the median step waits {e['step_skew_p50']:.0%} for it."),
        action=(f"Inspect that GPU (throttling, ECC/XID, placement, neighbours): steps "
                f"~{e['step_skew_p50'] / (1 + e['step_skew_p50']):.0%} shorter."),
        id="tp-straggler",
        title=f"TP rank {e['straggler_rank']} is a straggler",
        severity="warning",
        evidence=e,
        suggestion=(f"Inspect the GPU of rank {e['straggler_rank']}: clocks, temperature and power throttling, ECC/XID "
                    "errors, PCIe/NVLink placement, other processes on it; every step waits for the slowest rank."),
        expected_effect=(f"Rank {e['straggler_rank']} is the slowest in {e['straggler_share']:.0%} of {e['steps']} steps; "
                         f"the median step waits {e['step_skew_p50']:.0%} ({e['wait_ms_mean']:.2f} ms on average) for it. "
                         f"Fixing it makes steps ~{e['step_skew_p50'] / (1 + e['step_skew_p50']):.0%} shorter."),
        reference=ref("Tensor parallelism"),
        run_id=run_id,
        thresholds={"max_skew": max_skew, "min_straggler_share": min_straggler_share, "min_steps": min_steps,
                    "max_rows": max_rows},
    )]


def tp_kv_head_replication(con, run_id: str, *, model: ModelGeometry | None = None, kv_dtype: str = "bf16",
                           **_: object) -> list[Finding]:
    """Fires (info) when the run's TP size exceeds the model's KV heads, so KV heads are replicated."""
    tp = model_parallel_size(con, run_id, with_pp=False)
    if model is None or tp <= model.kv_heads:
        return []
    factor = replication_factor(model, tp)
    per_rank = kv_bytes_per_token_per_rank(model, tp, kv_dtype)
    total = kv_bytes_per_token(model, kv_dtype)
    e = {"tp": tp, "kv_heads": model.kv_heads, "replication": factor, "kv_bytes_per_token_total": total,
         "kv_bytes_per_token_per_rank": per_rank, "kv_bytes_per_token_all_ranks": per_rank * tp,
         "extra_bytes_per_token": per_rank * tp - total,
         "query": "SELECT value FROM run_info WHERE run_id = $run AND key = 'tp' "
                  "(else SELECT max(world_size) FROM sources WHERE run_id = $run)"}
    return [Finding(
        summary=(f"{model.kv_heads} KV heads over {tp} TP ranks: each head is held by {factor:g} ranks, "
                 f"{per_rank * tp - total:.0f} extra KV bytes per token across ranks."),
        action=f"Prefer TP <= {model.kv_heads} with data parallelism across the rest, or budget KV with it counted.",
        id="tp-kv-head-replication",
        title=f"KV heads replicated {factor:g}x across {tp} TP ranks",
        severity="info",
        evidence=e,
        suggestion=(f"With {model.kv_heads} KV heads over {tp} ranks each head is held by {factor:g} ranks: TP does "
                    f"not divide KV by {tp}. Prefer TP <= {model.kv_heads} with data parallelism across the rest, "
                    "or budget KV per card with the replication counted."),
        expected_effect=(f"Each rank holds {per_rank:.0f} bytes of KV per token, {factor:g}x its 1/{tp} share "
                         f"({total / tp:.0f} B); across ranks that is {per_rank * tp - total:.0f} extra bytes per token."),
        reference=ref("Tensor parallelism"),
        run_id=run_id,
        thresholds={},
    )]
