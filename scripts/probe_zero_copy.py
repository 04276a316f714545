#!/usr/bin/env python3
"""Zero-copy expert reads on the GPU: the fused MoE kernel reading one layer's experts straight from
pinned host memory (`slot_table.device_alias`, UVA) against the same experts in device memory and
against the stall it replaces (copy the experts over, then compute), for one OLMoE-shaped layer.

    python scripts/probe_zero_copy.py --out out/zero_copy.json [--tokens 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

from moetide.compute import fused_moe as fm
from moetide.residency.slot_table import Pool, dense_format, device_alias


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,8,32")
    args = ap.parse_args()
    H, I, E, k = 2048, 1024, 64, 8
    fmt = dense_format(H, I, torch.bfloat16)
    row_bytes = 3 * H * I * 2
    g = torch.Generator(device="cuda").manual_seed(0)
    device_arena = (torch.randn(E, row_bytes // 2, device="cuda", generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
    host_arena = torch.empty(E, row_bytes, dtype=torch.uint8, pin_memory=True)
    host_arena.copy_(device_arena)
    alias = device_alias(host_arena, torch.device("cuda"))
    on_device, on_host = Pool(device_arena, fmt), Pool(alias, fmt)
    pool_of = torch.zeros(E, dtype=torch.int32, device="cuda")
    slot_of = torch.arange(E, dtype=torch.int32, device="cuda")
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        weights, ids = torch.topk(torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1), k, dim=-1)
        ref = fm.fused_moe(x, ids, weights, pool_of, slot_of, [on_device])
        got = fm.fused_moe(x, ids, weights, pool_of, slot_of, [on_host])
        used = torch.unique(ids)
        staging = torch.empty(len(used), row_bytes, dtype=torch.uint8, device="cuda")

        used_host = used.cpu().tolist()

        def stall():  # what a miss costs with --on-miss stall: copy each used expert over, wait, compute
            for i, e in enumerate(used_host):
                staging[i].copy_(host_arena[e], non_blocking=True)  # pinned rows: full PCIe rate
            torch.cuda.synchronize()
            return fm.fused_moe(x, ids, weights, pool_of, slot_of, [on_device])

        t_dev = triton.testing.do_bench(lambda: fm.fused_moe(x, ids, weights, pool_of, slot_of, [on_device]),
                                        return_mode="median")  # fmt: skip
        t_host = triton.testing.do_bench(lambda: fm.fused_moe(x, ids, weights, pool_of, slot_of, [on_host]),
                                         return_mode="median")  # fmt: skip
        t_stall = triton.testing.do_bench(stall, return_mode="median")
        row = {"tokens": T, "experts": int(used.numel()), "exact": bool(torch.equal(got, ref)),
               "device_us": t_dev * 1e3, "zero_copy_us": t_host * 1e3, "stall_copy_us": t_stall * 1e3,
               "zero_copy_GB_s": used.numel() * row_bytes / (t_host * 1e-3) / 1e9}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
