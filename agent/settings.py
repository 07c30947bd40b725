"""One declared settings object per process: `AgentSettings` (the sidecar, `phasescope agent`) and
`ProbeSettings` (the probe, `attach(model, **options)`).

Each field is declared once, with its type, default, unit and help; everything else is generated
from the declaration (OpenTelemetry SDK's `SdkConfiguration` does the same):

- the `phasescope agent` flag `--<key-with-dashes>` (repeatable for a list, a switch for a boolean);
- the environment variable `PHASESCOPE_<KEY>` (or the name the field declares, e.g. the token's
  `PHASESCOPE_AGENT_TOKEN`); lists comma-separated, booleans 1/0 (also true/false, yes/no, on/off);
  an empty variable counts as unset, as in OpenTelemetry;
- the key `<key>` of the TOML config file (`--config FILE` or `$PHASESCOPE_CONFIG`); dashes in a
  file key are read as underscores; an unknown key or a value of the wrong type is an error;
- the table in docs/settings.md (`python -m phasescope.agent.settings docs/settings.md` rewrites it;
  a test checks the committed one is current).

Precedence: flag > environment > file > default for the agent; argument > environment > default
for the probe. `phasescope agent --print-config` prints every value with where it came from.
Stdlib only: the probe imports this module in the inference process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

from .records.address import ENV_ADDRESS, ENV_TOKEN

ENV_PREFIX = "PHASESCOPE_"
ENV_CONFIG = "PHASESCOPE_CONFIG"
ENV_DISABLE = "PHASESCOPE_DISABLE"  # `phasescope run`'s bootstrap loads nothing when 1
DEFAULT_API_ADDR = "127.0.0.1:7702"
SOURCES = ("flag", "env", "file", "default")


# --- parsers: one value from the environment (text) or the file (TOML types) ---

def parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean (1/0, true/false): {v!r}")


def parse_mode(v: Any) -> int:
    """A file mode: 0660, "0660" or "660" (octal)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    return int(str(v), 8)


def parse_labels(text: Any) -> dict[str, str]:
    """"a=1,b=x" (or a TOML table) -> {"a": "1", "b": "x"}; raises ValueError on an item without "="."""
    if isinstance(text, Mapping):
        return {str(k): str(v) for k, v in text.items()}
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad label {item!r}; expected key=value")
        out[key.strip()] = value.strip()
    return out


def check_address(v: Any) -> None:
    """unix:PATH, tcp:HOST:PORT with a port 0-65535, or a socket path containing a / (records.address)."""
    from .records.address import parse_address

    parse_address(str(v))


def check_host_port(v: Any) -> None:
    """HOST:PORT with a port 0-65535 (0: pick a free one)."""
    host, sep, port = str(v).rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError("expected HOST:PORT with a port 0-65535, e.g. 127.0.0.1:7702")


def check_url(v: Any) -> None:
    """An http:// or https:// URL with a host."""
    from urllib.parse import urlparse

    u = urlparse(str(v))
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError("expected an http:// or https:// URL, e.g. http://127.0.0.1:8000/metrics")
    try:
        port = u.port
    except ValueError:
        port = -1
    if port is not None and not 0 < port <= 65535:
        raise ValueError("expected an http:// or https:// URL with a port 1-65535")


def _number(kind: type) -> Callable[[Any], Any]:
    def parse(v: Any) -> Any:
        if isinstance(v, bool):  # TOML true is not a number
            raise ValueError(f"not a number: {v!r}")
        return kind(v)

    parse.__name__ = kind.__name__
    return parse


def _text(v: Any) -> str:
    if not isinstance(v, (str, int, float)) or isinstance(v, bool):
        raise ValueError(f"not a string: {v!r}")
    return str(v)


def _list_of(item: Callable[[Any], Any]) -> Callable[[Any], list]:
    def parse(v: Any) -> list:
        values = v if isinstance(v, (list, tuple)) else [s.strip() for s in str(v).split(",") if s.strip()]
        return [item(x) for x in values]

    return parse


