"""The GPU scenario matrix's fixtures (issue 55): import a `benchmarks/gpu/matrix.py` run, and its table.

    PYTHONPATH=tests python -m builders.gpu_matrix import DIR     # DIR: matrix.json + <scenario>.tar
    PYTHONPATH=tests python -m builders.gpu_matrix table          # docs/validation.md from the fixtures

Each fixture is a folder `tests/data/gpu/<scenario>/`: the store's tables as Parquet (what
`builders.scenarios.load` reads), `config.json` (run id, labels, vLLM's own counters) and `manifest.json`:
`{"scenario", "store": "." (the Parquet tables beside it; or the relative folder of a GPU fixture recorded
before the matrix), "device", "vllm_config", "expected": [{"id",
"severity"}], "forbidden": [ids], "why", "workload"}`. A fixture holds at most 5 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tarfile
import tempfile
from typing import Any

import duckdb

from .scenarios import DATA_DIR, TABLES, load, versions

GPU_DIR = os.path.join(DATA_DIR, "gpu")
DOC = os.path.join(os.path.dirname(DATA_DIR), os.pardir, "docs", "validation.md")
MAX_BYTES = 5_000_000


def fixtures() -> list[str]:
    """Scenario names with a fixture under tests/data/gpu, sorted."""
    if not os.path.isdir(GPU_DIR):
        return []
    return sorted(n for n in os.listdir(GPU_DIR) if os.path.exists(os.path.join(GPU_DIR, n, "manifest.json")))


def manifest(name: str) -> dict[str, Any]:
    with open(os.path.join(GPU_DIR, name, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def store(name: str) -> str:
    """The folder of fixture `name`'s Parquet tables and config.json: its manifest's `store`, relative to it
    (a matrix row may be a GPU fixture recorded before the matrix, e.g. "../../kv-pressure-vllm-h200")."""
    return os.path.normpath(os.path.join(GPU_DIR, name, manifest(name)["store"]))


def _run_labels(folder: str) -> tuple[str, dict[str, str]]:
    """The latest run's id and labels of an exported store (its `run_info` and `sources` Parquet files)."""
    con = duckdb.connect()
    try:
        run_id = con.execute("SELECT run_id FROM read_parquet(?) WHERE run_id != '' GROUP BY run_id ORDER BY max(connected_ns) DESC "
                             "LIMIT 1", [os.path.join(folder, "sources.parquet")]).fetchone()[0]
        path = os.path.join(folder, "run_info.parquet")
        labels = dict(con.execute("SELECT key, value FROM read_parquet(?) WHERE run_id = ?", [path, run_id])
                      .fetchall()) if os.path.exists(path) else {}
    finally:
        con.close()
    return run_id, labels


