"""Stable handles: one per (layer, expert), resolving to the active, fully materialised version.

A handle holds at most one device version per pool: "hi" (the ladder's top: checkpoint precision or
a hot format), a deeper ladder's middle tiers "mid1", "mid2", ... and "lo" (the coldest, int4/int2).
A version is *published* only after its copy's completion event has been observed, so `resolve()`
never returns a partially written version (publish-then-switch). The state is derived from the
versions, so it can never disagree with them:

    OFFLOADED     no device version
    LOADING       a copy in flight, nothing published
    RESIDENT_LO   lo published, nothing hotter
    RESIDENT_MID  a middle tier's version is the hottest published
    RESIDENT_HI   hi published
    PROMOTING     a version hotter than the hottest published one is in flight
    DEMOTING      the hottest published version is hotter than the target (it is being given up)
    EVICTING      its last version was released and waits for the compute that read it
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..policies.base import tier_rank


class HandleState(enum.Enum):
    OFFLOADED = "offloaded"
    LOADING = "loading"
    RESIDENT_LO = "resident_lo"
    RESIDENT_MID = "resident_mid"
    RESIDENT_HI = "resident_hi"
    PROMOTING = "promoting"
    DEMOTING = "demoting"
    EVICTING = "evicting"


@dataclass
class DeviceVersion:
    """One expert version in a device slot."""

    pool: str  # "hi" | "mid<t>" | "lo"
    precision: str  # "hi" or a FORMATS name ("int4", "int2+4", ...)
    slot: int
    ready: object  # copy completion event
    views: dict[str, torch.Tensor]
    meta: object
    published: bool = False
    last_use: int = 0  # LRU tick
    prefetched: bool = False  # brought in by a prediction, not yet used (a miss fill is not one)
    issued_at: int = -1  # the iteration its copy was started in
    gen: int = 0  # its copy's number, written to the slot's landed word after the data (wait_for_copies)


@dataclass
class ExpertHandle:
    layer: int
    expert: int
    versions: dict[str, DeviceVersion] = field(default_factory=dict)  # pool -> version
    target: str = "hi"  # the tier the precision policy wants: "hi", "mid<t>" or "lo"
    evicting: int = 0  # released versions whose readers may still run

    def published(self, pool: str) -> DeviceVersion | None:
        v = self.versions.get(pool)
        return v if v is not None and v.published else None

    def resolve(self) -> DeviceVersion | None:
        """The active complete version: the hottest published one (hi, a middle tier's, lo), or None."""
        published = [v for v in self.versions.values() if v.published]
        return min(published, key=lambda v: tier_rank(v.pool)) if published else None

    @property
    def state(self) -> HandleState:
        best = self.resolve()
        if best is None:
            if self.versions:
                return HandleState.LOADING
            return HandleState.EVICTING if self.evicting else HandleState.OFFLOADED
        rank = tier_rank(best.pool)
        if rank < tier_rank(self.target):
            return HandleState.DEMOTING
        if any(tier_rank(pool) < rank for pool in self.versions):
            return HandleState.PROMOTING
        if best.pool == "hi":
            return HandleState.RESIDENT_HI
        return HandleState.RESIDENT_MID if best.pool != "lo" else HandleState.RESIDENT_LO