# the declared type (the annotation's text) -> its parser
PARSERS: dict[str, Callable[[Any], Any]] = {
    "str": _text, "str | None": _text, "float": _number(float), "float | None": _number(float),
    "int": _number(int), "int | None": _number(int), "bool": parse_bool,
    "list[str]": _list_of(_text), "list[int]": _list_of(_number(int)),
}


class Spec(NamedTuple):
    """What a field declares besides its name, type and default."""

    help: str
    unit: str = ""  # "s", "MiB", "GiB", "days", ... ("" for none)
    env: str | None = ""  # "": PHASESCOPE_<KEY>; None: no environment variable
    parse: Callable[[Any], Any] | None = None  # None: by the declared type
    metavar: str | None = None
    shown: str | None = None  # how help and docs show the default (when the value itself says little)
    secret: bool = False  # --print-config masks it
    lo: float | None = None  # a number's allowed range: lo <= value (lo < value when lo_open) ...
    hi: float | None = None  # ... and value <= hi; None: unbounded on that side
    lo_open: bool = False
    check: Callable[[Any], Any] | None = None  # raises ValueError (what is allowed) for a bad value (each item)


def allowed(spec: Spec) -> str:
    """The allowed range of a number, as help and errors state it: "> 0 s", "0.05 to 3600 s", ">= 1"."""
    unit = f" {spec.unit}" if spec.unit and spec.unit != "fraction" else ""
    if spec.parse is parse_mode:
        return f"{int(spec.lo or 0):04o} to {int(spec.hi or 0):04o} (octal)"

    def num(v: float | None) -> str | None:
        return None if v is None else f"{int(v):,}" if float(v).is_integer() and abs(v) >= 1000 else f"{v:g}"

    lo, hi = num(spec.lo), num(spec.hi)
    if lo is not None and hi is not None:
        return (f"> {lo} and <= {hi}" if spec.lo_open else f"{lo} to {hi}") + unit
    if lo is not None:
        return f"{'>' if spec.lo_open else '>='} {lo}{unit}"
    return f"<= {hi}{unit}" if hi is not None else ""


def check_value(f: dataclasses.Field, value: Any) -> None:
    """Raise ValueError (what is allowed, in a few words) unless `value` (parsed) is within what `f` declares;
    a list is checked item by item; None passes (unset)."""
    if value is None:
        return
    for item in value if isinstance(value, list) else [value]:
        spec = spec_of(f)
        if spec.check is not None:
            spec.check(item)
        if isinstance(item, (int, float)) and not isinstance(item, bool) and (spec.lo is not None or spec.hi is not None):
            bad = (item != item or (spec.lo is not None and (item <= spec.lo if spec.lo_open else item < spec.lo))
                   or (spec.hi is not None and item > spec.hi))
            if bad:
                raise ValueError(f"must be {allowed(spec)}")


def setting(default: Any, help: str, **spec: Any) -> Any:
    """A settings field: `default` (a list default is copied per instance) and its `Spec`."""
    meta = {"spec": Spec(help, **spec)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def fields_of(cls: type) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def spec_of(f: dataclasses.Field) -> Spec:
    return f.metadata["spec"]


def env_name(f: dataclasses.Field) -> str | None:
    """The environment variable of a field (None: it has none)."""
    env = spec_of(f).env
    return ENV_PREFIX + f.name.upper() if env == "" else env


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def parser_of(f: dataclasses.Field) -> Callable[[Any], Any]:
    spec = spec_of(f)
    if spec.parse is not None:
        return spec.parse
    try:
        return PARSERS[str(f.type)]
    except KeyError:
        raise TypeError(f"setting {f.name}: no parser for type {f.type!r}; declare parse=") from None


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]


