#!/usr/bin/env python3
"""Time one MoE layer of the fused kernel on the GPU, per (packed tile product, format, T), against its
HBM roofline, and tune its tiles (`--tune`): writes the timings JSON and, with `--write-table`, the
committed tile table `src/moetide/compute/fused_moe_configs.json`.

    python scripts/tune_fused_moe.py --out out/fused.json [--variants v1,v3,v4,v5] [--tune --tune-seconds 60]
        [--formats int4,int2,int2+int4,bfloat16] [--tokens 1,8,32,128] [--shape olmoe-1b-7b] [--write-table]

`--variants`: the packed tile products of `fused_moe.PACKED_TILES`, each timed with the table's tiles
(dense formats run the same kernel whatever the variant: a control). Every output (each variant, each
tile tried) is checked against the v1 output with the table's tiles of the same (format, T): `max_rel_err`
is the largest relative (Frobenius) difference seen, `ok` whether it stays within `--max-err`; a tile
beyond it is never `best`, and the exit status is 1. `v1_ref_err` is v1's own error against the
PyTorch reference (`reference_moe`). With `--tune`, tiles are swept per (variant, format, T), each of
these cells getting an equal part of what is left of `--tune-seconds`, the likeliest candidates first;
candidates that run the same kernels are tried once. Every kernel the run needs (every candidate too,
with `--tune`) is first compiled by `--compile-workers` processes at once, into Triton's on-disk
cache: one by one, compiles would take most of a run (~60 kernels for the default A/B, ~1 s each).

Per layer, the bytes the kernel must move at least: every used expert's weights once (packed codes,
scales and offsets, or the dense matrices), the activations in and out. Roofline time = bytes / 3.3
TB/s (the H200's measured copy bandwidth, ~4.3 TB/s read+write, of which reads alone reach ~3.3).
The layer is timed as a CUDA graph replay of the whole `fused_moe` call (align, launches, reduce), so
launch gaps are not counted but every kernel's own time is. Without CUDA (a smoke run under
TRITON_INTERPRET=1, `--shape tiny`), one plain call is timed instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from moetide.compute import fused_moe as fm
from moetide.compute.expert_compute import reference_moe
from moetide.compute.fused_moe_config import FUSED_MAX_TOKENS, TABLE_PATH, KernelConfig, as_json, table_key
from moetide.residency.slot_table import Pool, dense_format, packed_format
from moetide.store import quant

SHAPES = {"olmoe-1b-7b": (2048, 1024, 64, 8), "qwen15-moe-a2.7b": (2048, 1408, 60, 4),
          "tiny": (128, 64, 8, 2)}  # H, I, E, k; tiny: a smoke run on CPU
ROOFLINE_BYTES_S = 3.3e12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PRECISION = {"int2+int4": "int2+4", "int2+int2g32": "int2+2"}  # PoolFormat name -> quant.pack_expert precision


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


def layer_inputs(num_tokens: int, hidden: int, experts: int, top_k: int):
    """(x, ids, weights, pool_of, slot_of) of one layer at `num_tokens`: the same for every variant."""
    g = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    logits = torch.randn(num_tokens, experts, device=DEVICE, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=torch.bfloat16, generator=g)
    pool_of = torch.zeros(experts, dtype=torch.int32, device=DEVICE)
    slot_of = torch.arange(experts, dtype=torch.int32, device=DEVICE)
    return x, ids, weights, pool_of, slot_of


def time_layer(pool, inputs, config, variant: str | None, copies: int = 1) -> tuple[float, torch.Tensor]:
    """Median microseconds of one graph-replayed `fused_moe` call, and its output (of the last replay).
    `pool`: one `Pool`, or the layer's list of pools (`config` then one per pool, or None). `copies` > 1:
    the graph runs that many layers in a row, each on its own copy of the pools' arenas (as a decode
    step's layers follow each other: no graph launch per layer, no layer's rows in L2 for the next), and
    the time is per layer; the output is the first one's."""
    x, ids, weights, pool_of, slot_of = inputs
    pools = pool if isinstance(pool, list) else [pool]
    layers = [pools] + [[Pool(p.arena.clone(), p.format) if p is not None else None for p in pools]
                        for _ in range(copies - 1)]  # fmt: skip

    def call():
        outs = [fm.fused_moe(x, ids, weights, pool_of, slot_of, ps, config=config, packed_tile=variant)
                for ps in layers]  # fmt: skip
        return outs[0]

    if DEVICE == "cpu":
        start = time.perf_counter()
        out = call()
        return (time.perf_counter() - start) * 1e6 / copies, out
    us, out = graph_replay_us(call)
    return us / copies, out.clone()


