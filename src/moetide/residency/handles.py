"""Stable handles: one per (layer, expert), resolving to the active, fully materialised version.

A handle holds at most one device version per pool ("hi" = checkpoint precision, "lo" = int4/int2).
A version is *published* only after its copy's completion event has been observed, so `resolve()`
never returns a partially written version (publish-then-switch). The state is derived from the
versions, so it can never disagree with them:

    OFFLOADED    no device version
    LOADING      a copy in flight, nothing published
    RESIDENT_LO  lo published, no hi
    RESIDENT_HI  hi published
    PROMOTING    lo published, hi copy in flight
    DEMOTING     hi published and its target is lo (the hi version is being given up)
    EVICTING     its last version was released and waits for the compute that read it
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class HandleState(enum.Enum):
    OFFLOADED = "offloaded"
    LOADING = "loading"
    RESIDENT_LO = "resident_lo"
    RESIDENT_HI = "resident_hi"
    PROMOTING = "promoting"
    DEMOTING = "demoting"
    EVICTING = "evicting"


@dataclass
class DeviceVersion:
    """One expert version in a device slot."""

    pool: str  # "hi" | "lo"
    precision: str  # "hi" | "int4" | "int2"
    slot: int
    ready: object  # copy completion event
    views: dict[str, torch.Tensor]
    meta: object
    published: bool = False
    last_read: object = None  # compute marker after the last step that used it
    last_use: int = 0  # LRU tick
    prefetched: bool = False  # brought in by a prefetch, not yet used
    issued_at: int = -1  # the iteration its copy was started in
    uses: int = 0


@dataclass
class ExpertHandle:
    layer: int
    expert: int
    versions: dict[str, DeviceVersion] = field(default_factory=dict)  # pool -> version
    target: str = "hi"  # precision the precision policy wants: "hi" or "lo"
    in_use: int = 0  # forward passes currently reading it
    evicting: int = 0  # released versions whose readers may still run

    def published(self, pool: str) -> DeviceVersion | None:
        v = self.versions.get(pool)
        return v if v is not None and v.published else None

    def resolve(self) -> DeviceVersion | None:
        """The active complete version: hi if published, else lo if published, else None."""
        return self.published("hi") or self.published("lo")

    @property
    def state(self) -> HandleState:
        hi, lo = self.versions.get("hi"), self.versions.get("lo")
        if hi is not None and hi.published:
            return HandleState.DEMOTING if self.target == "lo" else HandleState.RESIDENT_HI
        if lo is not None and lo.published:
            return HandleState.PROMOTING if hi is not None else HandleState.RESIDENT_LO
        if hi is not None or lo is not None:
            return HandleState.LOADING
        return HandleState.EVICTING if self.evicting else HandleState.OFFLOADED
