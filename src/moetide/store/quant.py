"""Expert weight formats: bit packing and kernel-ready buffers (the quantizers are in `quantize`).

Everything here is a pure function of its inputs (no module state, no device assumptions): the same
calls run on CPU and CUDA tensors.

An expert (one FFN of an MoE layer) is two matrices in the checkpoint dtype (bf16 or fp32):
    gate_up (2I, H)  rows 0..I-1 = gate projection, rows I..2I-1 = up projection
    down    (H, I)
and computes, for tokens x (T, H):  down(silu(x @ gate^T) * (x @ up^T)) -> (T, H).

Quantization (one matrix W (N, K), groups of `group_size` consecutive elements along K, the input
dimension, so that one group's scale multiplies one contiguous run of a row):
    code   = clamp(round((W - offset) / scale), 0, 2**bits - 1)      uint8, one per element
    W_hat  = code * scale + offset                                   (dequantized, one FMA)
    scale, offset: (N, K // group_size) float16 (see PARAM_DTYPE for why float16)
The offset form (offset = start of the group's quantization window, its minimum for plain RTN) rather
than an integer zero-point keeps both parameters in the weights' own range, so a group far from zero
cannot overflow float16.

Packing: codes are packed along K, element k of a row in byte k // (8 // bits) at bit position
(k % (8 // bits)) * bits (little end first). int4: two per byte, int2: four per byte.

Formats (`FORMATS`, the one registry of precisions; every other module reads it): each matrix of an
expert carries its own bit width and group size, so one version can hold gate_up in int2 and down in
int4 ("int2+4"). Names: "hi" (alias "bf16", the checkpoint dtype), "int<b>" (both matrices b bits),
"int<g>+<d>" (gate_up g bits, down d bits).

Kernel-ready buffer: one flat uint8 tensor per expert version, its layout described by `QuantMeta`.
    hi  (precision "hi"): slots gate_up (2I, H) and down (H, I) in the checkpoint dtype.
    lo  (any other format): slots, with b_gu / b_dn the bits of gate_up / down
        gate_up_packed (2I, H * b_gu // 8) uint8   gate_up_scale (2I, H // g_gu) f16
        gate_up_offset (2I, H // g_gu) f16
        down_packed    (H,  I * b_dn // 8) uint8   down_scale    (H,  I // g_dn) f16
        down_offset    (H,  I // g_dn) f16
Every slot starts at a multiple of ALIGN_BYTES, so typed views need no copy and kernels may use
vector loads. A host->GPU move of a version is one memcpy of the whole buffer.

Metadata schema (`QuantMeta`, frozen, hashable):
    precision            a FORMATS name ("hi", "int4", "int2", "int2+4", ...)
    dtype                checkpoint dtype (torch.bfloat16 or torch.float32); dequantize target
    intermediate_size    I
    hidden_size          H
    bits_gate_up         b_gu: 4 or 2 for lo; the dtype's bit width (16 / 32) for hi
    bits_down            b_dn: likewise, for down
    group_size_gate_up   g_gu (0 for hi): group size along H for gate_up
    group_size_down      g_dn (0 for hi): group size along I for down
    quant_method         "rtn" | "mse" | "hqq" | "ls" | "gptq" | "" (hi); how the parameters were chosen (informational)
    slots                tuple of TensorSlot(name, dtype, shape, offset_bytes), in buffer order
    nbytes               total buffer size, a multiple of ALIGN_BYTES
    bits                 (property) the one bit width of a uniform format; ValueError for a mixed one
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F

from .formats import (  # noqa: F401 - re-exported: the registry's names are part of the format API
    FORMATS,
    HI_ALIASES,
    LOW_BIT_FORMATS,
    FormatSpec,
    format_spec,
    normalize_precision,
    precision_names,
)
from .quantize import (  # noqa: F401 - re-exported: the quantizers are part of the format API
    CLIP_RATIOS,
    DEFAULT_GROUP_SIZE,
    DEFAULT_QUANT_METHOD,
    GPTQ_BLOCK,
    GPTQ_DAMP,
    HQQ_BETA,
    HQQ_ITERS,
    HQQ_KAPPA,
    HQQ_LP_NORM,
    LS_CLIP_RATIOS,
    LS_ITERS,
    MIN_DEFAULT_GROUP_SIZE,
    PARAM_DTYPE,
    QUANT_CHUNK_ELEMENTS,
    QUANT_CHUNK_ELEMENTS_GPU,
    QUANT_METHODS,
    QuantizedMatrix,
    _check_group_size,
    default_group_size,
    dequantize_matrix,
    quantize,
    quantize_gptq,
)

# 64 bytes = one CPU cache line and a multiple of the 16-byte vector loads GPU kernels use; the cost is
# under 64 bytes per slot, against megabytes per expert.
ALIGN_BYTES = 64


HI_PRECISION_ALIASES = HI_ALIASES
# Uniform low-bit formats by bit width (the single-width API of `quantize` and older callers).
LOW_BIT_PRECISIONS = MappingProxyType(
    {n: f.bits_gate_up for n, f in FORMATS.items() if f.is_low_bit and f.bits_gate_up == f.bits_down}
)


@dataclass(frozen=True)
class TensorSlot:
    """One typed tensor inside a flat expert buffer, at `offset_bytes` from the buffer's start."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset_bytes: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class QuantMeta:
    """Layout of one expert version's flat buffer; see the module docstring for the schema."""

    precision: str
    dtype: torch.dtype
    intermediate_size: int
    hidden_size: int
    bits_gate_up: int
    bits_down: int
    group_size_gate_up: int
    group_size_down: int
    quant_method: str
    slots: tuple[TensorSlot, ...]
    nbytes: int

    @property
    def is_low_bit(self) -> bool:
        return self.precision != "hi"

    @property
    def bits(self) -> int:
        """The bit width of a uniform format; a mixed one ("int2+4") has none."""
        if self.bits_gate_up != self.bits_down:
            raise ValueError(
                f"{self.precision} has {self.bits_gate_up}-bit gate_up and {self.bits_down}-bit down;"
                " read bits_gate_up / bits_down"
            )
        return self.bits_gate_up

    def bits_of(self, matrix: str) -> int:
        """Bits of "gate_up" or "down"."""
        return {"gate_up": self.bits_gate_up, "down": self.bits_down}[matrix]

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per expert weight: scales, offsets and alignment padding included."""
        return 8 * self.nbytes / (3 * self.intermediate_size * self.hidden_size)

    def slot(self, name: str) -> TensorSlot:
        for slot in self.slots:
            if slot.name == name:
                return slot
        raise KeyError(f"no slot {name!r} in a {self.precision} expert layout")


# ---------------------------------------------------------------------------------------------
# Bit packing
# ---------------------------------------------------------------------------------------------


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes along the last dimension: (..., K) uint8 in [0, 2**bits) -> (..., K * bits // 8) uint8.

    K must be a multiple of 8 // bits. Element k goes to byte k // (8 // bits), bit (k % (8 // bits)) * bits.
    """
    per_byte = _values_per_byte(bits)
    if codes.dtype != torch.uint8 or codes.shape[-1] % per_byte:
        raise ValueError(
            f"codes must be uint8 with last dim a multiple of {per_byte}, got {codes.dtype} "
            f"{tuple(codes.shape)}"
        )
    # NOTE: host sync; packing is offline.
    if codes.numel() and int(codes.max()) >= 2**bits:
        raise ValueError(f"codes exceed {bits} bits")
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte).to(torch.int32)
    shifts = _bit_shifts(bits, codes.device, torch.int32)
    # Fields occupy disjoint bits, so their sum is their bitwise OR.
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: (..., Kp) uint8 -> (..., Kp * 8 // bits) uint8 codes."""
    per_byte = _values_per_byte(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    shifts = _bit_shifts(bits, packed.device, torch.uint8)
    fields = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return fields.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def _values_per_byte(bits: int) -> int:
    if bits not in (2, 4):
        raise ValueError(f"bits must be 4 or 2, got {bits}")
    return 8 // bits


def _bit_shifts(bits: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(0, 8, bits, device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Kernel-ready expert buffers
# ---------------------------------------------------------------------------------------------


def bits_per_weight(precision: str, intermediate_size: int, hidden_size: int) -> float:
    """Stored bits per expert weight of a format (scales, offsets and padding included; hi = bf16)."""
    nbytes = expert_layout(precision, intermediate_size, hidden_size, torch.bfloat16).nbytes
    return 8 * nbytes / (3 * intermediate_size * hidden_size)


def expert_layout(
    precision: str,
    intermediate_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    group_size: int | tuple[int, int] | None = None,
    quant_method: str = DEFAULT_QUANT_METHOD,
) -> QuantMeta:
    """The buffer layout of one expert version, without any data.

    group_size: one size for both matrices, or (gate_up's along H, down's along I); None =
    `default_group_size` for each matrix's K. Ignored for "hi".
    """
    precision = normalize_precision(precision)
    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ValueError(f"checkpoint dtype must be bf16, fp16 or fp32, got {dtype}")
    if intermediate_size <= 0 or hidden_size <= 0:
        raise ValueError(f"sizes must be positive, got I={intermediate_size} H={hidden_size}")
    if precision == "hi":
        return _hi_layout(intermediate_size, hidden_size, dtype)
    if quant_method not in QUANT_METHODS:
        raise ValueError(f"quant_method must be one of {sorted(QUANT_METHODS)}, got {quant_method!r}")
    spec = FORMATS[precision]
    quant_method = spec.calibration or quant_method  # a calibrated format's codes come from its method
    gs_gate_up, gs_down = _split_group_sizes(group_size, spec, intermediate_size, hidden_size)
    _check_group_size(hidden_size, gs_gate_up, spec.bits_gate_up)
    _check_group_size(intermediate_size, gs_down, spec.bits_down)
    shapes = _low_bit_slot_shapes(intermediate_size, hidden_size, spec, gs_gate_up, gs_down)
    slots, nbytes = _place_slots(shapes)
    return QuantMeta(
        precision,
        dtype,
        intermediate_size,
        hidden_size,
        spec.bits_gate_up,
        spec.bits_down,
        gs_gate_up,
        gs_down,
        quant_method,
        slots,
        nbytes,
    )


def nbytes_for(
    precision: str,
    intermediate_size: int,
    hidden_size: int,
    dtype: torch.dtype,
    group_size: int | tuple[int, int] | None = None,
) -> int:
    """Bytes of one expert version's buffer (ALIGN_BYTES-aligned), for budgeting without packing."""
    return expert_layout(precision, intermediate_size, hidden_size, dtype, group_size).nbytes


def pack_expert(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    precision: str,
    *,
    group_size: int | tuple[int, int] | None = None,
    quant_method: str = DEFAULT_QUANT_METHOD,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, QuantMeta]:
    """Build one expert version's flat buffer.

    gate_up (2I, H), down (H, I): same float dtype (the checkpoint dtype, which "hi" stores as is).
    precision: a FORMATS name ("hi"/"bf16", "int4", "int2+4", "int2", ...).
    out: optional 1-D uint8 tensor of at least meta.nbytes bytes to write into (e.g. a slice of a
    pinned host arena, starting at an ALIGN_BYTES-aligned offset); allocated on gate_up's device if None.
    Returns (buffer (meta.nbytes,) uint8, meta).
    """
    intermediate_size, hidden_size = _expert_sizes(gate_up, down)
    meta = expert_layout(precision, intermediate_size, hidden_size, gate_up.dtype, group_size, quant_method)
    buffer = _output_buffer(out, meta.nbytes, gate_up.device)
    pack_experts(gate_up[None], down[None], meta, buffer[None])
    return buffer, meta


def pack_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    meta: QuantMeta,
    rows: torch.Tensor,
    hessians: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Quantize and pack P experts at once into `rows (P, >= meta.nbytes)` uint8, in `meta`'s layout.

    hessians: for meta.quant_method "gptq" (a calibrated format), each projection's input second
    moments per expert, (P, H, H) for gate_up and (P, I, I) for down (`store.calibrate`).

    gate_up (P, 2I, H), down (P, H, I), any float dtype and device. Groups run along rows, so P
    experts stacked are one (P * N, K) matrix per projection: a few hundred large kernels instead of
    that many per expert. Each group's result equals the one-expert quantizer's, or has a lower
    squared error (HQQ's refinement stops when no group of the batch improves any more, and keeps
    each group's best; tests/test_quant.py checks it).
    """
    views = expert_row_views(rows, meta)
    if not meta.is_low_bit:
        views["gate_up"].copy_(gate_up)
        views["down"].copy_(down)
        return
    for name, weight, group_size in (
        ("gate_up", gate_up, meta.group_size_gate_up),
        ("down", down, meta.group_size_down),
    ):
        p, n_rows, k = weight.shape
        bits = meta.bits_of(name)
        if meta.quant_method == "gptq":
            if hessians is None:
                raise ValueError(f"{meta.precision} is calibrated: pack_experts needs hessians")
            hessian = hessians[0] if name == "gate_up" else hessians[1]
            q = quantize_gptq(weight, hessian, bits, group_size)
        else:
            q = quantize(weight.reshape(p * n_rows, k), bits, group_size, meta.quant_method)
        views[f"{name}_packed"].copy_(pack(q.codes, bits).view(p, n_rows, -1))
        views[f"{name}_scale"].copy_(q.scale.view(p, n_rows, -1))
        views[f"{name}_offset"].copy_(q.offset.view(p, n_rows, -1))


def expert_row_views(rows: torch.Tensor, meta: QuantMeta) -> dict[str, torch.Tensor]:
    """Strided typed views `(P, *slot.shape)` of every slot of `rows (P, >= meta.nbytes)` uint8; no copy."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] < meta.nbytes:
        raise ValueError(
            f"rows must be 2-D uint8 of >= {meta.nbytes} bytes each, got {rows.dtype} {tuple(rows.shape)}"
        )
    views = {}
    for slot in meta.slots:
        raw = rows[:, slot.offset_bytes : slot.offset_bytes + slot.nbytes]
        views[slot.name] = raw.view(slot.dtype).view(rows.shape[0], *slot.shape)
    return views


def expert_views(buffer: torch.Tensor, meta: QuantMeta) -> dict[str, torch.Tensor]:
    """Typed views of the slots of `buffer` (1-D uint8, >= meta.nbytes): they alias it, no copies.

    hi: {"gate_up": (2I, H), "down": (H, I)} in meta.dtype.
    lo: {"gate_up_packed", "gate_up_scale", "gate_up_offset", "down_packed", "down_scale",
    "down_offset"} with the shapes in the module docstring.
    """
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < meta.nbytes:
        raise ValueError(
            f"buffer must be 1-D uint8 of >= {meta.nbytes} bytes, got {buffer.dtype} {tuple(buffer.shape)}"
        )
    return {slot.name: _slot_view(buffer, slot) for slot in meta.slots}


def dequantize(
    views: dict[str, torch.Tensor], meta: QuantMeta, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialize (gate_up (2I, H), down (H, I)) in `dtype` (default meta.dtype) from an expert's views.

    For "hi" this returns the views themselves (cast only if `dtype` differs).
    """
    dtype = meta.dtype if dtype is None else dtype
    if not meta.is_low_bit:
        return views["gate_up"].to(dtype), views["down"].to(dtype)
    return (
        _dequantize_slot(views, "gate_up", meta.bits_gate_up, dtype),
        _dequantize_slot(views, "down", meta.bits_down, dtype),
    )


def swiglu_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Reference expert: x (T, H), gate_up (2I, H), down (H, I) -> (T, H)."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def _hi_layout(intermediate_size: int, hidden_size: int, dtype: torch.dtype) -> QuantMeta:
    shapes = (
        ("gate_up", dtype, (2 * intermediate_size, hidden_size)),
        ("down", dtype, (hidden_size, intermediate_size)),
    )
    slots, nbytes = _place_slots(shapes)
    bits = _itemsize(dtype) * 8
    return QuantMeta("hi", dtype, intermediate_size, hidden_size, bits, bits, 0, 0, "", slots, nbytes)


def _low_bit_slot_shapes(
    intermediate_size: int, hidden_size: int, spec: FormatSpec, gs_gate_up: int, gs_down: int
) -> tuple[tuple[str, torch.dtype, tuple[int, int]], ...]:
    shapes = []
    for name, n_rows, k, bits, group_size in (
        ("gate_up", 2 * intermediate_size, hidden_size, spec.bits_gate_up, gs_gate_up),
        ("down", hidden_size, intermediate_size, spec.bits_down, gs_down),
    ):
        shapes += [
            (f"{name}_packed", torch.uint8, (n_rows, k * bits // 8)),
            (f"{name}_scale", PARAM_DTYPE, (n_rows, k // group_size)),
            (f"{name}_offset", PARAM_DTYPE, (n_rows, k // group_size)),
        ]
    return tuple(shapes)


def _place_slots(shapes) -> tuple[tuple[TensorSlot, ...], int]:
    """Lay slots out back to back, each at the next ALIGN_BYTES boundary. Returns (slots, total bytes)."""
    slots, cursor = [], 0
    for name, dtype, shape in shapes:
        slot = TensorSlot(name, dtype, tuple(shape), cursor)
        slots.append(slot)
        cursor = _align_up(cursor + slot.nbytes)
    return tuple(slots), cursor


def _align_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _split_group_sizes(
    group_size: int | tuple[int, int] | None, spec: FormatSpec, intermediate_size: int, hidden_size: int
) -> tuple[int, int]:
    """(gate_up's group size along H, down's along I): given, else the format's, else the default."""
    if isinstance(group_size, int):
        return group_size, group_size
    if group_size is not None:
        gs_gate_up, gs_down = group_size
        return gs_gate_up, gs_down
    return (
        default_group_size(spec.bits_gate_up, hidden_size, spec.group_size_gate_up),
        default_group_size(spec.bits_down, intermediate_size, spec.group_size_down),
    )


def _expert_sizes(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, int]:
    """(I, H) from gate_up (2I, H) and down (H, I); ValueError if they do not fit together."""
    if gate_up.dim() != 2 or down.dim() != 2 or gate_up.shape[0] % 2:
        raise ValueError(
            f"expected gate_up (2I, H) and down (H, I), got {tuple(gate_up.shape)} and {tuple(down.shape)}"
        )
    intermediate_size, hidden_size = gate_up.shape[0] // 2, gate_up.shape[1]
    if tuple(down.shape) != (hidden_size, intermediate_size) or down.dtype != gate_up.dtype:
        raise ValueError(
            f"down must be ({hidden_size}, {intermediate_size}) {gate_up.dtype}, got "
            f"{tuple(down.shape)} {down.dtype}"
        )
    return intermediate_size, hidden_size


def _output_buffer(out: torch.Tensor | None, nbytes: int, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < nbytes:
        raise ValueError(f"out must be 1-D uint8 of >= {nbytes} bytes, got {out.dtype} {tuple(out.shape)}")
    return out[:nbytes]


def _slot_view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    raw = buffer[slot.offset_bytes : slot.offset_bytes + slot.nbytes]
    return raw.view(slot.dtype).view(slot.shape)


def _dequantize_slot(
    views: dict[str, torch.Tensor], name: str, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    codes = unpack(views[f"{name}_packed"], bits)
    return dequantize_matrix(codes, views[f"{name}_scale"], views[f"{name}_offset"], dtype)
