"""What the engine codes against: the `Residency` protocol, and the residency that moves nothing.

Every residency gives each MoE layer a device table (`step_table`), read by the kernel with no host
decision, and the pools it names (`kernel_pools`). The engine brackets each forward with
`begin_step` / `end_step`, and, where `accounts` is true, hands the residency each finished step's
uses one step later (`observe_step`). A residency with a memory plan (`plan` and `options` not
None) is also the `ExpertSink` that policies steer (`policies/base.py`).

Implementations: `core.ResidencyManager` (pools under a budget) and `StaticResidency` (every expert
in hi at a fixed slot, no budget: the CPU's host store used in place, or one copy on the device).
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import numpy as np
import torch

from ..store.host_store import HostExpertStore
from .budget import MemoryPlan
from .metrics import ExpertMetrics
from .options import ResidencyOptions
from .slot_table import pool_for


class Residency(Protocol):
    plan: MemoryPlan | None  # None: no budget, nothing to steer
    options: ResidencyOptions | None  # the memory mode, precisions and rules (None with no plan)
    pool_ids: dict[str, int]  # a pool's name -> its index in `kernel_pools`

    @property
    def accounts(self) -> bool:
        """Whether the table changes between steps, so each step's uses must be observed."""

    def begin_step(self, iteration: int) -> None:
        """Between steps: act on what was asked and write the table step `iteration` reads."""

    def end_step(self) -> None:
        """The step's work has been issued (its compute marker fences slot reuse)."""

    def step_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(pool_of (E,), slot_of (P, E) or (E,))` int32 device tensors of `layer`."""

    def step_waits(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """`(wait_of (E,), landed (S,), pool id)` where a layer may wait for copies in flight, else None."""

    def static_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`step_table(layer)` when it is fixed for good, else None."""

    def kernel_pools(self, dtype: torch.dtype) -> list:
        """The pools the table's ids index (`slot_table.Pool`, or None for a pool without slots)."""

    def observe_step(self, ran: np.ndarray, iteration: int) -> None:
        """A finished step's uses: `ran (L, E)` the pool id each expert ran from (`UNUSED`: none)."""

    def resident_counts(self) -> dict[str, int]:
        """Published versions per pool."""

    def settle(self) -> None:
        """Apply every request and wait for every copy (evaluation and tests only)."""

    def close(self) -> None: ...


class StaticResidency:
    """Every expert in hi at row `layer * E + expert` of one pool, for good: on the CPU the host
    store's hi arena itself (host memory is the device's), on a GPU one copy of it made up front."""

    plan = None
    options = None
    pool_ids: ClassVar[dict[str, int]] = {"hi": 0}
    accounts = False

    def __init__(self, store: HostExpertStore, metrics: ExpertMetrics, device: torch.device):
        self.store = store
        self.metrics = metrics
        arena = store.versions["hi"]
        self._arena = arena if arena.device == device else arena.to(device)
        if self._arena is not arena:
            metrics.add_copy(arena.numel())
        L, E = store.num_layers, store.num_experts
        self._slots = torch.arange(L * E, dtype=torch.int32, device=device).view(L, E)
        self._pool_of = torch.zeros(L, E, dtype=torch.int32, device=device)
        self._pools = None

    def begin_step(self, iteration: int) -> None:
        pass

    def end_step(self) -> None:
        pass

    def step_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pool_of[layer], self._slots[layer]

    def step_waits(self, layer: int) -> None:
        return None

    def static_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.step_table(layer)

    def kernel_pools(self, dtype: torch.dtype) -> list:
        if self._pools is None or self._pools[0] != dtype:
            self._pools = (dtype, [pool_for(self._arena, None, self.store.shape, dtype)])
        return self._pools[1]

    def observe_step(self, ran: np.ndarray, iteration: int) -> None:
        pass

    def resident_counts(self) -> dict[str, int]:
        return {"hi": self.store.num_layers * self.store.num_experts, "lo": 0}

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass
