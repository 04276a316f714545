#!/usr/bin/env python3
"""Time one MoE layer of the fused kernel on the GPU, per (T, format), against its HBM roofline, and
tune its tiles (`--tune`): writes the timings JSON and, with `--write-table`, the committed tile table
`src/moetide/compute/fused_moe_configs.json`.

    python scripts/tune_fused_moe.py --out out/fused.json [--tune] [--write-table] [--shape olmoe-1b-7b]

Per layer, the bytes the kernel must move at least: every used expert's weights once (packed codes,
scales and offsets, or the dense matrices), the activations in and out. Roofline time = bytes / 3.3
TB/s (the H200's measured copy bandwidth, ~4.3 TB/s read+write, of which reads alone reach ~3.3).
The layer is timed as a CUDA graph replay of the whole `fused_moe` call (align, launches, reduce), so
launch gaps are not counted but every kernel's own time is.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from moetide.compute import fused_moe as fm
from moetide.compute.fused_moe_config import TABLE_PATH, KernelConfig, as_json, table_key
from moetide.residency.slot_table import Pool, dense_format, packed_format
from moetide.store import quant

SHAPES = {"olmoe-1b-7b": (2048, 1024, 64, 8), "qwen15-moe-a2.7b": (2048, 1408, 60, 4)}  # H, I, E, k
ROOFLINE_BYTES_S = 3.3e12


def make_pool(fmt: str, hidden: int, inter: int, experts: int, dtype=torch.bfloat16) -> Pool:
    """`experts` random experts in one format, built once and repeated (packing on the GPU)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(2 * inter, hidden, device="cuda", generator=g, dtype=torch.float32) * 0.02
    down = torch.randn(hidden, inter, device="cuda", generator=g, dtype=torch.float32) * 0.02
    if fmt == "bfloat16":
        row, _ = quant.pack_expert(gate_up.to(dtype), down.to(dtype), "hi")
        arena = row.unsqueeze(0).repeat(experts, 1)
        return Pool(arena, dense_format(hidden, inter, dtype))
    row, meta = quant.pack_expert(gate_up, down, fmt, quant_method="rtn")
    return Pool(row.unsqueeze(0).repeat(experts, 1), packed_format(meta, dtype))


def layer_bytes(pool: Pool, ids: torch.Tensor, hidden: int) -> int:
    used = int(torch.unique(ids).numel())
    return used * pool.arena.shape[1] + ids.shape[0] * hidden * 2 * 2


def time_layer(pool: Pool, num_tokens: int, hidden: int, experts: int, top_k: int, config) -> tuple[float, int]:
    """Median microseconds of one graph-replayed `fused_moe` call, and its minimum bytes."""
    import triton.testing

    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = torch.randn(num_tokens, experts, device="cuda", generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    pool_of = torch.zeros(experts, dtype=torch.int32, device="cuda")
    slot_of = torch.arange(experts, dtype=torch.int32, device="cuda")

    def call():
        return fm.fused_moe(x, ids, weights, pool_of, slot_of, [pool], config=config)

    call()  # compile
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median")
    return ms * 1000, layer_bytes(pool, ids, hidden)


def candidates(num_tokens: int):
    if num_tokens <= 2:
        for bn, bk in itertools.product((16, 32, 64), (128, 256)):
            yield KernelConfig(1, bn, bk, 4, 2)
        return
    if num_tokens <= 64:
        for bn, bk, s in itertools.product((32, 64, 128), (64, 128), (2, 3)):
            yield KernelConfig(16, bn, bk, 4, s)
        return
    for bm, bn, w in itertools.product((32, 64), (64, 128), (4, 8)):
        yield KernelConfig(bm, bn, 64, w, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="bfloat16,int4,int2")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048")
    ap.add_argument("--tune", action="store_true", help="sweep tiles per (T, format); else the table's choice")
    ap.add_argument("--tune-seconds", type=float, default=240, help="stop tuning after this long")
    ap.add_argument("--write-table", action="store_true")
    args = ap.parse_args()
    hidden, inter, experts, top_k = SHAPES[args.shape]
    start = time.perf_counter()
    rows, table = [], {}
    for fmt in args.formats.split(","):
        pool = make_pool(fmt, hidden, inter, experts)
        for t in (int(v) for v in args.tokens.split(",")):
            chosen = fm.config_for(t, hidden, inter, pool.format.name)
            base_us, nbytes = time_layer(pool, t, hidden, experts, top_k, chosen)
            best, best_us = chosen, base_us
            if args.tune and time.perf_counter() - start < args.tune_seconds:
                for cfg in candidates(t):
                    try:
                        us, _ = time_layer(pool, t, hidden, experts, top_k, cfg)
                    except Exception as e:  # a tile that does not fit in shared memory
                        print(f"  {fmt} T={t} {cfg}: {type(e).__name__}", flush=True)
                        continue
                    if us < best_us:
                        best, best_us = cfg, us
                table[table_key(t, hidden, inter, pool.format.name)] = best
            roof_us = nbytes / ROOFLINE_BYTES_S * 1e6
            rows.append({"format": fmt, "tokens": t, "default_us": round(base_us, 2), "best_us": round(best_us, 2),
                         "best": as_json({"c": best})["c"], "bytes": nbytes, "roofline_us": round(roof_us, 2),
                         "vs_roofline": round(best_us / roof_us, 2)})  # fmt: skip
            r = rows[-1]
            print(f"{fmt:9s} T={t:5d} default {r['default_us']:9.1f} us  best {r['best_us']:9.1f} us  "
                  f"roofline {r['roofline_us']:8.1f} us  x{r['vs_roofline']:.2f}  {r['best']}", flush=True)  # fmt: skip
            Path(args.out).write_text(json.dumps({"shape": args.shape, "gpu": torch.cuda.get_device_name(),
                                                  "torch": torch.__version__, "rows": rows}, indent=1))  # fmt: skip
    if args.write_table and table:
        existing = json.loads(TABLE_PATH.read_text()) if TABLE_PATH.exists() else {"configs": {}}
        existing["configs"].update(as_json(table))
        existing["note"] = f"tuned by scripts/tune_fused_moe.py on {torch.cuda.get_device_name()}"
        Path(args.out).with_name("fused_moe_configs.json").write_text(json.dumps(existing, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
