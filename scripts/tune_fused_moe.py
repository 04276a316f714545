#!/usr/bin/env python3
"""Time one MoE layer of the fused kernel on the GPU, per (T, format), against its HBM roofline, and
tune its tiles (`--tune`): writes the timings JSON and, with `--write-table`, the committed tile table
`src/moetide/compute/fused_moe_configs.json`.

    python scripts/tune_fused_moe.py --out out/fused.json [--variants new,old] [--tune] [--write-table]
        [--formats bfloat16,int4,int2,int2+int4] [--tokens 1,8,32,128] [--shape olmoe-1b-7b]

`--variants old` also times the kernel before the factored packed tiles (`scripts/fused_moe_v0.py`,
A/B only) with the same table's tiles; `--tune` sweeps the current kernel's tiles only. Tuning is
shared out over the (format, T) cells: each gets an equal part of what is left of `--tune-seconds`
(a candidate costs mostly its compile), trying the candidates most likely to win first.

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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moetide.compute import fused_moe as fm
from moetide.compute.expert_compute import reference_moe
from moetide.compute.fused_moe_config import TABLE_PATH, KernelConfig, as_json, table_key
from moetide.residency.slot_table import Pool, dense_format, packed_format
from moetide.store import quant

SHAPES = {"olmoe-1b-7b": (2048, 1024, 64, 8), "qwen15-moe-a2.7b": (2048, 1408, 60, 4)}  # H, I, E, k
ROOFLINE_BYTES_S = 3.3e12
DEVICE = "cuda"
MAX_ERR = 2e-2  # bf16 activations: the kernel's tolerance in tests/test_fused_moe.py


PRECISION = {"int2+int4": "int2+4"}  # pool format name -> quant.pack_expert precision


def make_pool(fmt: str, hidden: int, inter: int, experts: int, dtype=torch.bfloat16) -> Pool:
    """`experts` random experts in one format (a `PoolFormat.name`), built once and repeated (packing on
    the GPU)."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    gate_up = torch.randn(2 * inter, hidden, device=DEVICE, generator=g, dtype=torch.float32) * 0.02
    down = torch.randn(hidden, inter, device=DEVICE, generator=g, dtype=torch.float32) * 0.02
    if fmt == "bfloat16":
        row, _ = quant.pack_expert(gate_up.to(dtype), down.to(dtype), "hi")
        arena = row.unsqueeze(0).repeat(experts, 1)
        return Pool(arena, dense_format(hidden, inter, dtype))
    row, meta = quant.pack_expert(gate_up, down, PRECISION.get(fmt, fmt), quant_method="rtn")
    return Pool(row.unsqueeze(0).repeat(experts, 1), packed_format(meta, dtype))


def layer_bytes(pool: Pool, ids: torch.Tensor, hidden: int) -> int:
    used = int(torch.unique(ids).numel())
    return used * pool.arena.shape[1] + ids.shape[0] * hidden * 2 * 2


def time_layer(pool: Pool, num_tokens: int, hidden: int, experts: int, top_k: int, config, kernel=fm
               ) -> tuple[float, int]:  # fmt: skip
    """Median microseconds of one graph-replayed `kernel.fused_moe` call, its minimum bytes, and the
    relative error (Frobenius) of its output against `reference_moe`."""
    import triton.testing

    g = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    logits = torch.randn(num_tokens, experts, device=DEVICE, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16, generator=g)
    pool_of = torch.zeros(experts, dtype=torch.int32, device=DEVICE)
    slot_of = torch.arange(experts, dtype=torch.int32, device=DEVICE)

    def call():
        return kernel.fused_moe(x, ids, weights, pool_of, slot_of, [pool], config=config)

    out = call()  # compile
    ref = reference_moe(x, ids, weights, pool_of, slot_of, [pool], F.silu)
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median")
    return ms * 1000, layer_bytes(pool, ids, hidden), err


