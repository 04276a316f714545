"""Counters of the residency core, per layer and per run. Plain integers/floats; no locks needed
for the forward thread, a lock for counters the copy thread also touches."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class LayerCounters:
    used: int = 0  # expert uses (distinct experts per step, summed over steps)
    # every use is exactly one of these three: used == hits + lo_runs + misses
    hits: int = 0  # the wanted version was resident (hi; lo where lo is what the policy runs)
    lo_runs: int = 0  # the hi version was not resident and the resident lo version ran in its place
    misses: int = 0  # nothing usable was resident: read from host memory (zero-copy), or not run
    mid_runs: int = 0  # of the lo runs, those that ran a ladder's middle tier (neither hi nor lo)


@dataclass
class ExpertMetrics:
    """Everything the engine reports about expert residency. `snapshot()` gives a JSON-able dict."""

    num_layers: int
    layers: list[LayerCounters] = field(default_factory=list)
    bytes_h2d: int = 0
    copies: int = 0
    prefetches_issued: int = 0  # copies started for a prediction (not for experts already resident)
    prefetches_used: int = 0  # predicted versions read by a step before their eviction
    miss_fills: int = 0  # copies started to cache an expert a step ran from host memory (hi caches)
    prefetches_late: int = 0  # a prefetched version still on its way when its layer read the table
    parked_misses: int = 0  # a resident version kept out of the step's table (the in-step reserve)
    unparked: int = 0  # parked versions predicted within the step: their entries came back at once
    hits_in_flight: int = 0  # hits on a copy still in flight when the layer was sent to it (wait_for_copies)
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    deferred: int = 0
    host_syncs: int = 0
    steps: int = 0
    steps_observed: int = 0  # steps whose routing reached the host (accounting and policies)
    step_host_s: float = 0.0  # host seconds at step boundaries: residency decisions, table, publishing
    peak_device_bytes: int = 0
    host_store: object = field(default=None, repr=False)  # the HostExpertStore, for `host_stats`
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = [LayerCounters() for _ in range(self.num_layers)]

    def add_copy(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_h2d += nbytes
            self.copies += 1

    def bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    @property
    def hits(self) -> int:
        return sum(c.hits for c in self.layers)

    @property
    def misses(self) -> int:
        return sum(c.misses for c in self.layers)

    @property
    def lo_runs(self) -> int:
        return sum(c.lo_runs for c in self.layers)

    @property
    def mid_runs(self) -> int:
        return sum(c.mid_runs for c in self.layers)

    @property
    def hit_rate(self) -> float:
        """Share of uses that found the wanted version (a lo run in place of hi is not a hit, so
        combined's rate compares with lru's)."""
        total = self.hits + self.lo_runs + self.misses
        return self.hits / total if total else 0.0

    def snapshot(self, resident: dict[str, int] | None = None) -> dict:
        return {
            "experts_used": sum(c.used for c in self.layers),
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": round(self.hit_rate, 4),
            "lo_runs": self.lo_runs,
            "mid_runs": self.mid_runs,
            "bytes_h2d": self.bytes_h2d,
            "copies": self.copies,
            "prefetches_issued": self.prefetches_issued,
            "prefetches_used": self.prefetches_used,
            "miss_fills": self.miss_fills,
            "prefetches_late": self.prefetches_late,
            "parked_misses": self.parked_misses,
            "unparked": self.unparked,
            "hits_in_flight": self.hits_in_flight,
            "promotions": self.promotions,
            "demotions": self.demotions,
            "evictions": self.evictions,
            "deferred": self.deferred,
            "host_syncs": self.host_syncs,
            "steps": self.steps,
            "steps_observed": self.steps_observed,
            "step_host_s": round(self.step_host_s, 6),
            "peak_device_bytes": self.peak_device_bytes,
            **(self.host_store.host_stats() if self.host_store is not None else {}),
            "resident": resident or {},
            "per_layer": [
                {
                    "used": c.used,
                    "hits": c.hits,
                    "lo_runs": c.lo_runs,
                    "mid_runs": c.mid_runs,
                    "misses": c.misses,
                }
                for c in self.layers
            ],
        }

    def reset(self) -> None:
        with self._lock:
            keep = self.peak_device_bytes
            fresh = ExpertMetrics(self.num_layers)
            for name in fresh.__dataclass_fields__:
                if name not in ("_lock", "host_store"):
                    setattr(self, name, getattr(fresh, name))
            self.peak_device_bytes = keep
