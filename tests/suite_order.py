"""The order in which xdist hands the suite's files to its workers (tests/conftest.py applies it)."""

# The files whose tests take longest, longest first (summed call + setup seconds of the busy run beside 4 spinners
# and 4 workers at 62ce603, 2026-12-03: sweeps ~2,600 s, verify ~2,400 s (one test of 2,267 s), vLLM integration
# ~1,500 s, explain ~1,200 s, the issue-13 rebuilds ~1,000 s, DP skew ~800 s, ...). xdist hands a worker one file
# at a time in collection order (with `--no-loadscope-reorder`; its default puts the files with the most tests
# first, which left these for the last 40 minutes of that run, one or two at a time): started first, they
# overlap each other and the many short files fill the gaps.
SLOWEST_FILES_FIRST = (
    "tests/agent/test_vllm_sweep.py", "tests/analyzers/test_verify.py", "tests/agent/test_vllm_integration.py",
    "tests/agent/test_vllm_explain.py", "tests/analyzers/test_vllm_issue13.py", "tests/agent/test_vllm_dp_skew.py",
    "tests/analyzers/test_scenarios.py", "tests/analyzers/test_vllm_advice.py", "tests/agent/test_probe_exit.py",
    "tests/exporters/test_fleet_prometheus.py",
    "tests/analyzers/test_prefix_miss.py", "tests/deploy/test_image.py", "tests/agent/test_run_attach.py",
    "tests/agent/test_sidecar_hardening.py", "tests/dashboard/test_browser.py", "tests/dashboard/test_app.py",
    "tests/dashboard/test_exports.py",
)
