#!/usr/bin/env python3
"""The FineMoE searcher's cost, on the engine, against the decode iteration time.

Demo model, a budget where every expert fits (so prefetches move nothing and only the policy's own
cost differs), the map store warmed from held-out conversations 0..W-1, measured on W..W+N-1, once
per searcher placement (`--searchers`: its own process, a thread of the engine's process):
  - decode step time, per prompt under every condition in rotating order: no policy (the hooks
    switched off, same residency), FineMoE (hooks publish, the searcher searches) and, with a
    searcher process, "publish-only": the same hooks with the searcher process paused, dropping
    every event unread (what publishing alone costs; FineMoE minus publish-only is the searcher's
    own cost). One engine and one set of hooks for every condition: a second set of hooks on the
    same model (how publish-only was measured before) slowed every condition, "off" included
    (H200: 18.9 ms a step against 1.7 ms in the thread run);
  - the forward thread's time inside the policy hooks, per decode step;
  - the searcher's busy time (sum of its search times) over the measured wall time.

    python scripts/bench_searcher.py --out results.json [--device cuda] [--searchers process,thread]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import moetide
from moetide.analysis.trace import record_trace
from moetide.data.sharegpt import heldout_conversations


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


def activate(llm, conditions: dict, name: str) -> None:
    """Condition `name`: "off" switches FineMoE's hooks off (no policy sees anything); "finemoe"
    switches them on; "publish-only" switches them on with the searcher process paused (it drops
    every event unread: no search, no insert, no decision), so the hooks publish exactly as under
    "finemoe". One engine, one set of hooks for all three."""
    hooks = llm.loaded.policy_hooks
    hooks.enabled = conditions[name]
    if "publish-only" in conditions:
        llm.loaded.policy.pause_searches(name == "publish-only")


def paired_share(a: list[float], b: list[float], base: list[float] | None = None) -> dict:
    """Per prompt (a - b) / base (base defaults to b): mean and two standard errors over prompts, so a
    share is read with the noise of the same run (prompts are paired: each ran under every condition)."""
    base = base or b
    shares = [(x - y) / z for x, y, z in zip(a, b, base, strict=True)]
    sem = statistics.stdev(shares) / len(shares) ** 0.5 if len(shares) > 1 else float("nan")
    return {"mean": statistics.fmean(shares), "two_sem": 2 * sem, "prompts": len(shares)}


def warm_store(llm, args) -> tuple[list[list[int]], int, float]:
    """Warm FineMoE's map store on held-out conversations 0..warm-1; the next ones are the test
    prompts. Returns (test prompts, maps inserted, seconds)."""
    convs = heldout_conversations()
    warm = user_prompts(llm.tokenizer, convs[: args.warm])
    test = user_prompts(llm.tokenizer, convs[args.warm : args.warm + 4 * args.prompts])[: args.prompts]
    t0 = time.perf_counter()
    trace = record_trace(llm.loaded.model, llm.loaded.adapter, warm, max_new_tokens=16, spec_distances=())
    inserted = llm.loaded.policy.warm_up(trace)
    return test, inserted, time.perf_counter() - t0


def measure(args, searcher: str) -> dict:
    """One engine with FineMoE's searcher in `searcher` ("process" / "thread"). Conditions, rotated
    per prompt: no policy ("off"), FineMoE ("finemoe") and, with a searcher process, the same hooks
    feeding a searcher that never searches ("publish-only")."""
    llm = moetide.LLM(
        device=args.device, policy="finemoe", gpu_memory="2GiB", prefetch_distance=2, searcher=searcher
    )
    test, inserted, warm_s = warm_store(llm, args)
    policy = llm.loaded.policy
    conditions = {"off": False, "finemoe": True}  # name -> FineMoE's hooks on
    if searcher == "process":
        conditions["publish-only"] = True

    names = list(conditions)
    for name in names:  # untimed: first-use costs of every sequence length, under every condition
        activate(llm, conditions, name)
        timed_decode(llm, test[:2], args.new_tokens)
    policy.drain()
    times = {name: [] for name in names}
    per_prompt = {name: [] for name in names}  # median step time of each prompt under each condition
    hook_s = dict.fromkeys(names, 0.0)
    wall = 0.0
    before = policy.stats()
    for i, ids in enumerate(test):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order
            activate(llm, conditions, name)
            hooks = llm.loaded.policy_hooks
            hook_before, start = hooks.hook_time_s, time.perf_counter()
            steps = timed_decode(llm, [ids], args.new_tokens)
            times[name] += steps
            per_prompt[name].append(statistics.median(steps))
            if name == "finemoe":  # the searcher searches: its wall time
                wall += time.perf_counter() - start
            hook_s[name] += hooks.hook_time_s - hook_before
    policy.drain()
    stats = policy.stats()
    searches = sum(stats[k] - before[k] for k in ("semantic_searches", "trajectory_searches"))
    busy_s = stats["search_s"] - before["search_s"]
    off = statistics.median(times["off"])
    result = {
        "searcher": searcher,
        "store_maps": stats["store_size"],
        "warm_maps_inserted": inserted,
        "warm_s": round(warm_s, 2),
        "decode_steps_each": len(times["off"]),
        "median_step_ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
        "mean_step_ms": {name: 1e3 * statistics.fmean(t) for name, t in times.items()},
        "forward_overhead_share": {
            name: statistics.median(t) / off - 1 for name, t in times.items() if name != "off"
        },
        "hook_ms_per_step": {
            name: 1e3 * hook_s[name] / (len(times[name]) + len(test)) for name in names if name != "off"
        },
        "searcher_busy_share_of_wall": busy_s / wall,
        "mean_search_us": stats["mean_search_us"],
        "searches": searches,
        "late_skipped": stats["late_skipped"] - before["late_skipped"],
        "hit_rate": llm.metrics.hit_rate,
    }
    result["paired_share"] = {  # per prompt: (condition - off) / off, mean and 2 standard errors
        name: paired_share(per_prompt[name], per_prompt["off"]) for name in names if name != "off"
    }
    if "publish-only" in times:
        result["searcher_share"] = (
            statistics.median(times["finemoe"]) - statistics.median(times["publish-only"])
        ) / off
        result["paired_share"]["searcher"] = paired_share(
            per_prompt["finemoe"], per_prompt["publish-only"], per_prompt["off"]
        )
        policy.pause_searches(False)
    llm.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None)
    ap.add_argument("--warm", type=int, default=48, help="held-out conversations used to warm the store")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--searchers", default="process,thread", help="comma-separated: process, thread")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    runs = []
    for searcher in args.searchers.split(","):
        runs.append(measure(args, searcher))
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
