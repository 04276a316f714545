#!/usr/bin/env python3
"""One MoE layer's fused call as an engine's layers make it: the engine's own pools and slot table,
graph-replayed on the GPU, per policy, with each fused launch's time in launch order; then the same
call with the table copied into fresh tensors, and with the lo pool alone. For finding what makes a
launch slower in one engine than in another with the same pools' formats and tiles.

    python scripts/probe_layer_in_engine.py --out probe.json [--policies combined,static-int2]
        [--tokens 1,32] [--layer 0] [--budget 4GiB] [--checkpoint DIR] [--cache-dir DIR]

`engine`: `residency.kernel_pools` and `step_table(layer)` as they are after one generated token.
`fresh_table`: the same pools, `pool_of` / `slot_of` cloned (contiguous, new allocations).
`lo_only`: every expert sent to its lo row (`slot_of`'s lo row kept), only the lo pool passed
(static-int2's launches). Without CUDA (under TRITON_INTERPRET=1, a smoke run) one plain call is
timed and no launch times are listed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from profile_decode import kernel_durations
from tune_fused_moe import DEVICE, time_layer

import moetide
from moetide.bench.synthetic import write_synthetic_checkpoint
from moetide.compute import fused_moe as fm
from moetide.compute.fused_moe import LO_POOL_ID


def layer_inputs(llm, num_tokens: int, dtype: torch.dtype):
    """(x (T, H), ids (T, k), weights (T, k)): random routing over the model's experts."""
    cfg = llm.loaded.config
    experts = getattr(cfg, "num_experts", None) or cfg.n_routed_experts
    g = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    logits = torch.randn(num_tokens, experts, device=DEVICE, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), cfg.num_experts_per_tok, dim=-1)
    x = torch.randn(num_tokens, cfg.hidden_size, device=DEVICE, generator=g).to(dtype)
    return x, ids, weights.to(dtype)


def launches(pools, inputs) -> dict[str, list[float]]:
    """Each fused launch's microseconds, in launch order, over one call (CUDA only)."""
    if DEVICE != "cuda":
        return {}
    fm.fused_moe(*inputs, pools)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fm.fused_moe(*inputs, pools)
        torch.cuda.synchronize()
    return kernel_durations(prof, ("_gate_up_kernel", "_down_kernel", "_fused_gemv_kernel", "_reduce_kernel"))


def probe_policy(ckpt: Path, policy: str, args) -> dict:
    llm = moetide.LLM(str(ckpt), policy=policy, gpu_memory=args.budget, max_num_seqs=32, max_model_len=256,
                      cache_dir=args.cache_dir, device=DEVICE)  # fmt: skip
    llm.generate([[5, 6, 7, 8]], moetide.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    residency = llm.loaded.runtime.residency
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    pools = residency.kernel_pools(dtype)
    pool_of, slot_of = residency.step_table(args.layer)
    lo_of = torch.full_like(pool_of, LO_POOL_ID)
    lo_pools = [p if i == LO_POOL_ID else None for i, p in enumerate(pools)]
    variants = {"engine": (pools, pool_of, slot_of),
                "fresh_table": (pools, pool_of.clone(), slot_of.contiguous().clone()),
                "lo_only": (lo_pools, lo_of, slot_of.contiguous().clone())}  # fmt: skip
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        x, ids, weights = layer_inputs(llm, t, dtype)
        for name, (ps, po, so) in variants.items():
            inputs = (x, ids, weights, po, so)
            us, _ = time_layer(ps, inputs, None, None)
            rows.append({"policy": policy, "tokens": t, "variant": name, "us": round(us, 2),
                         "tiles": [None if c is None else vars(c) for c in fm.pool_configs(t, ps)],
                         "table_strides": [list(po.stride()), list(so.stride())],
                         "launch_us_in_order": launches(ps, inputs)})  # fmt: skip
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "tiles"}), flush=True)
    llm.close()
    return {"policy": policy, "pools": [pool_layout(p) for p in pools], "rows": rows,
            "compiled_variants": compiled_variants()}  # fmt: skip


def pool_layout(pool) -> dict | None:
    """What the launches' specialization sees of one pool: the arena's alignment and stride, and each
    matrix's offsets (Triton compiles separate kernels for arguments divisible by 16 or not)."""
    if pool is None:
        return None
    arena = pool.arena
    matrices = {name: {"bits": m.bits, "group": m.group_size, "data_offset": m.data_offset,
                       "scale_offset": m.scale_offset, "offset_offset": m.offset_offset}
                for name, m in (("gate_up", pool.format.gate_up), ("down", pool.format.down))}  # fmt: skip
    return {"format": pool.format.name, "rows": arena.shape[0], "row_bytes": arena.shape[1],
            "stride0": arena.stride(0), "dtype": str(arena.dtype), "device": str(arena.device),
            "ptr_mod_128": arena.data_ptr() % 128, "contiguous": arena.is_contiguous(),
            "matrices": matrices}  # fmt: skip


def compiled_variants() -> dict[str, list[str]]:
    """The specializations each fused kernel has been compiled for so far in this process."""
    out = {}
    for name in ("_gate_up_kernel", "_down_kernel", "_fused_gemv_kernel"):
        caches = getattr(getattr(fm, name), "device_caches", {})
        out[name] = sorted(str(key)[:600] for cache in caches.values() for key in cache[0])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="olmoe-1b-7b")
    ap.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the synthetic shape)")
    ap.add_argument("--policies", default="combined,static-int2")
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    ckpt = Path(args.checkpoint) if args.checkpoint else Path("/tmp/moetide-synthetic") / args.shape
    if not (ckpt / "config.json").is_file():
        write_synthetic_checkpoint(args.shape, ckpt)
    result = {"command": " ".join(sys.argv), "device": DEVICE, "runs": []}
    for policy in args.policies.split(","):
        result["runs"].append(probe_policy(ckpt, policy, args))
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
