"""Mutation testing of the SQL inside a module's string literals (issue 31): the store's views and queries.

    python benchmarks/mutation/sql_mutants.py benchmarks/mutation/sql_queries.toml            # run, report
    python benchmarks/mutation/sql_mutants.py benchmarks/mutation/sql_queries.toml --list     # mutants only
    python benchmarks/mutation/sql_mutants.py CONFIG --only 12,40                             # some mutants

Why hand-written: cosmic-ray and mutmut mutate Python syntax, and a figure's formula here is SQL text in a
string literal (`hit / queried`, `quantile_cont(ttft_s, ...)`, `WHERE total_pages > 0`), which both leave
alone. This tool finds the string tokens of the functions (or module-level names) a config names, skips
what is not SQL (f-string `{...}` fields, `-- comments`, SQL '...' literals, docstrings and strings with no
SQL keyword), and makes one mutant per operator match, as cosmic-ray does for Python operators:

    comparison  <  <=  >  >=  swapped for their strict/non-strict pair, = <-> <>
    arithmetic  + <-> -,  * <-> /            (only between spaces: `count(*)` and `-1` stay)
    aggregate   min <-> max, arg_min <-> arg_max, greatest <-> least, sum -> avg,
                quantile_cont -> quantile_disc, first <-> last
    logic       AND <-> OR, IS NULL <-> IS NOT NULL, IS DISTINCT FROM <-> IS NOT DISTINCT FROM,
                ASC <-> DESC, NULLS FIRST <-> NULLS LAST
    number      an integer n -> n + 1, a decimal or 1e9-style number -> half of it

Each mutant is written into the module file IN PLACE, the config's test command runs (killed: it exits
non-zero or runs past the timeout; survived: it passes), and the file is restored, also on Ctrl-C. Run it
in a checkout no one else is testing from. A mutant that makes the SQL invalid is killed like any other
(the query raises); the report counts them apart from the rest where the test output says so.

Config (TOML):  [sql-mutation]  module-path = "agent/read/queries.py"
                                 targets = ["request_summary", "VIEWS"]   # def names or module-level names
                                 test-command = "python -m pytest -x -q -p no:cacheprovider tests/..."
                                 timeout = 300.0                          # s per mutant
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import signal
import subprocess
import sys
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

SQL_WORD = re.compile(r"\b(SELECT|FROM|WHERE|WHEN|JOIN|GROUP BY|ORDER BY|FILTER|OVER)\b")


def _swap(a: str, b: str, call: bool = True) -> list[tuple[str, str, str]]:
    """Both directions of a word swap, as (name, regex, replacement); `call`: only where a `(` follows
    (a function, not a CTE or column of that name: `WITH last AS`)."""
    after = r"(?=\()" if call else r"\b"
    return [(f"{a}->{b}", rf"\b{a}{after}", b), (f"{b}->{a}", rf"\b{b}{after}", a)]


# (name, regex over the SQL text, replacement): one mutant per match
OPERATORS: list[tuple[str, str, str]] = [
    ("<=-><", r"<=", "<"),
    (">=->>", r">=", ">"),
    ("<-><=", r"(?<![<>=!|-])<(?![<>=])", "<="),
    (">->>=", r"(?<![<>=!|-])>(?![<>=])", ">="),
    ("=-><>", r"(?<![<>=!:])=(?![=>])", "<>"),
    ("<>->=", r"<>|!=", "="),
    ("+->-", r"(?<=\s)\+(?=\s)", "-"),
    ("-->+", r"(?<=\s)-(?=\s)", "+"),
    ("*->/", r"(?<=\s)\*(?=\s)", "/"),
    ("/->*", r"(?<=\s)/(?=\s)", "*"),
    *_swap("min", "max"),
    *_swap("arg_min", "arg_max"),
    *_swap("greatest", "least"),
    *_swap("first", "last"),
    ("sum->avg", r"\bsum(?=\()", "avg"),
    ("quantile_cont->quantile_disc", r"\bquantile_cont\b", "quantile_disc"),
    *_swap("AND", "OR", call=False),
    ("IS NULL->IS NOT NULL", r"\bIS NULL\b", "IS NOT NULL"),
    ("IS NOT NULL->IS NULL", r"\bIS NOT NULL\b", "IS NULL"),
    ("IS DISTINCT->IS NOT DISTINCT", r"\bIS DISTINCT FROM\b", "IS NOT DISTINCT FROM"),
    ("IS NOT DISTINCT->IS DISTINCT", r"\bIS NOT DISTINCT FROM\b", "IS DISTINCT FROM"),
    *_swap("ASC", "DESC", call=False),
    ("NULLS FIRST->NULLS LAST", r"\bNULLS FIRST\b", "NULLS LAST"),
    ("NULLS LAST->NULLS FIRST", r"\bNULLS LAST\b", "NULLS FIRST"),
    ("int->int+1", r"(?<![\w.$])(?<!\de-)\d+(?![\w.])", ""),
    ("num->num/2", r"(?<![\w.$])(?:\d+\.\d+|\d+e-?\d+)(?![\w.])", ""),
]
_COMPILED = [(n, re.compile(p), r) for n, p, r in OPERATORS]


@dataclass(frozen=True)
class Mutant:
    """One mutant: the text at [start, end) of the file (character offsets) becomes `after`."""
    index: int
    line: int
    op: str
    start: int
    end: int
    before: str
    after: str


def _masked(body: str, fstring: bool) -> list[bool]:
    """Per character of a literal's body: True where it is not SQL to mutate ({fields}, comments, '...')."""
    mask = [False] * len(body)
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if fstring and c == "{":
            if body.startswith("{{", i):
                mask[i] = mask[i + 1] = True
                i += 2
                continue
            depth, j = 0, i
            while j < n:
                depth += {"{": 1, "}": -1}.get(body[j], 0)
                j += 1
                if depth == 0:
                    break
            mask[i:j] = [True] * (j - i)
            i = j
        elif body.startswith("--", i):
            j = body.find("\n", i)
            j = n if j < 0 else j
            mask[i:j] = [True] * (j - i)
            i = j
        elif c == "'":
            j = body.find("'", i + 1)
            j = n if j < 0 else j + 1
            mask[i:j] = [True] * (j - i)
            i = j
        else:
            i += 1
    return mask


