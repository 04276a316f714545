#!/usr/bin/env python3
"""The FineMoE searcher's own CPU time per decode step, without a model or a GPU.

The searcher thread shares the GIL with the forward thread, so its Python time per step is what can
delay the forward pass (results/history.md §5). This runs the searcher's handler synchronously on
synthetic steps of the demo model's geometry (8 layers x 32 experts, top-4, hidden 256) against a
store of `--maps` entries and prints microseconds per step (begin + one event per layer + end).

    python scripts/bench_searcher_cpu.py [--maps 900] [--steps 300] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from moetide.policies.finemoe import FineMoEPolicy
from moetide.policies.hooks import NullSink


class CountingSink(NullSink):
    capacity_experts = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--maps", type=int, default=900)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--distance", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    L, J, H, k = args.layers, args.experts, args.hidden, args.top_k

    policy = FineMoEPolicy(prefetch_distance=args.distance, synchronous=True)
    policy.attach(CountingSink(), L, J, k)
    g = torch.Generator().manual_seed(0)
    store = policy._ensure_store(L, J, H)
    for _ in range(args.maps):
        store.add(torch.randn(H, generator=g), torch.softmax(3 * torch.randn(L, J, generator=g), -1))
    embeddings = [torch.randn(H, generator=g) for _ in range(args.steps)]
    maps = [torch.softmax(3 * torch.randn(L, J, generator=g), -1) for _ in range(args.steps)]
    ids = [torch.topk(m, k).indices[:, None, :] for m in maps]

    def run(first_iteration: int) -> None:
        for s in range(args.steps):
            it = first_iteration + s
            policy.begin_iteration(it, embeddings[s], 1)
            for layer in range(L):
                policy.observe_layer(it, layer, maps[s][layer], ids[s][layer])
            policy.end_iteration(it)

    run(1)  # warm-up (and fills the store past capacity, so RDY replacement runs)
    t0 = time.perf_counter()
    run(1 + args.steps)
    per_step = (time.perf_counter() - t0) / args.steps
    print(
        f"searcher CPU time: {per_step * 1e6:.0f} us per step (begin + {L} layers + end), {len(store)} maps"
    )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run(1 + 2 * args.steps)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