def candidates(num_tokens: int):
    """Tiles worth trying at `num_tokens`, the likeliest first. GEMV tiles (block_m 1) of packed
    matrices may span several groups along K, so their block_k goes past the group sizes (64 / 128);
    packed tl.dot tiles take one group-sized sub-tile per step whatever block_k says (`effective`)."""
    gemv = [KernelConfig(1, bn, bk, w, 2) for bn, bk, w in
            ((32, 256, 4), (16, 256, 4), (32, 512, 4), (64, 256, 4), (16, 512, 4), (64, 128, 4), (32, 128, 4),
             (64, 512, 8), (128, 256, 8))]  # fmt: skip
    if num_tokens <= 2:
        yield from gemv
        return
    small = [KernelConfig(16, bn, bk, w, s) for bn, bk, w, s in
             ((64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (32, 64, 4, 3), (128, 64, 8, 3),
              (256, 64, 8, 3), (128, 128, 4, 3), (64, 64, 8, 4), (128, 64, 4, 4))]  # fmt: skip
    if num_tokens <= 8:  # ~1 pair per expert: GEMV tiles re-read an expert from L2 but need no sort
        yield from itertools.chain(*zip(small, gemv[:5]))
        yield from small[5:]
        return
    if num_tokens <= 64:
        yield from small
        return
    for bm, bn, bk, w, s in ((32, 128, 64, 4, 3), (64, 128, 64, 4, 3), (32, 64, 64, 4, 3), (64, 128, 64, 8, 3),
                             (16, 128, 64, 4, 3), (32, 256, 64, 8, 3), (64, 64, 64, 4, 3), (32, 128, 64, 4, 4),
                             (64, 128, 128, 8, 3)):  # fmt: skip
        yield KernelConfig(bm, bn, bk, w, s)


def effective(config: KernelConfig, pool: Pool) -> tuple:
    """What the kernels of `pool` run with `config`: candidates equal here are one candidate."""
    ks = []
    for m in (pool.format.gate_up, pool.format.down):
        if not m.packed:
            ks.append(config.block_k)
        else:
            sub_k = fm._sub_k(config, m)
            ks.append(sub_k if config.block_m > 1 else (config.block_k, sub_k))
    return (config.block_m, config.block_n, config.num_warps, config.num_stages, *ks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="bfloat16,int4,int2,int2+int4", help="PoolFormat names")
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--variants", default="new", help="new (this kernel), old (scripts/fused_moe_v0.py)")
    ap.add_argument("--tune", action="store_true", help="sweep tiles per (T, format); else the table's choice")
    ap.add_argument("--tune-seconds", type=float, default=150, help="all tuning together stops after this long")
    ap.add_argument("--write-table", action="store_true", help="write fused_moe_configs.json next to --out")
    args = ap.parse_args()
    hidden, inter, experts, top_k = SHAPES[args.shape]
    variants = {"new": fm}
    if "old" in args.variants.split(","):
        import fused_moe_v0

        variants["old"] = fused_moe_v0
    formats, tokens = args.formats.split(","), [int(v) for v in args.tokens.split(",")]
    cells_left = len(formats) * len(tokens)
    tune_deadline = time.perf_counter() + args.tune_seconds
    rows, table = [], {}
    for fmt in formats:
        pool = make_pool(fmt, hidden, inter, experts)
        for t in tokens:
            chosen = fm.config_for(t, hidden, inter, pool.format.name)
            timed, errs = {}, {}
            for name, kernel in variants.items():
                timed[name], nbytes, errs[name] = time_layer(pool, t, hidden, experts, top_k, chosen, kernel)
            best, best_us, best_err = chosen, timed["new"], errs["new"]
            cell_end = time.perf_counter() + max(tune_deadline - time.perf_counter(), 0) / cells_left
            cells_left -= 1
            if args.tune:
                seen = {effective(chosen, pool)}
                for cfg in candidates(t):
                    if time.perf_counter() > cell_end:
                        break
                    if effective(cfg, pool) in seen:
                        continue
                    seen.add(effective(cfg, pool))
                    try:
                        us, _, err = time_layer(pool, t, hidden, experts, top_k, cfg)
                    except Exception as e:  # a tile that does not fit in shared memory
                        print(f"  {fmt} T={t} {cfg}: {type(e).__name__}", flush=True)
                        continue
                    if err > MAX_ERR:
                        print(f"  WRONG {fmt} T={t} {cfg}: error {err:.2e} against the reference", flush=True)
                        continue
                    if us < best_us:
                        best, best_us, best_err = cfg, us, err
                table[table_key(t, hidden, inter, pool.format.name)] = best
            roof_us = nbytes / ROOFLINE_BYTES_S * 1e6
            row = {"format": fmt, "tokens": t, "bytes": nbytes, "roofline_us": round(roof_us, 2),
                   "table": as_json({"c": chosen})["c"], "best": as_json({"c": best})["c"],
                   "best_us": round(best_us, 2), "vs_roofline": round(best_us / roof_us, 2),
                   "best_err": best_err}  # fmt: skip
            for name, us in timed.items():
                row[f"{name}_us"], row[f"{name}_err"] = round(us, 2), errs[name]
            rows.append(row)
            line = "  ".join(f"{name} {us:7.1f} us x{us / roof_us:5.2f} err {errs[name]:.1e}"
                             for name, us in timed.items())  # fmt: skip
            flag = "" if max(*errs.values(), best_err) <= MAX_ERR else "  WRONG (error > 2e-2)"
            print(f"{fmt:10s} T={t:4d} roofline {roof_us:6.1f} us | table tiles: {line} | best new {best_us:7.1f} us "
                  f"x{best_us / roof_us:5.2f} {tuple(row['best'].values())}{flag}", flush=True)  # fmt: skip
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
