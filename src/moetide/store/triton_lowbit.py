"""Fused low-bit matmul for few tokens (decode): x (T <= 16, K) @ dequant(W)^T -> (T, N), in Triton.

W (N, K) is stored as in `moetide.store.quant`: packed codes (N, K * bits // 8) uint8, element k of a
row at byte k // (8 // bits), bit (k % (8 // bits)) * bits; per-group float16 scale and offset
(N, K // group_size); W_hat = code * scale + offset. The kernel reads the packed bytes once and
dequantizes in registers, so for small T it moves bits/16 of the bytes a bf16 matmul moves and never
materializes W_hat in memory (which dequantize-then-F.linear does: write and re-read 2 bytes/weight).

Import this module only where triton is installed; `moetide.store.quant` does not import it. On CPU it
runs under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), which the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moetide.store.quant import QuantMeta

MAX_TOKENS = 16  # one tl.dot tile of rows; larger T is compute-bound enough for dequantize + F.linear

# Programs to aim for when choosing split-K: about two waves on an H200 (132 SMs).
TARGET_PROGRAMS = 264


@dataclass(frozen=True)
class LowBitConfig:
    """Tile sizes: block_k must divide the group size (one scale per row per K-tile); split_k splits
    the K loop over programs whose partial sums are added atomically (for small N at T=1)."""

    block_n: int = 32
    block_k: int = 64
    split_k: int = 1


@triton.jit
def _lowbit_matmul_kernel(
    x_ptr,
    packed_ptr,
    scale_ptr,
    offset_ptr,
    out_ptr,
    num_tokens,
    n_rows,
    k_per_split,
    stride_x_t,
    stride_packed_n,
    stride_scale_n,
    stride_out_t,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ATOMIC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """out[t, n] (+)= sum over this program's K range of x[t, k] * (code[n, k] * scale + offset)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.arange(0, BLOCK_T)
    n_mask = offs_n < n_rows
    t_mask = offs_t < num_tokens
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_t[:, None] * stride_x_t + offs_k[None, :], mask=t_mask[:, None], other=0.0)
        # Each byte is loaded once per value it holds; the repeats hit L1, and this keeps the
        # unpacking a shift and a mask per element, the same for int4 and int2.
        byte_ptrs = packed_ptr + offs_n[:, None] * stride_packed_n + (offs_k // PER_BYTE)[None, :]
        packed = tl.load(byte_ptrs, mask=n_mask[:, None], other=0).to(tl.int32)
        codes = (packed >> ((offs_k % PER_BYTE) * BITS)[None, :]) & ((1 << BITS) - 1)
        # BLOCK_K divides GROUP_SIZE: the whole tile lies in one group, one scale per row.
        param_offs = offs_n * stride_scale_n + k0 // GROUP_SIZE
        scale = tl.load(scale_ptr + param_offs, mask=n_mask, other=0.0).to(tl.float32)
        offset = tl.load(offset_ptr + param_offs, mask=n_mask, other=0.0).to(tl.float32)
        # Rounded to x's dtype as the dequantize-then-F.linear reference does.
        w = (codes.to(tl.float32) * scale[:, None] + offset[:, None]).to(x.dtype)  # (BLOCK_N, BLOCK_K)
        if BLOCK_T == 1:
            acc += tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION, out_dtype=tl.float32)
    out_ptrs = out_ptr + offs_t[:, None] * stride_out_t + offs_n[None, :]
    out_mask = t_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=out_mask)
    else:
        tl.store(out_ptrs, acc, mask=out_mask)


def default_config(num_tokens: int, n_rows: int, k: int, group_size: int) -> LowBitConfig:
    """A tile choice from the shape alone: split K until the grid fills about TARGET_PROGRAMS."""
    block_n = 32 if num_tokens == 1 else 64
    block_k = min(group_size, 64)
    split_k = 1
    n_blocks = triton.cdiv(n_rows, block_n)
    while n_blocks * split_k * 2 <= TARGET_PROGRAMS and k % (block_k * split_k * 2) == 0 and split_k < 16:
        split_k *= 2
    return LowBitConfig(block_n=block_n, block_k=block_k, split_k=split_k)


