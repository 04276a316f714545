#!/usr/bin/env python3
"""GPU measurement: batch-1 decode of an OLMoE-1B-7B-shaped random model (written as a
real checkpoint) under moetide policies at a 4 GiB budget, beside transformers fully on the GPU and
transformers + accelerate offload at the same cap, all in one run.

    python scripts/bench_offload.py --out results/offload_olmoe.json [--shape olmoe-1b-7b] [--budget 4GiB]

`--lo-kernel dequant,triton` runs every policy that computes lo versions (static-int4/int2, dynaexq,
combined) once per lo kernel, so one call A/B's the decode speed of the two lo paths, e.g.

    python scripts/bench_offload.py --skip-hf --policies static-int2 --lo-kernel dequant,triton --out lo.json

Random routers route near-uniformly (the hardest case for any predictor); this run measures the
residency core, transfer and compute costs, not prediction quality.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from moetide.bench.runs import bench_hf, bench_moetide
from moetide.bench.synthetic import write_synthetic_checkpoint
from moetide.config import CUDA_GRAPHS, LO_KERNELS
from moetide.policies.registry import policy_spec


def parse_args() -> tuple[argparse.Namespace, list[str], list[str]]:
    """The arguments, the lo kernels and the CUDA-graph settings to run."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="olmoe-1b-7b")
    ap.add_argument("--checkpoint", default="/tmp/moetide-synthetic")
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-offload-tokens", type=int, default=5)
    ap.add_argument(
        "--policies",
        default="no-offload,static-int4,static-int2,on-demand,lru,finemoe,combined:lo",
        help="comma-separated; POLICY:lo / POLICY:zero-copy sets --on-miss for that run",
    )
    ap.add_argument(
        "--lo-kernel",
        default="auto",
        help=f"comma-separated, of {', '.join(LO_KERNELS)}: policies with lo versions run once per kernel",
    )
    ap.add_argument(
        "--cuda-graphs",
        default="auto",
        help="comma-separated, of auto,off: no-offload and static-* run once per setting",
    )
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--repeat", type=int, default=1, help="run each moetide configuration this many times in this process"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    graph_modes = [g for g in args.cuda_graphs.split(",") if g]
    if not graph_modes or any(g not in CUDA_GRAPHS for g in graph_modes):
        ap.error(f"--cuda-graphs takes a comma-separated list of {', '.join(CUDA_GRAPHS)}")
    lo_kernels = [k for k in args.lo_kernel.split(",") if k]
    if not lo_kernels or any(k not in LO_KERNELS for k in lo_kernels):
        ap.error(f"--lo-kernel takes a comma-separated list of {', '.join(LO_KERNELS)}")
    return args, lo_kernels, graph_modes


def main() -> int:
    args, lo_kernels, graph_modes = parse_args()
    ckpt = Path(args.checkpoint) / args.shape
    t0 = time.perf_counter()
    if not (ckpt / "model.safetensors.index.json").is_file():
        write_synthetic_checkpoint(args.shape, ckpt)
    write_s = time.perf_counter() - t0
    results = {
        "shape": args.shape,
        "budget": args.budget,
        "machine": {
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "checkpoint_write_s": round(write_s, 1),
        "command": " ".join(sys.argv),
        "runs": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def record(r):
        results["runs"].append(r)
        out.write_text(json.dumps(results, indent=2))
        print_run(r)

    if not args.skip_hf:
        for impl in (None, "batched_mm"):
            try:
                record(bench_hf(ckpt, new_tokens=args.new_tokens, experts_implementation=impl))
            except Exception as e:  # one baseline failing must not lose the others
                print(f"hf {impl}: {type(e).__name__}: {e}", flush=True)
    run_policies(args, ckpt, lo_kernels, graph_modes, results, record)
    if not args.skip_hf:
        try:
            record(bench_hf(ckpt, offload_budget=args.budget, new_tokens=args.hf_offload_tokens))
        except Exception as e:
            print(f"hf-offload: {type(e).__name__}: {e}", flush=True)
    out.write_text(json.dumps(results, indent=2))
    return 0


def print_run(r: dict) -> None:
    tok_s = r.get("decode_tok_s")
    label = r.get("policy", r.get("experts_implementation", "")) or ""
    if r.get("lo_kernel"):
        label += f" [{r['lo_kernel']}]"
    if r.get("cuda_graphs_setting") == "off":
        label += " [no graphs]"
    print(
        f"{r['engine']:10s} {label:24s} "
        f"{r.get('gpu_memory')!s:6s} decode {tok_s or 0:8.2f} tok/s  peak {r['peak_gpu_bytes'] / 2**30:6.2f} GiB"
        f"  load {r['load_s']:6.1f}s",
        flush=True,
    )


def run_policies(args, ckpt: Path, lo_kernels, graph_modes, results: dict, record) -> None:
    """Every moetide configuration: each policy x lo kernel (lo versions only) x graph setting
    (no-offload, static-* only) x repeat; a failing one is recorded with its error."""
    for spec in args.policies.split(","):
        policy, _, on_miss = spec.partition(":")
        mode, has_lo = policy_spec(policy).memory_mode, policy_spec(policy).needs_lo
        budget = None if mode == "all-hi" else args.budget  # no offloading: the whole GPU
        kernels = lo_kernels if has_lo else ["auto"]  # the kernel only matters for lo versions
        graphs = graph_modes if mode in ("all-hi", "all-lo") else ["auto"]  # only these are ever captured
        runs = [(k, g, i) for k in kernels for g in graphs for i in range(args.repeat)]
        for lo_kernel, cuda_graphs, repeat in runs:
            try:
                kwargs = {"on_miss": on_miss} if on_miss else {}  # else the engine's default (lo)
                r = bench_moetide(
                    ckpt,
                    policy,
                    budget,
                    new_tokens=args.new_tokens,
                    lo_kernel=lo_kernel,
                    cuda_graphs=cuda_graphs,
                    **kwargs,
                )
                r["on_miss"] = on_miss or "default (lo)"
                r["lo_kernel"] = lo_kernel
                r["cuda_graphs_setting"] = cuda_graphs
                r["repeat"] = repeat
                record(r)
            except Exception as e:
                print(f"moetide {policy} [{lo_kernel}]: {type(e).__name__}: {e}", flush=True)
                results["runs"].append(
                    {"engine": "moetide", "policy": policy, "gpu_memory": budget, "lo_kernel": lo_kernel,
                     "error": str(e)}
                )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
