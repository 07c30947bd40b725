"""Tests own their ports: none binds the agent's default ports (a user's agent may hold them), and every
`phasescope agent` a test starts names its /metrics and read-API addresses (port 0, or off).

Port 0 in the child, then the port it prints: never "pick a free port, release it, let the child bind it"
for our own agent (another process can take it in between).
"""

from __future__ import annotations

import os
import re

TESTS = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PORTS = ("7702", "9464")
# lines that name a default port without binding it: (file, text the line contains)
NOT_A_BIND = {
    ("deploy/test_manifests.py", 'containerPort"] == 9464'),  # reads the pod spec
    ("exporters/test_prometheus.py", 'parse_host_port("9464")'),  # the parser's error
    ("exporters/test_prometheus.py", 'parse_host_port("[::1]:9464")'),  # the parser
    ("test_cli_errors.py", '"--agent", "127.0.0.1:7702"'),  # refused as a URL before any connection
}
LAUNCH = re.compile(r'"phasescope\.cli",(?:\s*"-v",)?\s*"agent"|CLI \+ \["agent"')
METRICS = ("--metrics-addr", "--no-metrics", "PHASESCOPE_METRICS_ADDR")
API = ("--api", "--no-api", "PHASESCOPE_API")


def _sources() -> dict[str, str]:
    out = {}
    for root, dirs, files in os.walk(TESTS):
        dirs[:] = [d for d in dirs if d not in ("data", "__pycache__")]
        for f in files:
            if f.endswith(".py") and f != "test_ports.py":
                path = os.path.join(root, f)
                with open(path, encoding="utf-8") as fh:
                    out[os.path.relpath(path, TESTS)] = fh.read()
    return out


def _statement(text: str, start: int) -> str:
    """From `start` to the end of the call that holds it (parentheses balanced from the line's start)."""
    begin = text.rfind("\n", 0, start) + 1
    depth, i = 0, begin
    while i < len(text):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth <= 0 and i > start:
                return text[begin:i + 1]
        i += 1
    return text[begin:]


def test_no_test_binds_a_default_port():
    bad = []
    for rel, text in _sources().items():
        for n, line in enumerate(text.splitlines(), 1):
            if any(p in line for p in DEFAULT_PORTS) and not any(rel == f and s in line for f, s in NOT_A_BIND):
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "default ports in tests:\n" + "\n".join(bad)


def test_every_agent_a_test_starts_names_its_ports():
    launches, bad = 0, []
    for rel, text in _sources().items():
        for m in LAUNCH.finditer(text):
            launches += 1
            stmt = _statement(text, m.start())
            if "*extra" in stmt:  # inside a helper: every call of the helper passes the addresses
                name = re.findall(r"def (\w+)\(", text[:m.start()])[-1]
                stmts = [_statement(text, c.start()) for c in re.finditer(rf"\b{name}\(", text)
                         if not text[max(0, c.start() - 4):c.start()].endswith("def ")]
                assert stmts, f"{rel}: {name} is never called"
            else:
                # env-configured launches set the addresses in the env dict built just before
                stmts = [stmt + text[max(0, m.start() - 1500):m.start()] if "env=env" in stmt else stmt]
            for s in stmts:
                if "--print-config" in s:  # prints the settings and exits: binds nothing
                    continue
                if not (any(k in s for k in METRICS) and any(k in s for k in API)):
                    bad.append(f"{rel}: {s.strip()[:160]}")
    assert launches >= 6  # the scan finds the launches (kill, hardening, zero-loss, cli-agent x3, deploy)
    assert not bad, "agents started on default ports:\n" + "\n".join(bad)


# --- pick a free port, release it, let a child bind it: a race --------------------------------------------------

ROOT = os.path.dirname(TESTS)
RACE_ROOTS = ("tests", "cli", "benchmarks")
# (file, function): releases of a free port still needed, each with the reason
RACE_KEPT: set[tuple[str, str]] = set()


def _binds_port_0(node) -> bool:
    import ast

    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bind"
            and len(node.args) == 1 and isinstance(node.args[0], ast.Tuple) and len(node.args[0].elts) == 2
            and isinstance(node.args[0].elts[1], ast.Constant) and node.args[0].elts[1].value == 0)


def releases_a_free_port(source: str) -> list[str]:
    """Functions in `source` that bind port 0 and return the port with the socket closed (a `with` block, or a
    `.close()`) instead of the socket itself: whoever binds the port next may not be the child it is meant for."""
    import ast

    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        nodes = list(ast.walk(fn))
        if not any(_binds_port_0(n) for n in nodes):
            continue
        closes = any(isinstance(n, ast.With) for n in nodes) or any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "close" for n in nodes)
        port_out = any(isinstance(n, ast.Return) and n.value is not None and not isinstance(n.value, ast.Name)
                       and "getsockname" in ast.unparse(n.value) for n in nodes) or any(
            isinstance(n, ast.Return) and isinstance(n.value, ast.Name) and any(
                isinstance(a, ast.Assign) and "getsockname" in ast.unparse(a.value)
                and any(isinstance(t, ast.Name) and t.id == n.value.id for t in a.targets) for a in nodes)
            for n in nodes)
        if closes and port_out:
            out.append(fn.name)
    return out


def test_the_release_scan_finds_both_shapes_and_spares_a_held_socket():
    with_block = ("def a():\n    with socket.socket() as s:\n        s.bind(('127.0.0.1', 0))\n"
                  "        return s.getsockname()[1]\n")
    closed = ("def b():\n    s = socket.socket()\n    s.bind(('127.0.0.1', 0))\n    port = s.getsockname()[1]\n"
              "    s.close()\n    return port\n")
    held = "def c():\n    s = socket.socket()\n    s.bind(('127.0.0.1', 0))\n    s.listen(1)\n    return s\n"
    fixed = "def d():\n    with socket.socket() as s:\n        s.bind(('127.0.0.1', 8000))\n        return 8000\n"
    assert releases_a_free_port(with_block + closed + held + fixed) == ["a", "b"]


def test_nothing_picks_a_free_port_and_releases_it_for_a_child():
    found = set()
    for top in RACE_ROOTS:
        for root, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("data", "__pycache__", "results")]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    with open(path, encoding="utf-8") as fh:
                        found |= {(os.path.relpath(path, ROOT), name) for name in releases_a_free_port(fh.read())}
    assert found - RACE_KEPT == set(), "bind port 0 in the child and read the port back instead"
    assert RACE_KEPT - found == set(), "a kept release is gone: take it off RACE_KEPT"
