"""The order in which xdist hands the suite's files to its workers (tests/conftest.py applies it)."""

# The files whose tests take longest, longest first (summed call + setup seconds of a busy run beside 4 spinners,
# 976ea9f, 2026-12-03: sweeps ~1,900 s, verify ~1,400 s, vLLM integration ~760 s, DP skew ~660 s, ...). xdist
# hands a worker one file at a time in collection order (with `--no-loadscope-reorder`; its default puts the
# files with the most tests first, which left these for the end, run one or two at a time): started first,
# they overlap each other and the many short files fill the gaps, so the run ends sooner.
SLOWEST_FILES_FIRST = (
    "tests/agent/test_vllm_sweep.py", "tests/analyzers/test_verify.py", "tests/agent/test_vllm_integration.py",
    "tests/agent/test_vllm_dp_skew.py", "tests/agent/test_vllm_explain.py", "tests/analyzers/test_vllm_issue13.py",
    "tests/analyzers/test_vllm_advice.py", "tests/analyzers/test_scenarios.py", "tests/analyzers/test_prefix_miss.py",
    "tests/agent/test_probe_exit.py", "tests/dashboard/test_browser.py", "tests/deploy/test_image.py",
    "tests/agent/test_run_attach.py", "tests/agent/test_sidecar_hardening.py", "tests/dashboard/test_exports.py",
)
