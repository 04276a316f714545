"""All chosen lo experts of a layer straight from their packed pool rows: a grouped low-bit expert MLP
in Triton, two launches per layer, no bf16 copy of any weight (`lo_kernel="triton"`).

The dequantize path (`lowbit.dequantize_rows` + a bf16 matmul) writes every chosen expert's weights
in bf16 and reads them back; these kernels read the packed codes and the float16 scale/offset once
and dequantize in registers. Pool rows are in the layout of `quant.expert_layout` (one row per slot
of the lo arena `(S, nbytes)` uint8, see `residency.pool.SlotPool`).

Shapes: T tokens (1..MAX_TOKENS; a program computes up to ROW_TILE tokens of one expert, so a
longer run of pairs sharing an expert is split into ROW_TILE chunks), k experts per token, H hidden, I expert intermediate,
P token-expert pairs (P <= T*k).
    hidden         (T, H)      activations (bf16, fp16 or fp32)
    routing        (T, k)      routing weights, any float dtype
    pair_slot      (P,)        int64, the pool row of each pair minus `slot_base`; pairs of one expert
                               must be adjacent (sorted), since one program computes a whole run
    pair_index     (P,)        int64, each pair's flat index t*k + j into `routing`; None = 0..P-1

Launch 1 (gate_up), grid (cdiv(I, BLOCK_N), P): program (n, p) with p the first pair of a run of
pairs sharing a row (other programs return at once) computes, for the run's tokens and I-columns
n*BLOCK_N.., h = silu(x @ Wg^T) * (x @ Wu^T) into a (P, I) scratch in the activation dtype.
Launch 2 (down), grid (cdiv(H, BLOCK_N), P): y[pair] = routing[pair] * (h @ Wd^T) into (T*k, H)
float32, stored at each pair's flat index; the caller's sum over k is deterministic (no atomics).

Unpacking: a K-tile of BLOCK_K codes of a weight row is BLOCK_K // (8 // bits) bytes, loaded once.
Instead of interleaving the unpacked fields back into K order, each field f (f = 0..8 // bits - 1,
bits f*bits.. of every byte = elements k0 + j*(8 // bits) + f) is dotted with the matching strided
slice of x: int4 is two dots per tile (low nibble with the even elements of x, high nibble with the
odd ones), int2 four. BLOCK_K divides the group size, so each tile has one scale and offset per row.
Products accumulate in float32; the dequantized weights are rounded to the activation dtype first,
as the dequantize path's weights are.

Import this module only where triton is installed; on CPU it runs under Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported), which the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..store.quant import QuantMeta

ROW_TILE = 16  # tokens one program computes at once (one tl.dot tile of rows)
MAX_TOKENS = 64  # decode batches up to this; longer runs of one expert are split into ROW_TILE chunks
AUTO_MAX_TOKENS = 16  # what `lo_kernel="auto"` hands the kernel: the range measured on the H200
MAX_BLOCK_K = 128  # codes per K-tile at most (32 bytes of a row for int4, 32 for int2 at 128)


@dataclass(frozen=True)
class GroupedConfig:
    """Tile choice: `block_n` output columns per program (>= 16), `num_warps` per program."""

    block_n: int = 32
    num_warps: int = 4

    @classmethod
    def for_tokens(cls, num_tokens: int) -> GroupedConfig:
        """The best tiles of the H200 sweep (BENCHMARKS.md, OLMoE expert shape, int4 and int2):
        block_n 16 at one token (49.5 vs 56.3 us per layer, int4), 64 at 4-8 tokens (111 vs 153 us
        at T=4, 148 vs 219 us at T=8)."""
        return cls(block_n=16 if num_tokens == 1 else 64, num_warps=4)


def block_k_for(group_size: int, bits: int) -> int:
    """K-tile in codes: the group size capped at MAX_BLOCK_K, so one scale per row per tile."""
    return min(group_size, MAX_BLOCK_K) if group_size >= 8 // bits else 0


def check_layout(meta: QuantMeta) -> None:
    """ValueError unless the kernels take `meta`'s lo layout (power-of-two group sizes)."""
    if not meta.is_low_bit:
        raise ValueError(f"the grouped low-bit kernel needs an int4/int2 layout, got {meta.precision}")
    for name, group_size in (("gate_up", meta.group_size_gate_up), ("down", meta.group_size_down)):
        if group_size & (group_size - 1) or not block_k_for(group_size, meta.bits):
            raise ValueError(
                f"the grouped low-bit kernel needs power-of-two group sizes; {name} has {group_size}"
            )