def parse_value(f: dataclasses.Field, raw: Any, where: str) -> Any:
    """`raw` parsed as field `f`'s type and checked against its range; ValueError naming `where` (the variable
    or file key), the value and what is allowed if it is not one."""
    try:
        value = parser_of(f)(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: bad value {raw!r} for {f.name} ({f.type}): {exc}") from None
    try:
        check_value(f, value)
    except ValueError as exc:
        raise ValueError(f"{where}: {raw!r} for {f.name}: {exc}") from None
    return value


def _flag_type(f: dataclasses.Field, parse: Callable[[Any], Any]) -> Callable[[str], Any]:
    """argparse's type= for a flag of `f`: parsed and range-checked; argparse prints the message with the flag
    ("argument --checkpoint-s: '-1': must be > 0 and <= 86400 s")."""
    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: not a {f.type} ({exc})") from None
        try:
            check_value(f, value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
        return value

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def check_options(cls: type, values: Mapping[str, Any], call: str = "attach") -> None:
    """Check option values given as arguments (e.g. attach's) against `cls`'s declarations: ValueError
    "attach(gpu_budget=2.0): must be > 0 and <= 1" for the first bad one. Unknown names are left alone."""
    known = {f.name: f for f in fields_of(cls)}
    for name, value in values.items():
        f = known.get(name)
        if f is None or value is None:
            continue
        try:
            check_value(f, value)
        except ValueError as exc:
            raise ValueError(f"{call}({name}={value!r}): {exc}") from None


# --- the three routes ---

def load_file(path: str, cls: type | None = None) -> dict[str, Any]:
    """The keys of a TOML config file, parsed. Raises ValueError on an unknown key or a bad value."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10 (declared in pyproject: tomli; python_version < "3.11")
        import tomli as tomllib
    cls = cls or AgentSettings
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    known = {f.name: f for f in fields_of(cls)}
    out = {}
    for key, value in raw.items():
        k = key.replace("-", "_")
        if k not in known:
            raise ValueError(f"{path}: unknown key {key!r}; known: {', '.join(sorted(known))}")
        out[k] = parse_value(known[k], value, f"{path}: {key}")
    return out


def from_env(environ: Mapping[str, str], cls: type | None = None, only: Iterable[str] | None = None) -> dict[str, Any]:
    """The fields set by their environment variables, parsed (empty counts as unset). Raises ValueError."""
    keep = set(only) if only is not None else None
    out = {}
    for f in fields_of(cls or AgentSettings):
        name = env_name(f)
        if name and environ.get(name, "").strip() and (keep is None or f.name in keep):
            out[f.name] = parse_value(f, environ[name], f"${name}")
    return out


def resolve_values(cls: type, flags: Mapping[str, Any], environ: Mapping[str, str] = os.environ,
                   path: str | None = None, only: Iterable[str] | None = None) -> tuple[Any, dict[str, str]]:
    """The settings of `cls` from `flags` (already parsed; the fields given), the environment, the file at
    `path` and the defaults, in that order of precedence; and where each value came from (`SOURCES`).
    `only`: read just these fields from the environment (the file is still checked whole)."""
    file_values = load_file(path, cls) if path else {}
    env_values = from_env(environ, cls, only)
    values, origin = {}, {}
    for f in fields_of(cls):
        for source, given in (("flag", flags), ("env", env_values), ("file", file_values)):
            if f.name in given:
                values[f.name], origin[f.name] = given[f.name], source
                break
        else:
            values[f.name], origin[f.name] = default_of(f), "default"
    return cls(**values), origin


# --- the command line ---

def _help(f: dataclasses.Field) -> str:
    spec = spec_of(f)
    default = spec.shown if spec.shown is not None else _shown(default_of(f))
    text = spec.help.replace("%", "%%") + (f", {spec.unit}" if spec.unit else "")
    if allowed(spec):
        text += f"; {allowed(spec)}"
    return f"{text} (default: {default})" if default else text


def _shown(value: Any) -> str:
    if value is None or value == [] or value is False:
        return ""
    return str(value)


def add_arguments(p: argparse.ArgumentParser, cls: type | None = None, only: Sequence[str] | None = None,
                  defaults: bool = False) -> None:
    """One flag per field of `cls` (or the fields named in `only`, in that order). A flag not given is absent
    from the parsed namespace (`resolve` fills it), unless `defaults`: then it has the field's default."""
    known = {f.name: f for f in fields_of(cls or AgentSettings)}
    for name in only or known:
        f = known[name]
        spec = spec_of(f)
        kw: dict[str, Any] = {"help": _help(f), "default": default_of(f) if defaults else argparse.SUPPRESS}
        if spec.metavar:
            kw["metavar"] = spec.metavar
        if str(f.type) == "bool":
            kw["action"] = "store_true"
        elif str(f.type).startswith("list["):
            kw.update(action="append", type=_flag_type(f, PARSERS["int" if f.type == "list[int]" else "str"]))
        else:
            kw["type"] = _flag_type(f, parser_of(f))
        p.add_argument(flag_name(f), **kw)


def resolve(args: argparse.Namespace, environ: Mapping[str, str] = os.environ,
            cls: type | None = None) -> dict[str, str]:
    """Fill every field of `cls` (default: AgentSettings) not given as a flag from the environment, then the
    `--config` file ($PHASESCOPE_CONFIG), then its default, on `args`; keep the whole object as
    `args.settings`. Returns where each value came from. Raises ValueError (OSError for an unreadable file)."""
    cls = cls or AgentSettings
    given = vars(args)
    flags = {f.name: given[f.name] for f in fields_of(cls) if given.get(f.name) is not None}
    path = getattr(args, "config", None) or environ.get(ENV_CONFIG) or None
    settings, origin = resolve_values(cls, flags, environ, path)
    for f in fields_of(cls):
        setattr(args, f.name, getattr(settings, f.name))
    args.settings, args.origin = settings, origin
    return origin


def print_config(settings: Any, origin: Mapping[str, str]) -> str:
    """Every value and where it came from, as a TOML file (a value that is not set is a comment)."""
    lines = [f"# {type(settings).__name__}: each value, then where it came from (flag > env > file > default)"]
    for f in fields_of(type(settings)):
        value = getattr(settings, f.name)
        where = origin.get(f.name, "default")
        if where == "env":
            where = f"env {env_name(f)}"
        if value is None or value == []:
            shown = spec_of(f).shown
            lines.append(f"# {f.name}: not set{f' ({shown})' if shown else ''}  # {where}")
            continue
        if spec_of(f).secret:
            value = "(set, not shown)"
        lines.append(f"{f.name} = {_toml(value, f)}  # {where}")
    return "\n".join(lines) + "\n"


def _toml(value: Any, f: dataclasses.Field) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if f.name == "socket_mode":
        return f'"{value:04o}"'
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v, f) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v, f)}" for k, v in value.items()) + "}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


