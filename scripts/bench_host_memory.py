#!/usr/bin/env python3
"""Capped against uncapped host memory, in one process: decode tok/s at two batch sizes, the share
of expert uses served in hi, start-up seconds and the host counters, for one policy and model.

    python scripts/bench_host_memory.py --policy combined --gpu-memory 40% --cpu-memory 30MiB \
        --batch-size 1,4 --out results/host_memory_cpu.json          # the demo model, CPU
    python scripts/bench_host_memory.py --model /dev/shm/olmoe --policy combined --gpu-memory 4GiB \
        --cpu-memory 25% --batch-size 1,32 --out results/gpu/host_memory_olmoe.json   # a GPU

`--cpu-memory NN%` is that share of the model's experts in the store's hi layout. Peak RSS (VmHWM)
only grows within a process: the uncapped run goes second, so the capped run's peak is its own.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import moetide
from moetide.config import EngineConfig, parse_bytes
from moetide.engine.host_memory import rss_bytes
from moetide.engine.llm import demo_model_path
from moetide.engine.memory import model_bytes


def measure(
    model: str, policy: str, gpu: str, cpu: int | None, batches: list[int], tokens: int, extra
) -> dict:
    start = time.perf_counter()
    llm = moetide.LLM(
        model, policy=policy, gpu_memory=gpu, cpu_memory=cpu, max_num_seqs=max(batches), **extra
    )
    load_s = time.perf_counter() - start
    params = moetide.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([[5, 6, 7, 8]], moetide.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    llm.metrics.reset()
    rates = {}
    for b in batches:
        prompts = [[(17 * i + 3 * j) % 4000 + 10 for j in range(16)] for i in range(b)]
        t = time.perf_counter()
        llm.generate(prompts, params)
        rates[f"bs{b}_tok_s"] = b * tokens / (time.perf_counter() - t)
    snap = llm.metrics.snapshot()
    used = snap["hits"] + snap["lo_runs"] + snap["misses"]
    hi_share = snap["hits"] / used if used else 0.0  # combined: a hit is a use served in the hot tier
    llm.close()
    keys = ("host_cap_bytes", "host_peak_bytes", "host_hi_mapped", "host_cache_hits", "host_staged_bytes",
            "disk_reads", "disk_read_bytes", "disk_read_s", "lo_runs", "hits", "misses")  # fmt: skip
    return {"cpu_memory_bytes": cpu, "load_s": load_s, **rates, "hit_share": hi_share,
            "rss_peak_bytes": rss_bytes()[1], **{k: snap[k] for k in keys}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(demo_model_path()))
    p.add_argument("--policy", default="combined")
    p.add_argument("--gpu-memory", default="40%")
    p.add_argument("--cpu-memory", default="30MiB")
    p.add_argument("--batch-size", default="1,4")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--hi", default="hi", help="hi precision (e.g. int4)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    batches = [int(b) for b in args.batch_size.split(",")]
    cpu = args.cpu_memory
    if cpu.endswith("%"):
        hi_all = model_bytes(EngineConfig(model=args.model)).all_experts_hi_bytes
        cpu = int(float(cpu[:-1]) / 100 * hi_all)
    cap = parse_bytes(cpu)
    extra = {"hi_precision": args.hi}
    capped = measure(args.model, args.policy, args.gpu_memory, cap, batches, args.tokens, extra)
    uncapped = measure(args.model, args.policy, args.gpu_memory, None, batches, args.tokens, extra)
    ratios = {f"bs{b}_capped_vs_uncapped": capped[f"bs{b}_tok_s"] / uncapped[f"bs{b}_tok_s"] for b in batches}
    ratios["hit_share_difference"] = capped["hit_share"] - uncapped["hit_share"]
    result = {"command": "python scripts/bench_host_memory.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
              "model": args.model, "policy": args.policy, "gpu_memory": args.gpu_memory,
              "capped": capped, "uncapped": uncapped, "ratios": ratios}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
