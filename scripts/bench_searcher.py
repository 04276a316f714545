#!/usr/bin/env python3
"""Issue 5: the FineMoE searcher's cost, on the engine, against the decode iteration time.

Demo model, a budget where every expert fits (so prefetches move nothing and only the policy's own
cost differs), the map store warmed from held-out conversations 0..W-1, measured on W..W+N-1, once
per variant (`--variants`): the searcher in its own process, the same with a searcher that never
searches (what publishing alone costs), and the searcher as a thread of the engine's process:
  - decode step time with FineMoE attached (forward hooks publish, the searcher searches)
    and with the hooks switched off (same residency, same prompts). Every prompt is decoded once
    untimed first (first-use costs of each sequence length), then both ways, in alternating order;
  - the forward thread's time inside the policy hooks, per decode step;
  - the searcher's busy time (sum of its search times) over the measured wall time.

    python scripts/bench_searcher.py --out results.json [--device cuda] [--variants process,publish-only,thread]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import moetide
from moetide.data.sharegpt import heldout_conversations
from moetide.policies.finemoe import FineMoEConfig, FineMoEPolicy
from moetide.policies.hooks import PolicyHooks
from moetide.policies.trace import record_trace


def user_prompts(tokenizer, convs, max_len=256):
    out = []
    for c in convs:
        user = next((t for role, t in c["turns"] if role == "user"), None)
        if user:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            out.append(ids[-max_len:])
    return out


def timed_decode(llm, prompts, new_tokens):
    """Per-step wall times of batch-1 generations (device-synchronized)."""
    times = []
    engine = llm.engine
    for ids in prompts:
        engine.add_request(ids, moetide.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return times[1:]  # drop the first step (a prefill)


def publish_only(llm) -> None:
    """Swap the engine's FineMoE for one whose store stays empty (no warm-up, no online inserts): the
    forward thread publishes exactly as before, the searcher process consumes every event and never
    searches or decides anything. The difference to "process" is the searcher's own cost."""
    loaded = llm.loaded
    loaded.policy_hooks.remove()
    loaded.policy.close()
    loaded.policy = FineMoEPolicy(FineMoEConfig(prefetch_distance=2, online_updates=False, searcher="process"))
    residency = loaded.runtime.residency
    loaded.policy_hooks = PolicyHooks(
        loaded.model, loaded.adapter, [loaded.policy], sink=residency, runtime=loaded.runtime
    )


def measure(args, variant: str) -> dict:
    """One engine with FineMoE (`variant`: "process" / "thread": where its searcher runs;
    "publish-only": see `publish_only`): step times with the policy's hooks on and off, interleaved,
    on the same prompts."""
    searcher = "thread" if variant == "thread" else "process"
    llm = moetide.LLM(
        device=args.device, policy="finemoe", gpu_memory="2GiB", prefetch_distance=2, searcher=searcher
    )
    convs = heldout_conversations()
    warm = user_prompts(llm.tokenizer, convs[: args.warm])
    test = user_prompts(llm.tokenizer, convs[args.warm : args.warm + 4 * args.prompts])[: args.prompts]
    t0 = time.perf_counter()
    inserted = 0
    if variant == "publish-only":
        publish_only(llm)
    else:
        trace = record_trace(llm.loaded.model, llm.loaded.adapter, warm, max_new_tokens=16, spec_distances=())
        inserted = llm.loaded.policy.warm_up(trace)
    policy = llm.loaded.policy
    warm_s = time.perf_counter() - t0

    hooks = llm.loaded.policy_hooks
    timed_decode(llm, test, args.new_tokens)  # untimed: first-use costs of every sequence length
    policy.drain()
    with_policy, without = [], []
    hook_s = wall = 0.0
    before = policy.stats()
    for i, ids in enumerate(test):
        for enabled in (True, False) if i % 2 == 0 else (False, True):  # alternate the order
            hooks.enabled = enabled
            if enabled:
                hook_before, start = hooks.hook_time_s, time.perf_counter()
                with_policy += timed_decode(llm, [ids], args.new_tokens)
                wall += time.perf_counter() - start
                policy.drain()
                hook_s += hooks.hook_time_s - hook_before
            else:
                without += timed_decode(llm, [ids], args.new_tokens)
    stats = policy.stats()
    searches = sum(stats[k] - before[k] for k in ("semantic_searches", "trajectory_searches"))
    busy_s = (
        stats["mean_search_us"] * (stats["semantic_searches"] + stats["trajectory_searches"])
        - before["mean_search_us"] * (before["semantic_searches"] + before["trajectory_searches"])
    ) / 1e6

    step_with, step_without = statistics.median(with_policy), statistics.median(without)
    result = {
        "variant": variant,
        "store_maps": stats["store_size"],
        "warm_maps_inserted": inserted,
        "warm_s": round(warm_s, 2),
        "decode_step_ms_with_finemoe": 1e3 * step_with,
        "decode_step_ms_without_policy": 1e3 * step_without,
        "forward_overhead_share": (step_with - step_without) / step_without,
        "mean_step_ms_with_finemoe": 1e3 * statistics.fmean(with_policy),
        "mean_step_ms_without_policy": 1e3 * statistics.fmean(without),
        "hook_ms_per_step": 1e3 * hook_s / (len(with_policy) + len(test)),
        "decode_steps_each": len(with_policy),
        "searcher_busy_share_of_wall": busy_s / wall,
        "mean_search_us": stats["mean_search_us"],
        "searches": searches,
        "late_skipped": stats["late_skipped"] - before["late_skipped"],
        "hit_rate": llm.metrics.hit_rate,
    }
    llm.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--warm", type=int, default=48, help="held-out conversations used to warm the store")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument(
        "--variants", default="process,publish-only,thread", help="comma-separated: process, publish-only, thread"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    runs = []
    for variant in args.variants.split(","):
        runs.append(measure(args, variant))
        print(json.dumps(runs[-1], indent=2), flush=True)
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "command": " ".join(sys.argv),
        "runs": runs,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
