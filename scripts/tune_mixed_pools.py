#!/usr/bin/env python3
"""Tune the tiles of the hi pool's launches in a mixed layer, on the GPU: bf16 hi slots holding a few hot
experts beside int2 lo rows holding the rest (what `combined` runs), the lo pool on its own table tiles.

    python scripts/tune_mixed_pools.py --out out/mixed.json [--tokens 1,8,32,128] [--hi-experts 2]
        [--hi bfloat16] [--lo int2] [--shape olmoe-1b-7b] [--write-table]

Per T: the layer's routing (random logits, top-k), its `--hi-experts` most-routed experts in hi slots
(the hot set a dynamic policy keeps there), every other expert a lo row. Timed as a CUDA graph replay of
the whole `fused_moe` call (`tune_fused_moe.time_layer`): `lo_only_us` with every expert in the lo pool
(one pool's launches, as static-int2), `mixed_us` on the table's tiles today, and each hi candidate
(block_m is the lo pool's: one alignment serves both pools), each also with no pair in the hi pool
(`*empty_us`: its launches still run, every program finding nothing to do); the best minimizes the
sum of the two, weighing a layer that routes no hot expert like one that does; `hi_cost_us` = mixed
- lo only. Each candidate's output is checked against the PyTorch reference (`reference_moe`, same
slot table); one beyond `--max-err` is never `best`. `--write-table` writes the best hi tiles of each T as the table's
`<hi>@<lo>` cells (`fused_moe_config.config_for`'s `beside`) into fused_moe_configs.json next to --out,
where they beat the hi format's own cell by more than 2 % (the same sum).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tune_fused_moe import DEVICE, SHAPES, layer_inputs, make_pool, precompile, rel_err, time_layer

from moetide.compute import fused_moe as fm
from moetide.compute.expert_compute import reference_moe
from moetide.compute.fused_moe_config import TABLE_PATH, KernelConfig, as_json, table_key


def mixed_inputs(num_tokens: int, hidden: int, experts: int, top_k: int, hi_experts: int):
    """((x, ids, weights, pool_of, slot_of), the hi experts' share of the pairs): the most-routed
    `hi_experts` in pool 0 (hi slots 0..n-1), the others in pool 1 (lo row = expert id)."""
    x, ids, weights, _, _ = layer_inputs(num_tokens, hidden, experts, top_k)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    hot = torch.argsort(counts, descending=True, stable=True)[:hi_experts]
    pool_of = torch.ones(experts, dtype=torch.int32, device=DEVICE)
    pool_of[hot] = 0
    slot_of = torch.zeros(2, experts, dtype=torch.int32, device=DEVICE)
    slot_of[0, hot] = torch.arange(hi_experts, dtype=torch.int32, device=DEVICE)
    slot_of[1] = torch.arange(experts, dtype=torch.int32, device=DEVICE)
    share = float(counts[hot].sum()) / ids.numel()
    return (x, ids, weights, pool_of, slot_of), share


def hi_candidates(block_m: int):
    """Hi tiles on the lo pool's block_m: narrow N-tiles first (a few experts' blocks: more programs)."""
    if block_m == 1:
        for bn, bk, w in itertools.product((16, 32, 64), (256, 512, 128, 1024), (4, 8)):
            yield KernelConfig(1, bn, bk, w, 2)
        return
    for bn, bk, w in itertools.product((16, 32, 64, 128), (128, 256, 64), (4, 2, 8)):
        yield KernelConfig(block_m, bn, bk, w, 3)


def lo_only(inputs):
    """The same layer with every expert sent to its lo row (pool 1): the hi pool has no pair to run."""
    x, ids, weights, pool_of, slot_of = inputs
    return x, ids, weights, torch.ones_like(pool_of), slot_of


def tune_cell(t, pools, inputs, lo_config, hi_table, max_err) -> dict:
    """Time the table's tiles and every hi candidate at one T: the row of the JSON."""
    hi, lo = pools
    ref = reference_moe(*inputs, pools, F.silu)
    no_hi = lo_only(inputs)
    lo_only_us, _ = time_layer([None, lo], no_hi, None, None)
    mixed_us, out = time_layer(pools, inputs, None, None)
    empty_us, _ = time_layer(pools, no_hi, None, None)  # the hi launches with no pair to run
    table_err = rel_err(out, ref)
    best, best_us, best_empty = replace(hi_table, block_m=lo_config.block_m), mixed_us, empty_us
    tried = []
    for cfg in hi_candidates(lo_config.block_m):
        try:
            us, out = time_layer(pools, inputs, [cfg, lo_config], None)
            empty, _ = time_layer(pools, no_hi, [cfg, lo_config], None)
        except Exception as e:  # a tile that does not fit in shared memory
            tried.append({"config": as_json({"c": cfg})["c"], "error": type(e).__name__})
            continue
        err = rel_err(out, ref)
        tried.append({"config": as_json({"c": cfg})["c"], "us": round(us, 2), "empty_us": round(empty, 2),
                      "rel_err": err})  # fmt: skip
        if err <= max_err and us + empty < best_us + best_empty:  # hi pairs or none: both are common
            best, best_us, best_empty = cfg, us, empty
    return {"tokens": t, "lo_only_us": round(lo_only_us, 2), "mixed_table_us": round(mixed_us, 2),
            "mixed_empty_table_us": round(empty_us, 2), "table_rel_err": table_err,
            "best": as_json({"c": best})["c"], "best_us": round(best_us, 2), "best_empty_us": round(best_empty, 2),
            "hi_cost_table_us": round(mixed_us - lo_only_us, 2), "hi_cost_best_us": round(best_us - lo_only_us, 2),
            "tried": tried}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--hi", default="bfloat16", help="the hi pool's PoolFormat name")
    ap.add_argument("--lo", default="int2", help="the lo pool's PoolFormat name")
    ap.add_argument("--hi-experts", type=int, default=2, help="experts in hi slots (the most routed)")
    ap.add_argument("--max-err", type=float, default=2e-2, help="relative error to the reference allowed")
    ap.add_argument("--compile-workers", type=int, default=8 if DEVICE == "cuda" else 0)
    ap.add_argument("--write-table", action="store_true")
    args = ap.parse_args()
    hidden, inter, experts, top_k = SHAPES[args.shape]
    hi, lo = make_pool(args.hi, hidden, inter, args.hi_experts), make_pool(args.lo, hidden, inter, experts)
    tokens = [int(v) for v in args.tokens.split(",")]
    if args.compile_workers > 0:  # the hi kernels alone: the lo pool's are the table's, compiled once
        jobs = [(args.hi, t, tuple(vars(c).values()), "v1") for t in tokens
                for c in hi_candidates(fm.pool_configs(t, [hi, lo])[1].block_m)]  # fmt: skip
        precompile(args.shape, jobs, args.compile_workers)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    rows, cells = [], {}
    for t in tokens:
        inputs, share = mixed_inputs(t, hidden, experts, top_k, args.hi_experts)
        hi_table, lo_config = fm.pool_configs(t, [hi, lo])
        own = fm.config_for(t, hidden, inter, hi.format.name)
        row = {"hi_pair_share": round(share, 4), **tune_cell(t, [hi, lo], inputs, lo_config, hi_table, args.max_err)}
        rows.append(row)
        print(f"T={t:4d} hi share {share:.3f} | lo only {row['lo_only_us']:7.1f} us | mixed, table "
              f"{row['mixed_table_us']:7.1f} (+{row['hi_cost_table_us']:.1f}; no hi pair "
              f"{row['mixed_empty_table_us']:.1f}) | best {row['best_us']:7.1f} (+{row['hi_cost_best_us']:.1f}; "
              f"no hi pair {row['best_empty_us']:.1f}) {tuple(row['best'].values())}", flush=True)  # fmt: skip
        own_tiles = [replace(own, block_m=lo_config.block_m), lo_config]
        if own_tiles[0] == hi_table:  # the table's tiles are the format's own: timed in tune_cell
            own_us = row["mixed_table_us"] + row["mixed_empty_table_us"]
        else:
            own_us = sum(time_layer([hi, lo], i, own_tiles, None)[0] for i in (inputs, lo_only(inputs)))
        if row["best_us"] + row["best_empty_us"] < 0.98 * own_us:
            cells[table_key(t, hidden, inter, hi.format.name, beside=lo.format.name)] = KernelConfig(**row["best"])
        result = {"shape": args.shape, "gpu": gpu, "torch": torch.__version__, "hi": args.hi, "lo": args.lo,
                  "hi_experts": args.hi_experts, "rows": rows}  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.write_table:
        existing = json.loads(TABLE_PATH.read_text())
        existing["configs"].update(as_json(cells))
        Path(args.out).with_name("fused_moe_configs.json").write_text(json.dumps(existing, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
