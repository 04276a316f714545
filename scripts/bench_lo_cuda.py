#!/usr/bin/env python3
"""One MoE layer of packed rows on the tensor-core kernels (`lo_cuda`) against the Triton tiles of the
table (MOETIDE_LO_CUDA=0), in one process, per (format, T, warps along K), against the HBM roofline.

    python scripts/bench_lo_cuda.py --out lo_cuda.json [--formats int2,int4] [--tokens 1,8,32,128] \
        [--warps-k auto,1,2,4] [--shape olmoe-1b-7b] [--reps 3]

Each cell is timed as tune_fused_moe.py times a layer (a graph-replayed `fused_moe` call, median of
`triton.testing.do_bench`, L2 flushed between replays), the two paths alternating `--reps` times;
`err_*` is each output's relative (Frobenius) difference from the per-expert PyTorch reference
(`reference_moe`, which rounds the dequantized weights to bf16). The roofline is tune_fused_moe's:
every used expert's row once plus the activations in and out, at 3.3 TB/s. `vs_roofline` of a cell
is its time over the roofline; the target `lo_kernel_vs_hbm_roofline_worst` is the worst over T = 1,
8, 32, 128 of the path the engine takes (`engine_us`: the CUDA kernels where `lo_cuda.eligible`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from tune_fused_moe import ROOFLINE_BYTES_S, SHAPES, layer_bytes, layer_inputs, make_pool, time_layer  # noqa: E402

from moetide.compute import lo_cuda  # noqa: E402
from moetide.compute.expert_compute import reference_moe  # noqa: E402

AUTO_WARPS = lo_cuda.warps_along_k


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def timed(pool, inputs, cuda: bool, warps: str) -> tuple[float, torch.Tensor]:
    os.environ["MOETIDE_LO_CUDA"] = "1" if cuda else "0"
    lo_cuda.warps_along_k = AUTO_WARPS if warps == "auto" else (lambda t, k, b, w=int(warps): w)
    try:
        return time_layer(pool, inputs, None, None)
    finally:
        lo_cuda.warps_along_k = AUTO_WARPS
        os.environ.pop("MOETIDE_LO_CUDA", None)


def cell(fmt: str, t: int, shape: tuple, warps_k: list[str], reps: int) -> dict:
    hidden, inter, experts, top_k = shape
    pool = make_pool(fmt, hidden, inter, experts)
    inputs = layer_inputs(t, hidden, experts, top_k)
    x, ids, weights, pool_of, slot_of = inputs
    ref = reference_moe(x, ids, weights, pool_of, slot_of, [pool], F.silu)
    roof_us = layer_bytes(pool, ids, hidden) / ROOFLINE_BYTES_S * 1e6
    row = {"format": fmt, "tokens": t, "roofline_us": round(roof_us, 2),
           "eligible": lo_cuda.eligible(pool, x, 1, weights.dtype)}  # fmt: skip
    triton_times, cuda_times = [], {w: [] for w in warps_k}
    for _ in range(reps):
        us, out = timed(pool, inputs, False, "auto")
        triton_times.append(us)
        row["err_triton"] = rel_err(out, ref)
        for w in warps_k:
            us, out = timed(pool, inputs, True, w)
            cuda_times[w].append(us)
            row[f"err_cuda_wk{w}"] = rel_err(out, ref)
    row["triton_us"] = round(statistics.median(triton_times), 2)
    row["cuda_us"] = {w: round(statistics.median(v), 2) for w, v in cuda_times.items()}
    row["auto_warps_k"] = AUTO_WARPS(t, hidden // pool.format.gate_up.group_size, pool.format.gate_up.bits)
    best = min(row["cuda_us"], key=row["cuda_us"].get)
    row["best_warps_k"], row["best_cuda_us"] = best, row["cuda_us"][best]
    engine_us = row["cuda_us"].get("auto", row["best_cuda_us"]) if row["eligible"] and t <= lo_cuda.MAX_TOKENS \
        else row["triton_us"]  # fmt: skip
    row.update(engine_us=engine_us, vs_roofline=round(engine_us / roof_us, 2),
               triton_vs_roofline=round(row["triton_us"] / roof_us, 2),
               speedup_vs_triton=round(row["triton_us"] / engine_us, 3))  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="int2,int4")
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--warps-k", default="auto,1,2,4")
    ap.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    shape = SHAPES[args.shape]
    rows = []
    for fmt in args.formats.split(","):
        for t in [int(v) for v in args.tokens.split(",")]:
            row = cell(fmt, t, shape, args.warps_k.split(","), args.reps)
            rows.append(row)
            print(f"{fmt:6s} T={t:5d} roofline {row['roofline_us']:7.1f} us | triton {row['triton_us']:7.1f} "
                  f"({row['triton_vs_roofline']:.2f}x) | cuda {row['cuda_us']} -> engine {row['engine_us']:.1f} "
                  f"({row['vs_roofline']:.2f}x) | err triton {row['err_triton']:.1e} cuda "
                  f"{row.get('err_cuda_wkauto', float('nan')):.1e}", flush=True)  # fmt: skip
    target = [r for r in rows if r["tokens"] in (1, 8, 32, 128)]
    worst = max(target, key=lambda r: r["vs_roofline"]) if target else None
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "rows": rows, "worst": worst and {k: worst[k] for k in ("format", "tokens", "vs_roofline")}}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("worst:", result["worst"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
