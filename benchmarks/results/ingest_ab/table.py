import json,glob,statistics as st
tab={}
for arm in ('old','new'):
    for f in sorted(glob.glob(f'{arm}_*.json')):
        for r in json.load(open(f))['results']:
            tab.setdefault((arm,r['producers']),[]).append(r)
print("| producers | d80577b records/s (median) | main records/s (median) | main/d80577b | d80577b ratio to DuckDB bulk | main ratio to bulk | main/d80577b, normalized |")
print("|---|---|---|---|---|---|---|")
for p in (1,4,16):
    o,n=tab[('old',p)],tab[('new',p)]
    ro=st.median(x['records_per_s'] for x in o); rn=st.median(x['records_per_s'] for x in n)
    qo=st.median(x['ratio'] for x in o); qn=st.median(x['ratio'] for x in n)
    print(f"| {p} | {ro:,.0f} | {rn:,.0f} | {rn/ro-1:+.1%} | {qo:.1%} | {qn:.1%} | {qn/qo-1:+.1%} |")
    print("  runs old", [round(x['records_per_s']) for x in o], "new", [round(x['records_per_s']) for x in n])