def _regions(src: str, targets: list[str]) -> list[tuple[int, int]]:
    """(first line, last line) of each target: a def's or a module-level assignment's, docstrings left out."""
    tree = ast.parse(src)
    out, found = [], set()
    for node in tree.body:
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            tgts = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in tgts if isinstance(t, ast.Name)]
        for name in names:
            if name in targets:
                found.add(name)
                first = node.lineno
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and \
                        isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None), ast.Constant):
                    first = node.body[0].end_lineno + 1  # after the docstring
                out.append((first, node.end_lineno))
    missing = set(targets) - found
    if missing:
        raise SystemExit(f"targets not found in the module: {sorted(missing)}")
    return out


def mutants(src: str, targets: list[str]) -> list[Mutant]:
    """Every mutant of the SQL in the string tokens of `targets`, in file order."""
    regions = _regions(src, targets)
    starts = [0]
    for line in src.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    out: list[Mutant] = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type != tokenize.STRING or not any(a <= tok.start[0] <= b for a, b in regions):
            continue
        text = tok.string
        m = re.match(r"([rRbBfFuU]*)('''|\"\"\"|'|\")", text)
        assert m is not None, text
        q = m.group(2)
        body_at = m.end()
        body = text[body_at:len(text) - len(q)]
        if not SQL_WORD.search(body):
            continue
        mask = _masked(body, "f" in m.group(1).lower())
        base = starts[tok.start[0] - 1] + tok.start[1] + body_at
        for name, rx, repl in _COMPILED:
            for hit in rx.finditer(body):
                if any(mask[hit.start():hit.end()]):
                    continue
                before = hit.group(0)
                if name == "int->int+1":
                    after = str(int(before) + 1)
                elif name == "num->num/2":
                    after = repr(float(before) / 2)
                else:
                    after = repl
                line = body.count("\n", 0, hit.start()) + tok.start[0]
                out.append(Mutant(0, line, name, base + hit.start(), base + hit.end(), before, after))
    out.sort(key=lambda m: (m.start, m.op))
    return [Mutant(i, m.line, m.op, m.start, m.end, m.before, m.after) for i, m in enumerate(out)]


def _run(cmd: str, timeout_s: float) -> tuple[str, float, str]:
    """('killed'|'survived'|'timeout', seconds, the output)."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout_s, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        return "timeout", time.monotonic() - t0, str(exc.stdout or "")
    return ("survived" if p.returncode == 0 else "killed"), time.monotonic() - t0, p.stdout + p.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--list", action="store_true", help="print the mutants and stop")
    ap.add_argument("--only", default="", help="comma-separated mutant indices")
    ap.add_argument("--out", help="write the report here too")
    args = ap.parse_args(argv)
    cfg = tomllib.loads(Path(args.config).read_text())["sql-mutation"]
    path = Path(cfg["module-path"])
    src = path.read_text()
    todo = mutants(src, list(cfg["targets"]))
    if args.only:
        keep = {int(i) for i in args.only.split(",")}
        todo = [m for m in todo if m.index in keep]
    if args.list:
        for m in todo:
            print(f"{m.index:4d} {path}:{m.line} {m.op}: {m.before!r} -> {m.after!r}")
        print(f"{len(todo)} mutants")
        return 0
    status, secs, out = _run(cfg["test-command"], float(cfg.get("timeout", 300)))
    if status != "survived":
        raise SystemExit(f"baseline: the test command fails on the unmutated module ({status}): {out[-2000:]}")
    print(f"baseline passed in {secs:.1f} s; {len(todo)} mutants", flush=True)

    def restore(*_: object) -> None:
        path.write_text(src)
        raise SystemExit(130)

    old = signal.signal(signal.SIGTERM, restore)
    lines, counts = [], {"killed": 0, "survived": 0, "timeout": 0, "invalid_sql": 0}
    try:
        for m in todo:
            path.write_text(src[:m.start] + m.after + src[m.end:])
            try:
                status, secs, out = _run(cfg["test-command"], float(cfg.get("timeout", 300)))
            finally:
                path.write_text(src)
            invalid = status == "killed" and re.search(r"duckdb\.\w*(Parser|Binder|Catalog)Exception", out)
            counts["invalid_sql" if invalid else status] += 1
            line = f"{m.index:4d} {path}:{m.line} {m.op}: {m.before!r} -> {m.after!r}: " \
                   f"{'killed (invalid SQL)' if invalid else status} ({secs:.0f} s)"
            lines.append(line)
            print(line, flush=True)
    finally:
        path.write_text(src)
        signal.signal(signal.SIGTERM, old)
    done = sum(counts.values())
    killed = done - counts["survived"]
    summary = (f"{path} {cfg['targets']}: {done} mutants, killed {killed} (of them invalid SQL {counts['invalid_sql']}, "
               f"timeout {counts['timeout']}), survived {counts['survived']}: score {100 * killed / max(done, 1):.1f}%")
    print(summary)
    if args.out:
        Path(args.out).write_text("\n".join(lines + [summary]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