def lowbit_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bits: int,
    group_size: int,
    config: LowBitConfig | None = None,
) -> torch.Tensor:
    """x (T, K) float, T <= MAX_TOKENS; packed (N, K * bits // 8) uint8; scale, offset (N, K // group_size)
    float16 -> (T, N) in x's dtype. Accumulates in float32."""
    num_tokens, k = x.shape
    n_rows = packed.shape[0]
    _check_inputs(x, packed, scale, offset, bits, group_size)
    config = config or default_config(num_tokens, n_rows, k, group_size)
    _check_config(config, k, group_size)
    x = x.contiguous()
    # Without split-K each output is written once, straight in x's dtype (tl.store casts): no fill and
    # no cast kernel, which matters at decode where launches dominate. Split-K adds float32 partials.
    atomic = config.split_k > 1
    if atomic:
        out = torch.zeros(num_tokens, n_rows, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(num_tokens, n_rows, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(n_rows, config.block_n), config.split_k)
    _lowbit_matmul_kernel[grid](
        x, packed, scale, offset, out,
        num_tokens, n_rows, k // config.split_k,
        x.stride(0), packed.stride(0), scale.stride(0), out.stride(0),
        BITS=bits, GROUP_SIZE=group_size, BLOCK_T=1 if num_tokens == 1 else MAX_TOKENS,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, ATOMIC=atomic,
        # float32 inputs would otherwise go through TF32 (10-bit mantissa) on tensor cores.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out.to(x.dtype)


def expert_forward_lowbit(
    x: torch.Tensor, views: dict[str, torch.Tensor], meta: QuantMeta, config: LowBitConfig | None = None
) -> torch.Tensor:
    """Expert output for x (T <= MAX_TOKENS, H) -> (T, H) from a lo version's views, fused kernels only.

    Same result as `quant.expert_forward` up to float32 summation order.
    """
    if not meta.is_low_bit:
        raise ValueError(f"expert_forward_lowbit needs a low-bit version, got {meta.precision}")
    gate_up = lowbit_linear(
        x,
        views["gate_up_packed"],
        views["gate_up_scale"],
        views["gate_up_offset"],
        meta.bits_gate_up,
        meta.group_size_gate_up,
        config,
    )
    gate, up = gate_up.chunk(2, dim=-1)
    return lowbit_linear(
        F.silu(gate) * up,
        views["down_packed"],
        views["down_scale"],
        views["down_offset"],
        meta.bits_down,
        meta.group_size_down,
        config,
    )


def _check_inputs(x, packed, scale, offset, bits, group_size) -> None:
    num_tokens, k = x.shape
    if not 1 <= num_tokens <= MAX_TOKENS:
        raise ValueError(
            f"lowbit_linear takes 1..{MAX_TOKENS} tokens, got {num_tokens}; use dequantize + F.linear"
        )
    if bits not in (2, 4) or packed.dtype != torch.uint8 or packed.shape[1] * (8 // bits) != k:
        raise ValueError(
            f"packed must be uint8 (N, {k * bits // 8}) for int{bits}, got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )
    expected = (packed.shape[0], k // group_size)
    if tuple(scale.shape) != expected or tuple(offset.shape) != expected:
        raise ValueError(
            f"scale and offset must be {expected}, got {tuple(scale.shape)}, {tuple(offset.shape)}"
        )
    if packed.stride(1) != 1 or scale.stride(1) != 1 or offset.stride(0) != scale.stride(0):
        raise ValueError("packed, scale and offset must be row-major with unit stride along K")


def _check_config(config: LowBitConfig, k: int, group_size: int) -> None:
    if group_size % config.block_k or k % (config.block_k * config.split_k):
        raise ValueError(
            f"{config}: block_k must divide group_size={group_size} and block_k * split_k must divide K={k}"
        )
