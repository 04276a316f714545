#!/usr/bin/env python3
"""Where the forward thread's time inside FineMoE's hooks goes (cProfile, per decode step).

Demo model, FineMoE with its searcher in its own process (store warmed as in bench_searcher.py),
batch-1 decode; prints the policy-side functions by cumulative time per decode step.

    python scripts/profile_hooks.py [--device cuda] [--steps 96]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys

import moetide
from moetide.analysis.trace import record_trace
from moetide.data.sharegpt import heldout_conversations

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_searcher import timed_decode, user_prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=3)
    args = ap.parse_args()
    llm = moetide.LLM(device=args.device, policy="finemoe", gpu_memory="2GiB", prefetch_distance=2)
    convs = heldout_conversations()
    warm = user_prompts(llm.tokenizer, convs[:24])
    test = user_prompts(llm.tokenizer, convs[24:40])[: args.prompts]
    llm.loaded.policy.warm_up(record_trace(llm.loaded.model, llm.loaded.adapter, warm, 16, spec_distances=()))
    timed_decode(llm, test, args.new_tokens)  # untimed
    profiler = cProfile.Profile()
    profiler.enable()
    steps = len(timed_decode(llm, test, args.new_tokens)) + len(test)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(r"hooks|finemoe|searcher_process|residency|runtime|expert", 45)
    print(f"decode steps profiled: {steps} (divide the times by this)")
    stats.sort_stats("tottime").print_stats(30)
    print(out.getvalue())
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
