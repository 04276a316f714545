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
  align     pairs sorted by expert into blocks of BLOCK_M rows, each block one expert
            (`align_pairs`, after vLLM's `moe_align_block_size`); at BLOCK_M == 1 every pair is
            its own block and nothing is sorted (decode of a few tokens: GEMV tiles).
  gate_up   per pool, grid (blocks, cdiv(I, BLOCK_N)): h = silu(x @ Wg^T) * (x @ Wu^T) into a
            (padded pairs, I) scratch. Blocks whose expert lives in another pool exit at once.
  down      per pool, grid (blocks, cdiv(H, BLOCK_N)): y[pair] = w[pair] * (h @ Wd^T), float32.
  reduce    out = y.view(T, k, H).sum(1): deterministic, no atomics.

Weights come straight from the pool rows: dense tiles are loaded as they are. Packed int4/int2
tiles factor each group's float16 scale s and offset o out of the dot, a . w = s (a . c) + o sum(a),
so the tensor cores multiply the raw codes, unpacked from int32 words two per shift-and-or
straight into bf16/fp16 registers (`_packed_sub`, `_lane_operand`); the GEMV tiles of one or two
tokens dequantize in float32 instead (`_gemv_packed`). Nothing is rounded before the float32
accumulation (the reference rounds dequantized weights to the activation dtype first). gate_up and
down each carry their own format, so one expert version may hold int2 gate_up with int4 down.
Mixed precision inside a layer costs one launch pair per pool over the same sorted blocks (the
alternative, one launch with a per-block format, would compile every format pair into one kernel;
see BENCHMARKS.md for the measurement).

Import this module only where triton is installed; on CPU it runs under Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported), which the tests use.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import triton
import triton.language as tl

from .fused_moe_config import KernelConfig, config_for
from ..residency.slot_table import MatrixFormat, Pool


