"""The simplest residency: every expert a step needs is read from the host store on demand.

On a CUDA device each needed expert's hi buffer is copied host->device for the step and dropped
after it (no cache): this is the foundation's reference behaviour and a correctness baseline. On the
CPU, where host and device memory are the same, the store's buffers are used in place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..store.host_store import HostExpertStore, hi_views
from .metrics import ExpertMetrics


@dataclass
class ResolvedExpert:
    """What a handle resolves to: a complete, usable version of one expert.

    Direct residency only ever resolves hi versions: `views` = gate_up (2I, H), down (H, I) on the
    compute device (lo versions live in the residency core's `DeviceVersion`).
    """

    precision: str
    views: dict[str, torch.Tensor]
    meta: object = None
    pool: str = "store"  # the kernel pool holding it (`DirectResidency.kernel_pools`)
    slot: int = 0


class DirectResidency:
    """No cache: fetch every needed expert each step. Counts bytes and stall time."""

    def __init__(self, store: HostExpertStore, metrics: ExpertMetrics, device_type: str = "cpu"):
        self.store = store
        self.metrics = metrics
        self.device_type = device_type
        self._pools = None
        self._table = None
        self._staged = None  # (n, bytes) on the device: the experts of the last acquire (GPU)

    table_mode = False  # steps resolve their experts through `acquire` (no device table to write)

    def begin_iteration(self, iteration: int) -> None:
        pass

    def acquire(
        self, layer: int, experts: list[int], device: torch.device
    ) -> tuple[dict[int, ResolvedExpert], list]:
        counters = self.metrics.layers[layer]
        counters.used += len(experts)
        resolved = {}
        start = time.perf_counter()
        rows = []
        for slot, e in enumerate(experts):
            buf = self.store.buffer(layer, e, "hi")
            if buf.device != device:
                buf = buf.to(device, non_blocking=True)
                self.metrics.add_copy(buf.numel())
                counters.misses += 1
            else:
                counters.hits += 1
            rows.append(buf)
            resolved[e] = ResolvedExpert("hi", hi_views(buf, self.store.shape), slot=slot)
        # this step's experts as one arena: the kernel's only pool until the next acquire
        self._staged = torch.stack(rows) if rows else None
        if device.type == "cuda" and counters.misses:
            torch.cuda.current_stream(device).synchronize()  # the copies above are the stall
        counters.stall_s += time.perf_counter() - start if device.type == "cuda" else 0.0
        return resolved, []

    def release(self, layer: int, experts: list[int]) -> None:
        pass

    pool_ids = {"store": 0}

    def kernel_pools(self, dtype: torch.dtype) -> list:
        """The one pool: on the CPU the host store's hi arena (host memory is the device's), on a
        GPU the experts the last `acquire` copied over, slot i = its i-th expert."""
        if self.device_type != "cpu" and self._staged is not None:
            from .slot_table import pool_for

            return [pool_for(self._staged, None, self.store.shape, dtype)]
        if self._pools is None:
            from .slot_table import pool_for

            self._pools = [pool_for(self.store.versions["hi"], None, self.store.shape, dtype)]
        return self._pools

    def static_table(self, layer: int):
        """On the CPU the store is the device memory: every expert sits at row layer*E + e."""
        if self.store.versions["hi"].device.type != "cpu" or self.device_type != "cpu":
            return None
        if self._table is None:
            L, E = self.store.num_layers, self.store.num_experts
            slots = torch.arange(L * E, dtype=torch.int32).view(L, E)
            self._table = (torch.zeros(L, E, dtype=torch.int32), slots)
        return self._table[0][layer], self._table[1][layer]

    def step_table(self, layer: int):
        return self.static_table(layer)

    def resident_counts(self) -> dict[str, int]:
        """On the CPU the store is the device memory, so every expert is resident in hi (and each use
        is counted as a hit); on a GPU nothing stays between steps."""
        hi = self.store.num_layers * self.store.num_experts if self.device_type == "cpu" else 0
        return {"hi": hi, "lo": 0}

    def close(self) -> None:
        pass
