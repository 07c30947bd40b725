"""`phasescope diagnose`, `plan-kv` and `compare` end to end (in-process `main`)."""

from __future__ import annotations

import json

from phasescope.cli.main import main
from phasescope.analyzers.compare import compare, resolve
from phasescope.analyzers.runinfo import read_run_info, record_run_info


def test_diagnose_json(scenario_db, capsys):
    path, run_id = scenario_db("kv-pressure")
    assert main(["diagnose", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run_id"] == run_id
    ids = [f["id"] for f in out["findings"]]
    assert "kv-near-cap" in ids and "preemption-recompute" in ids
    assert all(f["evidence"]["query"] and f["suggestion"] for f in out["findings"])


def test_diagnose_table_and_overrides(scenario_db, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")
    path, _ = scenario_db("internal-fragmentation")
    assert main(["diagnose", path]) == 0
    assert "kv-internal-fragmentation" in capsys.readouterr().out
    assert main(["diagnose", path, "--set", "max_internal_fragmentation=0.99", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []
    path, _ = scenario_db("healthy")
    assert main(["diagnose", path]) == 0
    assert "no findings" in capsys.readouterr().out


def test_plan_kv(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 8,
                               "hidden_size": 3584, "head_dim": 128, "torch_dtype": "bfloat16"}))
    assert main(["plan-kv", "--config", str(cfg), "--context", "2048", "--budget-gib", "40", "--tp", "1,2,4,8",
                 "--kv-dtype", "bf16,fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    first = out["rows"][0]
    assert (first["tp"], first["kv_dtype"]) == (1, "bf16")
    assert first["bytes_per_sequence_per_rank"] == 234_881_024 and first["max_sequences"] == 182
    assert len(out["rows"]) == 8
    assert main(["plan-kv", "--layers", "28", "--kv-heads", "8", "--head-dim", "128", "--context", "2048",
                 "--gpu", "H100-SXM", "--tp", "1,16"]) == 0
    assert "max sequences" in capsys.readouterr().out


def test_compare_labels(scenario_db, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")
    a, _ = scenario_db("healthy")
    b, _ = scenario_db("internal-fragmentation")
    assert main(["compare", a, b]) == 0
    text = capsys.readouterr().out
    assert "ttft_p50_s" in text and "page_size" in text and "warning" in text  # many knobs differ
    r = compare(resolve(a), resolve(b))
    assert r["differs"]["page_size"] == ("16", "256")
    assert len(r["differs"]) > 1 and r["warning"].startswith(f"{len(r['differs'])} variables differ")
    assert r["a"]["metrics"]["requests"] == 24 and r["a"]["metrics"]["survival_rate"] == 1.0


def test_compare_one_variable(tmp_path, scenario_db):
    import shutil

    src, run_id = scenario_db("kv-pressure")
    a, b = str(tmp_path / "a.duckdb"), str(tmp_path / "b.duckdb")
    shutil.copy(src, a)
    shutil.copy(src, b)
    record_run_info(b, run_id, kv_dtype="fp8")
    r = compare(resolve(f"{a}::{run_id}"), resolve(b))
    assert r["differs"] == {"kv_dtype": ("float32", "fp8")} and r["warning"] is None
    assert r["a"]["metrics"]["preemptions"] == r["b"]["metrics"]["preemptions"] > 0
    import duckdb

    con = duckdb.connect(b, read_only=True)
    assert read_run_info(con, run_id)["kv_dtype"] == "fp8"
    con.close()


def test_compare_prints_throughput_in_tokens_per_second(scenario_db, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")
    a, _ = scenario_db("healthy")
    r = compare(resolve(a), resolve(a))
    tps = r["a"]["metrics"]["output_tokens_per_s"]
    assert tps > 0
    assert main(["compare", a, a]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "output_tokens_per_s" in line)
    assert f"{tps:.1f} tok/s" in row and " ms" not in row
    assert _fmt_row("ttft_p50_s", 0.25) == "250.0 ms" and _fmt_row("ttft_p50_s", 12.5) == "12.50 s"


def _fmt_row(k, v):
    from phasescope.analyzers.render import _fmt_metric

    return _fmt_metric(k, v)


def test_compare_says_when_the_workloads_differ(scenario_db, capsys, monkeypatch):
    """Runs of different workloads (24 vs 100 requests) are never 'the same but for a setting' (issue 23)."""
    monkeypatch.setenv("COLUMNS", "240")
    a, _ = scenario_db("healthy")
    b, _ = scenario_db("overload")
    r = compare(resolve(a), resolve(b))
    assert r["workload_differs"]["requests"] == (24, 100)
    assert "the workloads differ (requests 24 vs 100" in r["warning"]
    assert main(["compare", a, b]) == 0
    assert "the workloads differ" in " ".join(capsys.readouterr().out.split())


def test_compare_keeps_one_unit_per_row(tmp_path, capsys, monkeypatch):
    from phasescope.analyzers.render import print_compare

    monkeypatch.setenv("COLUMNS", "200")
    m = {"ttft_p50_s": 0.25}
    print_compare({"a": {"run_id": "a", "metrics": m}, "b": {"run_id": "b", "metrics": {"ttft_p50_s": 12.5}},
                   "change": {}, "differs": {}, "warning": None})
    row = next(line for line in capsys.readouterr().out.splitlines() if "ttft_p50_s" in line)
    assert "0.25 s" in row and "12.50 s" in row and " ms" not in row  # not 250.0 ms beside 12.50 s
