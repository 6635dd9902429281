import json, sys, statistics as st
from pathlib import Path
out = Path(sys.argv[1]); trees = sys.argv[2:] or ["base", "new"]
rows = {t: [json.loads(l) for l in open(out / t / "disagg_bench.jsonl")] for t in trees}
def med(xs): return round(st.median(xs), 1) if xs else None
print("stage       " + "".join(f"{t:>22}" for t in trees) + "   (median of run p50 ms / best min ms)")
stages = []
for r in rows[trees[0]]:
    if r["bench"] == "disagg_stage" and r["stage"] not in stages: stages.append(r["stage"])
for s in stages:
    cells = []
    for t in trees:
        rs = [r for r in rows[t] if r["bench"] == "disagg_stage" and r["stage"] == s]
        cells.append(f"{med([r['p50_ms'] for r in rs])} / {min(r['min_ms'] for r in rs):.1f}")
    print(f"{s:12}" + "".join(f"{c:>22}" for c in cells))
for suite in ("aes", "unprotected"):
    for key in ("stream_p50_ms", "p50_ms", "min_ms", "stream_gib_s", "import_p50_ms", "export_p50_ms"):
        cells = []
        for t in trees:
            rs = [r for r in rows[t] if r["bench"] == "disagg_e2e" and r["suite"] == suite]
            cells.append(f"{med([r[key] for r in rs])}" if rs else "-")
        print(f"e2e {suite[:5]} {key:14}" + "".join(f"{c:>12}" for c in cells))
loads = [r["load_1m"] for t in trees for r in rows[t]]
print("load_1m", min(loads), "-", max(loads))
