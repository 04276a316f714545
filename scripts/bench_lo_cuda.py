#!/usr/bin/env python3
"""One MoE layer of packed rows on the tensor-core kernels (`lo_cuda`) against the Triton tiles of the
table (MOETIDE_LO_CUDA=0), in one process, per (format, T, warps along K), against the HBM roofline.

    python scripts/bench_lo_cuda.py --out lo_cuda.json [--formats int2,int4] [--tokens 1,8,32,128] \
        [--warps-k auto,1,2,4] [--shape olmoe-1b-7b] [--reps 3] [--pdl-ab] [--kernels] [--mixed 2]

Each cell is timed as tune_fused_moe.py times a layer (a graph-replayed `fused_moe` call, median of
`triton.testing.do_bench`, L2 flushed between replays), the two paths alternating `--reps` times;
`err_*` is each output's relative (Frobenius) difference from the per-expert PyTorch reference
(`reference_moe`, which rounds the dequantized weights to bf16). The roofline is tune_fused_moe's:
every used expert's row once plus the activations in and out, at 3.3 TB/s. `vs_roofline` of a cell
is its time over the roofline; the target `lo_kernel_vs_hbm_roofline_worst` is the worst over T = 1,
8, 32, 128 of the path the engine takes (`engine_us`: the CUDA kernels where `lo_cuda.eligible`).

A warps value is a program's grid: "2" (2 warps along K, the rest of 4 along N), "2x4" (2 along K, 4
along N: programs of 8 warps, on blocks of 16 or more rows), or gate_up's / down's ("4/2", "2x4/1x8").
`--pdl-ab` also times the CUDA kernels with down launched plainly (MOETIDE_LO_PDL=0, `cuda_plain_us`);
`--kernels` adds each path's kernels from the CUDA profiler (`kernels_*`, mean device µs per call);
`--against-source FILE[,FILE...]` also times the CUDA kernels built from other lo_mma.cu sources
(`cuda_other_source_us`, one per file name where several); a warps-along-K value "4/2" gives gate_up's
and down's; `--mixed N` adds,
per cell, the layer that `combined` runs: the N most-routed experts in bf16 hi slots beside the lo
rows (`tune_mixed_pools.mixed_inputs`), on both paths, and the lo rows alone. `--chain N` also times
each cell per layer of N in one graph, each layer on its own copy of the rows (`time_layer`'s `copies`:
a decode step's layers in a row, without a graph launch per layer): `chain_engine_us`, `chain_triton_us`,
`chain_vs_roofline`. `--rows-ab` also times the CUDA kernels with every block of 16 / 32 rows on each
main loop (`cuda_tokens_as_rows_us`, `cuda_weights_as_rows_us`: `lo_cuda.tokens_as_rows` from 0 tokens,
or never). `--max-tokens` / `--wide-block-m` / `--tokens-as-rows-from` set `lo_cuda.MAX_TOKENS` /
`WIDE_BLOCK_M` / `TOKENS_AS_ROWS_FROM` for the run. `--floor` also times, in the same harness, what
no layer can beat: one kernel that only reads every used expert's row once (`floor_read_us`, wide loads,
nothing computed) and a graph of one empty kernel (`floor_launch_us`, what a graph replay costs by itself);
with `--chain` also that read per layer of a chain (`floor_chain_read_us`). MOETIDE_LO_SOURCE set for
the run times that source's kernels throughout.
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
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from profile_fused_layer import kernel_times  # noqa: E402
from tune_fused_moe import (  # noqa: E402
    ROOFLINE_BYTES_S, SHAPES, graph_replay_us, layer_bytes, layer_inputs, make_pool, rel_err,
    time_layer)  # fmt: skip
from tune_mixed_pools import lo_only, mixed_inputs  # noqa: E402

from moetide.compute import lo_cuda  # noqa: E402
from moetide.compute.expert_compute import reference_moe  # noqa: E402

AUTO_WARPS, AUTO_WARPS_N = lo_cuda.warps_along_k, lo_cuda.warps_along_n


@triton.jit
def _read_rows_kernel(arena_ptr, slots_ptr, out_ptr, row_words, BLOCK: tl.constexpr):
    """Program (u, c) reads words c * BLOCK .. of used expert u's row and stores their XOR (a value
    that depends on every word, so no load is dropped)."""
    slot = tl.load(slots_ptr + tl.program_id(0)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(arena_ptr + slot * row_words + offs, mask=offs < row_words, other=0)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(words, axis=0))


@triton.jit
def _nothing_kernel(out_ptr):
    tl.store(out_ptr, 0)


def floor_times(pool, ids, chain: int = 0) -> dict:
    """The floors of a layer in the layer's harness (a graph replay, L2 flushed between replays): one
    kernel reading each used expert's row once, and a graph of one empty kernel; with `chain` > 1 also
    the read per layer of `chain` in one graph, each on its own copy of the arena (`floor_chain_read_us`,
    the floor of `chain_engine_us`)."""
    slots = torch.unique(ids).to(torch.int32)  # the bench's slot table is the identity
    words = pool.arena.view(torch.int32)
    row_words, block = words.shape[1], 8192
    chunks = triton.cdiv(row_words, block)
    out = torch.empty(slots.numel() * chunks, dtype=torch.int32, device=words.device)

    def read(arena=words):
        _read_rows_kernel[(slots.numel(), chunks)](arena, slots, out, row_words, BLOCK=block, num_warps=8)

    calls = {"floor_read_us": read, "floor_launch_us": lambda: _nothing_kernel[(1,)](out)}
    times = {name: round(graph_replay_us(call)[0], 2) for name, call in calls.items()}
    if chain > 1:
        copies = [words] + [words.clone() for _ in range(chain - 1)]
        times["floor_chain_read_us"] = round(graph_replay_us(lambda: [read(c) for c in copies])[0] / chain, 2)
    return times


def warps_rule(warps: str, hidden: int):
    """(`lo_cuda.warps_along_k`, `lo_cuda.warps_along_n`) for "auto", one grid for both launches ("2":
    2 warps along K, the rest of 4 along N; "2x4": 2 along K, 4 along N) or gate_up's / down's
    ("4/2", "2x4/1x8")."""
    if warps == "auto":
        return AUTO_WARPS, AUTO_WARPS_N
    gate_up, _, down = warps.partition("/")
    grids = [tuple(int(v) for v in (w + "x0").split("x")[:2]) for w in (gate_up, down or gate_up)]

    def along_k(t, groups, bits):  # gate_up's K is the hidden size
        return grids[0 if groups * lo_cuda.GROUP_BITS // bits == hidden else 1][0]

    def along_n(t, wk, n, block_m):  # down's N is the hidden size
        wn = grids[1 if n == hidden else 0][1]
        return wn or 4 // wk

    return along_k, along_n


def timed(pool, inputs, cuda: bool, warps: str, pdl: bool = True, profile: bool = False, source=None,
          copies: int = 1, tokens_as_rows_from: int | None = None):  # fmt: skip
    """(µs, output) of the graph-replayed layer on one path, or with `profile` its kernels' mean device µs;
    `source`: the CUDA kernels built from another lo_mma.cu; `copies`: per layer of that many in one graph;
    `tokens_as_rows_from`: `lo_cuda.TOKENS_AS_ROWS_FROM` for this layer."""
    own_from = lo_cuda.TOKENS_AS_ROWS_FROM
    if tokens_as_rows_from is not None:
        lo_cuda.TOKENS_AS_ROWS_FROM = tokens_as_rows_from
    own_env = {k: os.environ.get(k) for k in ("MOETIDE_LO_CUDA", "MOETIDE_LO_PDL", "MOETIDE_LO_SOURCE")}
    os.environ["MOETIDE_LO_CUDA"] = "1" if cuda else "0"
    os.environ["MOETIDE_LO_PDL"] = "1" if pdl else "0"
    lo_cuda.warps_along_k, lo_cuda.warps_along_n = warps_rule(warps, inputs[0].shape[1])
    if source is not None:
        os.environ["MOETIDE_LO_SOURCE"] = str(source)
    try:
        return kernel_times(pool, inputs, 20) if profile else time_layer(pool, inputs, None, None, copies)
    finally:
        lo_cuda.warps_along_k, lo_cuda.warps_along_n = AUTO_WARPS, AUTO_WARPS_N
        lo_cuda.TOKENS_AS_ROWS_FROM = own_from
        for key, value in own_env.items():  # the run's own (MOETIDE_LO_SOURCE: the kernels under test)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def mixed_cell(lo, fmt: str, t: int, shape: tuple, hi_experts: int, reps: int, kernels: bool = False) -> dict:
    """The `combined` layer at T: bf16 hi slots for the most-routed experts beside `lo`, both paths."""
    hidden, inter, experts, top_k = shape
    hi = make_pool("bfloat16", hidden, inter, hi_experts)
    inputs, share = mixed_inputs(t, hidden, experts, top_k, hi_experts)
    ref = reference_moe(*inputs, [hi, lo], F.silu)
    times, errs = {"cuda": [], "triton": [], "lo_only_cuda": []}, {}
    for _ in range(reps):
        variants = (("cuda", True, inputs), ("triton", False, inputs), ("lo_only_cuda", True, lo_only(inputs)))
        for name, cuda, layer in variants:
            us, out = timed([hi, lo], layer, cuda, "auto")
            times[name].append(us)
            if layer is inputs:
                errs[f"err_{name}"] = rel_err(out, ref)
    row = {"format": f"bfloat16x{hi_experts}+{fmt}", "tokens": t, "hi_share": round(share, 3), **errs}
    row.update({f"{k}_us": round(statistics.median(v), 2) for k, v in times.items()})
    row["hi_cost_cuda_us"] = round(row["cuda_us"] - row["lo_only_cuda_us"], 2)
    if kernels:
        row["kernels_cuda"] = timed([hi, lo], inputs, True, "auto", profile=True)
    return row


def cell(pool, fmt: str, t: int, shape: tuple, warps_k: list[str], reps: int, pdl_ab: bool = False,
         kernels: bool = False, against: str | None = None, chain: int = 0,
         rows_ab: bool = False, floor: bool = False) -> dict:  # fmt: skip
    hidden, inter, experts, top_k = shape
    inputs = layer_inputs(t, hidden, experts, top_k)
    x, ids, weights, pool_of, slot_of = inputs
    ref = reference_moe(x, ids, weights, pool_of, slot_of, [pool], F.silu)
    roof_us = layer_bytes(pool, ids, hidden) / ROOFLINE_BYTES_S * 1e6
    row = {"format": fmt, "tokens": t, "roofline_us": round(roof_us, 2),
           "eligible": lo_cuda.eligible(pool, x, 1, weights.dtype)}  # fmt: skip
    triton_times, cuda_times = [], {w: [] for w in warps_k}
    plain_times = []
    others = against.split(",") if against else []
    other_times = {path: [] for path in others}
    orientations = {"tokens_as_rows": 0, "weights_as_rows": 1 << 30} if rows_ab else {}
    orientation_times = {k: [] for k in orientations}
    for _ in range(reps):
        us, out = timed(pool, inputs, False, "auto")
        triton_times.append(us)
        row["err_triton"] = rel_err(out, ref)
        for w in warps_k:
            us, out = timed(pool, inputs, True, w)
            cuda_times[w].append(us)
            row[f"err_cuda_wk{w}"] = rel_err(out, ref)
        if pdl_ab:
            plain_times.append(timed(pool, inputs, True, "auto", pdl=False)[0])
        for path in others:
            us, out = timed(pool, inputs, True, "auto", source=path)
            other_times[path].append(us)
            row[f"err_cuda_{Path(path).stem}"] = rel_err(out, ref)
        for name, start in orientations.items():
            us, out = timed(pool, inputs, True, "auto", tokens_as_rows_from=start)
            orientation_times[name].append(us)
            row[f"err_cuda_{name}"] = rel_err(out, ref)
    row.update({f"cuda_{k}_us": round(statistics.median(v), 2) for k, v in orientation_times.items()})
    if plain_times:
        row["cuda_plain_us"] = round(statistics.median(plain_times), 2)
    if len(others) == 1:
        row["cuda_other_source_us"] = round(statistics.median(other_times[others[0]]), 2)
    elif others:
        row["cuda_other_source_us"] = {Path(p).stem: round(statistics.median(v), 2)
                                       for p, v in other_times.items()}  # fmt: skip
    if kernels:
        row["kernels_triton"] = timed(pool, inputs, False, "auto", profile=True)
        row["kernels_cuda"] = timed(pool, inputs, True, "auto", profile=True)
    row["triton_us"] = round(statistics.median(triton_times), 2)
    row["cuda_us"] = {w: round(statistics.median(v), 2) for w, v in cuda_times.items()}
    row["auto_warps_k"] = AUTO_WARPS(t, hidden // pool.format.gate_up.group_size, pool.format.gate_up.bits)
    best = min(row["cuda_us"], key=row["cuda_us"].get)
    row["best_warps_k"], row["best_cuda_us"] = best, row["cuda_us"][best]
    engine_us = row["cuda_us"].get("auto", row["best_cuda_us"]) if row["eligible"] else row["triton_us"]
    row.update(engine_us=engine_us, vs_roofline=round(engine_us / roof_us, 2),
               triton_vs_roofline=round(row["triton_us"] / roof_us, 2),
               speedup_vs_triton=round(row["triton_us"] / engine_us, 3))  # fmt: skip
    if floor:
        row.update(floor_times(pool, ids, chain))
        row["floor_read_vs_roofline"] = round(row["floor_read_us"] / roof_us, 2)
        if chain > 1:
            row["floor_chain_read_vs_roofline"] = round(row["floor_chain_read_us"] / roof_us, 2)
    if chain > 1:  # per layer of `chain` in one graph, each on its own rows: the engine's path and the tiles
        runs = {"engine": [], "triton": []}
        for _ in range(reps):
            runs["engine"].append(timed(pool, inputs, row["eligible"], "auto", copies=chain)[0])
            runs["triton"].append(timed(pool, inputs, False, "auto", copies=chain)[0])
        row["chain"] = chain
        row.update({f"chain_{k}_us": round(statistics.median(v), 2) for k, v in runs.items()})
        row["chain_vs_roofline"] = round(row["chain_engine_us"] / roof_us, 2)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="int2,int4")
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--warps-k", default="auto,1,2,4")
    ap.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pdl-ab", action="store_true", help="also time the CUDA kernels with MOETIDE_LO_PDL=0")
    ap.add_argument("--kernels", action="store_true", help="each path's kernels from the CUDA profiler")
    ap.add_argument("--mixed", type=int, default=0, help="also time the layer with N bf16 hi experts beside")
    ap.add_argument("--against-source", default=None,
                    help="also time the CUDA kernels of these lo_mma.cu sources (comma-separated)")  # fmt: skip
    ap.add_argument("--chain", type=int, default=0, help="also time each cell per layer of N in one graph")
    ap.add_argument("--max-tokens", type=int, default=lo_cuda.MAX_TOKENS, help="lo_cuda.MAX_TOKENS for the run")
    ap.add_argument("--wide-block-m", type=int, default=lo_cuda.WIDE_BLOCK_M, choices=(16, 32),
                    help="rows per block of the kernels where the table's tiles have more")  # fmt: skip
    ap.add_argument("--tokens-as-rows-from", type=int, default=lo_cuda.TOKENS_AS_ROWS_FROM,
                    help="lo_cuda.TOKENS_AS_ROWS_FROM for the run")  # fmt: skip
    ap.add_argument("--rows-ab", action="store_true", help="also time both main loops of the CUDA kernels")
    ap.add_argument("--floor", action="store_true", help="also time a read-only kernel of the layer's bytes")
    args = ap.parse_args()
    lo_cuda.MAX_TOKENS, lo_cuda.WIDE_BLOCK_M = args.max_tokens, args.wide_block_m
    lo_cuda.TOKENS_AS_ROWS_FROM = args.tokens_as_rows_from
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    shape = SHAPES[args.shape]
    rows, mixed_rows = [], []
    for fmt in args.formats.split(","):
        pool = make_pool(fmt, *shape[:3])  # the same rows for every T
        for t in [int(v) for v in args.tokens.split(",")]:
            row = cell(pool, fmt, t, shape, args.warps_k.split(","), args.reps, args.pdl_ab, args.kernels,
                       args.against_source, args.chain, args.rows_ab, args.floor)
            rows.append(row)
            print(f"{fmt:6s} T={t:5d} roofline {row['roofline_us']:7.1f} us | triton {row['triton_us']:7.1f} "
                  f"({row['triton_vs_roofline']:.2f}x) | cuda {row['cuda_us']} -> engine {row['engine_us']:.1f} "
                  f"({row['vs_roofline']:.2f}x) | err triton {row['err_triton']:.1e} cuda "
                  f"{row.get('err_cuda_wkauto', float('nan')):.1e}", flush=True)  # fmt: skip
            if args.pdl_ab or args.kernels or args.against_source or args.rows_ab or args.floor or args.chain:
                extra = ("kernels_", "cuda_plain", "cuda_other", "cuda_tokens_as", "cuda_weights_as", "floor",
                         "chain")  # fmt: skip
                print({k: v for k, v in row.items() if k.startswith(extra)}, flush=True)
            if args.mixed:
                mixed = mixed_cell(pool, fmt, t, shape, args.mixed, args.reps, args.kernels)
                mixed_rows.append(mixed)
                print(json.dumps(mixed), flush=True)
    target = [r for r in rows if r["tokens"] in (1, 8, 32, 128)]
    worst = max(target, key=lambda r: r["vs_roofline"]) if target else None
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "source": lo_cuda.source().name, "max_tokens": args.max_tokens, "wide_block_m": args.wide_block_m,
              "tokens_as_rows_from": args.tokens_as_rows_from,
              "rows": rows, "mixed": mixed_rows, "worst": worst and {k: worst[k] for k in ("format", "tokens", "vs_roofline")}}  # fmt: skip
    if args.chain > 1 and target:
        chained = max(target, key=lambda r: r["chain_vs_roofline"])
        result["worst_chain"] = {k: chained[k] for k in ("format", "tokens", "chain_vs_roofline")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("worst:", result["worst"], "chained:", result.get("worst_chain"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
