"""Measure quantization error of expert weights, for choosing group size, method and parameter dtype.

For an expert of the given shape (default OLMoE: H=2048, I=1024) with synthetic weights, reports per
(weight distribution, bits, group size, method):
  weight_err  relative Frobenius error ||W - W_hat|| / ||W|| over gate_up and down together
  output_err  relative error of the expert output on random inputs x ~ N(0, 1) (T tokens), in fp32,
              against the unquantized expert: the number that matters for model quality
  bits/w      stored bits per weight, scales and offsets included
  quant_s     seconds to quantize one expert (gate_up + down) on this machine
Median over --seeds experts. Writes a JSON list of rows to --json if given.

    python scripts/measure_quant_error.py --json out/quant_error.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moetide.store.quant import (
    PARAM_DTYPE,
    dequantize_matrix,
    nbytes_for,
    quantize,
    swiglu_expert,
)

# Expert weights of trained models have std about 0.02 and heavier tails than a Gaussian; a Student-t
# with 4 degrees of freedom stands in for those outliers (kurtosis infinite at 4, large in practice).
WEIGHT_STD = 0.02


def synthetic_weight(kind: str, shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """(N, K) bf16 weights with std WEIGHT_STD: "gauss" or "student_t4" (heavy-tailed)."""
    if kind == "gauss":
        w = torch.randn(shape, generator=generator)
    elif kind == "student_t4":
        normal = torch.randn(shape, generator=generator)
        chi2 = torch.randn((*shape, 4), generator=generator).square().sum(-1)
        w = normal / (chi2 / 4).sqrt() / 2**0.5  # t4 has variance 2
    else:
        raise ValueError(kind)
    return (w * WEIGHT_STD).to(torch.bfloat16)


def fake_quant(weight: torch.Tensor, bits: int, group_size: int, method: str, param_dtype: torch.dtype):
    """W_hat (N, K) float32. param_dtype other than float16 re-derives RTN codes for params rounded to it."""
    if param_dtype == PARAM_DTYPE:
        q = quantize(weight, bits, group_size, method)
        return dequantize_matrix(q.codes, q.scale, q.offset, torch.float32)
    groups = weight.float().reshape(weight.shape[0], -1, group_size)
    w_min, w_max = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((w_max - w_min) / (2**bits - 1)).clamp_min(1e-8).to(param_dtype).float()
    offset = w_min.to(param_dtype).float()
    codes = torch.round((groups - offset) / scale).clamp(0, 2**bits - 1)
    return (codes * scale + offset).reshape(weight.shape)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm())


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    intermediate, hidden = args.intermediate_size, args.hidden_size
    configs = [(b, g, m, torch.float16) for b in (4, 2) for g in (32, 64, 128) for m in ("rtn", "mse", "hqq")]
    configs += [(b, g, "rtn", torch.bfloat16) for b, g in ((4, 128), (2, 64))]
    for kind in ("gauss", "student_t4"):
        experts = []
        for seed in range(args.seeds):
            gen = torch.Generator().manual_seed(seed)
            gate_up = synthetic_weight(kind, (2 * intermediate, hidden), gen)
            down = synthetic_weight(kind, (hidden, intermediate), gen)
            x = torch.randn(args.tokens, hidden, generator=gen)
            experts.append((gate_up, down, x, swiglu_expert(x, gate_up.float(), down.float())))
        for bits, group_size, method, param_dtype in configs:
            weight_errs, output_errs, seconds = [], [], []
            for gate_up, down, x, reference in experts:
                start = time.perf_counter()
                gu_hat = fake_quant(gate_up, bits, group_size, method, param_dtype)
                dn_hat = fake_quant(down, bits, group_size, method, param_dtype)
                seconds.append(time.perf_counter() - start)
                exact = torch.cat([gate_up.float().flatten(), down.float().flatten()])
                weight_errs.append(relative_error(torch.cat([gu_hat.flatten(), dn_hat.flatten()]), exact))
                output_errs.append(relative_error(swiglu_expert(x, gu_hat, dn_hat), reference))
            nbytes = nbytes_for(f"int{bits}", intermediate, hidden, torch.bfloat16, group_size)
            row = {
                "weights": kind,
                "bits": bits,
                "group_size": group_size,
                "method": method,
                "param_dtype": str(param_dtype).removeprefix("torch."),
                "weight_err": statistics.median(weight_errs),
                "output_err": statistics.median(output_errs),
                "bits_per_weight": nbytes * 8 / (3 * intermediate * hidden),
                "quant_s": statistics.median(seconds),
            }
            rows.append(row)
            print(
                f"{kind:10s} int{bits} g{group_size:<4d} {method:3s} {row['param_dtype']:8s} "
                f"weight_err {row['weight_err']:.4f}  output_err {row['output_err']:.4f}  "
                f"bits/w {row['bits_per_weight']:.3f}  quant_s {row['quant_s']:.2f}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--json", help="write the rows as JSON to this path")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    rows = measure(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
