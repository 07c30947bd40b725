"""The declared settings (agent/settings.py): every agent field through flag, environment and file, with
flag > env > file > default; every probe option through argument and environment; the generated docs
table is the committed one; `--print-config`, `health` and `retention` read the same declarations."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from phasescope.agent import settings as S
from phasescope.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
FIELDS = S.fields_of(S.AgentSettings)


def sample(f: dataclasses.Field, which: int) -> tuple[object, list[str], str, str]:
    """A non-default value of field `f` (`which` picks one of two) as (parsed value, argv, env text, TOML text)."""
    t = str(f.type)
    if S.spec_of(f).parse is S.parse_mode:
        mode = (0o640, 0o604)[which]
        return mode, [S.flag_name(f), f"{mode:o}"], f"{mode:04o}", f'"{mode:04o}"'
    if t == "bool":
        return True, [S.flag_name(f)], "1", "true"
    if t in ("float", "float | None"):
        v = (12.5, 3.25)[which]
        return v, [S.flag_name(f), str(v)], str(v), str(v)
    if t in ("int", "int | None"):
        v = (7, 9)[which]
        return v, [S.flag_name(f), str(v)], str(v), str(v)
    valid = {"api": ("127.0.0.1:15702", "127.0.0.1:15703"), "metrics_addr": ("127.0.0.1:15464", "127.0.0.1:15465")}
    if f.name in valid:  # checked text: a HOST:PORT
        v = valid[f.name][which]
        return v, [S.flag_name(f), v], v, f'"{v}"'
    if f.name in ("listen", "scrape"):  # checked lists: addresses, URLs
        v = ([f"unix:/tmp/a{which}.sock", f"tcp:127.0.0.1:{7000 + which}"] if f.name == "listen" else
             [f"http://127.0.0.1:{8000 + which}/metrics", f"https://h{which}:9000/metrics"])
        return v, [S.flag_name(f), v[0], S.flag_name(f), v[1]], ",".join(v), "[" + ", ".join(f'"{x}"' for x in v) + "]"
    if t in ("str", "str | None"):
        v = f"{('f', 'e')[which]}-{f.name}"
        return v, [S.flag_name(f), v], v, f'"{v}"'
    if t == "list[str]":
        v = [f"a{which}-{f.name}", f"b{which}-{f.name}"]
        return v, [S.flag_name(f), v[0], S.flag_name(f), v[1]], ",".join(v), "[" + ", ".join(f'"{x}"' for x in v) + "]"
    if t == "list[int]":
        v = [11 + which, 21 + which]
        return v, [S.flag_name(f), str(v[0]), S.flag_name(f), str(v[1])], f"{v[0]},{v[1]}", f"[{v[0]}, {v[1]}]"
    raise AssertionError(f"no sample for {f.name}: {t}")  # a new type: add a sample


def resolve(argv: list[str], environ: dict[str, str]):
    args = build_parser().parse_args(["agent", *argv])
    origin = S.resolve(args, environ)
    return args, origin


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_every_agent_field_by_flag_env_and_file(f, tmp_path):
    value, argv, env_text, toml_text = sample(f, 0)
    other, _, other_env, other_toml = sample(f, 1)
    assert value != S.default_of(f)
    env = S.env_name(f)
    cfg = tmp_path / "agent.toml"

    cfg.write_text(f"{f.name} = {toml_text}\n")  # file alone
    args, origin = resolve(["--config", str(cfg)], {})
    assert (getattr(args, f.name), origin[f.name]) == (value, "file")
    cfg.write_text(f"{f.name.replace('_', '-')} = {toml_text}\n")  # dashes read as underscores
    assert getattr(resolve(["--config", str(cfg)], {})[0], f.name) == value

    args, origin = resolve([], {env: env_text})  # environment alone
    assert (getattr(args, f.name), origin[f.name]) == (value, "env")
    args, origin = resolve([], {env: "  "})  # empty: unset
    assert (getattr(args, f.name), origin[f.name]) == (S.default_of(f), "default")

    args, origin = resolve(argv, {})  # flag alone
    assert (getattr(args, f.name), origin[f.name]) == (value, "flag")

    # all three: the flag wins; environment and file: the environment wins ($PHASESCOPE_CONFIG names the file)
    if str(f.type) != "bool":  # a switch has one value: precedence is shown on the other types
        cfg.write_text(f"{f.name} = {other_toml}\n")
        args, origin = resolve(argv, {env: other_env, S.ENV_CONFIG: str(cfg)})
        assert (getattr(args, f.name), origin[f.name]) == (value, "flag")
        args, origin = resolve([], {env: env_text, S.ENV_CONFIG: str(cfg)})
        assert (getattr(args, f.name), origin[f.name]) == (value, "env")
        assert getattr(args.settings, f.name) == value
    args, origin = resolve([], {})
    assert (getattr(args, f.name), origin[f.name]) == (S.default_of(f), "default")


@pytest.mark.parametrize("f", [f for f in FIELDS if str(f.type) not in ("str", "str | None", "list[str]")
                               or S.spec_of(f).check is not None],
                         ids=lambda f: f.name)  # free text is a string: only checked text fields have a bad value
def test_a_bad_value_names_its_route(f, tmp_path):
    bad = "often"
    with pytest.raises(ValueError, match=S.env_name(f)):
        resolve([], {S.env_name(f): bad})
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'{f.name} = "{bad}"\n')
    with pytest.raises(ValueError, match=f.name):
        resolve(["--config", str(cfg)], {})


def test_every_agent_option_is_a_setting():
    """The `agent` flags are exactly the declared fields (+ --config, --print-config): none is read on its own."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices["agent"]
    dests = {a.dest for a in sub._actions} - {"help", "config", "print_config"}
    assert dests == {f.name for f in FIELDS}


