"""`ResidencyOptions`: how the residency core behaves for one policy (built by `build_residency`)."""

from __future__ import annotations

from dataclasses import dataclass

from .eviction import EVICTION_RULES

ON_MISS_RULES = ("lo", "zero-copy")
TABLE_LAG = 2  # a request made from step i's observations first reaches the table of step i + 2


@dataclass(frozen=True)
class ResidencyOptions:
    """Behaviour of the core for one policy.

    mode: memory mode of `plan_memory` ("all-hi", "all-lo", "hi-cache", "lo+hi").
    lo_precision: precision of lo versions (a low-bit name of `store.formats.FORMATS`).
    on_miss: what a step does with an expert that has no version on the device: "lo" (run its
        resident lo version; the lo+hi and all-lo modes keep one of each) or "zero-copy" (the kernel
        reads its hi version straight from pinned host memory).
    max_background_copies: precision changes issued per layer and step at most (the migration rate
        limit). Prefetches are not rate limited: the policy sized them (FineMoE's delta).
    max_inflight_prefetches: copies in flight at once for prefetches (None: two per layer); beyond it
        a prediction is dropped, not queued: it would land after the step it was for.
    protect_iterations: a `protect` request holds for this many iterations.
    hi_precision: what the hi pool holds: "hi" (the checkpoint's precision) or a FORMATS name.
    mid_precisions: a deeper ladder's tiers between hi and lo, hottest first (lo+hi mode).
    eviction: a rule of `eviction.RULES` ("lru", or FineMoE's "prob-freq").
    deterministic: publish copies only at step boundaries, after waiting for them.
    wait_for_copies: the table may send a layer to a hi copy still in flight, whose landing the
        kernel waits for on the device.
    """

    mode: str = "hi-cache"
    lo_precision: str = "int4"
    on_miss: str = "zero-copy"
    max_background_copies: int = 8
    max_inflight_prefetches: int | None = None
    protect_iterations: int = 1
    hi_precision: str = "hi"
    mid_precisions: tuple[str, ...] = ()
    eviction: str = "lru"
    deterministic: bool = False
    wait_for_copies: bool = False

    def __post_init__(self) -> None:
        if self.on_miss not in ON_MISS_RULES:
            raise ValueError(f"on_miss must be one of {ON_MISS_RULES}, got {self.on_miss!r}")
        if self.eviction not in EVICTION_RULES:
            raise ValueError(f"eviction must be one of {EVICTION_RULES}, got {self.eviction!r}")
