#!/usr/bin/env python3
"""One MoE layer of packed rows on the lo kernels (`lo_cuda`), called eagerly a few times, for Nsight
Compute to read the kernels' hardware counters (what bounds them: DRAM, L1/L2, issue, latency).

    ncu --clock-control none --kernel-name regex:lo_mma_kernel --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python scripts/profile_lo_ncu.py --format int2 --tokens 128

The layer is bench_lo_cuda.py's cell (tune_fused_moe's pool and inputs on the OLMoE shape); the first
call's launches build and warm the kernels, so `--launch-skip 2` profiles the second call's gate_up and
down. Prints the roofline of the layer's bytes at 3.3 TB/s, for the report's durations to be read against.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tune_fused_moe import ROOFLINE_BYTES_S, SHAPES, layer_bytes, layer_inputs, make_pool  # noqa: E402

from moetide.compute import fused_moe as fm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="int2", choices=("int2", "int4"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_lo_ncu: needs a CUDA device")
    hidden, inter, experts, top_k = SHAPES[args.shape]
    pool = make_pool(args.format, hidden, inter, experts)
    x, ids, weights, pool_of, slot_of = layer_inputs(args.tokens, hidden, experts, top_k)
    for _ in range(args.calls):
        fm.fused_moe(x, ids, weights, pool_of, slot_of, [pool])
    torch.cuda.synchronize()
    roof_us = layer_bytes(pool, ids, hidden) / ROOFLINE_BYTES_S * 1e6
    used = int(torch.unique(ids).numel())
    print(f"{args.format} T={args.tokens}: layer roofline {roof_us:.2f} us, {used} experts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