# --- the declarations ---

@dataclass(frozen=True)
class AgentSettings:
    """The options of `phasescope agent` (the sidecar process)."""

    db: str = setting("phasescope.duckdb", "DuckDB file to write")
    listen: list[str] = setting([], "unix:/path/agent.sock or tcp:127.0.0.1:PORT; repeatable", metavar="ADDR",
                                shown="the default socket", check=check_address)
    socket_mode: int = setting(0o600, "mode of the Unix socket, octal (0660 to share it through a group)",
                               parse=parse_mode, shown="0600", lo=0, hi=0o777)
    checkpoint_s: float = setting(10.0, "checkpoint interval", unit="s", lo=0, lo_open=True, hi=86400)
    api: str | None = setting(None, "serve named queries to live readers (dashboard, diagnose) here, on loopback; "
                                    "a taken default only warns", metavar="HOST:PORT", shown=DEFAULT_API_ADDR,
                              check=check_host_port)
    no_api: bool = setting(False, "no read API")
    token: str | None = setting(None, "shared secret every probe must present; TCP listeners are otherwise "
                                      "unauthenticated, so set one whenever you --listen tcp:",
                                env=ENV_TOKEN, secret=True)
    memory_budget_mib: float = setting(32.0, "received-but-unwritten records held at most; beyond it probes are "
                                             "slowed down and their rings drop and count", unit="MiB", lo=1,
                                     hi=1 << 20)
    read_memory_mib: int = setting(512, "DuckDB memory while a read-API query or retention roll runs; exact "
                                        "percentiles over 10M steps need ~250 MiB (the writer alone stays within "
                                        "48 MB)", unit="MiB", lo=1, hi=1 << 22)
    store_threads: int | None = setting(None, "DuckDB worker threads of the store (writes, folds, reads); a cap keeps "
                                                "them off the inference server's cores, folds get slower",
                                         shown="one per core", lo=1, hi=1024)
    fold_interval_s: float = setting(5.0, "fold new request events into the derived tables this often, a slice at "
                                          "a time, so reads stay fast and the fold at close stays small (0: only "
                                          "at reads and close)", unit="s", lo=0, hi=3600)
    fold_slice_rows: int = setting(200_000, "request events folded per transaction at most (its memory is the "
                                            "slice's, under the read memory)", lo=1, hi=100_000_000)
    max_connections: int = setting(256, "probe connections at once", lo=1, hi=1_000_000)
    idle_timeout_s: float = setting(120.0, "close a probe connection silent this long", unit="s", lo=0,
                                    lo_open=True, hi=7 * 86400)
    frame_timeout_s: float = setting(10.0, "a frame must arrive whole within this once it starts", unit="s", lo=0,
                                     lo_open=True, hi=3600)
    metrics_addr: str | None = setting(None, "serve Prometheus /metrics here (skipped with a warning if the "
                                             "default is taken)", metavar="HOST:PORT", shown="127.0.0.1:9464",
                                       check=check_host_port)
    no_metrics: bool = setting(False, "do not serve /metrics")
    otlp: bool = setting(False, "export OTLP/HTTP metrics and traces, configured by the standard "
                                "OTEL_EXPORTER_OTLP_* and OTEL_SERVICE_NAME variables (default endpoint "
                                "http://localhost:4318)")
    otlp_interval_s: float = setting(10.0, "OTLP metric export interval", unit="s", lo=0.1, hi=86400)
    sample_s: float = setting(1.0, "GPU (NVML), host and server-process (psutil) sampling interval", unit="s",
                              lo=0.05, hi=3600)
    host: str | None = setting(None, "host name in the Parquet export paths", shown="the hostname")
    retention_days: float = setting(7.0, "raw rows older than this are rolled up, exported and deleted",
                                    unit="days", lo=0, lo_open=True, hi=36500)
    retention_max_gib: float = setting(10.0, "above this store size the oldest raw rows are rolled too",
                                       unit="GiB", lo=0, lo_open=True, hi=1 << 20)
    rollup_days: float = setting(90.0, "per-minute rollups are kept this long", unit="days", lo=0, lo_open=True,
                                 hi=36500)
    retention_interval_s: float = setting(60.0, "how often retention runs", unit="s", lo=0, lo_open=True,
                                          hi=7 * 86400)
    export_dir: str | None = setting(None, "write rolled raw rows here as Parquet, host=/date=/table=",
                                     shown="no export")
    no_retention: bool = setting(False, "keep everything (unbounded)")
    scrape: list[str] = setting([], "scrape mode: poll an inference server's Prometheus /metrics (vLLM without "
                                    "the plugin, SGLang, TGI, TensorRT-LLM) every sample_s and store what maps "
                                    "onto the tables; repeatable", metavar="URL", check=check_url)
    pid: list[int] = setting([], "also sample this server process's CPU, threads, memory and files (psutil); "
                                 "the pids of attached probes are sampled without it; repeatable", metavar="PID",
                            lo=1, hi=1 << 22)


