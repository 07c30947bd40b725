"""Where an EngineCore's host time goes, from py-spy's collapsed stacks (`py-spy record -f raw --function`).

`vllm_h200.py --phases cost` with PHASESCOPE_BENCH_PYSPY_S / _DIR set samples the EngineCore of each condition
(A armed, B plain, C vLLM's stats) over the same rounds; this reads those files and prints, per condition, the
busy samples of the engine's main thread (the busy loop) and of its other threads, the share of the main thread
spent inside phasescope's frames, and both split by function: what an armed engine does that a plain one does not.

    python benchmarks/gpu/pyspy_share.py DIR [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re

OURS = re.compile(r"\((?:[^()]*/)?(?:phasescope/)?agent/(?:probe|records)/[^()]*\)")


def _theirs(frame: str) -> bool:
    """A frame of vLLM's own code (our adapter's path holds `adapters/vllm/` too)."""
    return "vllm/" in frame and not OURS.search(frame)


def _frames(stack: str) -> list[str]:
    return stack.split(";")


def _name(frame: str) -> str:
    """`func (file:line)` -> `file:func` without the line (py-spy --function gives the def line)."""
    m = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    return f"{m.group(2).rsplit('/', 1)[-1]}:{m.group(1)}" if m else frame


def read(path: pathlib.Path) -> dict:
    """Counts of one profile: main-thread and other-thread busy samples, ours by outermost and innermost frame,
    the main thread by vLLM engine entry point."""
    main = other = ours_main = ours_other = 0
    outer: collections.Counter = collections.Counter()
    inner: collections.Counter = collections.Counter()
    entry: collections.Counter = collections.Counter()
    entry_ours: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        frames = _frames(stack)
        is_main = not frames[0].startswith("Thread._bootstrap")
        # a sample is ours when, walking from its leaf up, the first frame of ours or vLLM's is ours (torch and
        # the standard library called from our hooks count as ours; vLLM's method under our wrapper does not)
        mine = []
        for i in range(len(frames) - 1, -1, -1):
            if OURS.search(frames[i]):
                mine.insert(0, i)
            elif _theirs(frames[i]):
                break
        if is_main:
            main += count
            # the vLLM call under EngineCore.step (schedule, execute_model, update_from_output, ...)
            step = next((i for i, f in enumerate(frames) if f.startswith("EngineCore.step")), None)
            if step is not None and step + 1 < len(frames):
                # the vLLM method called (past our wrapper), or our hook where the sample is in it
                rest = frames[step + 1:]
                theirs = next((f for f in rest if _theirs(f)), None)
                e = _name(theirs) if theirs is not None else "ours " + _name(rest[0])
                entry[e] += count
                if mine:
                    entry_ours[e] += count
            else:
                entry["(outside EngineCore.step)"] += count
                if mine:
                    entry_ours["(outside EngineCore.step)"] += count
        else:
            other += count
        if mine:
            if is_main:
                ours_main += count
            else:
                ours_other += count
            outer[("main " if is_main else "bg ") + _name(frames[mine[0]])] += count
            inner[("main " if is_main else "bg ") + _name(frames[mine[-1]])] += count
    return {"main": main, "other": other, "ours_main": ours_main, "ours_other": ours_other,
            "outer": dict(outer.most_common(25)), "inner": dict(inner.most_common(25)),
            "entry": dict(entry.most_common(20)), "entry_ours": dict(entry_ours.most_common(20))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--json")
    a = ap.parse_args()
    res = {}
    for p in sorted(pathlib.Path(a.dir).glob("pyspy_*.txt")):
        cond = p.stem.split("_", 1)[1]
        res[cond] = r = read(p)
        share = r["ours_main"] / r["main"] if r["main"] else 0.0
        print(f"== {cond}: main thread {r['main']} busy samples ({share:.1%} in phasescope), "
              f"other threads {r['other']} ({r['ours_other']} in phasescope)")
        for k, v in r["entry"].items():
            print(f"   entry {k}: {v}  (ours {r['entry_ours'].get(k, 0)})")
        for k, v in list(r["outer"].items())[:15]:
            print(f"   outer {k}: {v}")
        for k, v in list(r["inner"].items())[:15]:
            print(f"   inner {k}: {v}")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
