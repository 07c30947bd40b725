"""Options several commands share: the read-API URL a reading command reads (`--api URL`) and the
sidecar address `phasescope run` gives the probes (`--address ADDR`), each with its old spelling
`--agent` kept as a deprecated alias for one release."""

from __future__ import annotations

import argparse
import inspect
import warnings
from typing import Any

from .errors import UsageError

API_EXAMPLE = "http://127.0.0.1:7702"


class DeprecatedAlias(argparse.Action):
    """An old flag spelling: stores like the new one and raises a DeprecationWarning (shown with
    `python -W default` or PYTHONWARNINGS=default; silent otherwise, so a command's stderr stays its one
    line, and `phasescope run`'s stays the program's). Its help says which flag replaces it."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        warnings.warn(f"{parser.prog}: {option_string} is deprecated and goes in the next release; use {self.new}",
                      DeprecationWarning, stacklevel=2)
        setattr(namespace, self.dest, values)


def add_command(sub: Any, func: Any, **kwargs: Any) -> argparse.ArgumentParser:
    """Subcommand run by `func(args)` and named for it (`cmd_plan_kv` and `_cmd_plan_kv`: plan-kv). Its text is
    declared once, as `func`'s docstring: the first paragraph is the one-line help of the command list, the rest
    the description of its --help. `kwargs`: anything else `add_parser` takes."""
    name = func.__name__.lstrip("_").removeprefix("cmd_").replace("_", "-")
    help, _, description = inspect.cleandoc(func.__doc__ or "").partition("\n\n")
    if not help:
        raise TypeError(f"command {name}: {func.__name__} has no docstring (its help)")
    p = sub.add_parser(name, help=" ".join(help.split()), description=" ".join(description.split()) or None,
                       **kwargs)
    p.set_defaults(func=func)
    return p


def add_api_url(p: argparse.ArgumentParser, help: str) -> None:
    """`--api URL` (a running agent's read API), and `--agent URL`, its deprecated spelling."""
    p.add_argument("--api", metavar="URL", help=f"{help}, e.g. {API_EXAMPLE}")
    p.add_argument("--agent", metavar="URL", dest="api", action=DeprecatedAlias, new="--api",
                   help="deprecated: use --api")


def add_address(p: argparse.ArgumentParser, help: str) -> None:
    """`--address ADDR` (where the sidecar listens), and `--agent ADDR`, its deprecated spelling."""
    p.add_argument("--address", metavar="ADDR", help=help)
    p.add_argument("--agent", metavar="ADDR", dest="address", action=DeprecatedAlias, new="--address",
                   help="deprecated: use --address")


def reader_target(args: argparse.Namespace) -> str:
    """The DuckDB file (or folder of exports) or the read-API URL a reading command reads: exactly one."""
    if args.api and args.db:
        raise UsageError("give a DuckDB file or --api URL, not both")
    if args.api:
        if not args.api.startswith(("http://", "https://")):
            raise UsageError(f"--api takes the agent's read API URL, e.g. {API_EXAMPLE}, not {args.api!r}")
        return args.api
    if not args.db:
        raise UsageError("give a DuckDB file, or --api URL to read a running agent")
    return args.db  # a URL in place of the file reads through its API, never DuckDB's httpfs


def read_line(target: str) -> str:
    """What a reading command read, in one line (agent/read/history.read_line): a file's schema version and
    exports; a live agent's URL."""
    from phasescope.agent.read.exports import export_glob

    if target.startswith(("http://", "https://")):
        return f"read the live agent at {target}"
    if export_glob(target) is not None:
        return f"read the Parquet exports under {target}"
    from phasescope.agent.read.history import read_line as store_line
    from phasescope.agent.read.reader import connect_readonly

    con = connect_readonly(target)
    try:
        return store_line(con, target)
    finally:
        con.close()