@dataclass(frozen=True)
class ProbeSettings:
    """The value options of `attach(model, **options)` (see `Probe`); the environment variables are read by
    the zero-code paths (`phasescope run`'s bootstrap, the vLLM plugin) through `probe_options`. Callables
    and objects (`sink`, `device`, `clock_ns`, `perf_ns`) are arguments only."""

    address: str | None = setting(None, "where the sidecar listens: unix:/path/agent.sock or tcp:HOST:PORT",
                                env=ENV_ADDRESS, shown="$XDG_RUNTIME_DIR/phasescope/agent.sock",
                                check=check_address)
    rank: int | None = setting(None, "this process's rank", env=None, shown="$RANK, else $LOCAL_RANK, else 0",
                               lo=0)
    world_size: int | None = setting(None, "ranks in the run", env=None, shown="$WORLD_SIZE, else 1",
                                     lo=1)
    run_id: str | None = setting(None, "run id shared by every process of one run", shown="a new one")
    model_name: str | None = setting(None, "model name in every record", env=None,
                                     shown="the model's config name")
    runtime: str = setting("module", "runtime label (hf-generate, hf-cb, vllm, module); set by the adapter",
                           env=None)
    buffer_records: int = setting(65536, "records the ring holds before it drops the oldest (counted)", lo=16,
                                  hi=1 << 26)
    flush_interval_s: float = setting(0.1, "longest interval between the background thread's wakes (poll, ship, acks)",
                                     unit="s", lo=0.001, hi=60)
    cuda_timing: bool = setting(True, "time forwards with CUDA events (sampled under gpu_budget); 0: host only")
    event_pool_size: int = setting(256, "pre-created CUDA event pairs", lo=1, hi=1 << 16)
    poll_interval_s: float = setting(0.02, "shortest interval between wakes (the first one; a high step rate)",
                                    unit="s", lo=0.001, hi=10)
    gpu_budget: float | None = setting(0.005, "share of GPU time CUDA-event timing may cost (none: time every "
                                              "forward)", unit="fraction", lo=0, lo_open=True, hi=1)
    gpu_min_rate: float = setting(0.001, "share of forwards timed whatever the budget", unit="fraction", lo=0,
                                  hi=1)
    seed: int | None = setting(None, "seed of the timing sampler", shown="random")
    exact_tokens: bool = setting(True, "read exact token counts on CUDA asynchronously")
    connect: bool = setting(True, "ship records to the sidecar (0: keep them in the ring, for tests)")
    labels: dict[str, str] | None = setting(None, "run labels k=v,k=v", parse=parse_labels)


