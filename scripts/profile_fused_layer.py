#!/usr/bin/env python3
"""Where one MoE layer's time goes: every kernel of a `fused_moe` call (align, launches, reduce), from
the CUDA profiler, per (format, T), on the OLMoE shape with the committed tiles.

    python scripts/profile_fused_layer.py --out out/layer_kernels.json [--tokens 1,8] [--formats int2,int4,bfloat16]
        [--against-pdl] [--against-default] [--against-config 1,32,256,8,2,v6]

Each call is run `--reps` times under torch.profiler; per kernel name the mean device microseconds per
call are reported, with their sum and the graph-replayed wall time of the call (as the tuner times it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tune_fused_moe import ROOFLINE_BYTES_S, SHAPES, layer_bytes, layer_inputs, make_pool, time_layer  # noqa: E402

from moetide.compute import fused_moe as fm  # noqa: E402
from moetide.compute.fused_moe_config import KernelConfig, default_config  # noqa: E402


def kernel_times(pool, inputs, reps: int) -> dict[str, float]:
    """Mean device µs per call of each kernel of an eager `fused_moe` call (`pool`: one pool or the
    layer's list), from the CUDA profiler."""
    x, ids, weights, pool_of, slot_of = inputs
    pools = pool if isinstance(pool, list) else [pool]
    call = lambda: fm.fused_moe(x, ids, weights, pool_of, slot_of, pools)  # noqa: E731
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us and event.count >= reps:
            times[event.key[:80]] = round(device_us / reps, 2)
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--formats", default="int2,int4,bfloat16")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--against-default", action="store_true",
                    help="also time each cell on `default_config` (what a bucket the table lacks ran on before "
                         "it took its nearest tuned bucket's tiles)")  # fmt: skip
    ap.add_argument("--against-pdl", action="store_true",
                    help="also time each cell with MOETIDE_PDL flipped (programmatic dependent launches)")
    ap.add_argument("--against-config", default=None,
                    help="also time each cell on these tiles: block_m,block_n,block_k,warps,stages[,tile product]")
    args = ap.parse_args()
    hidden, inter, experts, top_k = SHAPES[args.shape]
    rows = []
    for fmt in args.formats.split(","):
        pool = make_pool(fmt, hidden, inter, experts)
        for t in (int(v) for v in args.tokens.split(",")):
            inputs = layer_inputs(t, hidden, experts, top_k)
            config = fm.config_for(t, hidden, inter, pool.format.name)
            graph_us, _ = time_layer(pool, inputs, config, config.packed_tile)
            kernels = kernel_times(pool, inputs, args.reps)
            roof_us = layer_bytes(pool, inputs[1], hidden) / ROOFLINE_BYTES_S * 1e6
            rows.append({"format": fmt, "tokens": t, "config": vars(config), "graph_us": round(graph_us, 2),
                         "roofline_us": round(roof_us, 2), "vs_roofline": round(graph_us / roof_us, 2),
                         "kernels_us": kernels, "kernels_sum_us": round(sum(kernels.values()), 2)})  # fmt: skip
            if args.against_pdl:  # the same call with programmatic dependent launches, in this process
                fm.PDL = not fm.PDL
                other_us, _ = time_layer(pool, inputs, config, config.packed_tile)
                fm.PDL = not fm.PDL
                rows[-1].update({"pdl": fm.PDL, "other_pdl_graph_us": round(other_us, 2)})
            if args.against_config:  # the same call on other tiles (KernelConfig fields), in this process
                other = KernelConfig(*[int(v) for v in args.against_config.split(",")[:5]],
                                     *args.against_config.split(",")[5:6])  # fmt: skip
                other_us, _ = time_layer(pool, inputs, other, other.packed_tile)
                rows[-1].update(other_config=vars(other), other_graph_us=round(other_us, 2))
            if args.against_default:
                default = default_config(t)
                default_us, _ = time_layer(pool, inputs, default, default.packed_tile)
                rows[-1].update(default_config=vars(default), default_graph_us=round(default_us, 2))
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