def designed() -> dict:
    """benchmarks/gpu/matrix.py's SCENARIOS: each scenario's design (expected, forbidden, known, why)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(DATA_DIR), os.pardir, "benchmarks", "gpu"))
    from matrix import SCENARIOS

    return SCENARIOS


def import_run(src: str, out: str = GPU_DIR) -> list[str]:
    """Every scenario of a matrix run at `src` as a fixture under `out`, with its design as matrix.py states it
    now; returns the names imported."""
    with open(os.path.join(src, "matrix.json"), encoding="utf-8") as f:
        doc = json.load(f)
    done = []
    for name, r in doc["scenarios"].items():
        tar = os.path.join(src, f"{name}.tar")
        if r.get("status") != "ok" or not os.path.exists(tar):
            print(f"{name}: not imported ({r.get('status')})", flush=True)
            continue
        tmp = tempfile.mkdtemp(prefix="ps-gm-")
        try:
            with tarfile.open(tar) as tf:
                tf.extractall(tmp, filter="data")
            folder = os.path.join(tmp, name)
            run_id, labels = _run_labels(folder)
            dest = os.path.join(out, name)
            shutil.rmtree(dest, ignore_errors=True)
            os.makedirs(dest)
            for t in TABLES:
                if os.path.exists(os.path.join(folder, f"{t}.parquet")):
                    shutil.copy(os.path.join(folder, f"{t}.parquet"), dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        child = r.get("child", {})
        config = {"scenario": name, "kind": "recorded", "run_id": run_id, "labels": labels, "expect": [],
                  "notes": r.get("why", ""), "vllm_metrics": child.get("metrics", {}), "versions": versions(),
                  "reproduce": f"benchmarks/gpu/lease.sh matrix OUT --scenarios {name} && "
                               f"PYTHONPATH=tests python -m builders.gpu_matrix import OUT"}
        sc = designed()[name]
        man = {"scenario": name, "store": ".", "device": doc.get("versions", {}).get("gpu", labels.get("gpu_name")),
               "versions": doc.get("versions", {}), "vllm_config": child.get("engine_args", {}),
               "workload": child.get("workload"), "why": sc.why,
               "expected": [{"id": i, "severity": s} for i, s in sc.expected], "forbidden": list(sc.forbidden),
               "known_issues": [{"id": i, "why": w} for i, w in sc.known],
               "run": {k: child.get(k) for k in ("engine_start_s", "workload_s", "client_output_tokens")}}
        for fname, body in (("config.json", config), ("manifest.json", man)):
            with open(os.path.join(dest, fname), "w", encoding="utf-8") as f:
                json.dump(body, f, indent=2, sort_keys=True, default=str)
                f.write("\n")
        size = sum(os.path.getsize(os.path.join(dest, x)) for x in os.listdir(dest))
        if size > MAX_BYTES:
            raise RuntimeError(f"{name}: the fixture is {size} bytes (> {MAX_BYTES}); trim the workload")
        done.append(name)
        print(f"{name}: run {run_id}, {size / 1e6:.2f} MB -> {dest}", flush=True)
    return done


def outcome(name: str) -> dict[str, Any]:
    """diagnose on fixture `name`: the findings (id -> severity), and what the manifest asked of them."""
    from phasescope.analyzers.diagnose import diagnose

    man = manifest(name)
    tmp = tempfile.mkdtemp(prefix="ps-gmo-")
    try:
        db = os.path.join(tmp, "run.duckdb")
        run_id = load(store(name), db)
        con = duckdb.connect(db, read_only=True)
        try:
            findings = diagnose(con, run_id)
        finally:
            con.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    got = {f.id: f.severity for f in findings}
    known = {k["id"]: k["why"] for k in man.get("known_issues", [])}
    missing = [e for e in man["expected"] if got.get(e["id"]) != e["severity"] and "missed:" + e["id"] not in known]
    # a known issue that no longer shows: fixed, its entry is to go (the test says so)
    fixed = [i for i in known if (got.get(i.removeprefix("missed:")) is not None) == i.startswith("missed:")]
    wrong = [i for i in man["forbidden"] if i in got]
    warnings = [i for i, s in got.items() if s in ("warning", "critical")]
    return {"manifest": man, "findings": findings, "got": got, "missing": missing, "forbidden_found": wrong,
            "warnings": [w for w in warnings if w not in known], "known": known, "known_fixed": fixed}


def table() -> str:
    """docs/validation.md: one row per GPU fixture (scenario, expected, got)."""
    lines = ["# Findings on real GPU runs: the scenario matrix", "",
             "Each row is a real vLLM run on a GPU whose cause is known by construction (`benchmarks/gpu/matrix.py`, "
             "issue 55), stored as a fixture under `tests/data/gpu/`; `got` is what `phasescope diagnose` says of it "
             "now. `tests/analyzers/test_gpu_matrix.py` fails when an expected finding is missing or a forbidden one "
             "fires. Regenerate this page with `PYTHONPATH=tests python -m builders.gpu_matrix table`.", "",
             "Every run here schedules asynchronously (vLLM 0.24's default): a step's host call returns before its "
             "GPU work ends, so a step not timed by CUDA events takes the interval between its output and the "
             "previous one (the next step's start-to-start period), and an ITL gap is tied to the larger prefill of "
             "its step and the one before (`agent/read/base.py`, `agent/read/itl.py`).", "",
             "| scenario | device | engine settings | why | expected | got (warnings and worse) | verdict |",
             "|---|---|---|---|---|---|---|"]
    notes = []
    for name in fixtures():
        o = outcome(name)
        man = o["manifest"]
        cfg = ", ".join(f"{k}={v}" for k, v in sorted(man["vllm_config"].items())
                        if k not in ("load_format", "skip_tokenizer_init", "seed", "dtype", "disable_log_stats"))
        exp = ", ".join(f"{e['id']} ({e['severity']})" for e in man["expected"]) or "no warning"
        got = ", ".join(f"{i} ({s})" for i, s in o["got"].items() if s in ("warning", "critical")) or "none"
        ok = not o["missing"] and not o["forbidden_found"] and (man["expected"] or not o["warnings"])
        verdict = "as designed" if ok and not o["known"] else "wrong" if not ok else "known issues (below)"
        lines.append(f"| {name} | {man['device']} | {cfg} | {man['why']} | {exp} | {got} | {verdict} |")
        notes += [f"- **{name}**, {'missed ' + i[len('missed:'):] if i.startswith('missed:') else i + ' fires'}: {w}."
                  for i, w in o["known"].items()]
    if notes:
        lines += ["", "## Known issues", "", "What the rules get wrong on these runs today; the CI test fails when one "
                  "is fixed (its entry in `benchmarks/gpu/matrix.py` is then to go) or when another appears.", ""]
        lines += notes
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="PYTHONPATH=tests python -m builders.gpu_matrix")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("import", help="a matrix run's stores as fixtures")
    i.add_argument("src")
    i.add_argument("--out", default=GPU_DIR)
    t = sub.add_parser("table", help="write docs/validation.md")
    t.add_argument("--out", default=os.path.normpath(DOC))
    a = p.parse_args(argv)
    if a.cmd == "import":
        import_run(a.src, a.out)
    else:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(table())
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