def graph_replay_us(call) -> tuple[float, object]:
    """Median microseconds of `call` captured in a CUDA graph and replayed (`triton.testing.do_bench`,
    L2 flushed between replays; warmed up eagerly and on a side stream first), and what the captured
    call returned."""
    import triton.testing

    call()  # compile
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=100, return_mode="median")
    return ms * 1000, out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def one_launch_candidates():
    """The one-launch path (`KernelConfig.split_i`): slice width, down chunk width, gate_up K-step, warps."""
    for si, bn, (bk, w) in itertools.product((64, 128, 32), (128, 256), ((512, 4), (1024, 8), (512, 8))):
        yield KernelConfig(1, bn, bk, w, 2, split_i=si)


def candidates(num_tokens: int, one_launch_only: bool = False):
    if num_tokens <= 2 and not one_launch_only:  # whole-row K-steps of few warps (v7's products)
        for bk, bn, w in itertools.product((2048, 1024), (16, 32), (2, 4, 1)):
            yield KernelConfig(1, bn, bk, w, 2)
    if num_tokens <= FUSED_MAX_TOKENS:  # GEMV tiles in one launch per pool first (a program per pair and slice)
        yield from one_launch_candidates()
    if one_launch_only:
        return
    if num_tokens <= 2:  # every pair its own block (no sort): GEMV tiles, or 16-row dot tiles of one pair
        for bk, bn, w in itertools.product((512, 256, 1024, 128), (16, 32, 64), (4, 8)):
            yield KernelConfig(1, bn, bk, w, 2)  # K-steps of several groups: more loads in flight
        for bk, bn, s in itertools.product((256, 512, 128), (16, 32, 64), (2, 3)):
            yield KernelConfig(16, bn, bk, 4, s)  # the dot unpacks two codes per op (v4 / v5)
        return
    if num_tokens <= 64:
        if num_tokens <= 16:  # GEMV tiles, a program per pair: an expert's rows read once per pair
            for bk, bn in itertools.product((1024, 512), (32, 64, 16)):
                yield KernelConfig(1, bn, bk, 4, 2)
        for bn, bk, s in itertools.product((64, 128, 32), (128, 256, 512, 64), (3, 2)):
            yield KernelConfig(16, bn, bk, 4, s)
        # then other warp counts, wider N-tiles and deeper pipelines (few experts' pairs fill a
        # 16-row block here: the unpacking, not the dot, is the work to spread)
        for w, bn, s in itertools.product((8, 2), (64, 128, 256), (3, 4)):
            yield KernelConfig(16, bn, 128, w, s)
        return
    for bm, bn, w, bk in itertools.product((32, 64), (128, 64), (4, 8), (128, 256, 64)):
        yield KernelConfig(bm, bn, bk, w, 3)


def effective(config: KernelConfig, pool: Pool) -> tuple:
    """What the kernels of `pool` run with `config` (a packed K-step is cut to divide the row)."""
    fmt = pool.format
    down_k = (config.split_i, config.split_i) if config.split_i else (config.block_k, fmt.intermediate_size)
    ks = [fm.k_tiles(config.block_k, fmt.gate_up, fmt.hidden_size), fm.k_tiles(down_k[0], fmt.down, down_k[1])]
    return (config.block_m, config.block_n, config.num_warps, config.num_stages, config.split_i, *ks)


