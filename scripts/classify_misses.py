"""Why a trace replay misses: at every layer's read of the device table (CPU engine), each routed
expert the table does not send to its hi version is classed by what the residency holds for it:

    no hi version     never fetched, or evicted (by an in-step prefetch, or between steps)
    parked            resident, kept out of this step's table for the in-step reserve
    in flight         its copy started and has not landed
    landed, stale     landed and not parked, yet the table still sends it elsewhere

    python scripts/classify_misses.py --trace TRACE --policy finemoe --prefetch-distance 1 [--out JSON]

Counts cover the warm-up requests too (the hit rate printed is the measured one). It wraps the
runtime's and the residency's methods in this process only; the engine is unchanged.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile

import torch

from moetide.bench.sweep import BenchSpec, run_sweep
from moetide.compute import runtime as rt
from moetide.residency import core


def install(kinds: collections.Counter, evicted_by: dict) -> None:
    run_layer, evict, take_in_step = (rt.ExpertRuntime.run_layer, core.ResidencyManager._evict,
                                      core.ResidencyManager._take_slot_in_step)  # fmt: skip

    def classify(self, layer, hidden, top_k_index, top_k_weights):
        res = self.residency
        table = res.step_table(layer) if getattr(res, "table_mode", False) else None
        if table is not None:
            hi = res.pool_ids["hi"]
            for e in torch.unique(top_k_index[: self.real_tokens]).tolist():
                if int(table[0][e]) == hi:
                    kinds["hit"] += 1
                    continue
                v = res.handles[layer][e].versions.get("hi")
                if v is None:
                    kinds[f"no hi version (evicted {evicted_by.get((layer, e), 'never')})"] += 1
                elif (layer, e) in res._parked["hi"]:
                    kinds["parked"] += 1
                elif not v.ready.query():
                    kinds["in flight"] += 1
                else:
                    kinds["landed, stale"] += 1
        return run_layer(self, layer, hidden, top_k_index, top_k_weights)

    def evict_between(self, handle, pool):
        evicted_by[(handle.layer, handle.expert)] = "between steps"
        return evict(self, handle, pool)

    def evict_in_step(self, pool, next_victim):
        before = set(self._lru[pool])
        slot = take_in_step(self, pool, next_victim)
        for key in before - set(self._lru[pool]):
            evicted_by[key] = "in step"
        return slot

    rt.ExpertRuntime.run_layer = classify
    core.ResidencyManager._evict = evict_between
    core.ResidencyManager._take_slot_in_step = evict_in_step


def replay_parser(description: str) -> argparse.ArgumentParser:
    """The options every CPU trace-replay diagnostic takes (also `scripts/trace_uses.py`'s)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--policy", default="finemoe")
    ap.add_argument("--prefetch-distance", type=int, default=1)
    ap.add_argument("--gpu-memory", default="25%")
    ap.add_argument("--trace-warmup", type=int, default=16)
    return ap


def run_replay(args, **spec_args) -> dict:
    """One CPU replay of `args.trace` for `args.policy` (the engine as patched in this process): its
    bench row. `spec_args`: further `BenchSpec` fields."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = BenchSpec(device="cpu", policies=[args.policy], gpu_memory=[args.gpu_memory], trace=args.trace,
                         trace_warmup=args.trace_warmup, out=tmp, prefetch_distance=args.prefetch_distance,
                         **spec_args)  # fmt: skip
        row = run_sweep(spec, progress=False)["runs"][0]
    if row.get("error"):
        raise SystemExit(f"the replay failed: {row['error']}")
    return row


def main() -> None:
    ap = replay_parser(__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="write the counts here (JSON)")
    args = ap.parse_args()
    kinds: collections.Counter = collections.Counter()
    install(kinds, {})
    row = run_replay(args, model=args.model)
    total = sum(kinds.values())
    print(f"{args.policy} d={args.prefetch_distance}: measured hit rate {row['hit_rate']}; {total} uses read")
    for kind, n in kinds.most_common():
        print(f"  {kind:36s} {n:7d}  {n / total:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"policy": args.policy, "prefetch_distance": args.prefetch_distance,
                       "hit_rate": row["hit_rate"], "uses": dict(kinds)}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
