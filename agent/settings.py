"""Configuration of `phasescope agent` by command line, environment and file.

Every long option of `phasescope agent` is also a key of the TOML config file
(`--config FILE` or $PHASESCOPE_CONFIG; dashes become underscores) and an
environment variable PHASESCOPE_<KEY> (e.g. PHASESCOPE_DB, PHASESCOPE_RETENTION_DAYS;
lists comma-separated, booleans 1/0). A flag given on the command line wins over
the environment, which wins over the file, which wins over the built-in default.
An unknown key in the file, or a value of the wrong type, is an error.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Mapping

ENV_PREFIX = "PHASESCOPE_"
ENV_CONFIG = "PHASESCOPE_CONFIG"


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {v!r}")


def _list(v: Any) -> list[str]:
    if isinstance(v, (list, tuple)):
        return [str(x) for x in v]
    return [s.strip() for s in str(v).split(",") if s.strip()]


def _mode(v: Any) -> int:
    """A file mode: 0660, "0660" or "660" (octal)."""
    if isinstance(v, int):
        return v
    return int(str(v), 8)


# key -> parser of a value from the environment or the file
KEYS: dict[str, Callable[[Any], Any]] = {
    "db": str, "listen": _list, "socket_mode": _mode, "api": str, "no_api": _bool,
    "metrics_addr": str, "no_metrics": _bool, "otlp": _bool, "otlp_interval_s": float,
    "checkpoint_s": float, "sample_s": float,
    "retention_days": float, "retention_max_gib": float, "rollup_days": float, "retention_interval_s": float,
    "export_dir": str, "host": str, "no_retention": _bool,
}


class _Unset:
    """The default of an option not given on the command line."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the config, socket and retention options to the `agent` parser; mark every default unset."""
    p.add_argument("--config", metavar="FILE", help=f"TOML config file (default: ${ENV_CONFIG} if set)")
    p.add_argument("--socket-mode", type=_mode, default=0o600,
                   help="mode of the Unix socket, octal (default: 0600; 0660 to share it through a group)")
    p.add_argument("--host", default=None, help="host name in the Parquet export paths (default: the hostname)")
    p.add_argument("--retention-days", type=float, default=7.0,
                   help="raw rows older than this are rolled up, exported and deleted (default: %(default)s)")
    p.add_argument("--retention-max-gib", type=float, default=10.0,
                   help="above this store size the oldest raw rows are rolled too, GiB (default: %(default)s)")
    p.add_argument("--rollup-days", type=float, default=90.0,
                   help="per-minute rollups are kept this long (default: %(default)s)")
    p.add_argument("--retention-interval-s", type=float, default=60.0,
                   help="how often retention runs, s (default: %(default)s)")
    p.add_argument("--export-dir", default=None,
                   help="write rolled raw rows here as Parquet, host=/date=/table= (default: no export)")
    p.add_argument("--no-retention", action="store_true", help="keep everything (unbounded)")
    for action in p._actions:
        # append actions (--listen) keep None as their unset default: they copy their default
        if action.dest in KEYS and not isinstance(action, argparse._AppendAction):
            action.default = _Unset(action.default)


def load_file(path: str) -> dict[str, Any]:
    """The keys of a TOML config file, parsed. Raises ValueError on an unknown key or bad value."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    out = {}
    for key, value in raw.items():
        k = key.replace("-", "_")
        if k not in KEYS:
            raise ValueError(f"{path}: unknown key {key!r}; known: {', '.join(sorted(KEYS))}")
        try:
            out[k] = KEYS[k](value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: bad value for {key!r}: {exc}") from exc
    return out


def from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """PHASESCOPE_<KEY> variables, parsed. Raises ValueError on a bad value."""
    out = {}
    for k, parse in KEYS.items():
        name = ENV_PREFIX + k.upper()
        if name in environ:
            try:
                out[k] = parse(environ[name])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"${name}: {exc}") from exc
    return out


def resolve(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Fill every option not given on the command line from the environment, then the file, then
    its default. Returns where each value came from ("flag", "env", "file", "default")."""
    path = getattr(args, "config", None) or environ.get(ENV_CONFIG)
    file_values = load_file(path) if path else {}
    env_values = from_env(environ)
    origin = {}
    for k in KEYS:
        if not hasattr(args, k):
            continue
        v = getattr(args, k)
        if v is None and k == "listen":
            v = _Unset(None)
        if not isinstance(v, _Unset):
            origin[k] = "flag"
        elif k in env_values:
            setattr(args, k, env_values[k])
            origin[k] = "env"
        elif k in file_values:
            setattr(args, k, file_values[k])
            origin[k] = "file"
        else:
            setattr(args, k, v.value)
            origin[k] = "default"
    return origin