@triton.jit
def _tile_dot(x, w, BLOCK_T: tl.constexpr, BYTES_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """x (BLOCK_T, BYTES_K) @ w (BLOCK_N, BYTES_K)^T -> (BLOCK_T, BLOCK_N) float32."""
    if BLOCK_T == 1:  # one token: a GEMV, no tensor-core padding
        return tl.sum(x.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]
    elif BYTES_K >= 16:  # tl.dot needs K >= 16
        return tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION, out_dtype=tl.float32)
    else:  # tiny groups: broadcast and reduce
        return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _pair_run(
    pair_slot_ptr,
    pair_index_ptr,
    chunk_start_ptr,
    num_pairs,
    pos,
    BLOCK_T: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    CHUNKED: tl.constexpr,
):
    """The run of pairs starting at `pos` that share its row: (pos is not where a program starts
    (inside a run, or with CHUNKED inside a ROW_TILE chunk of a longer run), row (scalar),
    member positions (BLOCK_T,), member mask (BLOCK_T,), flat pair indices (BLOCK_T,))."""
    slot = tl.load(pair_slot_ptr + pos)
    if CHUNKED:  # runs may be longer than BLOCK_T: a program starts at every chunk start
        prev = tl.where(tl.load(chunk_start_ptr + pos) != 0, -1, slot)
    else:
        prev = tl.load(pair_slot_ptr + pos - 1, mask=pos > 0, other=-1)
    member_pos = pos + tl.arange(0, BLOCK_T)
    in_range = member_pos < num_pairs
    member = in_range & (tl.load(pair_slot_ptr + member_pos, mask=in_range, other=-1) == slot)
    if HAS_INDEX:
        pair_index = tl.load(pair_index_ptr + member_pos, mask=member, other=0)
    else:
        pair_index = member_pos.to(tl.int64)
    return (pos > 0) & (prev == slot), slot, member_pos, member, pair_index


@triton.jit
def _row_pointers(arena_ptr, params_ptr, row, row_bytes, row_params, packed_off, scale_off, offset_off):
    """Where one matrix of pool row `row` lives: (packed codes, float16 scales, float16 offsets)."""
    row = row.to(tl.int64)
    params = params_ptr + row * row_params
    return arena_ptr + row * row_bytes + packed_off, params + scale_off, params + offset_off


