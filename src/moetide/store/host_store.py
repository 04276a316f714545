"""Host expert store: every routed expert's weights in host memory, one contiguous buffer each.

Layout of the hi version of one expert (checkpoint dtype or the compute dtype):
    gate_up (2I, H)  rows 0..I-1 = gate projection, rows I..2I-1 = up projection
    down    (H, I)
stored back to back in one flat byte buffer, so one host->device copy moves one expert.
All experts of all MoE layers share one arena tensor `(L * E, bytes_per_expert)` of uint8,
allocated (and, with CUDA, pinned) once, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..errors import CheckpointError


@dataclass(frozen=True)
class ExpertShape:
    """Geometry of one routed expert: hidden size H, intermediate size I, storage dtype."""

    hidden: int
    intermediate: int
    dtype: torch.dtype

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def hi_nbytes(self) -> int:
        """Bytes of one expert's hi version: gate_up (2I*H) + down (H*I) elements."""
        return 3 * self.intermediate * self.hidden * self.element_size


def hi_views(buffer: torch.Tensor, shape: ExpertShape) -> dict[str, torch.Tensor]:
    """Typed views `gate_up (2I, H)` and `down (H, I)` of a flat uint8 hi buffer (no copy)."""
    typed = buffer.view(shape.dtype)
    split = 2 * shape.intermediate * shape.hidden
    return {
        "gate_up": typed[:split].view(2 * shape.intermediate, shape.hidden),
        "down": typed[split:].view(shape.hidden, shape.intermediate),
    }


