"""Decode attention read straight from the paged KV pool (Triton): no gather of the rows' blocks.

Measured against the gather + SDPA path of `paged_cache.py` (one layer, CUDA graph
replay, `scripts/bench_attention.py`, BENCHMARKS.md): OLMoE's 16/16/128 heads at 32 rows of 512
tokens 57 µs against 133 µs, 64 rows of 2,048 tokens 268 against 837; Qwen3-30B-A3B's GQA 32/4 at
32 x 2,048 60 µs against 1,825. The work follows each row's length, not the batch's widest table, so
a captured decode step serves any lengths up to its table width.

Shapes: B rows, one query token each; Hq query heads, Hkv key/value heads (Hq % Hkv == 0), D head
dim (a power of two), W blocks per row, bs tokens per block.

    query         (B, Hq, D)        any strides (the last contiguous)
    keys, values  (slots, Hkv, D)   one layer's pool; slot = block * bs + offset in the block
    block_tables  (B, W) int64      each row's blocks in token order
    lengths       (B,) int32/int64  tokens each row attends to: positions 0 .. length - 1
    out           (B, Hq, D)        query's dtype

Grid (B, Hkv, S): a program takes every query head of one kv head (one `tl.dot` over the group,
padded to 16 rows) over one of S splits of the row's tokens, 64 tokens (4 blocks) per step, with an
online softmax in float32. With S > 1 the splits' unnormalized partials are combined by a second
kernel. S depends on static shapes only (B, Hkv, W), so a graph captured once stays valid; splits
past a row's length do nothing.

Import this module only where triton is installed; on CPU it runs under Triton's interpreter
(TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
TOKENS_PER_STEP = 64  # keys per inner step of a program (4 blocks of 16)
MAX_SPLITS = 64

# Triton's interpreter computes tl.dot of bf16 operands wrongly (see compute/fused_moe.py): widen them.
_WIDEN_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if _WIDEN_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, length_ptr, out_ptr, part_acc_ptr, part_stats_ptr,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_tb, stride_ob, stride_oh,
    tokens_per_split, qk_scale,
    HQ: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """One (row, kv head, split): softmax(q K^T * scale) V over the split's tokens of the row."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(length_ptr + row).to(tl.int32)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    head = kv_head * GROUP + g
    head_mask = g < GROUP
    q_ptrs = q_ptr + row * stride_qb + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None], other=0.0)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, length)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        token = t0 + n
        valid = token < end
        block = tl.load(table_ptr + row * stride_tb + token // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + token % BLOCK_SIZE
        k = tl.load(k_ptr + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=valid[:, None],
                    other=0.0)  # fmt: skip
        s = _dot(q, tl.trans(k), IEEE) * qk_scale  # (GROUP_PAD, BLOCK_N), log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=valid[:, None],
                    other=0.0)  # fmt: skip
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    if SPLITS == 1:
        o_ptrs = out_ptr + row * stride_ob + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
    else:  # unnormalized partials (B, Hq, S, D) and (B, Hq, S, 2): running max and sum (log2 units)
        part = (row * HQ + head) * SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=head_mask[:, None])
        tl.store(part_stats_ptr + part * 2, m_i, mask=head_mask)
        tl.store(part_stats_ptr + part * 2 + 1, l_i, mask=head_mask)


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr, part_stats_ptr, out_ptr, stride_ob, stride_oh,
    HQ: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """out[row, head] = the splits' partials rescaled to one max and normalized; empty splits weigh 0."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D)
    s_mask = s < SPLITS
    part = (row * HQ + head) * SPLITS + s
    m = tl.load(part_stats_ptr + part * 2, mask=s_mask, other=float("-inf"))
    total = tl.load(part_stats_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    weight = tl.where(total > 0, tl.exp2(m - tl.max(m, 0)), 0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(total * weight, 0)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def supports(query_heads: int, kv_heads: int, head_dim: int, value_dim: int) -> bool:
    """Whether the kernel takes an attention of these heads: grouped query heads, one power-of-two
    head dim for keys and values."""
    return (
        kv_heads > 0
        and query_heads % kv_heads == 0
        and head_dim == value_dim
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )


def num_splits(rows: int, kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Splits of each row's tokens: enough programs for two per SM (static shapes only)."""
    programs = 4
    if device.type == "cuda":
        programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-programs // (rows * kv_heads)), -(-max_tokens // TOKENS_PER_STEP), MAX_SPLITS))


def paged_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    block_size: int,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per row over its paged keys and values -> `(B, Hq, D)` (shapes
    in the module docstring). No host sync; capturable in a CUDA graph. `splits`: of each row's
    tokens, None = `num_splits` (1: no combine kernel)."""
    rows, query_heads, dim = query.shape
    kv_heads = keys.shape[1]
    if not supports(query_heads, kv_heads, dim, values.shape[-1]):
        raise ValueError(f"paged decode attention takes Hq % Hkv == 0 and one power-of-two head dim; got "
                         f"{query_heads}/{kv_heads} heads, dims {dim}/{values.shape[-1]}")  # fmt: skip
    if query.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("paged decode attention needs contiguous head dims")
    max_tokens = block_tables.shape[1] * block_size
    splits = splits or num_splits(rows, kv_heads, max_tokens, query.device)
    per_split = -(-(-(-max_tokens // splits)) // TOKENS_PER_STEP) * TOKENS_PER_STEP
    splits = -(-max_tokens // per_split)
    out = torch.empty(rows, query_heads, dim, dtype=query.dtype, device=query.device)
    if splits > 1:
        part_acc = torch.empty(rows, query_heads, splits, dim, dtype=torch.float32, device=query.device)
        part_stats = torch.empty(rows, query_heads, splits, 2, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_stats = out  # not read
    group = query_heads // kv_heads
    _paged_decode_kernel[(rows, kv_heads, splits)](
        query, keys, values, block_tables, lengths, out, part_acc, part_stats,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        per_split, float(scaling) * LOG2_E,
        HQ=query_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=dim,
        BLOCK_SIZE=block_size, BLOCK_N=TOKENS_PER_STEP, SPLITS=splits, IEEE=query.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    if splits > 1:
        _combine_splits_kernel[(rows, query_heads)](
            part_acc, part_stats, out, out.stride(0), out.stride(1),
            HQ=query_heads, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), D=dim,
        )  # fmt: skip
    return out


@torch.library.custom_op("moetide::paged_decode_attention", mutates_args=())
def paged_decode_attention_op(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    block_size: int,
) -> torch.Tensor:
    """`paged_decode_attention` as an operator (`torch.ops.moetide.paged_decode_attention`): opaque to
    `torch.compile`, so a compiled decode step attends straight from the pools, its kernels launched
    where the compiled graph reaches the operator (no graph break: Inductor still fuses the work on
    either side). `(B, Hq, D)`, a new tensor."""
    return paged_decode_attention(query, keys, values, block_tables, lengths, scaling, block_size)


@paged_decode_attention_op.register_fake
def _paged_decode_attention_fake(query, keys, values, block_tables, lengths, scaling, block_size):
    return query.new_empty(query.shape[0], query.shape[1], values.shape[-1])
