#!/usr/bin/env python3
"""Compute the fused-path and sync-free targets from raw GPU results; merge them into results/targets.json.

    python scripts/record_targets.py --decode results/gpu/X/decode_step.json --date 2026-12-01 --commit abc1234
    python scripts/record_targets.py --sync-free results/gpu/X/decode_a.json \
        --dynamic results/gpu/X/decode_b.json --compile off --date 2026-12-01 --commit abc1234
    python scripts/record_targets.py --serve X/demo_serve.json Y/olmoe_serve.json \
        --serve-pair X/demo_serve.json X/demo_serve_base.json --date 2026-12-01 --commit abc1234

Every value is a ratio or a rate from one raw file (one process, one run); `raw` names that file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = Path(__file__).resolve().parents[1] / "results" / "targets.json"


def decode_rate(runs: list[dict], policy: str, batch: int, compile_mode: str | None) -> float | None:
    for r in runs:
        if r.get("policy") == policy and r.get("batch") == batch and "decode_tok_s" in r:
            if compile_mode is None or r.get("compile", "off") == compile_mode:
                return r["decode_tok_s"]
    return None


def ttft(runs: list[dict], policy: str) -> float | None:
    return next((r["ttft_s"] for r in runs if r.get("policy") == policy and "ttft_s" in r), None)


def decode_targets(runs: list[dict], compile_mode: str) -> dict[str, tuple[float | None, float, str]]:
    """target -> (value, goal, "ge" | "le")."""
    rate = lambda p, b: decode_rate(runs, p, b, compile_mode)  # noqa: E731
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    return {
        "no_offload_bs1_tok_s": (rate("no-offload", 1), 400, "ge"),
        "no_offload_bs32_tok_s": (rate("no-offload", 32), 4388, "ge"),
        "static_int2_bs1_tok_s": (rate("static-int2", 1), 400, "ge"),
        "static_int2_bs32_tok_s": (rate("static-int2", 32), 3332, "ge"),
        "static_int2_bs32_vs_no_offload": (ratio(rate("static-int2", 32), rate("no-offload", 32)), 1.0, "ge"),
        "static_int4_bs32_vs_no_offload": (ratio(rate("static-int4", 32), rate("no-offload", 32)), 1.0, "ge"),
        "static_int2_prefill2k_ttft_vs_no_offload": (ratio(ttft(runs, "static-int2"), ttft(runs, "no-offload")),
                                                      1.5, "le"),  # fmt: skip
    }


def hf_rate(runs: list[dict], engine: str, batch: int) -> float | None:
    return next((r["decode_tok_s"] for r in runs if r.get("engine") == engine and r.get("batch") == batch
                 and "decode_tok_s" in r), None)  # fmt: skip


def sync_free_targets(runs: list[dict], compile_mode: str) -> dict[str, tuple[float | None, float, str]]:
    """Issue 15's targets from one run of combined, static-int2 and transformers (4 GiB, OLMoE shape)."""
    rate = lambda p, b: decode_rate(runs, p, b, compile_mode)  # noqa: E731
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    return {
        "combined_bs1_vs_static_int2": (ratio(rate("combined", 1), rate("static-int2", 1)), 0.8, "ge"),
        "combined_bs32_vs_static_int2": (ratio(rate("combined", 32), rate("static-int2", 32)), 0.8, "ge"),
        "combined_bs1_vs_transformers": (ratio(rate("combined", 1), hf_rate(runs, "hf", 1)), 3.0, "ge"),
        "combined_4gib_bs1_tok_s": (rate("combined", 1), 401.4, "ge"),
        "combined_4gib_bs32_tok_s": (rate("combined", 32), 1227, "ge"),
    }


