#!/usr/bin/env python3
"""Hit rates and ratios of `moetide bench --trace` runs at several prefetch distances, as one small JSON.

    python scripts/trace_replay_summary.py d1=OUT1,OUT1b d2=OUT2 d3=OUT3 --out results/X/summary.json

Each OUT is a bench output directory (its summary.json and runs/*.json); several, comma-separated,
are merged (runs of one distance split over processes). Per distance and policy: the
hit rate (for dynaexq and combined, the share of expert uses served in hi), lo-run rate, prefetches
issued / used, miss fills and FineMoE's searches; per distance: finemoe / lru, finemoe / moe-infinity
and combined / dynaexq (`combined_hi_use_share_vs_dynaexq`), where both runs are there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _searches(stats: dict | None) -> dict:
    """FineMoE's search counters, from finemoe's stats or combined's finemoe part."""
    if not stats:
        return {}
    part = stats.get("finemoe", stats)
    keys = ("semantic_searches", "trajectory_searches", "late_skipped", "dropped_events")
    return {k: part[k] for k in keys if k in part}


def policy_rows(out: Path) -> dict[str, dict]:
    """policy -> its figures, from one bench output directory."""
    summary = json.loads((out / "summary.json").read_text())
    rows = {}
    for row in summary["runs"]:
        if row.get("error"):
            rows[row["policy"]] = {"error": row["error"]}
            continue
        run = json.loads((out / "runs" / f"{row['name']}.json").read_text())
        m = run.get("metrics") or {}
        rows[row["policy"]] = {
            "hit_rate": row["hit_rate"],
            "lo_run_rate": row["lo_run_rate"],
            "experts_used": m.get("experts_used"),
            "prefetches_issued": m.get("prefetches_issued"),
            "prefetches_used": m.get("prefetches_used"),
            "prefetches_late": m.get("prefetches_late"),
            "miss_fills": m.get("miss_fills"),
            "bytes_h2d": row.get("bytes_h2d"),
            "tpot_mean_s": row.get("tpot_mean_s"),
            "hi_slots": run.get("hi_slots"),
            **_searches(run.get("policy_stats")),
        }
    return rows


def ratio(rows: dict, a: str, b: str) -> float | None:
    x, y = rows.get(a, {}).get("hit_rate"), rows.get(b, {}).get("hit_rate")
    return round(x / y, 4) if x is not None and y else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="LABEL=DIR[,DIR...], one per prefetch distance")
    ap.add_argument("--out", default=None, help="write the summary here (default: stdout only)")
    args = ap.parse_args()
    result = {}
    for item in args.dirs:
        label, _, paths = item.partition("=")
        rows = {}
        for path in paths.split(","):
            rows.update(policy_rows(Path(path)))
        result[label] = {
            "policies": rows,
            "finemoe_vs_lru_hit_rate": ratio(rows, "finemoe", "lru"),
            "finemoe_vs_moe_infinity_hit_rate": ratio(rows, "finemoe", "moe-infinity"),
            "combined_hi_use_share_vs_dynaexq": ratio(rows, "combined", "dynaexq"),
        }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
