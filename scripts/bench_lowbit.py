"""Time one layer's lo experts on CUDA per lo kernel (OLMoE-shaped by default: H=2048, I=1024).

Per layer (`layer_rows`): the routed experts of one MoE layer (64 experts, top-8, all lo-resident in a
lo pool) through the engine's own `ExpertRuntime.run_layer`, lo_kernel "dequant" (batched dequantize
of the chosen rows + gathered/grouped bf16 matmul, today's engine path) against "triton" (the grouped
fused kernel, `moetide.compute.lowbit_triton`), T = 1, 4, 8, int4 and int2, on two paths:
"static" (static-int4/int2: every expert at a fixed slot, no host sync where the kernel allows) and
"dynamic" (lo versions inside combined/dynaexq: host sync, acquire, `_compute`).
Times are medians in microseconds from triton.testing.do_bench (CUDA events, L2 flushed between runs,
so weights come from HBM as they would for an expert not touched recently) and, where the path has
no host sync, do_bench_cudagraph (launch overhead removed: the GPU time alone). `--sweep` also times a
grid of tile configs of the grouped kernel and reports the best. Prints tables and writes JSON to
the given path after each part.

    python scripts/bench_lowbit.py out/bench_lowbit.json [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from moetide.store.quant import dequantize, pack_expert

PRECISIONS = ("int4", "int2")
LAYER_TOKENS = (1, 4, 8)
LAYER_PATHS = ("static", "dynamic")
LO_KERNELS = ("dequant", "triton")
SWEEP_GROUPED_BLOCK_N = (16, 32, 64, 128)
SWEEP_GROUPED_WARPS = (2, 4, 8)


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


class LoPoolLayer:
    """One layer's experts, all lo-resident at slot e of a lo pool `arena (E, nbytes)`, seen through the
    residency interface `ExpertRuntime` uses. static: `static_lo_rows` answers (static-int4/int2);
    else every step acquires the experts and runs `_compute` (lo versions of combined/dynaexq)."""

    def __init__(self, arena: torch.Tensor, meta, static: bool):
        self.arena, self.meta, self.static = arena, meta, static

    def static_hi_groups(self, layer):
        return None

    def static_lo_rows(self, layer):
        return (0, self.arena, self.meta) if self.static else None

    def hi_pool_groups(self):
        return None

    def lo_pool_rows(self):
        return self.arena, self.meta

    def acquire(self, layer, experts, device):
        version = SimpleNamespace(pool="lo", precision=self.meta.precision)
        return {e: SimpleNamespace(**vars(version), slot=e) for e in experts}, []

    def release(self, layer, experts):
        pass


def lo_pool(precision: str, args, device: str) -> tuple[torch.Tensor, object]:
    """`(arena (E, nbytes) uint8, meta)`: E distinct rows (the values do not change the time, so one
    random expert is quantized and its row repeated; distinct addresses all the same)."""
    hidden, intermediate = args.hidden_size, args.intermediate_size
    generator = torch.Generator(device=device).manual_seed(1)
    gate_up = torch.randn(2 * intermediate, hidden, device=device, generator=generator).mul_(0.02).bfloat16()
    down = torch.randn(hidden, intermediate, device=device, generator=generator).mul_(0.02).bfloat16()
    buffer, meta = pack_expert(gate_up, down, precision, quant_method="rtn")
    return buffer.unsqueeze(0).repeat(args.num_experts, 1), meta


def routing(num_tokens: int, args, device: str, seed: int):
    """`(top_k_index (T, k), top_k_weights (T, k) float32)`: distinct experts per token, softmax weights."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.randperm(args.num_experts, generator=generator)[: args.top_k] for _ in range(num_tokens)]
    )
    weights = torch.softmax(torch.randn(num_tokens, args.top_k, generator=generator), dim=-1)
    return ids.to(device), weights.to(device)


def layer_cases(args: argparse.Namespace, device: str):
    """Every (precision, T) case of the layer benches: `(precision, arena, meta, T, ids, weights, x)`,
    one lo pool per precision, routing and activations seeded by T."""
    for precision in PRECISIONS:
        arena, meta = lo_pool(precision, args, device)
        for num_tokens in LAYER_TOKENS:
            ids, weights = routing(num_tokens, args, device, seed=num_tokens)
            x = torch.randn(num_tokens, args.hidden_size, device=device).bfloat16()
            yield precision, arena, meta, num_tokens, ids, weights, x