def env_of(cls: type, name: str) -> str:
    """The environment variable of field `name` of `cls` (each declared once, here)."""
    env = env_name(next(f for f in fields_of(cls) if f.name == name))
    assert env is not None, name
    return env


ENV_RUN_ID = env_of(ProbeSettings, "run_id")  # PHASESCOPE_RUN_ID
ENV_LABELS = env_of(ProbeSettings, "labels")  # PHASESCOPE_LABELS
ENV_CUDA_TIMING = env_of(ProbeSettings, "cuda_timing")  # PHASESCOPE_CUDA_TIMING


def probe_options(arguments: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """`attach` keyword arguments: `arguments` over the fields set in the environment (argument > env; the
    defaults are `Probe`'s own, declared equal in ProbeSettings). Raises ValueError on a bad variable."""
    return {**from_env(environ, ProbeSettings), **arguments}


# --- the docs table ---

def docs_table(cls: type) -> str:
    """The markdown table of `cls`'s fields: key, flag, variable, type, default, unit, meaning."""
    flags = cls is AgentSettings
    head = ["key", *(["flag"] if flags else []), "environment", "type", "default", "unit", "allowed", "meaning"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in fields_of(cls):
        spec = spec_of(f)
        value = default_of(f)
        default = spec.shown if spec.shown is not None else (str(value).lower() if isinstance(value, bool)
                                                               else _shown(value))
        env = env_name(f)
        cells = [f"`{f.name}`", *([f"`{flag_name(f)}`"] if flags else []), f"`{env}`" if env else "-",
                 f"`{f.type}`", default or "-", spec.unit or "-", allowed(spec) or (spec.check.__doc__ or "-").split(
                     " (records")[0].rstrip(".") if spec.check else allowed(spec) or "-", spec.help]
        cells = [c.replace("|", "\\|") for c in cells]  # a | inside a cell (str | None) would split it
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- generated by `python -m phasescope.agent.settings docs/settings.md`: {} -->", "<!-- end {} -->"


def render_docs(text: str) -> str:
    """`text` with each generated table (between its BEGIN and END marks) rewritten from the declarations."""
    for cls in (AgentSettings, ProbeSettings):
        begin, end = BEGIN.format(cls.__name__), END.format(cls.__name__)
        head, sep, rest = text.partition(begin + "\n")
        if not sep:
            raise ValueError(f"no {begin!r} mark")
        _, sep, tail = rest.partition(end)
        if not sep:
            raise ValueError(f"no {end!r} mark")
        text = head + begin + "\n" + docs_table(cls) + end + tail
    return text


def main(argv: list[str] | None = None) -> int:
    """`python -m phasescope.agent.settings FILE`: rewrite the generated tables in FILE."""
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1:
        print("usage: python -m phasescope.agent.settings docs/settings.md", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        text = f.read()
    with open(args[0], "w", encoding="utf-8") as f:
        f.write(render_docs(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
