#!/usr/bin/env python3
"""Where a decode step's time goes: batch-B decode steps of moetide policies on a synthetic shape, timed
(device-synced), then profiled with torch.profiler (host ops, kernels, launches) and cProfile (Python).

    python scripts/profile_decode.py --out profile.json [--policies combined,static-int2] [--batch-size 32] \
        [--compile off,auto] [--cache-dir DIR]

`decode_step_ms` is the wall time of a whole engine step, synced; `per_step_device_busy_ms` the
kernels' own time in it (torch.profiler): their difference is what the host adds to a step.

Diagnostic for the batch-32 throughput result; every number it prints is for the steps it ran.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import sys
import time
from pathlib import Path

import torch

import moetide
from moetide.bench.runs import prompt_ids
from moetide.bench.synthetic import write_synthetic_checkpoint
from moetide.policies.registry import policy_spec


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_durations(prof, prefixes: tuple[str, ...], first: int = 32) -> dict[str, list[float]]:
    """Microseconds of the first `first` launches of each kernel named by a prefix, in launch order (a
    mixed layer launches each pool's kernels in pool order: hi, then lo)."""
    found = {p: [] for p in prefixes}
    kernels = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    for e in sorted(kernels, key=lambda e: e.time_range.start):
        for p in prefixes:
            if e.name.startswith(p) and len(found[p]) < first:
                found[p].append(round(e.time_range.elapsed_us(), 2))
    return found


def moe_tiles(llm) -> dict:
    """The fused kernel's tiles per pool (hi, lo, ...) at T = 1 and 32, as this engine's layers take them."""
    from moetide.compute import fused_moe as fm

    residency = llm.loaded.runtime.residency
    if not hasattr(residency, "kernel_pools"):
        return {}
    pools = residency.kernel_pools(torch.bfloat16)
    return {t: [None if c is None else vars(c) for c in fm.pool_configs(t, pools)] for t in (1, 32)}


def profile_policy(ckpt: Path, policy: str, args, compile_mode: str = "off") -> dict:
    llm = moetide.LLM(
        str(ckpt),
        policy=policy,
        gpu_memory=None if policy_spec(policy).memory_mode == "all-hi" else args.budget,
        lo_kernel=args.lo_kernel,
        max_num_seqs=args.batch_size,
        max_model_len=args.prompt_len + 64,
        compile=compile_mode,
        cache_dir=args.cache_dir,
    )
    engine = llm.engine
    vocab = llm.loaded.config.vocab_size
    for i in range(args.batch_size):
        engine.add_request(
            prompt_ids(vocab, args.prompt_len, seed=i),
            moetide.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True),
        )
    for _ in range(8):  # prefill (possibly chunked), then decode steps that capture (and compile) the graph
        engine.step()
    times = []
    for _ in range(args.steps):
        _sync()
        t0 = time.perf_counter()
        engine.step()
        _sync()
        times.append(1e3 * (time.perf_counter() - t0))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(3):
            engine.step()
        _sync()
    launches_in_order = kernel_durations(prof, ("_gate_up_kernel", "_down_kernel"))
    events = prof.key_averages()
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60)
    by_cuda = (
        events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)
        if torch.cuda.is_available()
        else ""
    )
    launches = sum(
        e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
    )
    syncs = sum(e.count for e in events if "Synchronize" in e.key or e.key == "cudaMemcpyAsync")
    cuda_total_ms = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) / 1e3
    py = cProfile.Profile()
    py.enable()
    for _ in range(3):
        engine.step()
    _sync()
    py.disable()
    stream = io.StringIO()
    pstats.Stats(py, stream=stream).sort_stats("tottime").print_stats(16)
    snapshot = llm.metrics.snapshot()
    tiles = moe_tiles(llm)
    kv, ahead = engine.kv_stats(), engine.ahead_steps
    llm.close()
    return {
        "policy": policy,
        "compile": compile_mode,
        "batch": args.batch_size,
        "decode_step_ms": {
            "p50": round(sorted(times)[len(times) // 2], 2),
            "all": [round(t, 2) for t in times],
        },
        "per_step_kernel_launches": launches / 3,
        "per_step_sync_or_copy_calls": syncs / 3,
        "per_step_device_busy_ms": round(cuda_total_ms / 3, 2),
        "fused_moe_launch_us_in_order": launches_in_order,
        "fused_moe_tiles": tiles,
        "host_ops_by_self_cpu": by_cpu,
        "kernels_by_device_time": by_cuda,
        "python_by_tottime": stream.getvalue()[:6000],
        "metrics": {k: v for k, v in snapshot.items() if k != "per_layer"},
        "kv": kv,
        "ahead_steps": ahead,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="olmoe-1b-7b")
    ap.add_argument("--checkpoint", default="/tmp/moetide-synthetic")
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--policies", default="combined,static-int2")
    ap.add_argument("--lo-kernel", default="triton")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compile", default="off", help="comma-separated of off,auto: each policy once per setting")
    ap.add_argument("--cache-dir", default=None, help="where lo versions are cached between loads")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ckpt = Path(args.checkpoint) / args.shape
    if not (ckpt / "model.safetensors.index.json").is_file():
        write_synthetic_checkpoint(args.shape, ckpt)
    results = {"command": " ".join(sys.argv), "runs": []}
    for policy, compile_mode in itertools.product(args.policies.split(","), args.compile.split(",")):
        try:
            r = profile_policy(ckpt, policy, args, compile_mode)
        except Exception as e:  # noqa: BLE001 - one policy failing must not lose the others
            r = {"policy": policy, "compile": compile_mode, "error": f"{type(e).__name__}: {e}"}
        results["runs"].append(r)
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(
            json.dumps({k: r.get(k) for k in ("policy", "compile", "decode_step_ms", "per_step_kernel_launches",
                                               "per_step_sync_or_copy_calls", "per_step_device_busy_ms", "error")}),
            flush=True,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