def _compile_worker(shape: str, jobs: list) -> int:
    """Run each job (format, T, KernelConfig fields, variant) once: its kernels land in Triton's on-disk
    cache, where the timing process finds them compiled. -> the number of jobs that failed."""
    hidden, inter, experts, top_k = SHAPES[shape]
    pools, failed = {}, 0
    for fmt, t, cfg, variant in jobs:
        try:
            if fmt not in pools:
                pools[fmt] = make_pool(fmt, hidden, inter, experts)
            x, ids, weights, pool_of, slot_of = layer_inputs(t, hidden, experts, top_k)
            fm.fused_moe(x, ids, weights, pool_of, slot_of, [pools[fmt]], config=KernelConfig(*cfg),
                         packed_tile=variant)  # fmt: skip
        except Exception:  # a tile that does not fit: the timing loop reports it
            failed += 1
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return failed


def precompile(shape: str, jobs: list, workers: int) -> None:
    """Compile `jobs` (see `_compile_worker`) in `workers` processes at once (a compile is mostly
    single-threaded CPU work; one by one they would take most of a run)."""
    import concurrent.futures
    import multiprocessing

    start = time.perf_counter()
    chunks = [jobs[i::workers] for i in range(workers) if jobs[i::workers]]
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(len(chunks), mp_context=ctx) as pool:
            failed = sum(pool.map(_compile_worker, [shape] * len(chunks), chunks))
    except Exception as e:  # the timing loop compiles whatever is missing
        print(f"precompile failed ({type(e).__name__}: {e}); compiling as the timings go", flush=True)
        return
    print(f"precompiled {len(jobs)} calls in {len(chunks)} processes in {time.perf_counter() - start:.0f} s"
          f" ({failed} failed)", flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="int4,int2,int2+int4,bfloat16", help="PoolFormat names")
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--variants", default="v1,v3", help=f"tile products: {sorted(fm.PACKED_TILES)}")
    ap.add_argument("--max-err", type=float, default=2e-2, help="relative error to v1 allowed (bf16)")
    ap.add_argument("--tune", action="store_true", help="sweep tiles per (variant, format, T)")
    ap.add_argument("--tune-seconds", type=float, default=60, help="all tuning together stops after this")
    ap.add_argument("--one-launch-only", action="store_true",
                    help="tune only the one-launch path's tiles (`KernelConfig.split_i`) against the table's entry")
    ap.add_argument("--write-table", action="store_true", help="write fused_moe_configs.json next to --out")
    ap.add_argument("--table-variant", default="v1",
                    help="whose best tiles --write-table writes, with that tile product; best: per cell, "
                         "the fastest of the variants tuned and the table's own entry")  # fmt: skip
    workers = min(8, (os.cpu_count() or 2) // 2) if DEVICE == "cuda" else 0
    ap.add_argument("--compile-workers", type=int, default=workers,
                    help="processes compiling every kernel of the run first (0: as the timings go)")
    args = ap.parse_args()
    hidden, inter, experts, top_k = SHAPES[args.shape]
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in fm.PACKED_TILES]
    if unknown:
        ap.error(f"unknown variants {unknown}: pick from {sorted(fm.PACKED_TILES)}")
    formats, tokens = args.formats.split(","), [int(v) for v in args.tokens.split(",")]
    cells_left = len(formats) * len(tokens) * len(variants)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    pools = {fmt: make_pool(fmt, hidden, inter, experts) for fmt in formats}
    if args.compile_workers > 0:
        jobs, seen = [], set()
        for fmt, t, variant in itertools.product(formats, tokens, ["v1", *variants]):
            pool = pools[fmt]
            chosen = fm.config_for(t, hidden, inter, pool.format.name)
            tuned = args.tune and variant in variants  # v1 is always run with the table's tiles: the baseline
            for cfg in [chosen, *(candidates(t, args.one_launch_only) if tuned else ())]:
                packed = pool.format.gate_up.packed or pool.format.down.packed
                key = (fmt, t, effective(cfg, pool), variant if packed else None)
                if key not in seen:
                    seen.add(key)
                    jobs.append((fmt, t, tuple(vars(cfg).values()), variant))
        precompile(args.shape, jobs, args.compile_workers)
    tune_deadline = time.perf_counter() + args.tune_seconds
    rows, table, failed = [], {}, False
    for fmt in formats:
        pool = pools[fmt]
        packed = pool.format.gate_up.packed or pool.format.down.packed  # else no tile product
        for t in tokens:
            inputs = layer_inputs(t, hidden, experts, top_k)
            chosen = fm.config_for(t, hidden, inter, pool.format.name)
            nbytes = layer_bytes(pool, inputs[1], hidden)
            roof_us = nbytes / ROOFLINE_BYTES_S * 1e6
            v1_us, v1_out = time_layer(pool, inputs, chosen, "v1")  # what every output is checked against
            ref = reference_moe(*inputs[:3], *inputs[3:], [pool], F.silu)
            v1_ref_err = rel_err(v1_out, ref)
            key = table_key(t, hidden, inter, pool.format.name)
            if args.tune and args.table_variant == "best":  # the table's own entry is the one to beat
                own = chosen.packed_tile if packed else "v1"
                table[key] = (chosen, v1_us if own == "v1" else time_layer(pool, inputs, chosen, own)[0])
            for variant in variants:
                if variant == "v1":
                    table_us, out = v1_us, v1_out
                else:
                    table_us, out = time_layer(pool, inputs, chosen, variant)
                max_err = rel_err(out, v1_out)
                best, best_us, tried = chosen, table_us, 1
                cell_end = time.perf_counter() + max(tune_deadline - time.perf_counter(), 0) / cells_left
                cells_left -= 1
                if args.tune:
                    seen = {effective(chosen, pool)}
                    for cfg in candidates(t, args.one_launch_only):
                        if time.perf_counter() > cell_end:
                            break
                        if effective(cfg, pool) in seen:
                            continue
                        seen.add(effective(cfg, pool))
                        try:
                            us, out = time_layer(pool, inputs, cfg, variant)
                        except Exception as e:  # a tile that does not fit in shared memory
                            print(f"  {variant} {fmt} T={t} {cfg}: {type(e).__name__}", flush=True)
                            continue
                        tried += 1
                        err = rel_err(out, v1_out)
                        max_err = max(max_err, err)
                        if err > args.max_err:
                            print(f"  WRONG {variant} {fmt} T={t} {cfg}: error {err:.2e} to v1", flush=True)
                        elif us < best_us:
                            best, best_us = cfg, us
                    entry = replace(best, packed_tile=variant) if packed else best
                    if variant == args.table_variant or (
                        args.table_variant == "best" and best_us < table.get(key, (None, float("inf")))[1]
                    ):
                        table[key] = (entry, best_us)
                ok = max_err <= args.max_err and v1_ref_err <= args.max_err
                failed |= not ok
                rows.append({"variant": variant, "format": fmt, "tokens": t, "bytes": nbytes,
                             "roofline_us": round(roof_us, 2), "table": as_json({"c": chosen})["c"],
                             "table_us": round(table_us, 2), "best": as_json({"c": replace(best, packed_tile=variant) if packed else best})["c"],
                             "best_us": round(best_us, 2), "vs_roofline": round(best_us / roof_us, 2),
                             "tiles_tried": tried, "max_rel_err": max_err, "v1_ref_err": v1_ref_err,
                             "ok": ok})  # fmt: skip
                flag = "" if ok else f"  WRONG (error > {args.max_err:g})"
                print(f"{variant:4s} {fmt:10s} T={t:5d} roofline {roof_us:7.1f} us | table tiles "
                      f"{table_us:8.1f} us x{table_us / roof_us:6.2f} | best {best_us:8.1f} us "
                      f"x{best_us / roof_us:6.2f} {tuple(rows[-1]['best'].values())} ({tried} tried) | "
                      f"err vs v1 {max_err:.1e}, v1 vs ref {v1_ref_err:.1e}{flag}", flush=True)  # fmt: skip
                result = {"shape": args.shape, "gpu": gpu, "torch": torch.__version__, "rows": rows}
                Path(args.out).write_text(json.dumps(result, indent=1))
    if args.write_table and table:
        existing = json.loads(TABLE_PATH.read_text()) if TABLE_PATH.exists() else {"configs": {}}
        existing["configs"].update(as_json({key: cfg for key, (cfg, _us) in table.items()}))
        existing["note"] = f"tuned by scripts/tune_fused_moe.py on {gpu} (packed tiles {args.table_variant})"
        Path(args.out).with_name("fused_moe_configs.json").write_text(json.dumps(existing, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
