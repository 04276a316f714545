"""Time one expert's forward in each format on CUDA: bf16, dequantize + F.linear, Triton fused low-bit.

OLMoE-shaped expert by default (H=2048, I=1024), T = 1, 4, 16 tokens, int4 and int2 at the default
group sizes. Times are medians in microseconds from triton.testing.do_bench (CUDA events, L2 flushed
between runs, so weights come from HBM as they would for an expert not touched recently) and, where it
works, do_bench_cudagraph (launch overhead removed: the GPU time alone). `--sweep` also times a grid of
Triton tile configs and reports the best. Prints a table and writes JSON to the given path.

    python scripts/bench_lowbit.py out/bench_lowbit.json [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from functools import partial

import torch

from moetide.store.quant import (
    dequantize,
    expert_forward,
    expert_views,
    pack_expert,
    swiglu_expert,
)

TOKENS = (1, 4, 16)
PRECISIONS = ("int4", "int2")
SWEEP_BLOCK_N = (16, 32, 64)
SWEEP_BLOCK_K = (32, 64)
SWEEP_SPLIT_K = (1, 2, 4, 8)


def time_us(fn, triton_testing, cudagraph: bool) -> float | None:
    """Median microseconds of fn(); None if CUDA-graph capture fails for it."""
    try:
        if cudagraph:
            return 1e3 * triton_testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return 1e3 * triton_testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    except RuntimeError as error:  # graph capture can fail (e.g. allocator state); report and go on
        print(f"  timing failed ({'cudagraph' if cudagraph else 'events'}): {error}", file=sys.stderr)
        return None


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.float() - exact.float()).norm() / exact.float().norm())


def bench(args: argparse.Namespace, triton_testing, device: str = "cuda") -> list[dict]:
    """All rows; `triton_testing` is triton.testing (a stand-in lets the logic be smoke-tested on CPU)."""
    from moetide.store import triton_lowbit

    hidden, intermediate = args.hidden_size, args.intermediate_size
    generator = torch.Generator(device=device).manual_seed(0)
    gate_up = torch.randn(2 * intermediate, hidden, device=device, generator=generator).mul_(0.02).bfloat16()
    down = torch.randn(hidden, intermediate, device=device, generator=generator).mul_(0.02).bfloat16()
    versions = {p: pack_expert(gate_up, down, p) for p in ("hi", *PRECISIONS)}
    rows = []
    for num_tokens in TOKENS:
        x = torch.randn(num_tokens, hidden, device=device, generator=generator).bfloat16()
        hi_buffer, hi_meta = versions["hi"]
        hi_views = expert_views(hi_buffer, hi_meta)
        rows.append(measure("bf16", "F.linear", num_tokens, hi_meta.nbytes, None, triton_testing,
                            partial(expert_forward, x, hi_views, hi_meta)))  # fmt: skip
        for precision in PRECISIONS:
            buffer, meta = versions[precision]
            views = expert_views(buffer, meta)
            reference = swiglu_expert(x, *dequantize(views, meta))
            rows.append(measure(precision, "dequantize+F.linear", num_tokens, meta.nbytes, None, triton_testing,
                                partial(expert_forward, x, views, meta)))  # fmt: skip
            fused = triton_lowbit.expert_forward_lowbit(x, views, meta)
            error = relative_error(fused, reference)
            rows.append(measure(precision, "triton default", num_tokens, meta.nbytes, error, triton_testing,
                                partial(triton_lowbit.expert_forward_lowbit, x, views, meta)))  # fmt: skip
            if args.sweep:
                rows.append(sweep(precision, num_tokens, x, views, meta, triton_lowbit, triton_testing))
    return rows


def measure(precision, method, num_tokens, nbytes, error, triton_testing, fn, config=None) -> dict:
    fn()
    events_us = time_us(fn, triton_testing, cudagraph=False)
    graph_us = time_us(fn, triton_testing, cudagraph=True)
    best_us = min(t for t in (events_us, graph_us) if t is not None)
    row = {
        "precision": precision,
        "method": method,
        "tokens": num_tokens,
        "events_us": events_us,
        "cudagraph_us": graph_us,
        "version_bytes": nbytes,
        # Bytes of the version read per forward over the best time: how close to HBM bandwidth.
        "weight_gb_per_s": nbytes / best_us / 1e3,
        "rel_err_vs_dequantize": error,
        "config": config,
    }
    print(
        f"{precision:5s} {method:24s} T={num_tokens:<3d} events {_fmt(events_us)} us  "
        f"graph {_fmt(graph_us)} us  {row['weight_gb_per_s']:7.1f} GB/s"
        + (f"  err {error:.1e}" if error is not None else "")
        + (f"  {config}" if config else ""),
        flush=True,
    )
    return row


def sweep(precision, num_tokens, x, views, meta, triton_lowbit, triton_testing) -> dict:
    """Best Triton tile config by CUDA-graph time (events time if capture fails)."""
    best = None
    for block_n, block_k, split_k in itertools.product(SWEEP_BLOCK_N, SWEEP_BLOCK_K, SWEEP_SPLIT_K):
        config = triton_lowbit.LowBitConfig(block_n=block_n, block_k=block_k, split_k=split_k)
        try:
            triton_lowbit.expert_forward_lowbit(x, views, meta, config)
        except ValueError:
            continue  # tile does not fit this shape / group size
        fn = partial(triton_lowbit.expert_forward_lowbit, x, views, meta, config)
        elapsed = time_us(fn, triton_testing, cudagraph=True) or time_us(fn, triton_testing, cudagraph=False)
        if best is None or elapsed < best[0]:
            best = (elapsed, config)
    _, config = best
    fn = partial(triton_lowbit.expert_forward_lowbit, x, views, meta, config)
    return measure(precision, "triton best of sweep", num_tokens, meta.nbytes, None, triton_testing, fn,
                   config=dataclasses.asdict(config))  # fmt: skip


def _fmt(value: float | None) -> str:
    return f"{value:8.1f}" if value is not None else "     n/a"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("json_path", help="where to write the results as JSON")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of Triton tile configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_lowbit needs CUDA")
    torch.set_grad_enabled(False)
    import triton.testing

    rows = bench(args, triton.testing)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "rows": rows,
    }
    with open(args.json_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json_path}")


if __name__ == "__main__":
    main()
