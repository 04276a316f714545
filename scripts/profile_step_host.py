#!/usr/bin/env python3
"""The host part of a decode step (`metrics.step_host_s`: the runtime's begin_step / end_step, i.e. the
residency's accounting and requests and the policies' publication) per step, median over decode steps.

Runs on the CPU: an OLMoE-shaped synthetic checkpoint (16 MoE layers, 64 experts, top-8) at a tiny
width, so that the forward is cheap and the host part has the GPU run's counts (layers, experts,
requests per step). The budget should leave the lo pool holding every expert, as 4 GiB does on the
OLMoE shape (the tool prints the pools' slots).

    python scripts/profile_step_host.py [--policy combined] [--batch-size 1] [--gpu-memory 160MiB] \
        [--steps 150] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
from pathlib import Path

import moetide
from moetide.bench.runs import prompt_ids
from moetide.bench.synthetic import write_synthetic_checkpoint

TINY = dict(hidden_size=256, intermediate_size=128, vocab_size=2048, num_attention_heads=4, num_key_value_heads=4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="combined")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--gpu-memory", default="160MiB")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--checkpoint", default="/tmp/moetide-olmoe-tiny")
    ap.add_argument("--profile", action="store_true", help="cProfile begin_step / end_step, by own time")
    args = ap.parse_args()
    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").exists():
        write_synthetic_checkpoint("olmoe-1b-7b", ckpt, progress=False, **TINY)
    llm = moetide.LLM(str(ckpt), policy=args.policy, gpu_memory=args.gpu_memory, device="cpu",
                      max_num_seqs=args.batch_size, max_model_len=256, compile="off")  # fmt: skip
    engine, runtime = llm.engine, llm.loaded.runtime
    for i in range(args.batch_size):
        params = moetide.SamplingParams(max_tokens=args.steps + 20, temperature=0, ignore_eos=True)
        engine.add_request(prompt_ids(TINY["vocab_size"], 32, seed=i), params)
    for _ in range(10):  # prefill and the first decode steps
        engine.step()
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        for name in ("begin_step", "end_step"):
            setattr(runtime, name, _profiled(getattr(runtime, name), profiler))
    per_step = []
    for _ in range(args.steps):
        before = runtime.metrics.step_host_s
        engine.step()
        per_step.append(runtime.metrics.step_host_s - before)
    pools = {name: pool.num_slots for name, pool in runtime.residency.pools.items()}
    print(f"{args.policy} batch {args.batch_size} at {args.gpu_memory} (pool slots {pools}): step_host "
          f"median {1e6 * statistics.median(per_step):.0f} us, mean {1e6 * statistics.mean(per_step):.0f} us")
    if profiler is not None:
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    llm.close()
    return 0


def _profiled(fn, profiler):
    def call(*a, **k):
        profiler.enable()
        try:
            return fn(*a, **k)
        finally:
            profiler.disable()

    return call


if __name__ == "__main__":
    raise SystemExit(main())