def test_the_keys_the_issue_found_missing_are_settings(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text("memory_budget_mib = 64\n")
    args, origin = resolve(["--config", str(cfg)], {"PHASESCOPE_READ_MEMORY_MIB": "256"})
    assert (args.memory_budget_mib, origin["memory_budget_mib"]) == (64.0, "file")
    assert (args.read_memory_mib, origin["read_memory_mib"]) == (256, "env")
    args, origin = resolve([], {"PHASESCOPE_AGENT_TOKEN": "s3cret"})
    assert (args.token, origin["token"]) == ("s3cret", "env")


def test_environment_names_are_declared_once():
    names = [S.env_name(f) for cls in (S.AgentSettings, S.ProbeSettings) for f in S.fields_of(cls) if S.env_name(f)]
    names += [S.ENV_CONFIG, S.ENV_DISABLE]
    assert len(names) == len(set(names))
    assert (S.ENV_RUN_ID, S.ENV_LABELS, S.ENV_CUDA_TIMING) == (
        "PHASESCOPE_RUN_ID", "PHASESCOPE_LABELS", "PHASESCOPE_CUDA_TIMING")
    from phasescope.agent.probe import autoattach
    from phasescope.agent.probe.adapters import vllm

    assert autoattach.ENV_RUN_ID is S.ENV_RUN_ID and vllm.ENV_RUN_ID is S.ENV_RUN_ID


def test_probe_settings_are_probes_options():
    """ProbeSettings declares every value option of Probe (what attach passes on), with Probe's defaults."""
    from phasescope.agent.probe.probe import Probe

    params = {n: p.default for n, p in inspect.signature(Probe.__init__).parameters.items()
              if p.kind is inspect.Parameter.KEYWORD_ONLY}
    objects = {"sink", "device", "clock_ns", "perf_ns"}  # arguments only
    objects.add("agent")  # the deprecated spelling of `address` (one release)
    declared = {f.name: S.default_of(f) for f in S.fields_of(S.ProbeSettings)}
    assert set(params) - objects == set(declared)
    assert {n: params[n] for n in declared} == declared


@pytest.mark.parametrize("f", S.fields_of(S.ProbeSettings), ids=lambda f: f.name)
def test_every_probe_option_by_argument_and_env(f):
    env = S.env_name(f)
    arg = {"address": "unix:/arg.sock", "rank": 1, "world_size": 2, "run_id": "arg", "model_name": "m",
           "runtime": "hf-cb", "buffer_records": 128, "flush_interval_s": 0.5, "cuda_timing": False,
           "event_pool_size": 8, "poll_interval_s": 0.1, "gpu_budget": 0.1, "gpu_min_rate": 0.5, "seed": 3,
           "exact_tokens": False, "connect": False, "labels": {"a": "1"}}[f.name]
    assert S.probe_options({}, {}) == {}  # nothing set: Probe's own defaults apply
    if env is None:
        assert S.probe_options({f.name: arg}, {}) == {f.name: arg}
        return
    text = {"address": "tcp:127.0.0.1:1", "run_id": "env", "buffer_records": "64", "flush_interval_s": "0.25",
            "cuda_timing": "1", "event_pool_size": "16", "poll_interval_s": "0.05", "gpu_budget": "0.25",
            "gpu_min_rate": "0.125", "seed": "5", "exact_tokens": "1", "connect": "1", "labels": "k=v,x=y"}[f.name]
    from_env = S.probe_options({}, {env: text})[f.name]
    assert from_env == S.parse_value(f, text, env) and from_env != arg
    assert S.probe_options({f.name: arg}, {env: text}) == {f.name: arg}  # argument > env


def test_docs_table_is_generated():
    path = ROOT / "docs" / "settings.md"
    text = path.read_text()
    assert S.render_docs(text) == text, "run: python -m phasescope.agent.settings docs/settings.md"
    for f in FIELDS:
        assert f"| `{f.name}` | `{S.flag_name(f)}` | `{S.env_name(f)}` |" in text


def test_shipped_config_file_is_all_settings():
    values = S.load_file(str(ROOT / "deploy" / "agent.toml"))
    assert set(values) <= {f.name for f in FIELDS} and values["api"] == S.DEFAULT_API_ADDR


def test_print_config_shows_each_source(tmp_path):
    cfg = tmp_path / "agent.toml"
    cfg.write_text('db = "/file.duckdb"\nrollup_days = 30\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHASESCOPE_")}
    env.update(PHASESCOPE_CONFIG=str(cfg), PHASESCOPE_RETENTION_DAYS="1.5", PHASESCOPE_AGENT_TOKEN="s3cret")
    out = subprocess.run([sys.executable, "-m", "phasescope.cli", "agent", "--print-config", "--sample-s", "2",
                          "--db", str(tmp_path / "flag.duckdb")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f'db = "{tmp_path / "flag.duckdb"}"  # flag' in lines
    assert "sample_s = 2.0  # flag" in lines
    assert "retention_days = 1.5  # env PHASESCOPE_RETENTION_DAYS" in lines
    assert "rollup_days = 30.0  # file" in lines
    assert "checkpoint_s = 10.0  # default" in lines
    assert 'token = "(set, not shown)"  # env PHASESCOPE_AGENT_TOKEN' in lines and "s3cret" not in out.stdout
    assert not (tmp_path / "flag.duckdb").exists()  # printed, nothing started
    assert len([ln for ln in lines if not ln.startswith("# AgentSettings")]) == len(FIELDS)


def test_health_finds_the_api_as_the_agent_does(tmp_path):
    from phasescope.cli.deploy import api_address

    def health(argv, environ):
        return api_address(build_parser().parse_args(["health", *argv]), environ)

    cfg = tmp_path / "agent.toml"
    cfg.write_text('api = "127.0.0.1:1111"\n')
    assert health([], {}) == S.DEFAULT_API_ADDR
    assert health(["--config", str(cfg)], {}) == "127.0.0.1:1111"
    assert health([], {S.ENV_CONFIG: str(cfg), "PHASESCOPE_API": "127.0.0.1:2222"}) == "127.0.0.1:2222"
    assert health(["--api", "127.0.0.1:3333"], {"PHASESCOPE_API": "127.0.0.1:2222"}) == "127.0.0.1:3333"
    # an unrelated bad variable does not stop health
    assert health([], {"PHASESCOPE_SAMPLE_S": "often"}) == S.DEFAULT_API_ADDR


def test_retention_command_takes_the_agents_retention_defaults():
    args = build_parser().parse_args(["retention", "x.duckdb"])
    for name in ("retention_days", "retention_max_gib", "rollup_days", "export_dir", "host"):
        assert getattr(args, name) == getattr(S.AgentSettings(), name)


def test_tomli_is_declared_for_python_310():
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("tomli") and "python_version<'3.11'" in d.replace(" ", "")
               for d in deps)


@pytest.mark.parametrize("f", [f for f in FIELDS + S.fields_of(S.ProbeSettings)
                               if S.spec_of(f).lo is not None or S.spec_of(f).hi is not None], ids=lambda f: f.name)
def test_every_declared_range_is_checked_on_every_route(f, tmp_path):
    """Just outside the declared range: refused by flag (agent), environment and file, with the option, the value
    and the range in one line; just inside: accepted. The probe's options: by attach's own check."""
    spec = S.spec_of(f)
    integer = str(f.type).startswith(("int", "list[int]")) or spec.parse is S.parse_mode
    step = 1 if integer else 1e-9 * max(1.0, abs(spec.lo or spec.hi or 1))
    outside = (spec.lo if spec.lo_open else spec.lo - step) if spec.lo is not None else spec.hi + step
    inside = (spec.lo + step if spec.lo_open else spec.lo) if spec.lo is not None else spec.hi
    if f in S.fields_of(S.ProbeSettings):
        with pytest.raises(ValueError, match=rf"attach\({f.name}=.*must be"):
            S.check_options(S.ProbeSettings, {f.name: outside})
        S.check_options(S.ProbeSettings, {f.name: inside})
        return
    text = f"{int(outside):o}" if spec.parse is S.parse_mode else repr(outside)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["agent", S.flag_name(f), text])
    import re

    with pytest.raises(ValueError, match=rf"{S.env_name(f)}.*{f.name}: must be {re.escape(S.allowed(spec))}"):
        resolve([], {S.env_name(f): text})
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f"{f.name} = {text if spec.parse is not S.parse_mode else repr(text)}\n")
    with pytest.raises(ValueError, match=f"{f.name}: must be"):
        resolve(["--config", str(cfg)], {})
    ok = f"{int(inside):o}" if spec.parse is S.parse_mode else repr(inside)
    args, _ = resolve([S.flag_name(f), ok], {})
    assert getattr(args, f.name) in (inside, [inside])
