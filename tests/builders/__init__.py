"""Builders of the recorded fixtures under tests/data/ (test-only: nothing in the package imports them).

`scenarios` runs each scenario and exports it; `synthetic` writes stated records for what no runtime
produces on CPU; `vllm_workload` holds the workloads the vLLM scenarios serve. Imported by the tests
as `builders.*` (pytest puts tests/ on sys.path); from the repository root:

    PYTHONPATH=tests python -m builders.scenarios build [NAME ...]
"""