def bench_layer(args: argparse.Namespace, triton_testing, device: str = "cuda") -> list[dict]:
    """Per-layer time of the routed lo experts through `ExpertRuntime.run_layer`, per lo kernel."""
    from moetide.compute.runtime import ExpertRuntime
    from moetide.residency.metrics import ExpertMetrics

    rows = []
    for precision, arena, meta, num_tokens, ids, weights, x in layer_cases(args, device):
        for path in LAYER_PATHS:
            outputs = {}
            for lo_kernel in LO_KERNELS:
                runtime = ExpertRuntime(
                    LoPoolLayer(arena, meta, path == "static"),
                    ExpertMetrics(1), F.silu, args.num_experts, args.top_k,
                )  # fmt: skip
                runtime.set_lo_kernel(lo_kernel, torch.device(device))
                fn = partial(runtime.run_layer, 0, x, ids, weights)
                outputs[lo_kernel] = fn()
                # the host sync of the dynamic path (and of static dequant at T > 1) cannot be captured
                graphable = path == "static" and (lo_kernel == "triton" or num_tokens == 1)
                rows.append(measure_layer(precision, num_tokens, path, lo_kernel, fn, triton_testing,
                                          graphable, outputs))  # fmt: skip
    return rows


def measure_layer(precision, num_tokens, path, lo_kernel, fn, triton_testing, graphable, outputs) -> dict:
    events_us = time_us(fn, triton_testing, cudagraph=False)
    graph_us = time_us(fn, triton_testing, cudagraph=True) if graphable else None
    error = relative_error(outputs[lo_kernel], outputs["dequant"]) if lo_kernel != "dequant" else None
    row = {
        "precision": precision,
        "tokens": num_tokens,
        "path": path,
        "lo_kernel": lo_kernel,
        "events_us": events_us,
        "cudagraph_us": graph_us,
        "rel_err_vs_dequant": error,
    }
    print(
        f"layer {precision:5s} T={num_tokens:<2d} {path:8s} {lo_kernel:8s} events {_fmt(events_us)} us  "
        f"graph {_fmt(graph_us)} us" + (f"  err {error:.1e}" if error is not None else ""),
        flush=True,
    )
    return row


def sweep_grouped(args: argparse.Namespace, triton_testing, device: str = "cuda") -> list[dict]:
    """Best `GroupedConfig` of the grouped kernel per (precision, T), called directly, CUDA-graph time."""
    from moetide.compute import lowbit_triton

    rows = []
    for precision, arena, meta, num_tokens, ids, weights, x in layer_cases(args, device):
        pair_slot, pair_index = lowbit_triton.topk_pairs(ids)
        results = []
        for block_n, num_warps in itertools.product(SWEEP_GROUPED_BLOCK_N, SWEEP_GROUPED_WARPS):
            config = lowbit_triton.GroupedConfig(block_n=block_n, num_warps=num_warps)
            fn = partial(lowbit_triton.grouped_lowbit_moe, x, weights, pair_slot, pair_index, arena, meta,
                         config=config)  # fmt: skip
            fn()
            graph_us = time_us(fn, triton_testing, cudagraph=True)
            results.append((graph_us if graph_us is not None else float("inf"), dataclasses.asdict(config)))
        best_us, best = min(results, key=lambda r: r[0])
        default_us = next(t for t, c in results if c == dataclasses.asdict(lowbit_triton.GroupedConfig()))
        rows.append({"precision": precision, "tokens": num_tokens, "best_cudagraph_us": best_us,
                     "best_config": best, "default_cudagraph_us": default_us})  # fmt: skip
        print(f"grouped sweep {precision:5s} T={num_tokens:<2d} best {best_us:8.1f} us {best}  "
              f"default {default_us:8.1f} us", flush=True)  # fmt: skip
    return rows


def _fmt(value: float | None) -> str:
    return f"{value:8.1f}" if value is not None else "     n/a"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("json_path", help="where to write the results as JSON")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--num-experts", type=int, default=64, help="experts of the layer (lo pool rows)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of Triton tile configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_lowbit needs CUDA")
    torch.set_grad_enabled(False)
    import triton.testing

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_experts": args.num_experts,
        "top_k": args.top_k,
    }
    parts = [("layer_rows", bench_layer)]  # the A/B first: it is what a short run must not lose
    if args.sweep:
        parts.append(("grouped_sweep", sweep_grouped))
    for key, run in parts:
        result[key] = run(args, triton.testing)
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json_path} ({key})", flush=True)


if __name__ == "__main__":
    main()