@triton.jit
def _lowbit_rows_dot(
    x_ptr,
    x_rows,
    stride_x,
    x_mask,
    packed_ptr,
    scale_ptr,
    offset_ptr,
    rows,
    row_mask,
    K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """x[x_rows] (BLOCK_T, K) @ W[rows] (BLOCK_N, K)^T -> (BLOCK_T, BLOCK_N) float32, W dequantized
    from one matrix of a pool row: packed (N, K*BITS/8) uint8, scale/offset (N, K/GROUP_SIZE) f16."""
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_K: tl.constexpr = BLOCK_K // PER_BYTE
    ROW_BYTES: tl.constexpr = K // PER_BYTE
    GROUPS: tl.constexpr = K // GROUP_SIZE
    offs_b = tl.arange(0, BYTES_K)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        packed = tl.load(
            packed_ptr + rows[:, None] * ROW_BYTES + (k0 // PER_BYTE + offs_b)[None, :],
            mask=row_mask[:, None],
            other=0,
        ).to(tl.int32)  # (BLOCK_N, BYTES_K)
        param = rows * GROUPS + k0 // GROUP_SIZE
        scale = tl.load(scale_ptr + param, mask=row_mask, other=0.0).to(tl.float32)
        offset = tl.load(offset_ptr + param, mask=row_mask, other=0.0).to(tl.float32)
        for f in tl.static_range(PER_BYTE):  # field f of each byte holds element k0 + j*PER_BYTE + f
            x = tl.load(
                x_ptr + x_rows[:, None] * stride_x + (k0 + offs_b * PER_BYTE + f)[None, :],
                mask=x_mask[:, None],
                other=0.0,
            )  # (BLOCK_T, BYTES_K)
            codes = ((packed >> (f * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
            w = (codes * scale[:, None] + offset[:, None]).to(x.dtype)
            acc += _tile_dot(x, w, BLOCK_T, BYTES_K, DOT_PRECISION)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr,
    stride_x,
    arena_ptr,
    params_ptr,
    row_bytes,
    row_params,
    pair_slot_ptr,
    pair_index_ptr,
    chunk_start_ptr,
    num_pairs,
    slot_base,
    h_ptr,
    packed_off,
    scale_off,
    offset_off,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    CHUNKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """h[pos] (BLOCK_N columns) = silu(x[token] @ Wg^T) * (x[token] @ Wu^T) for one run of pairs."""
    pid_n = tl.program_id(0)
    pos = tl.program_id(1)
    inside, slot, member_pos, member, pair_index = _pair_run(
        pair_slot_ptr, pair_index_ptr, chunk_start_ptr, num_pairs, pos, BLOCK_T, HAS_INDEX, CHUNKED
    )
    if inside:  # the program of the run's first pair computes it
        return
    packed_ptr, scale_ptr, offset_ptr = _row_pointers(
        arena_ptr, params_ptr, slot + slot_base, row_bytes, row_params, packed_off, scale_off, offset_off
    )
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < INTER
    tokens = pair_index // TOP_K
    gate = _lowbit_rows_dot(x_ptr, tokens, stride_x, member, packed_ptr, scale_ptr, offset_ptr,
                            offs_n, n_mask, HIDDEN, BITS, GROUP_SIZE, BLOCK_T, BLOCK_N, BLOCK_K,
                            DOT_PRECISION)  # fmt: skip
    up = _lowbit_rows_dot(x_ptr, tokens, stride_x, member, packed_ptr, scale_ptr, offset_ptr,
                          offs_n + INTER, n_mask, HIDDEN, BITS, GROUP_SIZE, BLOCK_T, BLOCK_N, BLOCK_K,
                          DOT_PRECISION)  # fmt: skip
    h = gate * tl.sigmoid(gate) * up
    h_ptrs = h_ptr + member_pos[:, None] * INTER + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=member[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    arena_ptr,
    params_ptr,
    row_bytes,
    row_params,
    pair_slot_ptr,
    pair_index_ptr,
    chunk_start_ptr,
    num_pairs,
    slot_base,
    routing_ptr,
    y_ptr,
    packed_off,
    scale_off,
    offset_off,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    CHUNKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """y[pair] (BLOCK_N columns) = routing[pair] * (h[pos] @ Wd^T) for one run of pairs, float32."""
    pid_n = tl.program_id(0)
    pos = tl.program_id(1)
    inside, slot, member_pos, member, pair_index = _pair_run(
        pair_slot_ptr, pair_index_ptr, chunk_start_ptr, num_pairs, pos, BLOCK_T, HAS_INDEX, CHUNKED
    )
    if inside:
        return
    packed_ptr, scale_ptr, offset_ptr = _row_pointers(
        arena_ptr, params_ptr, slot + slot_base, row_bytes, row_params, packed_off, scale_off, offset_off
    )
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < HIDDEN
    acc = _lowbit_rows_dot(h_ptr, member_pos, INTER, member, packed_ptr, scale_ptr, offset_ptr,
                           offs_n, n_mask, INTER, BITS, GROUP_SIZE, BLOCK_T, BLOCK_N, BLOCK_K,
                           DOT_PRECISION)  # fmt: skip
    weight = tl.load(routing_ptr + pair_index, mask=member, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + pair_index[:, None] * HIDDEN + offs_n[None, :]
    tl.store(y_ptrs, acc * weight[:, None], mask=member[:, None] & n_mask[None, :])


def _matrix_offsets(meta: QuantMeta, name: str) -> tuple[int, int, int]:
    """(packed offset in bytes, scale and offset offsets in float16 elements) of `name` in a row."""
    return (
        meta.slot(f"{name}_packed").offset_bytes,
        meta.slot(f"{name}_scale").offset_bytes // 2,
        meta.slot(f"{name}_offset").offset_bytes // 2,
    )


def grouped_lowbit_moe(
    hidden: torch.Tensor,
    routing: torch.Tensor,
    pair_slot: torch.Tensor,
    pair_index: torch.Tensor | None,
    arena: torch.Tensor,
    meta: QuantMeta,
    slot_base: int = 0,
    config: GroupedConfig | None = None,
) -> torch.Tensor:
    """Sum over pairs of routing * expert(x) from packed lo rows, two launches: `(T, H)` in hidden's dtype.

    hidden (T, H), T <= MAX_TOKENS; routing (T, k); pair_slot (P,) int64 with equal rows adjacent,
    the row being `pair_slot + slot_base`; pair_index (P,) int64 flat pair indices or None for
    0..P-1 (then P == T*k); arena (S, nbytes) uint8 lo pool rows laid out as `meta`.
    Pairs not listed contribute nothing. No host sync.
    """
    config = config or GroupedConfig.for_tokens(hidden.shape[0])
    num_tokens, hidden_size = hidden.shape
    top_k = routing.shape[1]
    num_pairs = pair_slot.numel()
    _check_args(hidden, routing, pair_slot, pair_index, arena, meta, config)
    inter = meta.intermediate_size
    hidden = hidden.contiguous()
    routing = routing.contiguous()
    params = arena.view(torch.float16)  # the same bytes, for the scale and offset slots
    h = torch.empty(num_pairs, inter, device=hidden.device, dtype=hidden.dtype)
    alloc = torch.empty if num_pairs == num_tokens * top_k else torch.zeros  # unlisted pairs add 0
    y = alloc(num_tokens * top_k, hidden_size, device=hidden.device, dtype=torch.float32)
    common = {
        "BITS": meta.bits,
        "BLOCK_T": 1 if num_tokens == 1 else ROW_TILE,
        "CHUNKED": num_tokens > ROW_TILE,
        "BLOCK_N": config.block_n,
        "HAS_INDEX": pair_index is not None,
        # float32 inputs would otherwise go through TF32 (10-bit mantissa) on tensor cores
        "DOT_PRECISION": "ieee" if hidden.dtype == torch.float32 else "tf32",
        "num_warps": config.num_warps,
    }
    index = pair_index if pair_index is not None else pair_slot  # unread when HAS_INDEX is False
    # unread unless CHUNKED (more tokens than a row tile, so a run of one expert may need several programs)
    chunk_start = _chunk_starts(pair_slot, ROW_TILE) if num_tokens > ROW_TILE else pair_slot
    _gate_up_kernel[(triton.cdiv(inter, config.block_n), num_pairs)](
        hidden, hidden.stride(0), arena, params, arena.stride(0), params.stride(0),
        pair_slot, index, chunk_start, num_pairs, slot_base, h, *_matrix_offsets(meta, "gate_up"),
        TOP_K=top_k, HIDDEN=hidden_size, INTER=inter, GROUP_SIZE=meta.group_size_gate_up,
        BLOCK_K=block_k_for(meta.group_size_gate_up, meta.bits), **common,
    )  # fmt: skip
    _down_kernel[(triton.cdiv(hidden_size, config.block_n), num_pairs)](
        h, arena, params, arena.stride(0), params.stride(0),
        pair_slot, index, chunk_start, num_pairs, slot_base, routing, y, *_matrix_offsets(meta, "down"),
        HIDDEN=hidden_size, INTER=inter, GROUP_SIZE=meta.group_size_down,
        BLOCK_K=block_k_for(meta.group_size_down, meta.bits), **common,
    )  # fmt: skip
    return y.view(num_tokens, top_k, hidden_size).sum(1).to(hidden.dtype)


def _chunk_starts(pair_slot: torch.Tensor, tile: int) -> torch.Tensor:
    """(P,) int8, 1 where a program starts: at the first pair of every run of equal rows and then every
    `tile` pairs inside the run. On the device, no host sync."""
    positions = torch.arange(pair_slot.numel(), device=pair_slot.device)
    new_run = torch.ones_like(pair_slot, dtype=torch.bool)
    new_run[1:] = pair_slot[1:] != pair_slot[:-1]
    run_start = torch.cummax(torch.where(new_run, positions, torch.zeros_like(positions)), 0).values
    return ((positions - run_start) % tile == 0).to(torch.int8)


def topk_pairs(top_k_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(pair_slot (P,), pair_index (P,) or None)` for every pair of `top_k_index (T, k)`, on its device
    (no host sync): the expert ids as they are for one token (distinct), else sorted by expert."""
    flat = top_k_index.reshape(-1)
    if top_k_index.shape[0] == 1:
        return flat, None
    pair_slot, pair_index = torch.sort(flat, stable=True)
    return pair_slot, pair_index


def _check_args(hidden, routing, pair_slot, pair_index, arena, meta, config) -> None:
    num_tokens, hidden_size = hidden.shape
    if not 1 <= num_tokens <= MAX_TOKENS:
        raise ValueError(f"the grouped low-bit kernel takes 1..{MAX_TOKENS} tokens, got {num_tokens}")
    if hidden_size != meta.hidden_size or routing.shape[0] != num_tokens:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} / routing {tuple(routing.shape)} do not fit H={meta.hidden_size}"
        )
    if pair_slot.dtype != torch.int64 or (pair_index is not None and pair_index.shape != pair_slot.shape):
        raise ValueError("pair_slot and pair_index must be int64 tensors of the same shape")
    if pair_index is None and pair_slot.numel() != routing.numel():
        raise ValueError("pair_index=None needs one pair per (token, expert)")
    if arena.dtype != torch.uint8 or arena.dim() != 2 or arena.shape[1] < meta.nbytes or arena.stride(1) != 1:
        raise ValueError(f"arena must be (S, >= {meta.nbytes}) uint8 rows, got {tuple(arena.shape)}")
    if config.block_n < 16 or config.block_n & (config.block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {config.block_n}")
    check_layout(meta)
