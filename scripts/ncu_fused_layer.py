#!/usr/bin/env python3
"""One MoE layer of the fused kernel, called a few times, for Nsight Compute to profile on the GPU.

    ncu --clock-control none -k regex:"gate_up|down" --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        --section MemoryWorkloadAnalysis python3 scripts/ncu_fused_layer.py int2 1 v6 [1,16,512,4,2]

Arguments: the pool format, T, the packed tile product ("engine": the path the engine takes, the
tensor-core kernels of `lo_cuda` where they apply; "cuda": those kernels at any T), and optionally
the tiles (block_m, block_n, block_k, warps, stages; else the tile table's), on the OLMoE shape
with the tuner's random weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tune_fused_moe import SHAPES, layer_inputs, make_pool  # noqa: E402

from moetide.compute import fused_moe as fm  # noqa: E402
from moetide.compute import lo_cuda  # noqa: E402
from moetide.compute.fused_moe_config import KernelConfig  # noqa: E402


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__)
        return 2
    fmt, num_tokens, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tile = None if path in ("engine", "cuda") else path
    if path == "cuda":
        lo_cuda.MAX_TOKENS = max(lo_cuda.MAX_TOKENS, num_tokens)
    config = KernelConfig(*[int(v) for v in sys.argv[4].split(",")]) if len(sys.argv) > 4 else None
    hidden, inter, experts, top_k = SHAPES["olmoe-1b-7b"]
    pool = make_pool(fmt, hidden, inter, experts)
    x, ids, weights, pool_of, slot_of = layer_inputs(num_tokens, hidden, experts, top_k)
    for _ in range(3):  # the first compiles; ncu skips it (--launch-skip)
        out = fm.fused_moe(x, ids, weights, pool_of, slot_of, [pool], config=config, packed_tile=tile)
    torch.cuda.synchronize()
    print(f"{fmt} T={num_tokens} {tile}: output norm {out.float().norm().item():.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
