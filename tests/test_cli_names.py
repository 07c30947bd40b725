"""Distinct names (issue 24): the read-API URL is `--api URL` on the reading commands, the sidecar address
`phasescope run --address ADDR`; the old spelling `--agent` still works, deprecated. Library code raises the
library's errors, never the command line's; only the CLI turns them into exit codes."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

from phasescope.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
READERS = [["dashboard"], ["summary"], ["diagnose"], ["compare", "a", "b"]]


@pytest.mark.parametrize("cmd", READERS, ids=lambda c: c[0])
def test_read_api_url_is_api_and_agent_is_a_deprecated_alias(cmd, capsys):
    url = "http://127.0.0.1:5799"
    assert build_parser().parse_args([*cmd, "--api", url]).api == url
    assert capsys.readouterr().err == ""
    with pytest.warns(DeprecationWarning, match="--agent is deprecated"):
        args = build_parser().parse_args([*cmd, "--agent", url])
    assert args.api == url
    assert capsys.readouterr().err == ""  # a warning, not a line: a command's stderr is its one error line


def test_run_address_and_its_quiet_alias(capsys):
    args = build_parser().parse_args(["run", "--address", "unix:/s.sock", "--", "true"])
    assert args.address == "unix:/s.sock"
    with pytest.warns(DeprecationWarning, match="use --address"):
        args = build_parser().parse_args(["run", "--agent", "unix:/s.sock", "--", "true"])
    assert args.address == "unix:/s.sock"
    assert capsys.readouterr().err == ""  # run leaves stderr to the program
    help_text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "deprecated: use --address" in help_text


def test_the_deprecation_shows_when_warnings_are_on(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-W", "default::DeprecationWarning", "-m", "phasescope.cli", "summary",
                          "--agent", "127.0.0.1:5799"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "phasescope summary: --agent is deprecated and goes in the next release; use --api" in out.stderr


def test_the_alias_and_the_new_name_read_the_same(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert main(["summary", "--agent", "127.0.0.1:5799"]) == 2
    assert "--api takes the agent's read API URL" in capsys.readouterr().err
    assert main(["summary", "--api", "127.0.0.1:5799"]) == 2
    assert main(["diagnose", "--api", "127.0.0.1:5799"]) == 2  # diagnose checks the URL as summary does
    assert "--api takes the agent's read API URL" in capsys.readouterr().err


def test_library_errors_are_the_librarys(tmp_path):
    from phasescope.agent.read.reader import StoreBusyError, connect_readonly
    from phasescope.agent.records.errors import PhasescopeError, ReadError
    from phasescope.cli.errors import CliError

    assert issubclass(StoreBusyError, ReadError) and not issubclass(ReadError, CliError)
    with pytest.raises(ReadError, match="no such file") as info:
        connect_readonly(str(tmp_path / "missing.duckdb"))
    assert not isinstance(info.value, CliError) and isinstance(info.value, PhasescopeError)


def test_only_the_cli_imports_the_cli_errors():
    users = []
    for folder in ("agent", "analyzers", "exporters", "dashboard"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and "CliError" in ast.dump(node):
                    users.append(str(path.relative_to(ROOT)))
    assert users == []


def test_one_queries_module():
    found = sorted(str(p.relative_to(ROOT)) for folder in ("agent", "analyzers", "exporters", "dashboard", "cli")
                   for p in (ROOT / folder).rglob("queries.py"))
    assert found == ["agent/read/queries.py"]


def test_attach_takes_address_and_agent_is_a_deprecated_alias():
    torch = pytest.importorskip("torch")
    from phasescope.agent.probe.probe import Probe

    model = torch.nn.Linear(2, 2)
    p = Probe(model, address="tcp:127.0.0.1:5799", connect=False, cuda_timing=False)
    assert str(p.addr) == "tcp:127.0.0.1:5799"
    p.close(0.1)
    with pytest.warns(DeprecationWarning, match="use attach\\(address=...\\)"):
        p = Probe(model, agent="tcp:127.0.0.1:5799", connect=False, cuda_timing=False)
    assert str(p.addr) == "tcp:127.0.0.1:5799"
    p.close(0.1)
    with pytest.raises(TypeError, match="both address= and"):
        Probe(model, address="tcp:127.0.0.1:5799", agent="tcp:127.0.0.1:5799", connect=False)
