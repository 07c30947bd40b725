"""Medians of run.sh's A/B: records/s committed and acknowledged, and the agent's CPU per record (less
sensitive to the machine's load than the rate)."""
import glob
import json
import os
import statistics as st

os.chdir(os.path.dirname(os.path.abspath(__file__)))
tab: dict = {}
for arm in ("old", "new"):
    for f in sorted(glob.glob(f"{arm}_*.json")):
        for r in json.load(open(f))["results"]:
            tab.setdefault((arm, r["producers"]), []).extend(r["runs"])
print("| producers | 699d632 records/s | new records/s | new/old | 699d632 agent CPU us/record | new agent CPU us/record | old/new CPU |")
print("|---|---|---|---|---|---|---|")
for p in sorted({k[1] for k in tab}):
    o, n = tab[("old", p)], tab[("new", p)]
    ro, rn = st.median(x["records_per_s"] for x in o), st.median(x["records_per_s"] for x in n)
    co, cn = st.median(x["agent_cpu_us_per_record"] for x in o), st.median(x["agent_cpu_us_per_record"] for x in n)
    print(f"| {p} | {ro:,.0f} | {rn:,.0f} | {rn / ro:.1f}x | {co:.2f} | {cn:.2f} | {co / cn:.1f}x |")
    print(f"  runs old {[round(x['records_per_s']) for x in o]} new {[round(x['records_per_s']) for x in n]};"
          f" every run delivered == stored: {all(x['delivered_equals_stored'] for x in o + n)}")
