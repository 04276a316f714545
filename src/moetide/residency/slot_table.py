"""Where the fused MoE kernel finds each expert's weights: pools of fixed slots and a per-layer table.

A *pool* is one device arena `(S, row_bytes)` uint8 whose rows all hold expert versions in one
format (`PoolFormat`): the hi pool's dense rows (checkpoint dtype) or the lo pool's packed rows
(int4/int2, each projection in its own bit width). The *slot table* of a layer maps each expert
to `(pool id, slot)`:

    pool_of (E,) int32     index into the pools list, or -1: no version to run (the expert adds 0)
    slot_of (P, E) int32   the row of each pool's arena that holds the expert's version there (or
                           (E,): one row number whatever the pool, for tables that never change)

The table is device memory: the kernel reads it, so the host never resolves a version in the
forward pass. Who writes it (the residency core) decides which version a step uses. A slot row per
pool lets a copy stream switch an expert to a new version while a step runs, with no torn entry:
it writes the new pool's slot first (no reader looks there yet), then `pool_of` (one 4-byte word);
a reader sees the old version or the new one, each with its own slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NOT_RESIDENT = -1
UNUSED = -2  # in a step's record of where each expert ran from: no token chose it
WAITED = 1 << 8  # added to the pool id in that record: its copy was in flight when the layer was sent
#                  to it (wait_for_copies), the layer waited for it to land if it had not yet


def slot_in_pool(slot_of: torch.Tensor, pool: int, expert: int):
    """The slot of `expert` in pool `pool`: `slot_of[pool, expert]` for a (P, E) table, else
    `slot_of[expert]` (a scalar tensor)."""
    return slot_of[pool, expert] if slot_of.dim() == 2 else slot_of[expert]


@dataclass(frozen=True)
class MatrixFormat:
    """One projection inside a slot row.

    bits: 16/32 for a dense matrix in the pool dtype; 4 or 2 for packed codes.
    group_size: codes per scale/offset pair along K (0 when dense).
    data_offset: where the matrix starts in a row, in elements of its view (dense: the dtype's
        elements; packed: bytes).
    scale_offset, offset_offset: where its float16 scales / offsets start, in float16 elements.
    """

    bits: int
    group_size: int
    data_offset: int
    scale_offset: int = 0
    offset_offset: int = 0

    @property
    def packed(self) -> bool:
        return self.bits < 8


@dataclass(frozen=True)
class PoolFormat:
    """The layout of every row of one pool: gate_up (2I, H) and down (H, I) of one expert."""

    gate_up: MatrixFormat
    down: MatrixFormat
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype  # the dense dtype (hi) or the dtype codes dequantize to (lo)

    @property
    def name(self) -> str:
        """The tile table's name of the layout: "bfloat16", "int4", "int2", "int2+int4", ...; a packed
        matrix whose groups are not its width's default along its K gets them named ("int2+int2g32":
        int2 down in groups of 32), since its products are that wide and want their own tiles."""
        from ..store.quant import default_group_size

        def one(m: MatrixFormat, k: int) -> str:
            if not m.packed:
                return str(self.dtype).removeprefix("torch.")
            try:
                default = default_group_size(m.bits, k)
            except ValueError:
                default = None
            return f"int{m.bits}" + ("" if m.group_size == default else f"g{m.group_size}")

        gu, dn = one(self.gate_up, self.hidden_size), one(self.down, self.intermediate_size)
        return gu if gu == dn else f"{gu}+{dn}"


@dataclass(frozen=True)
class Pool:
    """A device arena `(S, row_bytes)` uint8 with its rows' format."""

    arena: torch.Tensor
    format: PoolFormat

    def data_view(self, matrix: MatrixFormat) -> torch.Tensor:
        """The arena as the element type `matrix`'s data is addressed in: `(S, row elements)`."""
        return self.arena if matrix.packed else self.arena.view(self.format.dtype)

    def param_view(self) -> torch.Tensor:
        """The arena as float16 `(S, row_bytes // 2)`: scales and offsets of packed matrices."""
        return self.arena.view(torch.float16)

    def weights(self, slot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot `slot` as dense `gate_up (2I, H)`, `down (H, I)` in `dtype` (packed ones dequantized):
        the reference path's weights."""
        f = self.format
        inter, hidden = f.intermediate_size, f.hidden_size
        return (
            self._matrix(slot, f.gate_up, 2 * inter, hidden, dtype),
            self._matrix(slot, f.down, hidden, inter, dtype),
        )

    def _matrix(self, slot: int, m: MatrixFormat, rows: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        data = self.data_view(m)[slot]
        if not m.packed:
            return data[m.data_offset : m.data_offset + rows * k].view(rows, k).to(dtype)
        from ..store import quant

        row_bytes = k * m.bits // 8
        packed = data[m.data_offset : m.data_offset + rows * row_bytes].view(rows, row_bytes)
        params = self.param_view()[slot]
        groups = rows * (k // m.group_size)
        scale = params[m.scale_offset : m.scale_offset + groups].view(rows, -1)
        offset = params[m.offset_offset : m.offset_offset + groups].view(rows, -1)
        return quant.dequantize_matrix(quant.unpack(packed, m.bits), scale, offset, dtype)


def dense_format(hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> PoolFormat:
    """The hi layout of `store.host_store.hi_views`: gate_up then down, back to back."""
    bits = torch.empty((), dtype=dtype).element_size() * 8
    return PoolFormat(
        MatrixFormat(bits, 0, 0),
        MatrixFormat(bits, 0, 2 * intermediate_size * hidden_size),
        hidden_size,
        intermediate_size,
        dtype,
    )


def matrix_bits(meta, name: str) -> int:
    """Bit width of projection `name` ("gate_up" | "down") of a lo layout (per-tensor precision)."""
    return int(meta.bits_of(name))


def packed_format(meta, dtype: torch.dtype) -> PoolFormat:
    """The lo layout of `store.quant.expert_layout` (`meta`), dequantized to `dtype`."""

    def matrix(name: str, group_size: int) -> MatrixFormat:
        return MatrixFormat(
            matrix_bits(meta, name),
            group_size,
            meta.slot(f"{name}_packed").offset_bytes,
            meta.slot(f"{name}_scale").offset_bytes // 2,
            meta.slot(f"{name}_offset").offset_bytes // 2,
        )

    return PoolFormat(
        matrix("gate_up", meta.group_size_gate_up),
        matrix("down", meta.group_size_down),
        meta.hidden_size,
        meta.intermediate_size,
        dtype,
    )


def pool_for(arena: torch.Tensor, meta, shape, dtype: torch.dtype) -> Pool:
    """A `Pool` over `arena (S, row_bytes)`: packed rows laid out as `meta`, or (meta None or hi)
    dense rows of `shape` (`ExpertShape`) in `shape.dtype`."""
    if meta is None or not getattr(meta, "is_low_bit", False):
        return Pool(arena, dense_format(shape.hidden, shape.intermediate, shape.dtype))
    return Pool(arena, packed_format(meta, dtype))


class _CudaArrayInterface:
    """The minimal `__cuda_array_interface__` holder `torch.as_tensor` wraps without a copy."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over the pinned host tensor `host` (same bytes, same shape, uint8): under UVA
    pinned host memory is device-addressable, so kernels read it in place over PCIe (zero-copy).
    `host` must stay alive as long as the alias is used (the host store keeps its arenas)."""
    if not host.is_pinned():
        raise ValueError("zero-copy reads need pinned host memory")
    flat = torch.as_tensor(_CudaArrayInterface(host.data_ptr(), host.numel() * host.element_size()), device=device)
    return flat.view(host.shape) if host.dtype == torch.uint8 else flat