def dynamic_targets(runs: list[dict]) -> dict[str, tuple[float | None, float, str]]:
    rates = [r["decode_tok_s"] for r in runs if r.get("batch") == 1 and "decode_tok_s" in r
             and r.get("policy") in ("finemoe", "dynaexq", "lru", "on-demand", "moe-infinity")]  # fmt: skip
    return {"dynamic_policies_bs1_min_tok_s": (min(rates) if len(rates) == 5 else None, 100, "ge")}


def level(result: dict, clients: int) -> dict | None:
    return next((lv for lv in result["levels"] if lv["concurrency"] == clients), None)


def serve_targets(paths: list[str]) -> dict[str, tuple[float | None, float, str, str]]:
    """The serving targets over bench_server.py results (one per model): the worst model's TTFT p90
    at 32 and 64 clients and the worst prefix-probe ratio; `raw` names the worst model's file."""
    found = {}
    results = {p: json.loads(Path(p).read_text()) for p in paths}
    for clients in (32, 64):
        values = [(lv["ttft_s"]["p90"], p) for p, r in results.items() if (lv := level(r, clients))]
        if values:
            value, raw = max(values)
            found[f"serve_ttft_p90_s_{clients}_clients"] = (value, 2.0, "le", raw)
    probes = [(r["prefix_probe"]["ttft_ratio"], p) for p, r in results.items() if r.get("prefix_probe")]
    if probes:
        value, raw = max(probes)
        found["prefix_cache_ttft_ratio"] = (value, 0.3, "le", raw)
    return found


def serve_pair_target(new: str, base: str) -> dict[str, tuple[float | None, float, str, str]]:
    """Output tok/s at 32 clients of this engine over another version's (`--server-src`), one call."""
    a, b = (level(json.loads(Path(p).read_text()), 32) for p in (new, base))
    value = a["output_tokens_per_s"] / b["output_tokens_per_s"] if a and b else None
    return {"serve_tok_s_32_clients_vs_left_padded": (value, 2.0, "ge", new)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode")
    ap.add_argument("--sync-free", help="decode JSON with combined, static-int2 and the hf baseline")
    ap.add_argument("--dynamic", help="decode JSON with finemoe, dynaexq, lru, on-demand, moe-infinity at bs 1")
    ap.add_argument("--serve", nargs="+", help="bench_server.py JSONs of this engine, one per model")
    ap.add_argument("--serve-pair", nargs=2, metavar=("NEW", "BASE"), help="bench_server.py JSONs, one call")
    ap.add_argument("--compile", default="auto", help="which compile setting's decode rows count")
    ap.add_argument("--date", required=True)
    ap.add_argument("--commit", required=True)
    args = ap.parse_args()
    targets = json.loads(TARGETS.read_text()) if TARGETS.exists() else {}
    found = {}
    if args.decode:
        runs = json.loads(Path(args.decode).read_text())["runs"]
        found.update({k: (*v, args.decode) for k, v in decode_targets(runs, args.compile).items()})
    if args.sync_free:
        runs = json.loads(Path(args.sync_free).read_text())["runs"]
        found.update({k: (*v, args.sync_free) for k, v in sync_free_targets(runs, args.compile).items()})
    if args.dynamic:
        runs = json.loads(Path(args.dynamic).read_text())["runs"]
        found.update({k: (*v, args.dynamic) for k, v in dynamic_targets(runs).items()})
    if args.serve:
        found.update(serve_targets(args.serve))
    if args.serve_pair:
        found.update(serve_pair_target(*args.serve_pair))
    for name, (value, goal, sense, raw) in found.items():
        if value is None:
            continue
        met = value >= goal if sense == "ge" else value <= goal
        targets[name] = {"value": round(value, 3), "goal": f"{'>=' if sense == 'ge' else '<='} {goal}",
                         "met": met, "date": args.date, "commit": args.commit, "raw": raw}  # fmt: skip
        print(f"{name:45s} {value:10.3f}  goal {targets[name]['goal']:>8s}  {'met' if met else 'MISSED'}")
    TARGETS.write_text(json.dumps(dict(sorted(targets.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
