"""Host expert store: every routed expert's weights in host memory, one contiguous buffer each.

Layout of the hi version of one expert (checkpoint dtype or the compute dtype):
    gate_up (2I, H)  rows 0..I-1 = gate projection, rows I..2I-1 = up projection
    down    (H, I)
stored back to back in one flat byte buffer, so one host->device copy moves one expert.
All experts of all MoE layers share one arena tensor `(L * E, bytes_per_expert)` of uint8,
allocated (and, with CUDA, pinned) once, before any weight is read.

Under a `--cpu-memory` cap too small for that arena, the store has no hi arena: the checkpoint is
the bottom tier (`store.mapped`, read in place through a memory map) and a fixed number of hi
versions are staged in host slots (`store.staging`). Every host allocation of expert
versions (arenas, staged slots, a quantizer batch read from the map) is reserved against the
store's `budget` first, and released when it goes.
"""

from __future__ import annotations

from contextlib import contextmanager
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

    def __init__(self, num_layers: int, num_experts: int, shape: ExpertShape, *, pin_memory: bool = False,
                 budget=None, mapped=None):  # fmt: skip
        """`budget`: a `residency.budget.BudgetTracker` of host bytes (None: no cap); `mapped`: the
        checkpoint's `MappedExperts`, to read hi versions from in place of a hi arena."""
        from .tracker import BudgetTracker

        self.num_layers = num_layers
        self.num_experts = num_experts
        self.shape = shape
        self.pin_memory = pin_memory
        self.budget = budget if budget is not None else BudgetTracker(1 << 62)
        self.mapped = mapped
        self.staged = None  # the `store.staging.StagedHi` slots of a mapped store, once made
        self.meta: dict[str, object] = {}
        self.versions: dict[str, torch.Tensor] = {}
        self._filled: torch.Tensor = torch.zeros(num_layers, num_experts, 3, dtype=torch.bool)
        self.checkpoint_dtype: torch.dtype | None = None  # the dtype the checkpoint's tensors came in
        if mapped is None:
            self._allocate("hi", None, shape.hi_nbytes)
        else:
            self.meta["hi"] = None
            self.checkpoint_dtype = mapped.checkpoint_dtype
            for layer, expert, role in mapped.index:
                if 0 <= layer < num_layers and 0 <= expert < num_experts:
                    self._filled[layer, expert, ("gate", "up", "down").index(role)] = True

    # -- allocation ---------------------------------------------------------------------------------
    def _allocate(self, precision: str, meta, nbytes: int) -> torch.Tensor:
        rows = self.num_layers * self.num_experts
        self.budget.reserve(rows * nbytes, precision, f"the host {precision} versions of {rows} experts")
        arena = torch.empty((rows, nbytes), dtype=torch.uint8, pin_memory=self.pin_memory)
        self.meta[precision] = meta
        self.versions[precision] = arena
        return arena

    def bytes_per_expert(self, precision: str = "hi") -> int:
        if precision == "hi" and "hi" not in self.versions:
            return self.shape.hi_nbytes
        return self.versions[precision].shape[1]

    def nbytes(self, precision: str | None = None) -> int:
        """Host bytes held by one precision, or by all of them (staged hi slots included)."""
        names = [precision] if precision else list(self.versions)
        held = sum(self.versions[p].numel() for p in names if p in self.versions)
        if self.staged is not None and precision in (None, "hi"):
            held += self.staged.nbytes
        return held

    # -- the mapped checkpoint as the bottom tier ---------------------------------------------------
    @property
    def hi_mapped(self) -> bool:
        """The hi versions are read from the mapped checkpoint (no hi arena in host memory)."""
        return "hi" not in self.versions and self.mapped is not None

    def hi_source(self, layer: int, expert: int) -> torch.Tensor | None:
        """The host buffer `(nbytes,)` a hi copy of one expert reads: its row of the hi arena, or its
        staged slot; None while it is only on disk (it is then queued for the stager)."""
        if "hi" in self.versions:
            return self.versions["hi"][self.row(layer, expert)]
        return self.staged.get(layer, expert) if self.staged is not None else None

    @contextmanager
    def hi_batches(self, step: int):
        """A function `rows(start, stop)` -> typed hi views `gate_up (G, 2I, H)`, `down (G, H, I)` of
        rows `start..stop-1` (G <= `step`): views of the hi arena, or (mapped) the rows read from the
        map into one buffer of `step` experts, reserved in the budget while the context lives and
        reused by every batch (the views of a batch are valid until the next call)."""
        if "hi" in self.versions:
            yield lambda start, stop: hi_group_views(self.versions["hi"][start:stop], self.shape)
            return
        nbytes = step * self.shape.hi_nbytes
        self.budget.reserve(nbytes, "batch", f"a batch of {step} hi experts read from the checkpoint")
        buffer = torch.empty((step, self.shape.hi_nbytes), dtype=torch.uint8)

        def rows(start: int, stop: int):
            for i, row in enumerate(range(start, stop)):
                layer, expert = divmod(row, self.num_experts)
                self.mapped.read_into(layer, expert, hi_views(buffer[i], self.shape), self.shape.intermediate)
            return hi_group_views(buffer[: stop - start], self.shape)

        try:
            yield rows
        finally:
            self.budget.release(nbytes, "batch")

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
        step = self.experts_per_batch(device)
        if experts_per_batch is not None:
            step = max(1, min(step, experts_per_batch))
        if self.hi_mapped:  # the batch read from the map stays inside what the budget has left
            left = self.budget.total_bytes - self.budget.used_bytes
            step = max(1, min(step, left // shape.hi_nbytes))
        with self.hi_batches(step) as hi_rows:
            for start in range(0, arena.shape[0], step):
                stop = min(start + step, arena.shape[0])
                gate_up, down = hi_rows(start, stop)
                self._quantize_rows(arena, meta, start, stop, gate_up, down, device, hessians)
                if progress is not None:
                    progress.update(stop - start)

    @staticmethod
    def _quantize_rows(arena, meta, start, stop, gate_up, down, device, hessians) -> None:
        """Quantize hi experts `gate_up (G, 2I, H)`, `down (G, H, I)` into `arena[start:stop]`."""
        from . import quant

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
        hi_held = "hi" in self.versions or self.hi_mapped  # (mapped: read from the map)
        if not hi_held or any(p != "hi" and p not in self.versions for p in (hot, cold)):
            return None
        total = self.num_layers * self.num_experts
        gain = torch.zeros(total)
        step = self.experts_per_batch()
        for start in range(0, total, step):
            rows = slice(start, min(start + step, total))
            exact = self._first_rows(rows)
            gain[rows] = self._squared_error(cold, rows, exact) - self._squared_error(hot, rows, exact)
        return gain.view(self.num_layers, self.num_experts)

    def _first_rows(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 `gate_up (G, n, H)`, `down (G, n, I)`: the first n <= GAIN_ROWS rows of each expert's
        hi matrices; a mapped store reads only those rows from the map."""
        n = self.GAIN_ROWS
        if "hi" in self.versions:
            gate_up, down = hi_group_views(self.versions["hi"][rows], self.shape)
            return gate_up[:, :n].float(), down[:, :n].float()
        inter, out = self.shape.intermediate, ([], [])
        for row in range(rows.start, rows.stop):
            layer, expert = divmod(row, self.num_experts)
            gate = self.mapped.tensor(layer, expert, "gate", n)
            if gate.shape[0] < n:  # gate_up's first rows run on into up
                gate = torch.cat([gate, self.mapped.tensor(layer, expert, "up", n - inter)])
            out[0].append(gate.float())
            out[1].append(self.mapped.tensor(layer, expert, "down", n).float())
        return torch.stack(out[0]), torch.stack(out[1])

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
            scale, offset = (
                views[f"{name}_{part}"][:, :n].reshape(p * n, -1) for part in ("scale", "offset")
            )
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
        arena = self.versions.pop(precision, None)
        if arena is not None:
            self.budget.release(arena.numel(), precision)

    def host_stats(self) -> dict:
        """Host-memory counters: staged-cache hits, disk reads (count, checkpoint bytes, seconds),
        staged bytes, the expert bytes held and their peak against the cap, and the process's RSS."""
        from .host_ram import rss_bytes

        rss, hwm = rss_bytes()
        staged, mapped = self.staged, self.mapped
        return {
            "host_cap_bytes": self.budget.total_bytes if self.budget.total_bytes < 1 << 62 else None,
            "host_expert_bytes": self.budget.used_bytes,
            "host_peak_bytes": self.budget.peak_bytes,
            "host_hi_mapped": self.hi_mapped,
            "host_cache_hits": staged.hits if staged is not None else 0,
            "host_cache_requests": staged.requests if staged is not None else 0,
            "host_staged_bytes": staged.nbytes if staged is not None else 0,
            "disk_reads": mapped.reads if mapped is not None else 0,
            "disk_read_bytes": mapped.read_bytes if mapped is not None else 0,
            "disk_read_s": round(mapped.read_s, 6) if mapped is not None else 0.0,
            "rss_bytes": rss,
            "rss_peak_bytes": hwm,
        }

    def close(self) -> None:
        """Stop the stager and unmap the checkpoint (mapped stores)."""
        if self.staged is not None:
            self.staged.close()
        if self.mapped is not None:
            self.mapped.close()
