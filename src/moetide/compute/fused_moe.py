"""One fused MoE path for any number of tokens and every precision a slot can hold (Triton).

Shapes: T tokens, k experts per token, P = T*k (token, expert) pairs, E experts of the layer,
H hidden, I expert intermediate.
    hidden        (T, H)   bf16 / fp16 / fp32 activations
    topk_ids      (T, k)   int64 expert ids chosen by the router
    topk_weights  (T, k)   routing weights, any float dtype
    pool_of       (E,)     int32, the pool holding each expert's version to run, -1 = none
    slot_of       (P, E)   int32, its row in each pool's arena (or (E,): the same row whatever the
                           pool; see `slot_table`)

Stages (all on the device, no host sync; capturable in a CUDA graph for a fixed T):
  align     pairs sorted by expert into blocks of BLOCK_M rows, each block one expert, by one
            program per expert (`align_pairs`, a counting sort). At BLOCK_M == 1 (GEMV tiles), and
            for any tiles at T <= GEMV_MAX_TOKENS, every pair is its own block and the kernels read
            the router's ids as they are. Where the lo pool runs on the tensor-core kernels
            (`lo_cuda`) at a T whose tiles have wider blocks than those take, every pool's blocks are
            cut to `lo_cuda.WIDE_BLOCK_M` rows (`_layer_blocks`).
  gate_up   per pool, grid (blocks, cdiv(I, BLOCK_N)): h = silu(x @ Wg^T) * (x @ Wu^T) into a
            (padded pairs, I) scratch. Blocks whose expert lives in another pool exit at once.
  down      per pool, grid (blocks, cdiv(H, BLOCK_N)): y[pair] = w[pair] * (h @ Wd^T), float32.
  one launch  (GEMV tiles with `KernelConfig.split_i`, up to FUSED_MAX_TOKENS tokens) gate_up and
            down in one launch per pool, grid (P, I / split_i), one float32 row of y per (pair,
            slice) (`_fused_gemv_kernel`); the slices of every pool of a layer are the lead pool's.
  reduce    out[t] = sum_j y[t * k + j] (and over the slices) in float32 over the pairs whose
            expert has a version, cast to the activations' dtype (`_reduce_kernel`): deterministic,
            no atomics. A pool on the tensor-core kernels beside one-launch pools stores each pair's
            whole sum in slice 0 of its rows (`ONE_SLICE`).

Weights come straight from the pool rows: dense tiles as they are; packed int4 / int2 tiles as whole
bytes (or int32 words), unpacked in registers. A K-step (BLOCK_K) may span several groups of a packed
matrix; it is computed as products of SUB_K <= the group size (`k_tiles`), one float16 scale s and
offset o per output column and product. The tile product of packed matrices is the tile table's
(`KernelConfig.packed_tile`, tuned per (T bucket, format) by `scripts/tune_fused_moe.py`) or the
caller's (`fused_moe(packed_tile=...)`):
  v1   weights dequantized in float32 (c * s + o), rounded to the activation dtype, each bit field
       dotted with its strided slice of the activations (`_tile_product`): the reference's rounding.
  v3   s and o factored out of the dot, a . w = s (a . c) + o sum(a); the codes become bf16 / fp16
       operands by ORing them into a mantissa (`_codes`), the activation tile loaded once per K-step
       and split into its bit-field slices in registers (`_packed_product`).
  v4   as v3, two codes per mask and OR from int32 words (`_paired_product`); bf16 / fp16 only.
  v5   as v4, computing W_tile @ a^T (the codes as the MMA's first operand). At GEMV tiles v4 and v5
       are v3.
  v6   GEMV tiles: each code set into the mantissa of 1.0 and multiplied with its activation scaled
       to match, partial sums reduced once after the K loop (`_gemv_words`). Dot tiles: v5.
  v7   GEMV tiles: v6's codes over a whole K-step of several groups as one tile (`_gemv_groups`).
       Dot tiles: v5.
v3 to v7 round no weight: their results differ from the reference by that rounding (~2^-9 relative
per weight for bf16 activations, none for float32). gate_up and down each carry their own format, so
one expert version may hold int2 gate_up with int4 down; mixed precision inside a layer costs one
launch pair per pool over the same sorted blocks.

Import this module only where triton is installed; on CPU it runs under Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported), which the tests use.
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import lru_cache

import torch
import triton
import triton.language as tl

from ..residency.slot_table import MatrixFormat, Pool, PoolFormat
from . import lo_cuda
from .fused_moe_config import (
    FUSED_MAX_TOKENS,
    GEMV_MAX_TOKENS,
    MIN_SPLIT_I,
    KernelConfig,
    config_for,
    t_bucket,
)

# The packed tile products (see above), name -> the kernels' PACKED constexpr (0: a dense matrix; the
# kernels compare these numbers, e.g. PACKED >= 6 for v5 and later).
PACKED_TILES = {"v1": 1, "v3": 4, "v4": 5, "v5": 6, "v6": 7, "v7": 8}
_GDC = dict(USE_GDC=True, launch_pdl=True)  # a launch's arguments as a programmatic dependent


@triton.jit
def _tile_product(
    a_ptr,
    a_rows,
    stride_a,
    a_mask,
    data_ptr,
    param_ptr,
    row,
    row_data,
    row_param,
    data_off,
    scale_off,
    offset_off,
    offs_n,
    n_mask,
    k0,
    K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """a[a_rows, k0 : k0 + BLOCK_K] @ W[offs_n, k0 : k0 + BLOCK_K]^T -> (BLOCK_M, BLOCK_N) float32,
    W (N, K) being one matrix of pool row `row`.

    Dense (BITS >= 8): W row-major at `data_off` elements. Packed: codes row-major at `data_off`
    bytes, K // (8 // BITS) bytes per row, element k at bits (k % per_byte) * BITS of byte
    k // per_byte; float16 scale/offset (N, K // GROUP) at `scale_off` / `offset_off` elements.
    A packed tile is loaded as whole bytes (contiguous along K, so the loads are wide) and never
    interleaved back into K order: field f of every byte holds the elements k0 + j * per_byte + f,
    so it is dotted with that strided slice of `a` (int4: two dots per tile, int2: four). The tile
    lies inside one group (GROUP % BLOCK_K == 0): one scale and offset per column. Dequantized
    weights are rounded to a's dtype before the dot, as the reference's weights are (packed tile
    product v1; v3: `_packed_product`)."""
    dtype = a_ptr.dtype.element_ty
    if BITS >= 8:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + offs_k[None, :], mask=a_mask[:, None] & k_mask[None, :],
                    other=0.0)  # fmt: skip
        w_ptrs = data_ptr + row * row_data + data_off + offs_n[None, :] * K + offs_k[:, None]
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        return _mm(a, w.to(dtype), BLOCK_M, DOT_PRECISION)
    else:
        PER_BYTE: tl.constexpr = 8 // BITS
        packed, scale, offset, offs_b, b_mask = _packed_tile(
            data_ptr, param_ptr, row, row_data, row_param, data_off, scale_off, offset_off, offs_n, n_mask, k0, K,
            BITS, GROUP, BLOCK_K)  # fmt: skip
        acc = tl.zeros((BLOCK_M, offs_n.shape[0]), dtype=tl.float32)
        for f in tl.static_range(PER_BYTE):
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + (offs_b * PER_BYTE + f)[None, :],
                        mask=a_mask[:, None] & b_mask[None, :], other=0.0)  # fmt: skip
            codes = ((packed >> (f * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
            acc += _mm(a, (codes * scale[None, :] + offset[None, :]).to(dtype), BLOCK_M, DOT_PRECISION)
        return acc


@triton.jit
def _packed_tile(data_ptr, param_ptr, row, row_data, row_param, data_off, scale_off, offset_off, offs_n, n_mask,
                 k0, K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The K-tile k0 .. k0 + BLOCK_K of a packed W (layout in `_tile_product`): its codes as whole
    bytes (BLOCK_K // per_byte, N) int32, the group's float16 scale and offset (N,) float32, the
    bytes' offsets along the row and their mask."""
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_K: tl.constexpr = BLOCK_K // PER_BYTE
    ROW_BYTES: tl.constexpr = K // PER_BYTE
    offs_b = k0 // PER_BYTE + tl.arange(0, BYTES_K)
    b_mask = offs_b < ROW_BYTES
    w_ptrs = data_ptr + row * row_data + data_off + offs_n[None, :] * ROW_BYTES + offs_b[:, None]
    packed = tl.load(w_ptrs, mask=b_mask[:, None] & n_mask[None, :], other=0).to(tl.int32)
    params = param_ptr + row * row_param + offs_n * (K // GROUP) + k0 // GROUP
    scale = tl.load(params + scale_off, mask=n_mask, other=0.0).to(tl.float32)
    offset = tl.load(params + offset_off, mask=n_mask, other=0.0).to(tl.float32)
    return packed, scale, offset, offs_b, b_mask


@triton.jit
def _act_tile(a_ptr, a_rows, stride_a, a_mask, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """a[a_rows, k0 : k0 + BLOCK_K] (zeros past K), contiguous along K, and its row sums in float32
    (BLOCK_M, 1): what the factored packed products (`_packed_product`) of one K-tile share."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + offs_k[None, :]
    a = tl.load(a_ptrs, mask=a_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    return a, tl.sum(a.to(tl.float32), axis=1)[:, None]


@triton.jit
def _packed_product(
    a,
    a_sum,
    data_ptr,
    param_ptr,
    row,
    row_data,
    row_param,
    data_off,
    scale_off,
    offset_off,
    offs_n,
    n_mask,
    k0,
    K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """`_tile_product` of a packed W with the group's scale s and offset o factored out of the dot
    (v3): a (BLOCK_M, BLOCK_K) and a_sum its row sums (`_act_tile`); inside the tile's group
    w[k, n] = s[n] * c[k, n] + o[n], so a @ w = s * (a @ c) + o * sum(a).

    The codes c become operands of a's dtype without an int-to-float conversion (`_codes`; float32
    for the GEMV tiles, which multiply in float32). a is split into its per_byte strided field slices
    in registers (field f of byte j multiplies element j * per_byte + f) and each is dotted with its
    field of the bytes.

    Numerics: the weights are never rounded (the reference rounds the dequantized weights to a's
    dtype before its matmul, as v1 does); a . c is exact products summed in float32, and the float16
    scale and offset are applied in float32 after the dot."""
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_K: tl.constexpr = BLOCK_K // PER_BYTE
    MASK: tl.constexpr = (1 << BITS) - 1
    packed, scale, offset, _offs_b, _b_mask = _packed_tile(
        data_ptr, param_ptr, row, row_data, row_param, data_off, scale_off, offset_off, offs_n, n_mask, k0, K, BITS,
        GROUP, BLOCK_K)  # fmt: skip
    # the interpreter's dots widen to float32 (`_WIDEN_DOT`) and its bf16 arithmetic is wrong: there the
    # codes go to float32, except float16 ones (bf16 codes are checked on CUDA)
    cdtype = a.dtype if BLOCK_M > 1 and (not _WIDEN_DOT or a.dtype == tl.float16) else tl.float32
    tl.static_assert(BITS == 4 or BITS == 2, "packed codes are int4 or int2")
    if BITS == 4:  # element 2j + f is [j, f]
        a0, a1 = tl.split(tl.reshape(a, (BLOCK_M, BYTES_K, 2)))
        dot = _mm(a0, _codes(packed & MASK, cdtype), BLOCK_M, DOT_PRECISION)
        dot += _mm(a1, _codes((packed >> 4) & MASK, cdtype), BLOCK_M, DOT_PRECISION)
    else:  # element 4j + 2p + q is [j, p, q]: field f = 2p + q
        even, odd = tl.split(tl.reshape(a, (BLOCK_M, BYTES_K, 2, 2)))
        a0, a2 = tl.split(even)
        a1, a3 = tl.split(odd)
        dot = _mm(a0, _codes(packed & MASK, cdtype), BLOCK_M, DOT_PRECISION)
        dot += _mm(a1, _codes((packed >> 2) & MASK, cdtype), BLOCK_M, DOT_PRECISION)
        dot += _mm(a2, _codes((packed >> 4) & MASK, cdtype), BLOCK_M, DOT_PRECISION)
        dot += _mm(a3, _codes((packed >> 6) & MASK, cdtype), BLOCK_M, DOT_PRECISION)
    return dot * scale[None, :] + a_sum * offset[None, :]


@triton.jit
def _paired_product(a_ptr, a_rows, stride_a, a_mask, word_ptr, param_ptr, row, row_words, row_param, word_off,
                    scale_off, offset_off, offs_n, n_mask, k0, K: tl.constexpr, BITS: tl.constexpr,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):  # fmt: skip
    """`_packed_product` with two codes per integer op (v4, v5): (BLOCK_M, BLOCK_N) float32, or its
    transpose (BLOCK_N, BLOCK_M) when SWAP.

    The packed W is read as int32 words (`word_ptr`: the arena as int32, offsets in words), a word
    holding 32 // BITS consecutive codes of one column. One shift and one mask take field c of the
    word's bytes 0 and 2 (c < per_byte) or 1 and 3 at once, into the low and high halves; ORed into
    the mantissa of 128 (bf16; fp16: 1024) each half is the bf16 of 128 + code, with no conversion
    and no subtraction: the constant is folded into the offset, s (a . (c + 128)) + (o - 128 s) sum(a).
    Field c of word j, half h, is element k = j * W + h * W / 2 + c (W = codes per word); the halves
    are joined along the column (index 2j + h) and dotted with that strided slice of a, loaded from
    memory per field. SWAP (v5) computes W_tile @ a^T, so that the unpacked codes are the
    instruction's first operand (kept in registers) and the few token rows its narrow second one.
    bf16 / fp16 activations only (`_paired_codes`)."""
    WORD: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = WORD // 2
    PER_BYTE: tl.constexpr = 8 // BITS
    WORDS_K: tl.constexpr = BLOCK_K // WORD
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    dtype = a_ptr.dtype.element_ty
    BF16: tl.constexpr = dtype == tl.bfloat16
    tl.static_assert(BF16 or dtype == tl.float16, "v4 / v5 take bf16 or fp16 activations (`_paired_codes`)")
    offs_w = k0 // WORD + tl.arange(0, WORDS_K)
    w_ptrs = word_ptr + row * row_words + word_off + offs_n[:, None] * (K // WORD) + offs_w[None, :]
    words = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_w < K // WORD)[None, :], other=0)  # (BLOCK_N, WORDS_K)
    params = param_ptr + row * row_param + offs_n * (K // GROUP) + k0 // GROUP
    scale = tl.load(params + scale_off, mask=n_mask, other=0.0).to(tl.float32)
    offset = tl.load(params + offset_off, mask=n_mask, other=0.0).to(tl.float32)
    m = tl.arange(0, 2 * WORDS_K)
    k_of_m = k0 + (m // 2) * WORD + (m % 2) * HALF  # element of field 0 at joined index m
    acc = _accumulator(BLOCK_M, BLOCK_N, SWAP)
    a_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for c in tl.static_range(HALF):
        w_t = _code_pairs(words >> (8 * (c // PER_BYTE) + BITS * (c % PER_BYTE)), BITS, BF16)  # [n, 2j + h]
        k = k_of_m + c
        if SWAP:
            a_t = tl.load(a_ptr + a_rows[None, :] * stride_a + k[:, None],
                          mask=a_mask[None, :] & (k < K)[:, None], other=0.0)  # fmt: skip
            acc += _mm(w_t, a_t, BLOCK_N, DOT_PRECISION)
            a_sum += tl.sum(a_t.to(tl.float32), axis=0)
        else:
            a_c = tl.load(a_ptr + a_rows[:, None] * stride_a + k[None, :],
                          mask=a_mask[:, None] & (k < K)[None, :], other=0.0)  # fmt: skip
            acc += _mm(a_c, tl.trans(w_t), BLOCK_M, DOT_PRECISION)
            a_sum += tl.sum(a_c.to(tl.float32), axis=1)
    if BF16:
        offset = offset - 128.0 * scale
    else:
        offset = offset - 1024.0 * scale
    if SWAP:
        return acc * scale[:, None] + offset[:, None] * a_sum[None, :]
    else:
        return acc * scale[None, :] + a_sum[:, None] * offset[None, :]


@triton.jit
def _gemv_words(a_ptr, a_rows, stride_a, a_mask, word_ptr, param_ptr, row, row_words, row_param, word_off,
                scale_off, offset_off, offs_n, n_mask, second_n, k0, K: tl.constexpr, BITS: tl.constexpr,
                GROUP: tl.constexpr, SUB_K: tl.constexpr, TWO: tl.constexpr):  # fmt: skip
    """The GEMV tiles of v6: a[a_rows, k0 : k0 + SUB_K] . W[offs_n, same]^T (one group of a packed W,
    a_rows one row) as (SUB_K // codes per word, BLOCK_N) float32 partial sums, whose column sums are
    the product: the kernel accumulates them elementwise over the whole K loop and reduces once.
    TWO (gate and up): the columns offs_n + second_n too, from the same activations -> (first,
    second); else (first, first).

    The tile is read as int32 words (as in `_paired_product`), word j holding codes j * W .. j * W + W - 1
    (W = 32 // BITS), code c at bits c * BITS; the codes are multiplied by `_mantissa_dot`. The
    group's scale s and offset o: a . w = s (a' . m - sum a') + o sum a."""
    WORD: tl.constexpr = 32 // BITS
    WORDS_K: tl.constexpr = SUB_K // WORD
    offs_w = k0 // WORD + tl.arange(0, WORDS_K)
    w_ptrs = word_ptr + row * row_words + word_off + offs_n[None, :] * (K // WORD) + offs_w[:, None]
    words = tl.load(w_ptrs, mask=n_mask[None, :], other=0)  # (WORDS_K, BLOCK_N)
    words2 = words
    if TWO:
        words2 = tl.load(w_ptrs + second_n * (K // WORD), mask=n_mask[None, :], other=0)
    a_base = a_ptr + a_rows[None, :] * stride_a + (offs_w * WORD)[:, None]  # (WORDS_K, 1)
    dot, dot2, a_scaled, a_plain = _mantissa_dot(words, words2, a_base, a_mask[None, :], BITS, TWO)
    params = (param_ptr + row * row_param + offs_n * (K // GROUP) + k0 // GROUP)[None, :]
    first = _group_params(dot - a_scaled, a_plain, params, scale_off, offset_off, n_mask[None, :])
    second = first
    if TWO:
        second = _group_params(dot2 - a_scaled, a_plain, params + second_n * (K // GROUP), scale_off, offset_off,
                               n_mask[None, :])  # fmt: skip
    return first, second


@triton.jit
def _group_params(codes, plain, params, scale_off, offset_off, mask):
    """s * codes + o * plain, the group's float16 scale s and offset o loaded at `params` (masked by
    `mask`, broadcast against codes): a . w of v6's and v7's products, codes = a' . m - sum a' and
    plain = sum a."""
    scale = tl.load(params + scale_off, mask=mask, other=0.0).to(tl.float32)
    offset = tl.load(params + offset_off, mask=mask, other=0.0).to(tl.float32)
    return codes * scale + plain * offset


@triton.jit
def _gemv_groups(a_ptr, a_rows, stride_a, a_mask, word_ptr, param_ptr, row, row_words, row_param, word_off,
                 scale_off, offset_off, offs_n, n_mask, second_n, k0, K: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, STEP_K: tl.constexpr, TWO: tl.constexpr):  # fmt: skip
    """The GEMV tiles of v7: a[a_rows, k0 : k0 + STEP_K] . W[offs_n, same]^T -> (1, BLOCK_N) float32, a
    whole K-step of G groups (or of one part of a group) at once, a_rows one row; TWO as in
    `_gemv_words`.

    The step's words are one (BLOCK_N, G, words per group) tile, contiguous along its last two
    dimensions (wide loads, every word of the step in flight together), multiplied by `_mantissa_dot`
    with activations of shape (1, G, words per group), loaded and scaled once for the rows a thread
    holds. The group sums then take each row's scales and offsets (BLOCK_N, G) and are summed over
    the step."""
    WORD: tl.constexpr = 32 // BITS
    SPAN: tl.constexpr = min(STEP_K, GROUP)  # codes of one group inside the step
    G: tl.constexpr = STEP_K // SPAN
    WPG: tl.constexpr = SPAN // WORD
    groups = tl.arange(0, G)
    word_k = k0 // WORD + groups[:, None] * WPG + tl.arange(0, WPG)[None, :]  # (G, WPG) words of the row
    w_ptrs = word_ptr + row * row_words + word_off + offs_n[:, None, None] * (K // WORD) + word_k[None, :, :]
    words = tl.load(w_ptrs, mask=n_mask[:, None, None], other=0)  # (BLOCK_N, G, WPG)
    words2 = words
    if TWO:
        words2 = tl.load(w_ptrs + second_n * (K // WORD), mask=n_mask[:, None, None], other=0)
    a_base = a_ptr + a_rows[:, None, None] * stride_a + (word_k * WORD)[None, :, :]  # (1, G, WPG)
    dot, dot2, a_scaled, a_plain = _mantissa_dot(words, words2, a_base, a_mask[:, None, None], BITS, TWO)
    scaled, plain = tl.sum(a_scaled, axis=2), tl.sum(a_plain, axis=2)  # (1, G)
    params = param_ptr + row * row_param + offs_n[:, None] * (K // GROUP) + ((k0 + groups * SPAN) // GROUP)[None, :]
    first = _group_params(tl.sum(dot, axis=2) - scaled, plain, params, scale_off, offset_off, n_mask[:, None])
    second = first
    if TWO:
        second = _group_params(tl.sum(dot2, axis=2) - scaled, plain, params + second_n * (K // GROUP), scale_off,
                               offset_off, n_mask[:, None])  # fmt: skip
    return tl.sum(first, axis=1)[None, :], tl.sum(second, axis=1)[None, :]  # (BLOCK_N, G) summed over the step


@triton.jit
def _mantissa_dot(words, words2, a_base, a_ok, BITS: tl.constexpr, TWO: tl.constexpr):
    """sum over the codes of each int32 word of a' m, as float32 partial sums of words' shape (and of
    words2's, TWO: both from the same activations, loaded and scaled once), and the activations' own
    sums a' and a (the shape of `a_base`, which broadcasts against words): code c of a word (bits
    c * BITS) multiplies the activation at `a_base + c` (masked by `a_ok`).

    A code is set into the mantissa of 1.0 at bit p by one mask and OR (int2: two codes per shift, at
    p = 19 and 21; int4: one, at p = 19), and the float m = 1 + code * 2^(p - 23) multiplies
    a' = a * 2^(23 - p): a' m - a' = a * code, exactly but for float32 rounding of at most
    2^(23 - p + 1) ulps. No int-to-float conversion, no reduction."""
    WORD: tl.constexpr = 32 // BITS
    PER_SHIFT: tl.constexpr = 2 if BITS == 2 else 1
    LOW: tl.constexpr = 23 - PER_SHIFT * BITS  # the bit where code q * PER_SHIFT lands
    dot = tl.zeros(words.shape, dtype=tl.float32)
    dot2 = dot
    a_scaled = tl.zeros(a_base.shape, dtype=tl.float32)
    a_plain = tl.zeros(a_base.shape, dtype=tl.float32)
    for q in tl.static_range(WORD // PER_SHIFT):  # (constexprs cannot be named inside a static loop)
        for r in tl.static_range(PER_SHIFT):  # code q * PER_SHIFT + r, at bit p = LOW + r * BITS
            a = tl.load(a_base + (q * PER_SHIFT + r), mask=a_ok, other=0.0).to(tl.float32)
            a_s = a * (1 << (23 - LOW - r * BITS))
            dot += a_s * _mantissa(words, q, r, BITS, PER_SHIFT, LOW)
            if TWO:
                dot2 += a_s * _mantissa(words2, q, r, BITS, PER_SHIFT, LOW)
            a_scaled += a_s
            a_plain += a
    return dot, dot2, a_scaled, a_plain


@triton.jit
def _mantissa(words, q: tl.constexpr, r: tl.constexpr, BITS: tl.constexpr, PER_SHIFT: tl.constexpr,
              LOW: tl.constexpr):  # fmt: skip
    """Code q * PER_SHIFT + r of each word as the float32 1 + code * 2^(LOW + r * BITS - 23)."""
    if LOW >= BITS * PER_SHIFT * q:
        shifted = words << (LOW - BITS * PER_SHIFT * q)
    else:
        shifted = words >> (BITS * PER_SHIFT * q - LOW)
    return ((shifted & (((1 << BITS) - 1) << (LOW + r * BITS))) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _code_pairs(words, BITS: tl.constexpr, BF16: tl.constexpr):
    """Words (N, Wk) int32, shifted so that the wanted field of bytes 0 / 1 sits at bit 0 and that of
    bytes 2 / 3 at bit 16 -> (N, 2 Wk) bf16 (BF16) or fp16 of 128 + code (1024 + code), joined index
    2j + h for half h of word j: one mask and one OR for two codes, then the halves reinterpreted."""
    MASK: tl.constexpr = (1 << BITS) - 1
    pair = words & (MASK | (MASK << 16))
    if BF16:
        pair = pair | 0x43004300
        lo = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        pair = pair | 0x64006400
        lo = pair.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))


@triton.jit
def _accumulator(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr, ROWS: tl.constexpr = 0):
    """A zero float32 tile: (BLOCK_M, BLOCK_N), or transposed (the SWAP products of v5), or (ROWS,
    BLOCK_N) partial sums (ROWS > 0: v6's GEMV tiles, `_gemv_words`)."""
    if ROWS > 0:
        return tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    elif SWAP:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _finish(acc, SWAP: tl.constexpr, ROWS: tl.constexpr):
    """An accumulator of `_accumulator` -> (BLOCK_M, BLOCK_N)."""
    if ROWS > 0:
        return tl.sum(acc, axis=0)[None, :]
    elif SWAP:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _codes(fields, cdtype: tl.constexpr):
    """Unsigned codes (int32, 0..15) -> `cdtype`, exactly, with no int-to-float conversion (a quarter
    of an integer op's throughput on sm_90): OR the code into the mantissa of 128 (bf16: 0x4300 | c
    is 128 + c, its step there being 1; fp16: 0x6400 | c is 1024 + c; float32, the GEMV tiles':
    2^23), reinterpret the bits, subtract the constant (exact)."""
    if cdtype == tl.bfloat16:
        return ((fields | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0).to(tl.bfloat16)
    elif cdtype == tl.float16:
        return ((fields | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0).to(tl.float16)
    elif cdtype == tl.float32:  # the GEMV tiles' codes: 0x4B000000 | c is 2^23 + c
        return (fields | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        return fields.to(cdtype)


# Triton's interpreter (CPU tests) computes tl.dot of bf16 operands wrongly (triton 3.9: errors of
# 1e10 on a 16x16 product); there the operands are widened first, which is exact for bf16/fp16.
_WIDEN_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _mm(a, b, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a (BLOCK_M, BLOCK_K) @ b (BLOCK_K, BLOCK_N) -> float32; BLOCK_M == 1 is a GEMV (no tl.dot)."""
    if BLOCK_M == 1:
        return tl.sum(a.to(tl.float32).reshape(a.shape[1], 1) * b.to(tl.float32), axis=0)[None, :]
    elif a.shape[1] < 16:  # tl.dot needs K >= 16 (packed tiles of small groups): broadcast and reduce
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif _WIDEN_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION, out_dtype=tl.float32)


WAIT_SPINS = tl.constexpr(1 << 22)  # reads of a landed word a program waits at most (~1 s), then goes on


@triton.jit
def _block_rows(block_expert_ptr, pool_of_ptr, slot_of_ptr, slot_stride, sorted_pair_ptr, num_pairs, POOL_ID,
                wait_ptr, landed_ptr, BLOCK_M: tl.constexpr, WAIT: tl.constexpr, ONE_PAIR: tl.constexpr):  # fmt: skip
    """This program's block: (runs here?, pool row, scratch rows of h (BLOCK_M,), pairs, pair mask).
    ONE_PAIR: every pair is its own block (no sort; `block_expert_ptr` holds the router's ids): the
    block's first row is pair `program_id(0)`, the others are masked, and h is indexed by pair.
    The row is read from this pool's row of the slot table (`slot_stride` = E, or 0 for one row).
    WAIT >= 0 (the launch for the pool the landed words are for, whose id it is): the expert's
    `wait_ptr` word, when not 0, is the number of a copy into its row still in flight when the table
    sent the layer there: spin on the row's landed word (volatile: the copy stream writes it after
    the data) until it says so, at most WAIT_SPINS reads."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    safe = tl.maximum(expert, 0)
    pool = tl.load(pool_of_ptr + safe)
    runs = (expert >= 0) & (pool == POOL_ID)
    row = tl.load(slot_of_ptr + POOL_ID * slot_stride + safe).to(tl.int64)
    if WAIT >= 0:
        want = tl.load(wait_ptr + safe)
        if runs and want != 0:
            spins = 0
            while (tl.load(landed_ptr + row, volatile=True) != want) & (spins < WAIT_SPINS):
                spins += 1
    if ONE_PAIR:  # GEMV tiles, or a few tokens' dot tiles: program = pair, its expert the router's id
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
        h_rows = pair
    else:
        h_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pair_ptr + h_rows)
    return runs, row, h_rows.to(tl.int64), pair.to(tl.int64), pair < num_pairs


@triton.jit
def _k_tile_products(a_ptr, a_rows, stride_a, a_mask, data_ptr, param_ptr, row, row_data, row_param, data_off,
                     scale_off, offset_off, offs_n, n_mask, second_n, k0, K: tl.constexpr, BITS: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, SUB_K: tl.constexpr, PACKED: tl.constexpr,
                     TWO: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """The products of a[a_rows, k0 : k0 + SUB_K] with one K-sub-tile of W (inside one group of a
    packed W), for the columns offs_n and, TWO (gate and up), offs_n + second_n: (first, second)
    float32 (BLOCK_M, BLOCK_N), transposed for v5 / v6 / v7's dot tiles, (SUB_K // codes per word,
    BLOCK_N) partial sums for v6's GEMV tiles; not TWO: (first, first). The tile product is the one `PACKED`
    names (the launcher hands the GEMV tiles v3 for v4 / v5)."""
    PAIRS: tl.constexpr = BITS < 8 and PACKED >= 5 and BLOCK_M > 1
    if BITS < 8 and PACKED == 7 and BLOCK_M == 1:  # v6's GEMV tiles: partial sums (`_gemv_words`)
        first, second = _gemv_words(a_ptr, a_rows, stride_a, a_mask, data_ptr, param_ptr, row, row_data, row_param,
                                    data_off, scale_off, offset_off, offs_n, n_mask, second_n, k0, K, BITS, GROUP,
                                    SUB_K, TWO)  # fmt: skip
    elif BITS < 8 and PACKED == 8 and BLOCK_M == 1:  # v7's GEMV tiles: a whole K-step (`_gemv_groups`)
        first, second = _gemv_groups(a_ptr, a_rows, stride_a, a_mask, data_ptr, param_ptr, row, row_data,
                                     row_param, data_off, scale_off, offset_off, offs_n, n_mask, second_n, k0, K,
                                     BITS, GROUP, SUB_K, TWO)  # fmt: skip
    elif PAIRS:  # v4 / v5 (v6's and v7's dot tiles are v5's)
        first = _paired_product(a_ptr, a_rows, stride_a, a_mask, data_ptr, param_ptr, row, row_data, row_param,
                                data_off, scale_off, offset_off, offs_n, n_mask, k0, K, BITS, GROUP, BLOCK_M, SUB_K,
                                PACKED >= 6, DOT_PRECISION)  # fmt: skip
        second = first
        if TWO:
            second = _paired_product(a_ptr, a_rows, stride_a, a_mask, data_ptr, param_ptr, row, row_data,
                                     row_param, data_off, scale_off, offset_off, offs_n + second_n, n_mask, k0, K,
                                     BITS, GROUP, BLOCK_M, SUB_K, PACKED >= 6, DOT_PRECISION)  # fmt: skip
    elif BITS < 8 and PACKED > 1:  # v3: one activation tile and its row sums for both
        a, a_sum = _act_tile(a_ptr, a_rows, stride_a, a_mask, k0, K, SUB_K)
        first = _packed_product(a, a_sum, data_ptr, param_ptr, row, row_data, row_param, data_off, scale_off,
                                offset_off, offs_n, n_mask, k0, K, BITS, GROUP, BLOCK_M, SUB_K, PACKED,
                                DOT_PRECISION)  # fmt: skip
        second = first
        if TWO:
            second = _packed_product(a, a_sum, data_ptr, param_ptr, row, row_data, row_param, data_off,
                                     scale_off, offset_off, offs_n + second_n, n_mask, k0, K, BITS, GROUP,
                                     BLOCK_M, SUB_K, PACKED, DOT_PRECISION)  # fmt: skip
    else:  # dense, or v1
        first = _tile_product(a_ptr, a_rows, stride_a, a_mask, data_ptr, param_ptr, row, row_data, row_param,
                              data_off, scale_off, offset_off, offs_n, n_mask, k0, K, BITS, GROUP, BLOCK_M, SUB_K,
                              DOT_PRECISION)  # fmt: skip
        second = first
        if TWO:
            second = _tile_product(a_ptr, a_rows, stride_a, a_mask, data_ptr, param_ptr, row, row_data,
                                   row_param, data_off, scale_off, offset_off, offs_n + second_n, n_mask, k0, K,
                                   BITS, GROUP, BLOCK_M, SUB_K, DOT_PRECISION)  # fmt: skip
    return first, second


@triton.jit(do_not_specialize=["num_pairs"])  # one compile for every T of a tile bucket
def _gate_up_kernel(
    x_ptr,
    stride_x,
    h_ptr,
    sorted_pair_ptr,
    block_expert_ptr,
    pool_of_ptr,
    slot_of_ptr,
    slot_stride,
    num_pairs,
    POOL_ID,
    wait_ptr,
    landed_ptr,
    data_ptr,
    param_ptr,
    row_data,
    row_param,
    data_off,
    scale_off,
    offset_off,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    PACKED: tl.constexpr,
    WAIT: tl.constexpr,
    ONE_PAIR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """h[scratch row] (BLOCK_N columns) = silu(x[token] @ Wg^T) * (x[token] @ Wu^T). The K loop takes
    BLOCK_K per step (several groups of a packed W: their loads issued together), as SUB_K-wide
    products (one group each)."""
    runs, row, h_rows, pair, m_mask = _block_rows(
        block_expert_ptr, pool_of_ptr, slot_of_ptr, slot_stride, sorted_pair_ptr, num_pairs, POOL_ID,
        wait_ptr, landed_ptr, BLOCK_M, WAIT, ONE_PAIR
    )
    if runs:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        token = pair // TOP_K
        SWAP: tl.constexpr = BITS < 8 and PACKED >= 6 and BLOCK_M > 1  # v5, v6
        ROWS: tl.constexpr = SUB_K * BITS // 32 if BITS < 8 and PACKED == 7 and BLOCK_M == 1 else 0  # v6 GEMV
        acc_gate = _accumulator(BLOCK_M, BLOCK_N, SWAP, ROWS)
        acc_up = _accumulator(BLOCK_M, BLOCK_N, SWAP, ROWS)
        for k0 in range(0, HIDDEN, BLOCK_K):
            for kk in tl.static_range(0, BLOCK_K, SUB_K):
                gate, up = _k_tile_products(x_ptr, token, stride_x, m_mask, data_ptr, param_ptr, row, row_data,
                                            row_param, data_off, scale_off, offset_off, offs_n, n_mask, INTER,
                                            k0 + kk, HIDDEN, BITS, GROUP, BLOCK_M, SUB_K, PACKED, True,
                                            DOT_PRECISION)  # fmt: skip
                acc_gate += gate
                acc_up += up
        acc_gate = _finish(acc_gate, SWAP, ROWS)
        acc_up = _finish(acc_up, SWAP, ROWS)
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
        h_ptrs = h_ptr + h_rows[:, None] * INTER + offs_n[None, :]
        tl.store(h_ptrs, h.to(x_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # one compile for every T of a tile bucket
def _down_kernel(
    h_ptr,
    y_ptr,
    routing_ptr,
    sorted_pair_ptr,
    block_expert_ptr,
    pool_of_ptr,
    slot_of_ptr,
    slot_stride,
    num_pairs,
    POOL_ID,
    wait_ptr,
    landed_ptr,
    data_ptr,
    param_ptr,
    row_data,
    row_param,
    data_off,
    scale_off,
    offset_off,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    PACKED: tl.constexpr,
    WAIT: tl.constexpr,
    ONE_PAIR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y[pair] (BLOCK_N columns) = routing[pair] * (h[scratch row] @ Wd^T), float32; K loop as in
    `_gate_up_kernel`."""
    runs, row, h_rows, pair, m_mask = _block_rows(
        block_expert_ptr, pool_of_ptr, slot_of_ptr, slot_stride, sorted_pair_ptr, num_pairs, POOL_ID,
        wait_ptr, landed_ptr, BLOCK_M, WAIT, ONE_PAIR
    )
    if runs:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < HIDDEN
        SWAP: tl.constexpr = BITS < 8 and PACKED >= 6 and BLOCK_M > 1
        ROWS: tl.constexpr = SUB_K * BITS // 32 if BITS < 8 and PACKED == 7 and BLOCK_M == 1 else 0
        acc = _accumulator(BLOCK_M, BLOCK_N, SWAP, ROWS)
        for k0 in range(0, INTER, BLOCK_K):
            for kk in tl.static_range(0, BLOCK_K, SUB_K):
                part, _ = _k_tile_products(h_ptr, h_rows, INTER, m_mask, data_ptr, param_ptr, row, row_data,
                                           row_param, data_off, scale_off, offset_off, offs_n, n_mask, 0, k0 + kk,
                                           INTER, BITS, GROUP, BLOCK_M, SUB_K, PACKED, False,
                                           DOT_PRECISION)  # fmt: skip
                acc += part
        acc = _finish(acc, SWAP, ROWS)
        weight = tl.load(routing_ptr + pair, mask=m_mask, other=0.0).to(tl.float32)
        y_ptrs = y_ptr + pair[:, None] * HIDDEN + offs_n[None, :]
        tl.store(y_ptrs, acc * weight[:, None], mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])  # one compile for every T
def _fused_gemv_kernel(  # long: one program's GEMV, SiLU-mul and down slice share registers
    x_ptr,
    stride_x,
    h_ptr,
    y_ptr,
    routing_ptr,
    ids_ptr,
    pool_of_ptr,
    slot_of_ptr,
    slot_stride,
    num_pairs,
    POOL_ID,
    wait_ptr,
    landed_ptr,
    param_ptr,
    row_param,
    gu_data_ptr,
    gu_row_data,
    gu_data_off,
    gu_scale_off,
    gu_offset_off,
    dn_data_ptr,
    dn_row_data,
    dn_data_off,
    dn_scale_off,
    dn_offset_off,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    GU_BITS: tl.constexpr,
    GU_GROUP: tl.constexpr,
    GU_BLOCK_K: tl.constexpr,
    GU_SUB_K: tl.constexpr,
    GU_PACKED: tl.constexpr,
    DN_BITS: tl.constexpr,
    DN_GROUP: tl.constexpr,
    DN_BLOCK_K: tl.constexpr,
    DN_SUB_K: tl.constexpr,
    DN_PACKED: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WAIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The one-launch path (GEMV tiles): grid (P, I / BLOCK_I), program (pair p, slice s) of columns
    i = s * BLOCK_I .. + BLOCK_I. h[p, i] = silu(x[token] @ Wg[i]^T) * (x[token] @ Wu[i]^T) (stored in
    the activations' dtype, as the two-launch path stores it, and read back after a barrier), then
    y[p * S + s] = routing[p] * (h[p, i] @ Wd[:, i]^T), float32 (H,), in BLOCK_N-wide chunks; S = I /
    BLOCK_I partial sums per pair, summed by the reduce. Each weight is read once per pair, as in the
    two-launch path; the down launch, its gap and its re-read of h go."""
    runs, row, h_rows, pair, m_mask = _block_rows(
        ids_ptr, pool_of_ptr, slot_of_ptr, slot_stride, ids_ptr, num_pairs, POOL_ID, wait_ptr, landed_ptr, 1, WAIT,
        True,
    )  # fmt: skip
    if runs:
        s = tl.program_id(1)
        offs_i = s * BLOCK_I + tl.arange(0, BLOCK_I)
        i_mask = offs_i < INTER
        token = pair // TOP_K
        GU_ROWS: tl.constexpr = GU_SUB_K * GU_BITS // 32 if GU_BITS < 8 and GU_PACKED == 7 else 0  # v6
        acc_gate = _accumulator(1, BLOCK_I, False, GU_ROWS)
        acc_up = _accumulator(1, BLOCK_I, False, GU_ROWS)
        for k0 in range(0, HIDDEN, GU_BLOCK_K):
            for kk in tl.static_range(0, GU_BLOCK_K, GU_SUB_K):
                gate, up = _k_tile_products(x_ptr, token, stride_x, m_mask, gu_data_ptr, param_ptr, row, gu_row_data,
                                            row_param, gu_data_off, gu_scale_off, gu_offset_off, offs_i, i_mask,
                                            INTER, k0 + kk, HIDDEN, GU_BITS, GU_GROUP, 1, GU_SUB_K, GU_PACKED, True,
                                            DOT_PRECISION)  # fmt: skip
                acc_gate += gate
                acc_up += up
        acc_gate = _finish(acc_gate, False, GU_ROWS)
        acc_up = _finish(acc_up, False, GU_ROWS)
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(h_ptr + h_rows[:, None] * INTER + offs_i[None, :], h.to(x_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & i_mask[None, :])  # fmt: skip
        tl.debug_barrier()  # the slice of h is in memory before any thread of the program reads it
        weight = tl.load(routing_ptr + pair, mask=m_mask, other=0.0).to(tl.float32)
        DN_ROWS: tl.constexpr = DN_SUB_K * DN_BITS // 32 if DN_BITS < 8 and DN_PACKED == 7 else 0
        SLICES: tl.constexpr = INTER // BLOCK_I
        for n0 in range(0, HIDDEN, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < HIDDEN
            acc = _accumulator(1, BLOCK_N, False, DN_ROWS)
            for kk in tl.static_range(0, BLOCK_I, DN_SUB_K):
                part, _ = _k_tile_products(h_ptr, h_rows, INTER, m_mask, dn_data_ptr, param_ptr, row, dn_row_data,
                                           row_param, dn_data_off, dn_scale_off, dn_offset_off, offs_n, n_mask, 0,
                                           s * BLOCK_I + kk, INTER, DN_BITS, DN_GROUP, 1, DN_SUB_K, DN_PACKED, False,
                                           DOT_PRECISION)  # fmt: skip
                acc += part
            acc = _finish(acc, False, DN_ROWS)
            y_ptrs = y_ptr + (pair * SLICES + s)[:, None] * HIDDEN + offs_n[None, :]
            tl.store(y_ptrs, acc * weight[:, None], mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _align_kernel(ids_ptr, sorted_pair_ptr, block_expert_ptr, num_pairs, NUM_EXPERTS: tl.constexpr,
                  EXPERTS_P2: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """`align_pairs`, one program per expert e (grid (E,)): a counting sort of the pairs by expert, stable.

    Every program counts every expert's pairs (one-hot rows of CHUNK pairs, summed), pads the counts to
    BLOCK_M and takes their prefix sums: expert e's rows are [starts[e], starts[e] + padded[e]). Program
    e then stores its own pairs there in pair order (a running count plus a prefix sum of the chunk's
    matches), the sentinel `num_pairs` in its padding rows and e as the expert of its blocks; the rows
    and blocks past the last expert's are shared out among the programs (sentinel, -1)."""
    e = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_P2)
    counts = tl.zeros((EXPERTS_P2,), dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    start = tl.sum(tl.where(experts == e, starts, 0))
    count = tl.sum(tl.where(experts == e, counts, 0))
    pad = tl.sum(tl.where(experts == e, padded, 0))
    total = tl.sum(padded)
    running = count * 0
    for p0 in range(0, num_pairs, CHUNK):
        offs = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
        mine = (ids == e).to(tl.int32)
        rank = tl.cumsum(mine, axis=0) - 1 + running
        tl.store(sorted_pair_ptr + start + rank, offs, mask=(mine > 0) & (offs < num_pairs))
        running += tl.sum(mine, axis=0)
    lanes = tl.arange(0, BLOCK_M)
    tl.store(sorted_pair_ptr + start + count + lanes, lanes * 0 + num_pairs, mask=count + lanes < pad)
    chunk = tl.arange(0, CHUNK)
    for b0 in range(0, pad // BLOCK_M, CHUNK):
        tl.store(block_expert_ptr + start // BLOCK_M + b0 + chunk, chunk * 0 + e, mask=b0 + chunk < pad // BLOCK_M)
    for r0 in range(total + e * CHUNK, ROWS, NUM_EXPERTS * CHUNK):
        tl.store(sorted_pair_ptr + r0 + chunk, chunk * 0 + num_pairs, mask=r0 + chunk < ROWS)
    NUM_BLOCKS: tl.constexpr = ROWS // BLOCK_M
    for b0 in range(total // BLOCK_M + e * CHUNK, NUM_BLOCKS, NUM_EXPERTS * CHUNK):
        tl.store(block_expert_ptr + b0 + chunk, chunk * 0 - 1, mask=b0 + chunk < NUM_BLOCKS)


def aligned_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The static bound on `align_pairs`' rows: P + min(E, P) * (block_m - 1), rounded up to block_m."""
    return -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the (token, expert) pairs into blocks of `block_m` rows, each block one expert.

    topk_ids (T, k), or flattened (P,) -> (sorted_pair (R,) int32: pair id t*k + j at each row, P
    where padding; block_expert (R // block_m,) int32: each block's expert, -1 past the last block). R is
    `aligned_rows(P, E, block_m)`, so shapes depend on T only (graph capture) and nothing is read
    back on the host; one launch of a program per expert (`_align_kernel`), pairs of one expert in pair order. block_m == 1:
    no sort, every pair is its own block and both are the flat ids, which the kernels read as such."""
    flat = topk_ids.reshape(-1).contiguous()
    if block_m == 1:
        return flat, flat
    num_pairs = flat.numel()
    rows = aligned_rows(num_pairs, num_experts, block_m)
    sorted_pair = torch.empty(rows, device=flat.device, dtype=torch.int32)
    block_expert = torch.empty(rows // block_m, device=flat.device, dtype=torch.int32)
    experts_p2 = triton.next_power_of_2(num_experts)
    _align_kernel[(num_experts,)](flat, sorted_pair, block_expert, num_pairs, NUM_EXPERTS=num_experts,
                        EXPERTS_P2=experts_p2, ROWS=rows, BLOCK_M=block_m,
                        CHUNK=max(16, min(256, 16384 // experts_p2)), num_warps=8)  # fmt: skip
    return sorted_pair, block_expert


@triton.jit
def _reduce_kernel(y_ptr, out_ptr, ids_ptr, pool_of_ptr, TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                   BLOCK: tl.constexpr, SLICES: tl.constexpr = 1, ONE_SLICE: tl.constexpr = 0,
                   USE_GDC: tl.constexpr = False):  # fmt: skip
    """out[t] = sum_j sum_s y[(t * k + j) * S + s] (float32, in j then s order; S = SLICES per-slice
    partial sums of the one-launch path, else 1) over the pairs whose expert has a version (`pool_of`
    >= 0; the others' rows of y are never written), stored in out's dtype: grid (T, H / BLOCK). A pair
    whose pool's bit is set in ONE_SLICE (pools on two launches beside one-launch pools: the CUDA
    kernels) has its whole sum in slice 0. USE_GDC: y is read after the launch before has finished
    (`gdc_wait`)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pool = tl.load(pool_of_ptr + tl.load(ids_ptr + t * TOP_K + j))
        ran = pool >= 0
        slices = tl.where(((ONE_SLICE >> tl.maximum(pool, 0)) & 1) != 0, 1, SLICES)
        for s in range(SLICES):
            y_row = y_ptr + ((t * TOP_K + j) * SLICES + s) * HIDDEN
            acc += tl.load(y_row + cols, mask=cols < tl.where(ran & (s < slices), HIDDEN, 0), other=0.0)
    tl.store(out_ptr + t * HIDDEN + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < HIDDEN)


def _pair_outputs(num_pairs: int, hidden_size: int, device) -> torch.Tensor:
    """y (P, H) float32, unfilled: the down launches write the rows of every pair that has a version,
    and the reduce reads no other row."""
    return torch.empty(num_pairs, hidden_size, device=device, dtype=torch.float32)


def k_tiles(block_k: int, matrix: MatrixFormat, k: int) -> tuple[int, int]:
    """(BLOCK_K, SUB_K) of one projection whose reduction length is `k`: a dense matrix takes
    `block_k` whole; a packed one takes the largest power of two <= block_k that divides k (a K-step
    may span several groups, never past the row), as products of SUB_K <= its group size."""
    if not matrix.packed:
        return block_k, block_k
    step = min(block_k, k)
    while k % step:
        step //= 2
    return step, min(step, matrix.group_size)


def _matrix_args(pool: Pool, matrix: MatrixFormat, k: int, block_k: int, block_m: int, packed_tile: str,
                 act_dtype: torch.dtype) -> dict:  # fmt: skip
    """The kernel arguments of one projection of `pool` (`matrix`, reduction length `k`) on K-steps of
    `block_k` and, if packed, the tile product `packed_tile` (a `PACKED_TILES` name): v4 to v7 read
    the arena as int32 words where they can, else they run as v3; v7's GEMV tiles take the whole
    K-step as one product (SUB_K = BLOCK_K)."""
    data, data_off = pool.data_view(matrix), matrix.data_offset
    block_k, sub_k = k_tiles(block_k, matrix, k)
    if matrix.packed and PACKED_TILES[packed_tile] >= 5:
        words = pool.arena.shape[1] % 4 == 0 and data_off % 4 == 0
        if block_m > 1:  # codes set into bf16 / fp16 pairs
            words = words and _paired_codes(act_dtype)
        else:  # GEMV tiles: v6's and v7's own (any activation dtype), v4 / v5 are v3 there
            words = words and packed_tile in ("v6", "v7") and sub_k % (32 // matrix.bits) == 0
            if words and packed_tile == "v7":  # one product per K-step, over its groups
                sub_k = block_k
        if words:
            data, data_off = pool.arena.view(torch.int32), data_off // 4
        else:
            packed_tile = "v3"
    return dict(data_ptr=data, row_data=data.stride(0), data_off=data_off, scale_off=matrix.scale_offset,
                offset_off=matrix.offset_offset, BITS=matrix.bits, GROUP=max(matrix.group_size, 1), BLOCK_K=block_k,
                SUB_K=sub_k, PACKED=PACKED_TILES[packed_tile] if matrix.packed else 0)  # fmt: skip


def _launch_matrix(kernel, grid, pool: Pool, pool_id: int, matrix: MatrixFormat, k: int, config, packed_tile: str,
                   **args):  # fmt: skip
    """One launch of `kernel` over `pool`'s rows for one projection (`matrix`, reduction length `k`), its
    tiles from `config` and, if packed, its tile product from `packed_tile` (a `PACKED_TILES` name)."""
    params = pool.param_view()
    kernel[grid](
        **args,
        **_matrix_args(pool, matrix, k, config.block_k, config.block_m, packed_tile, args["h_ptr"].dtype),
        POOL_ID=pool_id,
        param_ptr=params,
        row_param=params.stride(0),
        BLOCK_N=config.block_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _launch_fused(pool: Pool, pool_id: int, config, packed_tile: str, num_pairs: int, **args) -> None:
    """One launch of `_fused_gemv_kernel` over `pool`'s rows: gate_up on K-steps of `config.block_k`,
    down over each program's slice of `config.split_i` columns, in chunks of `config.block_n` outputs."""
    fmt, dtype = pool.format, args["x_ptr"].dtype
    params = pool.param_view()
    gate_up = _matrix_args(pool, fmt.gate_up, fmt.hidden_size, config.block_k, 1, packed_tile, dtype)
    down = _matrix_args(pool, fmt.down, config.split_i, config.split_i, 1, packed_tile, dtype)
    prefixed = {(f"gu_{key}" if key.islower() else f"GU_{key}"): value for key, value in gate_up.items()}
    prefixed |= {(f"dn_{key}" if key.islower() else f"DN_{key}"): value for key, value in down.items()}
    grid = (num_pairs, fmt.intermediate_size // config.split_i)
    _fused_gemv_kernel[grid](**args, **prefixed, POOL_ID=pool_id, param_ptr=params, row_param=params.stride(0),
                             num_pairs=num_pairs, BLOCK_I=config.split_i, BLOCK_N=config.block_n,
                             num_warps=config.num_warps, num_stages=config.num_stages)  # fmt: skip


def _paired_codes(dtype: torch.dtype) -> bool:
    """v4 / v5 take bf16 and fp16 activations (codes set into a mantissa); float32 ones take v3, and so
    does bf16 under the interpreter (whose bf16 arithmetic is wrong)."""
    return dtype == torch.float16 or (dtype == torch.bfloat16 and not _WIDEN_DOT)


def _fits_dot(config: KernelConfig, fmt: PoolFormat) -> bool:
    """tl.dot needs 16 bytes of packed codes per product; groups smaller than that (a product lies
    inside one group) leave only the GEMV tiles (block_m 1), which take any tile width."""
    for m, k in ((fmt.gate_up, fmt.hidden_size), (fmt.down, fmt.intermediate_size)):
        if m.packed and config.block_m > 1 and k_tiles(config.block_k, m, k)[1] * m.bits // 8 < 16:
            return False
    return True


INTERPRETER_TILE = 256  # the least block_n and block_k of the table's tiles under the interpreter (CPU tests)
LO_POOL_ID = 1  # `ResidencyManager.pool_ids["lo"]`: in a mixed layer, the pool that runs most pairs


def pool_configs(num_tokens: int, pools: list[Pool | None], config=None, mixed_cells: bool = True) -> list:
    """The tiles of each pool's launches (None where a pool is None). `config`: one `KernelConfig` for
    every pool, or one per pool (the tuners, tests); else each pool's own format's from the table,
    since bf16 hi slots and int2 lo rows want different tiles and tile products (per-tensor
    precision), and a pool beside the lo pool in a mixed layer its cell for that (`config_for`'s
    `beside`: it runs a few hot experts' pairs). They share block_m, for one alignment of the pairs
    serves every pool: the lo pool's where there is one, else the first pool's; block_m 1 for all
    where a pool's groups are too small for tl.dot tiles. `mixed_cells` False: every pool its format's
    own cell (the tuners' baseline for the `@<lo>` cells)."""
    formats = tuple(pool.format if pool is not None else None for pool in pools)
    if isinstance(config, list):
        config = tuple(config)
    one_launch = num_tokens <= FUSED_MAX_TOKENS
    return list(_pool_configs(t_bucket(num_tokens), formats, config, mixed_cells, one_launch))


def _shared_split(split_i: int, inter: int) -> int:
    """The one-launch path's slice width for a layer of intermediate size `inter`: `split_i` halved
    until it divides `inter` (every program a whole slice), 0 (two launches) below MIN_SPLIT_I."""
    while split_i >= MIN_SPLIT_I and inter % split_i:
        split_i //= 2
    return split_i if split_i >= MIN_SPLIT_I else 0


@lru_cache(maxsize=256)
def _pool_configs(bucket: int, formats: tuple, config, mixed_cells: bool, one_launch: bool = True) -> tuple:
    first = next(f for f in formats if f is not None)
    lo = formats[LO_POOL_ID] if len(formats) > LO_POOL_ID else None
    beside = lo.name if lo is not None and mixed_cells else None  # the other pools' `@<lo>` cells
    if isinstance(config, tuple):
        configs = [c if f is not None else None for c, f in zip(config, formats, strict=True)]
    elif config is not None:
        configs = [config if f is not None else None for f in formats]
    else:
        configs = [config_for(bucket, first.hidden_size, first.intermediate_size, f.name,
                              beside=beside if i != LO_POOL_ID else None)
                   if f is not None else None for i, f in enumerate(formats)]  # fmt: skip
        if _WIDEN_DOT:  # the interpreter runs each program in Python: wide tiles, few programs and K-steps
            configs = [replace(c, block_n=max(c.block_n, INTERPRETER_TILE), block_k=max(c.block_k, INTERPRETER_TILE))
                       if c is not None else None for c in configs]  # fmt: skip
    lead = configs[LO_POOL_ID] if len(configs) > LO_POOL_ID and configs[LO_POOL_ID] is not None else None
    block_m = (lead or next(c for c in configs if c is not None)).block_m
    if not all(_fits_dot(replace(c, block_m=block_m), f) for c, f in zip(configs, formats, strict=True) if c):
        block_m = 1
    # every pool of a layer on the lead's one-launch slices (the reduce sums one set), or all on two launches
    # a cell tuned for two launches takes the lead's down chunks when it joins the lead's one launch
    main = lead or next(c for c in configs if c is not None)
    split_i = _shared_split(main.split_i, first.intermediate_size) if block_m == 1 and one_launch else 0
    return tuple(replace(c, block_m=block_m, split_i=split_i, block_n=main.block_n if split_i and not c.split_i
                         else c.block_n) if c is not None else None for c in configs)  # fmt: skip


def fused_moe(  # long: every pool's launches share the layer's blocks, scratch and reduce
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pool_of: torch.Tensor,
    slot_of: torch.Tensor,
    pools: list[Pool],
    config=None,
    packed_tile: str | None = None,
    waits: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    cuda_kernels: bool = True,
) -> torch.Tensor:
    """Routed experts of one layer from the pools' rows through the slot table: `(T, H)`.

    `pools[i]` is pool id i (None: a pool without slots). Experts whose `pool_of` is -1 contribute
    nothing. No host sync. `config`: tiles for every pool, or per pool (`pool_configs`); None = the
    table's. `packed_tile`: the packed tile product (`PACKED_TILES`); None = the tile table's
    (`KernelConfig.packed_tile`). `cuda_kernels` False: packed pools stay on the Triton tiles, never
    on the tensor-core kernels of `lo_cuda` (`--lo-kernel triton`). `waits`
    (`wait_of` (E,), `landed` (slots,) int32, pool id): an expert in that pool whose `wait_of` is not
    0 is read once `landed[slot] == wait_of` (a copy in flight; `ResidencyManager.step_waits`).
    """
    if packed_tile is not None and packed_tile not in PACKED_TILES:
        raise ValueError(f"packed_tile must be one of {sorted(PACKED_TILES)}, got {packed_tile!r}")
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    fmt = next(pool for pool in pools if pool is not None).format
    inter = fmt.intermediate_size
    if fmt.hidden_size != hidden_size:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not fit the pools' H={fmt.hidden_size}")
    configs, block_m, one_pair, on_cuda = _layer_blocks(num_tokens, pools, hidden, topk_weights.dtype, config,
                                                        packed_tile, cuda_kernels)  # fmt: skip
    rows_per_block = 1 if one_pair else block_m
    # > 0: one launch per Triton pool; the CUDA pools write their sums into slice 0 of their pairs' rows
    triton_pools = any(pool is not None and not cuda for pool, cuda in zip(pools, on_cuda, strict=True))
    split_i = next(c for c in configs if c is not None).split_i if triton_pools else 0
    slices = inter // split_i if split_i else 1
    one_slice = sum(1 << i for i, cuda in enumerate(on_cuda) if cuda) if split_i else 0
    hidden = hidden.contiguous()
    flat_ids = topk_ids.reshape(-1).contiguous()  # pair p = t * k + j: the sort's input and the reduce's
    sorted_pair, block_expert = align_pairs(flat_ids, pool_of.numel(), rows_per_block)
    h = torch.empty(sorted_pair.numel(), inter, device=hidden.device, dtype=hidden.dtype)
    y = _pair_outputs(num_pairs * slices, hidden_size, hidden.device)
    routing = topk_weights.contiguous().reshape(-1)
    blocks = block_expert.numel()
    dot_precision = "ieee" if hidden.dtype == torch.float32 else "tf32"  # no TF32 rounding of fp32
    common = dict(
        sorted_pair_ptr=sorted_pair,
        block_expert_ptr=block_expert,
        pool_of_ptr=pool_of,
        slot_of_ptr=slot_of,
        slot_stride=slot_of.shape[-1] if slot_of.dim() == 2 else 0,
        num_pairs=num_pairs,
        HIDDEN=hidden_size,
        INTER=inter,
        BLOCK_M=block_m,
        ONE_PAIR=one_pair,
        DOT_PRECISION=dot_precision,
        wait_ptr=waits[0] if waits is not None else pool_of,  # (unread when WAIT is -1)
        landed_ptr=waits[1] if waits is not None else pool_of,
    )
    dependent = any(on_cuda) and lo_cuda.dependent_launches(hidden.device)  # CUDA down after its gate_up
    pair_rows = y.view(num_pairs, slices * hidden_size)  # a CUDA pool's sums: slice 0 of each pair's rows
    for pool_id, pool in enumerate(pools):
        if pool is None:  # a pool without slots (no expert can point there)
            continue
        f, config = pool.format, configs[pool_id]
        tile = packed_tile or config.packed_tile
        common["WAIT"] = pool_id if waits is not None and pool_id == waits[2] else -1  # only its pool waits
        if on_cuda[pool_id]:  # the tensor-core kernels (`lo_cuda`): the same blocks, h and y
            lo_waits = waits[:2] if common["WAIT"] >= 0 else None
            _launch_lo_cuda(pool, pool_id, hidden, h, pair_rows, routing, dict(
                blocks=blocks, block_m=rows_per_block, one_pair=one_pair, sorted_pair=sorted_pair,
                block_expert=block_expert, pool_of=pool_of, slot_of=slot_of, num_pairs=num_pairs, top_k=top_k,
                num_tokens=num_tokens, waits=lo_waits), dependent)  # fmt: skip
            continue
        if split_i:
            _launch_fused(pool, pool_id, config, tile, num_pairs, x_ptr=hidden, stride_x=hidden.stride(0), h_ptr=h, y_ptr=y,
                          routing_ptr=routing, ids_ptr=flat_ids, pool_of_ptr=pool_of, slot_of_ptr=slot_of,
                          slot_stride=common["slot_stride"], wait_ptr=common["wait_ptr"],
                          landed_ptr=common["landed_ptr"], TOP_K=top_k, HIDDEN=hidden_size, INTER=inter,
                          WAIT=common["WAIT"], DOT_PRECISION=dot_precision)  # fmt: skip
            continue
        _launch_matrix(_gate_up_kernel, (blocks, triton.cdiv(inter, config.block_n)), pool, pool_id,
                       f.gate_up, hidden_size, config, tile, x_ptr=hidden, stride_x=hidden.stride(0), h_ptr=h,
                       TOP_K=top_k, **common)  # fmt: skip
        _launch_matrix(_down_kernel, (blocks, triton.cdiv(hidden_size, config.block_n)), pool, pool_id,
                       f.down, inter, config, tile, h_ptr=h, y_ptr=y, routing_ptr=routing,
                       **common)  # fmt: skip
    last = max(i for i, pool in enumerate(pools) if pool is not None)
    reduce_pdl = _GDC if dependent and on_cuda[last] else {}  # a dependent of the CUDA down
    return _reduce(y, hidden, flat_ids, pool_of, top_k, slices, reduce_pdl, one_slice)


def _layer_blocks(num_tokens: int, pools: list, hidden: torch.Tensor, routing_dtype: torch.dtype, config,
                  packed_tile: str | None, cuda_kernels: bool = True) -> tuple[list, int, bool, list[bool]]:  # fmt: skip
    """(configs, block_m, one_pair, on_cuda): every pool's tiles (`pool_configs`), their shared rows per
    sorted block, whether each pair is its own block (no sort), and which pools run on the tensor-core
    kernels (`_cuda_pools`). Where the table's blocks have more rows than those kernels take (64 at
    prefill-sized T), every pool's blocks are cut to `lo_cuda.WIDE_BLOCK_M` if that puts a pool on them."""
    configs = pool_configs(num_tokens, pools, config)
    block_m = next(c for c in configs if c is not None).block_m
    one_pair = block_m == 1 or num_tokens <= GEMV_MAX_TOKENS  # each pair its own block: no sort
    rows = 1 if one_pair else block_m if block_m in lo_cuda.BLOCK_MS else lo_cuda.WIDE_BLOCK_M
    on_cuda = _cuda_pools(pools, hidden, rows, routing_dtype, config, packed_tile, cuda_kernels)
    if any(on_cuda) and not one_pair and rows != block_m:  # the kernels' blocks for every pool
        block_m = rows
        configs = [replace(c, block_m=block_m) if c is not None else None for c in configs]
    return configs, block_m, one_pair, on_cuda


def _cuda_pools(pools: list, hidden: torch.Tensor, rows_per_block: int, routing_dtype: torch.dtype, config,
                packed_tile: str | None, cuda_kernels: bool = True) -> list[bool]:  # fmt: skip
    """Per pool, whether it runs on the tensor-core kernels (`lo_cuda.eligible`): never where tiles or
    a tile product are asked for (the tuners' and tests' Triton runs), nor without `cuda_kernels`."""
    if not cuda_kernels or config is not None or packed_tile is not None:
        return [False] * len(pools)
    return [pool is not None and lo_cuda.eligible(pool, hidden, rows_per_block, routing_dtype) for pool in pools]


def _launch_lo_cuda(pool: Pool, pool_id: int, hidden, h, y, routing, blocks: dict,
                    dependent: bool) -> None:
    """A packed pool's gate_up (x -> h) and down (h -> y, routing weights applied) on the tensor-core
    kernels of `lo_cuda`, over the same blocks as the Triton launches (`blocks`: `lo_cuda.launch`'s
    block arguments; `dependent`: down as a programmatic dependent of gate_up)."""
    f = pool.format
    lo_cuda.launch(pool, pool_id, f.gate_up, act=hidden, out=h, k=f.hidden_size, n=f.intermediate_size, **blocks)
    lo_cuda.launch(pool, pool_id, f.down, act=h, out=y, k=f.intermediate_size, n=f.hidden_size, routing=routing,
                   dependent=dependent, **blocks)  # fmt: skip


def _reduce(y, hidden, flat_ids, pool_of, top_k: int, slices: int, pdl: dict,
            one_slice: int = 0) -> torch.Tensor:
    """out[t] = sum over t's pairs (and their `slices` slices; one for the pools of bitmask `one_slice`)
    of y's float32 rows: `(T, H)`, the activations' dtype, one launch (`_reduce_kernel`)."""
    out = torch.empty_like(hidden)
    num_tokens, hidden_size = hidden.shape
    block = max(64, 1024 // slices)  # per program ~1,024 rows' columns: more programs for more slices
    _reduce_kernel[(num_tokens, triton.cdiv(hidden_size, block))](y, out, flat_ids, pool_of, TOP_K=top_k,
                                                                  HIDDEN=hidden_size, BLOCK=block, SLICES=slices,
                                                                  ONE_SLICE=one_slice, **pdl)  # fmt: skip
    return out