def hi_group_views(arena: torch.Tensor, shape: ExpertShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Strided typed views of many hi buffers `arena (G, nbytes)` uint8 -> `gate_up (G, 2I, H)`,
    `down (G, H, I)`: one group per row, no copy (the layout of `hi_views`, row by row)."""
    typed = arena.view(shape.dtype)
    split = 2 * shape.intermediate * shape.hidden
    gate_up = typed[:, :split].view(arena.shape[0], 2 * shape.intermediate, shape.hidden)
    down = typed[:, split : split + shape.hidden * shape.intermediate].view(
        arena.shape[0], shape.hidden, shape.intermediate
    )
    return gate_up, down


class HostExpertStore:
    """Versions of every (layer, expert) in host memory.

    `versions[precision]` is one arena `(L*E, nbytes)` uint8 with one row per expert; `meta[precision]`
    says how a row is laid out. The hi version is filled from the checkpoint; lo versions are made by
    `add_precision` (quantizing hi) or loaded from a prepared cache.
    """

    def __init__(self, num_layers: int, num_experts: int, shape: ExpertShape, *, pin_memory: bool = False):
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.shape = shape
        self.pin_memory = pin_memory
        self.meta: dict[str, object] = {}
        self.versions: dict[str, torch.Tensor] = {}
        self._filled: torch.Tensor = torch.zeros(num_layers, num_experts, 3, dtype=torch.bool)
        self.checkpoint_dtype: torch.dtype | None = None  # the dtype the checkpoint's tensors came in
        self._allocate("hi", None, shape.hi_nbytes)

    # -- allocation ---------------------------------------------------------------------------------
    def _allocate(self, precision: str, meta, nbytes: int) -> torch.Tensor:
        rows = self.num_layers * self.num_experts
        arena = torch.empty((rows, nbytes), dtype=torch.uint8, pin_memory=self.pin_memory)
        self.meta[precision] = meta
        self.versions[precision] = arena
        return arena

    def bytes_per_expert(self, precision: str = "hi") -> int:
        return self.versions[precision].shape[1]

    def nbytes(self, precision: str | None = None) -> int:
        """Host bytes held by one precision, or by all of them."""
        names = [precision] if precision else list(self.versions)
        return sum(self.versions[p].numel() for p in names)

    # -- access ---------------------------------------------------------------------------------------
    def row(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def buffer(self, layer: int, expert: int, precision: str = "hi") -> torch.Tensor:
        """The flat uint8 buffer `(nbytes,)` of one expert version (a view into the arena)."""
        return self.versions[precision][self.row(layer, expert)]

    def views(self, layer: int, expert: int, precision: str = "hi") -> dict[str, torch.Tensor]:
        """Typed views of one expert version: hi -> `hi_views`; lo -> `quant.expert_views`."""
        if precision == "hi":
            return hi_views(self.buffer(layer, expert, "hi"), self.shape)
        from . import quant

        return quant.expert_views(self.buffer(layer, expert, precision), self.meta[precision])

    # -- filling from a checkpoint ------------------------------------------------------------------
    def put_projection(self, layer: int, expert: int, role: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (gate (I,H), up (I,H) or down (H,I)) into the hi version."""
        if not (0 <= layer < self.num_layers and 0 <= expert < self.num_experts):
            raise CheckpointError(
                f"expert tensor for layer {layer} expert {expert} is outside the model's shape"
            )
        v = self.views(layer, expert, "hi")
        inter = self.shape.intermediate
        target = {"gate": v["gate_up"][:inter], "up": v["gate_up"][inter:], "down": v["down"]}[role]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"expert tensor {role} of layer {layer} expert {expert} has shape {tuple(tensor.shape)},"
                f" expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        self._filled[layer, expert, ("gate", "up", "down").index(role)] = True
        self.checkpoint_dtype = self.checkpoint_dtype or tensor.dtype

    @property
    def values_dtype(self) -> torch.dtype:
        """The narrowest dtype that holds the hi values exactly: the checkpoint's when the store
        widened it to float32 (an exact cast), else the store's. Quantizing is a function of the
        values alone, so two stores with the same values_dtype give the same lo versions."""
        if self.shape.dtype == torch.float32 and self.checkpoint_dtype is not None:
            return self.checkpoint_dtype
        return self.shape.dtype

    def check_complete(self) -> None:
        """Raise CheckpointError naming the first expert tensor the checkpoint did not provide."""
        missing = (~self._filled).nonzero()
        if missing.numel():
            layer, expert, role = missing[0].tolist()
            raise CheckpointError(
                f"checkpoint is missing the {('gate', 'up', 'down')[role]} tensor of layer {layer} expert {expert}"
            )

    # -- lo versions -----------------------------------------------------------------------------------
    def add_precision(
        self,
        precision: str,
        progress=None,
        device: torch.device | str | None = None,
        hessians: tuple[torch.Tensor, torch.Tensor] | None = None,
        experts_per_batch: int | None = None,
    ) -> None:
        """Quantize every hi expert into a new `precision` arena (any low-bit `quant.FORMATS` name).

        Experts are quantized `experts_per_batch` at a time, stacked into one matrix per projection
        (`quant.pack_experts`). `device`: where the quantizer runs (a GPU is faster for large models;
        the result is the same function of the weights, and lands in host memory either way).
        `progress`: anything with `update(n)` (a tqdm bar), advanced by experts.
        `hessians`: a calibrated format's per-expert input statistics, (L*E, H, H) and (L*E, I, I)
        in expert order (`store.calibrate.expert_hessians`).
        `experts_per_batch`: at most that many at a time (a memory budget's share, `experts_fitting`).
        """
        from . import quant

        shape = self.shape
        meta = quant.expert_layout(precision, shape.intermediate, shape.hidden, shape.dtype)
        arena = self._allocate(precision, meta, meta.nbytes)
        gate_up_all, down_all = hi_group_views(self.versions["hi"], shape)
        step = self.experts_per_batch(device)
        if experts_per_batch is not None:
            step = max(1, min(step, experts_per_batch))
        for start in range(0, arena.shape[0], step):
            stop = min(start + step, arena.shape[0])
            gate_up, down = gate_up_all[start:stop], down_all[start:stop]
            part = None if hessians is None else (hessians[0][start:stop], hessians[1][start:stop])
            if device is not None:
                gate_up, down = gate_up.to(device), down.to(device)
                if part is not None:
                    part = (part[0].to(device), part[1].to(device))
                rows = torch.empty((stop - start, meta.nbytes), dtype=torch.uint8, device=device)
                quant.pack_experts(gate_up, down, meta, rows, part)
                arena[start:stop].copy_(rows)
            else:
                quant.pack_experts(gate_up, down, meta, arena[start:stop], part)
            if progress is not None:
                progress.update(stop - start)

    # Weights quantized per batch: 4 M on the CPU (16 MiB per float32 temporary, so a batch's ~20
    # live temporaries stay near the caches), 64 M on a GPU (enough to fill it).
    WEIGHTS_PER_BATCH = MappingProxyType({"cpu": 1 << 22, "cuda": 1 << 26})

    def experts_per_batch(self, device: torch.device | str | None = None) -> int:
        kind = torch.device(device).type if device is not None else "cpu"
        per_expert = 3 * self.shape.intermediate * self.shape.hidden
        return max(1, self.WEIGHTS_PER_BATCH.get(kind, 1 << 22) // per_expert)

    # device bytes the quantizer holds per weight of a batch (its float32 temporaries; measured: a
    # batch of 66 M weights peaked at 1.0 GB on the GPU, 15 bytes per weight)
    QUANT_BYTES_PER_WEIGHT = 20

    def experts_fitting(self, device_bytes: int) -> int:
        """Experts per quantizer batch that fit in `device_bytes` of device memory (0: not one)."""
        per_expert = 3 * self.shape.intermediate * self.shape.hidden * self.QUANT_BYTES_PER_WEIGHT
        return max(0, int(device_bytes) // per_expert)

    GAIN_ROWS = 64

    def promotion_gain(self, hot: str, cold: str) -> torch.Tensor | None:
        """(L, E) float32: how much squared weight error each expert loses when it runs `hot` instead
        of `cold`, estimated on the first GAIN_ROWS rows of gate_up and of down (an expert's rows
        share its weight statistics; the whole matrices would cost a large model tens of seconds of
        start-up); None when a version is not in host memory. Experts are dequantized
        `experts_per_batch` at a time."""
        if any(p not in self.versions for p in ("hi", hot, cold)):
            return None
        gate_up, down = hi_group_views(self.versions["hi"], self.shape)
        gain = torch.zeros(gate_up.shape[0])
        step = self.experts_per_batch()
        for start in range(0, gate_up.shape[0], step):
            rows = slice(start, start + step)
            exact = (gate_up[rows, : self.GAIN_ROWS].float(), down[rows, : self.GAIN_ROWS].float())
            gain[rows] = self._squared_error(cold, rows, exact) - self._squared_error(hot, rows, exact)
        return gain.view(self.num_layers, self.num_experts)

    def _squared_error(self, precision: str, rows: slice, exact) -> torch.Tensor:
        """Per expert of `rows`, the squared error of `precision`'s weights against `exact`."""
        from . import quant

        if precision == "hi":
            return torch.zeros(exact[0].shape[0])
        meta = self.meta[precision]
        views = quant.expert_row_views(self.versions[precision][rows], meta)
        error = torch.zeros(exact[0].shape[0])
        for name, weight in zip(("gate_up", "down"), exact, strict=True):
            p, n, k = weight.shape  # n <= GAIN_ROWS: the sampled rows
            packed = views[f"{name}_packed"][:, :n]
            codes = quant.unpack(packed, meta.bits_of(name)).reshape(p * n, k)
            scale, offset = (views[f"{name}_{part}"][:, :n].reshape(p * n, -1) for part in ("scale", "offset"))
            w_hat = quant.dequantize_matrix(codes, scale, offset, torch.float32).view(p, n, k)
            error += (w_hat - weight).square().sum((1, 2))
        return error

    def load_precision(self, precision: str, arena: torch.Tensor, meta) -> None:
        """Adopt a prepared arena (from the on-disk cache) for `precision`."""
        target = self._allocate(precision, meta, arena.shape[1])
        if tuple(arena.shape) != tuple(target.shape):
            raise CheckpointError(
                f"prepared {precision} cache has shape {tuple(arena.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(arena)

    def drop_precision(self, precision: str) -> None:
        """Free a version the user does not want kept in host memory (its layout `meta` stays: the
        device copies are still described by it)."""
        self.versions.pop(precision, None)
