"""Under CI=true every skip fails except those CI may take (tests/ci_guard.py); without CI, skips skip."""

from __future__ import annotations

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))

CONFTEST = f"""
import sys
sys.path.insert(0, {TESTS!r})
from ci_guard import (pytest_make_collect_report, pytest_runtest_makereport, pytest_sessionfinish,
                      pytest_terminal_summary)
"""
CASES = {
    "test_a_skip.py": "import pytest\ndef test_it():\n    pytest.skip('needs a tool')\n",
    "test_a_skipif.py": "import pytest\n@pytest.mark.skipif(True, reason='no namespaces')\ndef test_it():\n    pass\n",
    "test_an_importorskip.py": "import pytest\npytest.importorskip('no_such_module_here')\ndef test_it():\n    pass\n",
    "test_cuda.py": "import pytest\n@pytest.mark.skipif(True, reason='needs a CUDA GPU')\ndef test_it():\n    pass\n",
    "test_xfail.py": "import pytest\n@pytest.mark.xfail(reason='known')\ndef test_it():\n    assert False\n",
    "test_passes.py": "def test_it():\n    pass\n",
}


def _run(tmp_path, ci: bool) -> tuple[int, str, str]:
    for name, text in {"conftest.py": CONFTEST, **CASES}.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:randomly",
                          str(tmp_path)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    return out.returncode, out.stdout.splitlines()[-1].split(" in ")[0].strip("= "), out.stdout


def test_skips_fail_under_ci_except_the_allowed_ones(tmp_path):
    # pytest.skip() in a test fails; a skipif mark fails the test's setup (an error); the module skipped at collection fails the run at its end (an error at
    # collection would stop every other test); the CUDA skip stays a skip; xfail is untouched
    rc, last, out = _run(tmp_path, ci=True)
    assert last == "1 failed, 1 passed, 2 skipped, 1 xfailed, 1 error"
    assert rc == 1
    assert "FAILED (skipped at collection under CI=true) test_an_importorskip.py" in out
    said = [ln for ln in out.splitlines() if "skipped under CI=true, where everything it needs is installed" in ln]
    assert any("needs a tool" in ln for ln in said) and any("no namespaces" in ln for ln in said), out


def test_skips_skip_outside_ci(tmp_path):
    rc, last, _ = _run(tmp_path, ci=False)
    assert (rc, last) == (0, "1 passed, 4 skipped, 1 xfailed")
