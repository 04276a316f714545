"""Many lo expert versions at once: typed views over rows of a lo arena and a batched dequantize.

rows (P, nbytes) uint8: P expert buffers in the layout of `quant.expert_layout` (one per row).
Dequantizing P experts in one pass costs the same ~10 kernel launches as one expert does.
"""

from __future__ import annotations

import torch

from ..store import quant


def row_views(rows: torch.Tensor, meta: quant.QuantMeta) -> dict[str, torch.Tensor]:
    """Strided typed views `(P, *slot.shape)` of every slot of `rows (P, nbytes)`; no copy."""
    return quant.expert_row_views(rows, meta)


def _dequantize_batched(
    packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """packed (P, N, Kp) uint8, scale/offset (P, N, G) -> (P, N, K) in `dtype`."""
    codes = quant.unpack(packed, bits)  # (P, N, K)
    p, n, k = codes.shape
    groups = scale.shape[-1]
    # fp32 math on the CPU (exact reference); in bf16/fp16 on the GPU: codes <= 15 are exact there and
    # the one rounding of code*scale+offset is ~100x below the int4 quantization error, for half the
    # bytes of an fp32 intermediate (this pass is memory-bound)
    work = torch.float32 if codes.device.type == "cpu" or dtype == torch.float32 else dtype
    grouped = codes.view(p, n, groups, k // groups).to(work)
    w = torch.addcmul(offset.to(work).unsqueeze(-1), grouped, scale.to(work).unsqueeze(-1))
    return w.view(p, n, k).to(dtype)


def dequantize_rows(
    rows: torch.Tensor, meta: quant.QuantMeta, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows (P, nbytes)` of lo versions -> `gate_up (P, 2I, H)`, `down (P, H, I)` in `dtype`.

    Each matrix is unpacked at its own width (`meta.bits_gate_up`, `meta.bits_down`): "int2+4" rows
    give int2 gate_up and int4 down."""
    v = row_views(rows, meta)
    gate_up, down = (
        _dequantize_batched(
            v[f"{name}_packed"], v[f"{name}_scale"], v[f"{name}_offset"], meta.bits_of(name), dtype
        )
        for name in ("gate_up", "down")
    )
    return gate_up, down
