"""Compare this run's headline metrics with a previous run's, flagging regressions beyond the spread.

Rule, per metric matched on (bench, key, metric): when both sides measured a range (n >= 2), a
regression is a current range entirely on the worse side of the baseline range (no overlap); an
improvement the opposite; anything else is within the measured spread. When either side has a
single value there is no spread to judge by, so the change is held against ``tolerance`` (relative).
"""

from __future__ import annotations

import pandas as pd

DEFAULT_TOLERANCE = 0.05


def _verdict(cur: pd.Series, base: pd.Series, tolerance: float) -> tuple[str, str]:
    higher = cur["better"] == "higher"
    if cur["n"] >= 2 and base["n"] >= 2:
        worse = cur["max"] < base["min"] if higher else cur["min"] > base["max"]
        better = cur["min"] > base["max"] if higher else cur["max"] < base["min"]
        basis = "ranges"
    else:
        change = (cur["median"] - base["median"]) / base["median"] if base["median"] else 0.0
        worse = change < -tolerance if higher else change > tolerance
        better = change > tolerance if higher else change < -tolerance
        basis = f"single value: +/-{tolerance:.0%}"
    return ("regression" if worse else "improvement" if better else "within spread"), basis


def compare(current: pd.DataFrame, baseline: pd.DataFrame, tolerance: float = DEFAULT_TOLERANCE) -> pd.DataFrame:
    """One row per metric present in both runs, plus those only one side has (status says which)."""
    on = ["bench", "key", "metric"]
    merged = current.merge(baseline, on=on, how="outer", suffixes=("", "_base"), indicator=True)
    rows = []
    for _, r in merged.iterrows():
        rec = {k: r[k] for k in on}
        rec["unit"] = r["unit"] if isinstance(r["unit"], str) else r["unit_base"]
        rec["better"] = r["better"] if isinstance(r["better"], str) else r["better_base"]
        for side, suffix in (("current", ""), ("baseline", "_base")):
            for stat in ("median", "min", "max", "n"):
                rec[f"{side}_{stat}"] = r[f"{stat}{suffix}"]
        if r["_merge"] == "left_only":
            rec.update(status="new (no baseline)", basis="", change=None)
        elif r["_merge"] == "right_only":
            rec.update(status="missing (baseline only)", basis="", change=None)
        else:
            cur = pd.Series({"median": r["median"], "min": r["min"], "max": r["max"], "n": r["n"], "better": rec["better"]})
            base = pd.Series({"median": r["median_base"], "min": r["min_base"], "max": r["max_base"], "n": r["n_base"]})
            status, basis = _verdict(cur, base, tolerance)
            change = (r["median"] - r["median_base"]) / r["median_base"] if r["median_base"] else None
            rec.update(status=status, basis=basis, change=change)
        rows.append(rec)
    cols = [*on, "unit", "better", "baseline_median", "baseline_min", "baseline_max", "baseline_n",
            "current_median", "current_min", "current_max", "current_n", "change", "status", "basis"]
    order = {"regression": 0, "improvement": 1, "within spread": 2, "new (no baseline)": 3, "missing (baseline only)": 4}
    out = pd.DataFrame(rows, columns=cols)
    return out.sort_values(by=["status", "bench", "key"], key=lambda s: s.map(order) if s.name == "status" else s,
                           kind="stable").reset_index(drop=True)