@triton.jit
def _matmul(
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
    second,
    K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    SUB_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TWO: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """a[a_rows, :K] @ W[offs_n, :K]^T -> (BLOCK_M, BLOCK_N) float32, W (N, K) being one matrix of
    pool row `row`; with TWO also the product with W's rows `offs_n + second` (gate and up: one
    activation tile, its loads and row sums, for both), else zeros in its place.

    Dense (BITS >= 8): W row-major at `data_off` elements. Packed: codes row-major at `data_off`
    bytes, K // (8 // BITS) bytes per row, element k at bits (k % per_byte) * BITS of byte
    k // per_byte; float16 scale/offset (N, K // GROUP) at `scale_off` / `offset_off` elements,
    w = code * scale + offset; a K-tile is BLOCK_K // SUB_K sub-tiles (`_packed_sub`), each inside
    one group. tl.dot tiles (BLOCK_M > 1) of packed matrices take one sub-tile per step
    (BLOCK_K == SUB_K) and load the next step's activations and group parameters a step ahead: the
    compiler pipelines only the loads that feed a dot as they are (here the codes), and the
    activations are split into bit fields before theirs."""
    dtype = a_ptr.dtype.element_ty
    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BITS >= 8:
        w_ptrs = data_ptr + row * row_data + data_off + offs_n[None, :] * K
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = _act_tile(a_ptr, a_rows, stride_a, a_mask, k0, K, BLOCK_K)
            w_mask = (offs_k < K)[:, None] & n_mask[None, :]
            acc0 += _mm(a, tl.load(w_ptrs + offs_k[:, None], mask=w_mask, other=0.0).to(dtype), BLOCK_M,
                        DOT_PRECISION)  # fmt: skip
            if TWO:
                w = tl.load(w_ptrs + second * K + offs_k[:, None], mask=w_mask, other=0.0)
                acc1 += _mm(a, w.to(dtype), BLOCK_M, DOT_PRECISION)
    else:
        codes_ptr = data_ptr + row * row_data + data_off + offs_n[None, :] * (K * BITS // 8)
        params = param_ptr + row * row_param + offs_n * (K // GROUP)
        bias = _code_bias(dtype, BLOCK_M)
        if BLOCK_M > 1:
            tl.static_assert(BLOCK_K == SUB_K, "packed tl.dot tiles take one sub-tile per step")
            a_next = _act_tile(a_ptr, a_rows, stride_a, a_mask, 0, K, SUB_K)
            scale0_next, shift0_next = _group_params(params, scale_off, offset_off, n_mask, 0, K, GROUP, bias)
            scale1_next, shift1_next = scale0_next, shift0_next
            if TWO:
                scale1_next, shift1_next = _group_params(params + second * (K // GROUP), scale_off, offset_off, n_mask,
                                                         0, K, GROUP, bias)  # fmt: skip
            for k0 in range(0, K, SUB_K):
                a, scale0, shift0, scale1, shift1 = a_next, scale0_next, shift0_next, scale1_next, shift1_next
                a_next = _act_tile(a_ptr, a_rows, stride_a, a_mask, k0 + SUB_K, K, SUB_K)
                scale0_next, shift0_next = _group_params(params, scale_off, offset_off, n_mask, k0 + SUB_K, K, GROUP,
                                                         bias)  # fmt: skip
                if TWO:
                    scale1_next, shift1_next = _group_params(params + second * (K // GROUP), scale_off, offset_off,
                                                             n_mask, k0 + SUB_K, K, GROUP, bias)  # fmt: skip
                part0, part1 = _packed_sub(a, codes_ptr, second, n_mask, k0, scale0, shift0, scale1, shift1, K, BITS,
                                           SUB_K, BLOCK_M, BLOCK_N, TWO, DOT_PRECISION)  # fmt: skip
                acc0 += part0
                acc1 += part1
        else:  # GEMV: weights dequantized in float32 into per-element accumulators, reduced once at the end
            acc0, acc1 = _gemv_packed(a_ptr, a_rows, stride_a, a_mask, codes_ptr, params, scale_off, offset_off,
                                      n_mask, second, K, BITS, GROUP, SUB_K, BLOCK_N, BLOCK_K, TWO)  # fmt: skip
    return acc0, acc1


@triton.jit
def _gemv_packed(
    a_ptr,
    a_rows,
    stride_a,
    a_mask,
    codes_ptr,
    params,
    scale_off,
    offset_off,
    n_mask,
    second,
    K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    SUB_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TWO: tl.constexpr,
):
    """The packed product of `_matmul` for one activation row (BLOCK_M 1), without tl.dot: every
    weight dequantized in float32 (`_top_mantissa`: a shift, an and-or, then one multiply-add with
    the group's scale and offset) and multiplied into an accumulator per (byte, column), which is
    summed over K once after the loop (a sum per tile would reduce across threads every step).
    Codes are loaded as whole bytes, field f multiplied with the strided slice of a it holds (as in
    `_packed_sub`). -> ((1, BLOCK_N), (1, BLOCK_N)) float32."""
    PER_BYTE: tl.constexpr = 8 // BITS
    SUB_BYTES: tl.constexpr = SUB_K // PER_BYTE
    ROW_BYTES: tl.constexpr = K // PER_BYTE
    MASK: tl.constexpr = (1 << BITS) - 1
    part0 = tl.zeros((SUB_BYTES, BLOCK_N), dtype=tl.float32)
    part1 = tl.zeros((SUB_BYTES, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB_K):
            ks = k0 + sub * SUB_K
            offs_b = ks // PER_BYTE + tl.arange(0, SUB_BYTES)
            b_mask = offs_b < ROW_BYTES
            c_mask = b_mask[:, None] & n_mask[None, :]
            packed0 = tl.load(codes_ptr + offs_b[:, None], mask=c_mask, other=0).to(tl.int32)  # (SUB_BYTES, N)
            scale0, offset0 = _group_params(params, scale_off, offset_off, n_mask, ks, K, GROUP, 0.0)
            packed1, scale1, offset1 = packed0, scale0, offset0
            if TWO:
                packed1 = tl.load(codes_ptr + second * ROW_BYTES + offs_b[:, None], mask=c_mask, other=0).to(tl.int32)
                scale1, offset1 = _group_params(params + second * (K // GROUP), scale_off, offset_off, n_mask, ks, K,
                                                GROUP, 0.0)  # fmt: skip
            # w = c * s + o = (1 + c / 16) * 16 s + (o - 16 s), 1 + c / 16 being the code set as the top
            # mantissa bits of 1.0 (exact): one shift, one and-or and one multiply-add per weight
            scale0, offset0 = scale0 * 16.0, offset0 - scale0 * 16.0
            scale1, offset1 = scale1 * 16.0, offset1 - scale1 * 16.0
            # the activations of the sub-tile as one contiguous load, split into the fields' slices
            a = tl.reshape(_act_tile(a_ptr, a_rows, stride_a, a_mask, ks, K, SUB_K), (SUB_BYTES, PER_BYTE))
            tl.static_assert(BITS == 4 or BITS == 2, "packed codes are int4 or int2")
            if BITS == 4:
                a0, a1 = tl.split(a)
                p0, p1 = _gemv_field(a0, packed0, scale0, offset0, packed1, scale1, offset1, 0, BITS, TWO)
                part0, part1 = part0 + p0, part1 + p1
                p0, p1 = _gemv_field(a1, packed0, scale0, offset0, packed1, scale1, offset1, 1, BITS, TWO)
                part0, part1 = part0 + p0, part1 + p1
            else:  # element 4j + 2p + q of the sub-tile is [j, p, q]: field f = 2p + q
                even, odd = tl.split(tl.reshape(a, (SUB_BYTES, 2, 2)))
                a0, a2 = tl.split(even)
                a1, a3 = tl.split(odd)
                p0, p1 = _gemv_field(a0, packed0, scale0, offset0, packed1, scale1, offset1, 0, BITS, TWO)
                part0, part1 = part0 + p0, part1 + p1
                p0, p1 = _gemv_field(a1, packed0, scale0, offset0, packed1, scale1, offset1, 1, BITS, TWO)
                part0, part1 = part0 + p0, part1 + p1
                p0, p1 = _gemv_field(a2, packed0, scale0, offset0, packed1, scale1, offset1, 2, BITS, TWO)
                part0, part1 = part0 + p0, part1 + p1
                p0, p1 = _gemv_field(a3, packed0, scale0, offset0, packed1, scale1, offset1, 3, BITS, TWO)
                part0, part1 = part0 + p0, part1 + p1
    return tl.sum(part0, axis=0)[None, :], tl.sum(part1, axis=0)[None, :]


@triton.jit
def _gemv_field(a, packed0, scale0, offset0, packed1, scale1, offset1, F: tl.constexpr, BITS: tl.constexpr,
                TWO: tl.constexpr):  # fmt: skip
    """Field F of a GEMV sub-tile: a (SUB_BYTES,) * w, w from the field of packed (SUB_BYTES, N) int32
    as (1 + c / 16) * scale + offset, scale and offset already rescaled by `_gemv_packed`."""
    a = a.to(tl.float32)[:, None]
    part0 = a * (_top_mantissa(packed0, F, BITS) * scale0[None, :] + offset0[None, :])
    part1 = part0
    if TWO:
        part1 = a * (_top_mantissa(packed1, F, BITS) * scale1[None, :] + offset1[None, :])
    return part0, part1


@triton.jit
def _top_mantissa(packed, F: tl.constexpr, BITS: tl.constexpr):
    """Field F of every byte of packed (int32), c, as the float32 1 + c / 16 (c at mantissa bits 19 up)."""
    SHIFT: tl.constexpr = 19 - F * BITS
    return (((packed << SHIFT) & (((1 << BITS) - 1) << 19)) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _act_tile(a_ptr, a_rows, stride_a, a_mask, k0, K: tl.constexpr, WIDTH: tl.constexpr):
    """a[a_rows, k0 : k0 + WIDTH] (zeros past K): (BLOCK_M, WIDTH), contiguous along K."""
    offs_k = k0 + tl.arange(0, WIDTH)
    return tl.load(a_ptr + a_rows[:, None] * stride_a + offs_k[None, :], mask=a_mask[:, None] & (offs_k < K)[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _group_params(params, scale_off, offset_off, n_mask, ks, K: tl.constexpr, GROUP: tl.constexpr, bias):
    """(scale, offset - bias * scale) float32 (BLOCK_N,) of the group holding element ks (past K: the
    last group's, which multiply a tile of zeros)."""
    p_ptrs = params + tl.minimum(ks // GROUP, K // GROUP - 1)
    scale = tl.load(p_ptrs + scale_off, mask=n_mask, other=0.0).to(tl.float32)
    return scale, tl.load(p_ptrs + offset_off, mask=n_mask, other=0.0).to(tl.float32) - bias * scale


@triton.jit
def _packed_sub(
    a,
    codes_ptr,
    second,
    n_mask,
    ks,
    scale0,
    shift0,
    scale1,
    shift1,
    K: tl.constexpr,
    BITS: tl.constexpr,
    SUB_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TWO: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """a (BLOCK_M, SUB_K) @ W[offs_n, ks : ks + SUB_K]^T for a packed W whose sub-tile lies inside one
    group, and the same for rows `offs_n + second` (TWO; else a copy of the first).

    Inside a group w[n, k] = s[n] * c[n, k] + o[n], so the scale and offset come out of the dot:
        a . w[n] = s[n] * (a . c[n]) + o[n] * sum(a).
    The dot operand is the raw codes, made 16-bit floats by bit tricks (`_lane_operand`, exact:
    code + bias, the bias taken back out with the offset, `shift` = o - bias * s), with no
    per-weight multiply-add and no float32 round trip; sum(a) is one more dot, with ones, so it
    comes out in the accumulator's layout (`_row_sums`). The codes are loaded as int32 words
    (contiguous along K, so the loads are wide) and never interleaved back into K order: each lane
    field r of the words holds the elements per_word * i + per_word / 2 * lane + r, so it is dotted
    with that strided slice of `a`, split off in registers (int4: four dots per sub-tile, int2:
    eight). Unlike the reference (weights dequantized,
    rounded to a's dtype, then the matmul), nothing is rounded before the float32 accumulation: the
    result differs from it by the reference's own rounding of the weights, within a's precision."""
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = SUB_K // PER_WORD
    ROW_WORDS: tl.constexpr = K // PER_WORD
    offs_w = ks // PER_WORD + tl.arange(0, WORDS)
    w_mask = (offs_w < ROW_WORDS)[:, None] & n_mask[None, :]
    words0 = tl.load((codes_ptr + offs_w[:, None] * 4).to(tl.pointer_type(tl.int32)), mask=w_mask, other=0)
    words1 = words0
    if TWO:
        words1 = tl.load((codes_ptr + second * (K // 8 * BITS) + offs_w[:, None] * 4).to(tl.pointer_type(tl.int32)),
                         mask=w_mask, other=0)  # fmt: skip
    # element PER_WORD * i + PER_WORD / 2 * lane + r of the sub-tile is a[:, i, lane, r]
    tl.static_assert(BITS == 4 or BITS == 2, "packed codes are int4 or int2")
    if BITS == 4:  # r = 2 r1 + r0
        even, odd = tl.split(tl.reshape(a, (BLOCK_M, WORDS, 2, 2, 2)))
        a0, a2 = tl.split(even)
        a1, a3 = tl.split(odd)
        dot0, dot1, a_sum = _lanes(a0, words0, words1, 0, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        d0, d1, s = _lanes(a1, words0, words1, 1, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        dot0, dot1, a_sum = dot0 + d0, dot1 + d1, a_sum + s
        d0, d1, s = _lanes(a2, words0, words1, 2, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        dot0, dot1, a_sum = dot0 + d0, dot1 + d1, a_sum + s
        d0, d1, s = _lanes(a3, words0, words1, 3, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        dot0, dot1, a_sum = dot0 + d0, dot1 + d1, a_sum + s
    else:  # r = 4 r2 + 2 r1 + r0
        even, odd = tl.split(tl.reshape(a, (BLOCK_M, WORDS, 2, 2, 2, 2)))
        e0, e1 = tl.split(even)
        o0, o1 = tl.split(odd)
        a0, a4 = tl.split(e0)
        a2, a6 = tl.split(e1)
        a1, a5 = tl.split(o0)
        a3, a7 = tl.split(o1)
        dot0, dot1, a_sum = _lanes(a0, words0, words1, 0, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        d0, d1, s = _lanes(a1, words0, words1, 1, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        dot0, dot1, a_sum = dot0 + d0, dot1 + d1, a_sum + s
        d0, d1, s = _lanes(a2, words0, words1, 2, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        dot0, dot1, a_sum = dot0 + d0, dot1 + d1, a_sum + s
        d0, d1, s = _lanes(a3, words0, words1, 3, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        dot0, dot1, a_sum = dot0 + d0, dot1 + d1, a_sum + s
        d0, d1, s = _lanes(a4, words0, words1, 4, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        dot0, dot1, a_sum = dot0 + d0, dot1 + d1, a_sum + s
        d0, d1, s = _lanes(a5, words0, words1, 5, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        dot0, dot1, a_sum = dot0 + d0, dot1 + d1, a_sum + s
        d0, d1, s = _lanes(a6, words0, words1, 6, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        dot0, dot1, a_sum = dot0 + d0, dot1 + d1, a_sum + s
        d0, d1, s = _lanes(a7, words0, words1, 7, BITS, TWO, BLOCK_N, BLOCK_M, DOT_PRECISION)
        dot0, dot1, a_sum = dot0 + d0, dot1 + d1, a_sum + s
    return dot0 * scale0[None, :] + a_sum * shift0[None, :], dot1 * scale1[None, :] + a_sum * shift1[None, :]


@triton.jit
def _lanes(a, words0, words1, R: tl.constexpr, BITS: tl.constexpr, TWO: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Lane field R of a packed sub-tile: (a @ codes0, a @ codes1 (TWO; else the first again),
    sum(a) as `_row_sums`), a (BLOCK_M, WORDS, 2) being the activations of the elements it holds
    (`_lane_operand`)."""
    a = tl.reshape(a, (a.shape[0], 2 * a.shape[1]))
    dot0 = _mm(a, _lane_operand(words0, R, BITS, a.dtype, BLOCK_M), BLOCK_M, DOT_PRECISION)
    dot1 = dot0
    if TWO:
        dot1 = _mm(a, _lane_operand(words1, R, BITS, a.dtype, BLOCK_M), BLOCK_M, DOT_PRECISION)
    return dot0, dot1, _row_sums(a, BLOCK_N, BLOCK_M, DOT_PRECISION)


@triton.jit
def _lane_operand(words, R: tl.constexpr, BITS: tl.constexpr, dtype: tl.constexpr, BLOCK_M: tl.constexpr):
    """Lane field R of packed int32 words (WORDS, N) as the dot operand (2 WORDS, N), code + `_code_bias`.

    A word holds 32 // BITS codes; (word >> R * BITS) & (MASK | MASK << 16) holds two, one in each
    16-bit half: elements PER_WORD * i + R (low) and PER_WORD * i + PER_WORD / 2 + R (high). With
    the bias bits or-ed in (`_code_bias`), the halves are the two 16-bit floats as they lie in one
    register of the dot operand (pairs along K), so one shift and one and-or make two weights
    (the compiler folds the split into halves and the join back). Float32 operands: `_exact_f32`."""
    MASK: tl.constexpr = (1 << BITS) - 1
    lanes = (words >> (R * BITS)) & (MASK | (MASK << 16))
    if BLOCK_M > 1 and dtype != tl.float32:
        lanes = lanes | (0x43004300 if dtype == tl.bfloat16 else 0x64006400)
        pair = tl.join((lanes & 0xFFFF).to(tl.int16), (lanes >> 16).to(tl.int16))  # (WORDS, N, 2)
        out = tl.reshape(tl.permute(pair, (0, 2, 1)), (2 * words.shape[0], words.shape[1]))
        return out.to(dtype, bitcast=True)
    else:
        pair = tl.join(lanes & 0xFFFF, lanes >> 16)
        out = tl.reshape(tl.permute(pair, (0, 2, 1)), (2 * words.shape[0], words.shape[1]))
        return _exact_f32(out)


@triton.jit
def _row_sums(a, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """sum(a, axis=1) of a (BLOCK_M, K) in float32: GEMV (BLOCK_M 1) (1, 1); else a @ ones (BLOCK_M,
    BLOCK_N), every column the sum, computed by the tensor cores straight into the accumulator's
    layout (a reduction over K would shuffle across threads)."""
    if BLOCK_M == 1:
        return tl.sum(a.to(tl.float32), axis=1)[:, None]
    else:
        return _mm(a, tl.full((a.shape[1], BLOCK_N), 1.0, a.dtype), BLOCK_M, DOT_PRECISION)


@triton.jit
def _exact_f32(codes):
    """Small non-negative int32 codes as float32, exactly and without an int -> float convert:
    0x4B000000 | c is 2^23 + c."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _code_bias(dtype: tl.constexpr, BLOCK_M: tl.constexpr):
    """What `_lane_operand` adds to each code: 16-bit floats 0x4300 | c = 128 + c (bf16), 0x6400 | c
    = 1024 + c (fp16); float32 operands (float32 activations) are the codes themselves."""
    if BLOCK_M > 1 and dtype == tl.bfloat16:
        return 128.0
    elif BLOCK_M > 1 and dtype == tl.float16:
        return 1024.0
    else:
        return 0.0


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


@triton.jit
def _block_rows(block_expert_ptr, pool_of_ptr, slot_of_ptr, slot_stride, sorted_pair_ptr, num_pairs, POOL_ID,
                BLOCK_M: tl.constexpr):  # fmt: skip
    """This program's block: (runs here?, pool row, sorted positions (BLOCK_M,), pairs, pair mask).
    The row is read from this pool's row of the slot table (`slot_stride` = E, or 0 for one row).
    GEMV (BLOCK_M 1): program i is pair i and `block_expert_ptr` the router's ids themselves (no
    sort, `sorted_pair_ptr` unused)."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int32)
    safe = tl.maximum(expert, 0)
    pool = tl.load(pool_of_ptr + safe)
    runs = (expert >= 0) & (pool == POOL_ID)
    row = tl.load(slot_of_ptr + POOL_ID * slot_stride + safe).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if BLOCK_M == 1:
        pair = offs_m
    else:
        pair = tl.load(sorted_pair_ptr + offs_m)
    return runs, row, offs_m.to(tl.int64), pair.to(tl.int64), pair < num_pairs


@triton.jit
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
    SUB_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """h[sorted position] (BLOCK_N columns) = silu(x[token] @ Wg^T) * (x[token] @ Wu^T)."""
    runs, row, offs_m, pair, m_mask = _block_rows(
        block_expert_ptr, pool_of_ptr, slot_of_ptr, slot_stride, sorted_pair_ptr, num_pairs, POOL_ID, BLOCK_M
    )
    if runs:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        token = pair // TOP_K
        acc_gate, acc_up = _matmul(x_ptr, token, stride_x, m_mask, data_ptr, param_ptr, row, row_data, row_param,
                                   data_off, scale_off, offset_off, offs_n, n_mask, INTER, HIDDEN, BITS, GROUP, SUB_K,
                                   BLOCK_M, BLOCK_N, BLOCK_K, True, DOT_PRECISION)  # fmt: skip
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
        h_ptrs = h_ptr + offs_m[:, None] * INTER + offs_n[None, :]
        tl.store(h_ptrs, h.to(x_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
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
    SUB_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y[pair] (BLOCK_N columns) = routing[pair] * (h[sorted position] @ Wd^T), float32."""
    runs, row, offs_m, pair, m_mask = _block_rows(
        block_expert_ptr, pool_of_ptr, slot_of_ptr, slot_stride, sorted_pair_ptr, num_pairs, POOL_ID, BLOCK_M
    )
    if runs:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < HIDDEN
        acc, _ = _matmul(h_ptr, offs_m, INTER, m_mask, data_ptr, param_ptr, row, row_data, row_param, data_off,
                         scale_off, offset_off, offs_n, n_mask, 0, INTER, BITS, GROUP, SUB_K, BLOCK_M, BLOCK_N, BLOCK_K,
                         False, DOT_PRECISION)  # fmt: skip
        weight = tl.load(routing_ptr + pair, mask=m_mask, other=0.0).to(tl.float32)
        y_ptrs = y_ptr + pair[:, None] * HIDDEN + offs_n[None, :]
        tl.store(y_ptrs, acc * weight[:, None], mask=m_mask[:, None] & n_mask[None, :])


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the (token, expert) pairs into blocks of `block_m` rows, each block one expert.

    topk_ids (T, k) -> (sorted_pair (R,) int32: pair id t*k + j at each row, P where padding;
    block_expert (R // block_m,) int32: each block's expert, -1 past the last block). R is the
    static bound P + min(E, P) * (block_m - 1), rounded up to block_m, so shapes depend on T only
    (graph capture) and nothing is read back on the host. block_m == 1: no sort, every pair is a
    block."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    if block_m == 1:
        return torch.arange(num_pairs, device=device, dtype=torch.int32), flat.to(torch.int32)
    flat = flat.to(torch.int64)
    counts = torch.zeros(num_experts, device=device, dtype=torch.int64)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_expert = flat.index_select(0, order)
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - first_of_expert.index_select(0, sorted_expert)
    dest = (ends - padded).index_select(0, sorted_expert) + rank
    rows = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    sorted_pair = torch.full((rows,), num_pairs, device=device, dtype=torch.int32)
    sorted_pair.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, rows, block_m, device=device, dtype=torch.int64)
    block_expert = torch.searchsorted(ends, block_start, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pair, block_expert


def _launch_matrix(kernel, grid, pool: Pool, pool_id: int, matrix: MatrixFormat, config, **args):
    """One launch of `kernel` over `pool`'s rows for one projection (`matrix`), its tiles from `config`."""
    data = pool.data_view(matrix)
    params = pool.param_view()
    group = max(matrix.group_size, 1)
    sub_k = _sub_k(config, matrix)
    if matrix.packed and (matrix.data_offset % 4 or data.stride(0) % 4 or data.data_ptr() % 4):
        raise ValueError("packed codes are read as int32 words: rows and offsets must be 4-byte aligned")
    kernel[grid](
        **args,
        POOL_ID=pool_id,
        data_ptr=data,
        param_ptr=params,
        row_data=data.stride(0),
        row_param=params.stride(0),
        data_off=matrix.data_offset,
        scale_off=matrix.scale_offset,
        offset_off=matrix.offset_offset,
        BITS=matrix.bits,
        GROUP=group,
        SUB_K=sub_k,
        BLOCK_N=config.block_n,
        BLOCK_K=sub_k if matrix.packed and config.block_m > 1 else config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _sub_k(config: KernelConfig, matrix: MatrixFormat) -> int:
    """The K-width of a packed sub-tile: a power of two inside one group (dense: unused, 1)."""
    group = max(matrix.group_size, 1)
    return min(config.block_k, group & -group)


def _fit_packed_tiles(config: KernelConfig, pools: list[Pool | None]) -> KernelConfig:
    """tl.dot needs 16 bytes of packed codes per K-sub-tile; groups smaller than that (sub-tiles lie
    inside one group) leave only the GEMV tiles (block_m 1), which take any tile width."""
    for pool in pools:
        for m in (pool.format.gate_up, pool.format.down) if pool is not None else ():
            if m.packed and config.block_m > 1 and _sub_k(config, m) * m.bits // 8 < 16:
                return replace(config, block_m=1)
    return config


def fused_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    pool_of: torch.Tensor,
    slot_of: torch.Tensor,
    pools: list[Pool],
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Routed experts of one layer from the pools' rows through the slot table: `(T, H)`.

    `pools[i]` is pool id i (None: a pool without slots). Experts whose `pool_of` is -1 contribute
    nothing. No host sync.
    """
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    fmt = next(pool for pool in pools if pool is not None).format
    inter = fmt.intermediate_size
    if fmt.hidden_size != hidden_size:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not fit the pools' H={fmt.hidden_size}")
    if config is None:
        config = config_for(num_tokens, hidden_size, inter, fmt.name)
        if _WIDEN_DOT:  # the interpreter runs each program in Python: wide tiles, few programs
            config = replace(config, block_n=max(config.block_n, 128))
    config = _fit_packed_tiles(config, pools)
    hidden = hidden.contiguous()
    if config.block_m == 1:  # every pair its own block: the kernels read the router's ids as they are
        block_expert = sorted_pair = topk_ids.reshape(-1)
    else:
        sorted_pair, block_expert = align_pairs(topk_ids, pool_of.numel(), config.block_m)
    h = torch.empty(sorted_pair.numel(), inter, device=hidden.device, dtype=hidden.dtype)
    y = torch.zeros(num_pairs, hidden_size, device=hidden.device, dtype=torch.float32)
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
        BLOCK_M=config.block_m,
        DOT_PRECISION=dot_precision,
    )
    for pool_id, pool in enumerate(pools):
        if pool is None:  # a pool without slots (no expert can point there)
            continue
        f = pool.format
        _launch_matrix(_gate_up_kernel, (blocks, triton.cdiv(inter, config.block_n)), pool, pool_id,
                       f.gate_up, config, x_ptr=hidden, stride_x=hidden.stride(0), h_ptr=h,
                       TOP_K=top_k, **common)  # fmt: skip
        _launch_matrix(_down_kernel, (blocks, triton.cdiv(hidden_size, config.block_n)), pool, pool_id,
                       f.down, config, h_ptr=h, y_ptr=y, routing_ptr=routing, **common)  # fmt: skip
    return y.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
