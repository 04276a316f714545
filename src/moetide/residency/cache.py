"""Which expert versions each pool holds, in LRU order, and which of them an eviction may take.

`VersionCache` owns the handles (one per (layer, expert)) and, per pool, the LRU order of the
versions it holds. It ranks eviction candidates with the configured rule (`eviction.py`): landed
versions only (a copy in flight is never a victim), never a protected expert (FineMoE spares the
experts predicted for the iteration), and, in a pool above lo of the lo+hi mode, the versions the
precision policy no longer wants there first ("cold"). An evicted version's slot goes back to its
pool through the fence of the last step that could read it (`SlotPool.free`).
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from .eviction import UNPROTECTED, EvictionRule, ExpertStats, eviction_order, first_victim
from .handles import DeviceVersion, ExpertHandle
from .pool import SlotPool


class VersionCache:
    """Handles, per-pool LRU order and eviction for `num_layers x num_experts` experts.

    Args:
        pools: name -> `SlotPool` of every tier.
        stats: the experts' probability estimates, visits and protections.
        rule: the eviction rule.
        prefer_cold: the lo+hi mode: in a pool above lo, versions whose expert's target is another
            tier go first.
        metrics: the `ExpertMetrics` whose `evictions` count every version dropped.
        deterministic: a copy becomes visible only at a step boundary (`publish_all`), however early
            it lands.
    """

    def __init__(
        self, num_layers: int, num_experts: int, pools: dict[str, SlotPool], stats: ExpertStats,
        rule: EvictionRule, prefer_cold: bool, metrics, deterministic: bool = False,
    ):  # fmt: skip
        self.handles = [[ExpertHandle(l, e) for e in range(num_experts)] for l in range(num_layers)]
        self.pools = pools
        self.stats = stats
        self.rule = rule
        self.prefer_cold = prefer_cold
        self.deterministic = deterministic
        self.metrics = metrics
        self.lru = {name: OrderedDict() for name in pools}  # (layer, expert) -> None, oldest first
        self.tick = 0
        self.changed: set[tuple[int, int]] = set()  # experts whose table entry may have changed
        self._evicting = {name: 0 < p.num_slots < num_layers * num_experts for name, p in pools.items()}

    def evicts(self, pool: str) -> bool:
        """Whether `pool` can ever need a victim: it has slots, fewer than there are experts."""
        return self._evicting[pool]

    def publish_if_ready(self, version: DeviceVersion) -> bool:
        """Whether `version` is published, publishing it now if its copy has landed (not under
        `deterministic`, where only `publish_all` does)."""
        if not version.published and not self.deterministic and version.ready.query():
            version.published = True
        return version.published

    def publish_all(self) -> None:
        """Wait for every copy in flight and publish it (a step boundary under `deterministic`)."""
        for lru in self.lru.values():
            for layer, expert in lru:
                for version in self.handles[layer][expert].versions.values():
                    if not version.published:
                        version.ready.synchronize()
                        version.published = True

    # -- residents ------------------------------------------------------------------------------------
    def add(self, handle: ExpertHandle, version: DeviceVersion) -> None:
        """`version` now lives in its pool's slot (its copy may be in flight): newest in LRU order."""
        handle.versions[version.pool] = version
        version.last_use = self.tick
        self.lru[version.pool][(handle.layer, handle.expert)] = None
        self.changed.add((handle.layer, handle.expert))

    def touch(self, handle: ExpertHandle, pool: str) -> None:
        self.tick += 1
        handle.versions[pool].last_use = self.tick
        self.lru[pool].move_to_end((handle.layer, handle.expert))

    def evict(self, handle: ExpertHandle, pool: str, fence) -> DeviceVersion:
        """Drop `handle`'s version in `pool`; its slot is freed once `fence` has completed (a version
        never published: once its own copy has landed)."""
        version = handle.versions.pop(pool)
        self.lru[pool].pop((handle.layer, handle.expert), None)
        handle.evicting += 1
        self.changed.add((handle.layer, handle.expert))

        def freed() -> None:
            handle.evicting -= 1

        self.pools[pool].free(version.slot, version.ready if not version.published else fence, freed)
        self.metrics.bump("evictions")
        return version

    def hand_over(self, handle: ExpertHandle, pool: str) -> int:
        """Drop `handle`'s version in `pool` and return its slot for another version at once (its
        readers are done; the slot's reservation carries over)."""
        version = handle.versions.pop(pool)
        self.lru[pool].pop((handle.layer, handle.expert), None)
        self.changed.add((handle.layer, handle.expert))
        self.metrics.bump("evictions")
        return version.slot

    # -- victims ----------------------------------------------------------------------------------------
    def _evictable(self, pool: str, below_layer: int | None = None):
        """`(layers (n,), experts (n,), cold (n,) bool)` of the evictable versions of `pool`, in LRU
        order: landed, not protected, of a layer before `below_layer` when given."""
        keys, cold = [], []
        prefer_cold = self.prefer_cold and pool != "lo"
        protected = self.stats.protected
        for layer, expert in self.lru[pool]:
            if below_layer is not None and layer >= below_layer:
                continue
            if protected[layer, expert] != UNPROTECTED:
                continue
            h = self.handles[layer][expert]
            if not self.publish_if_ready(h.versions[pool]):
                continue
            keys.append((layer, expert))
            cold.append(not prefer_cold or h.target != pool)
        layers = np.fromiter((k[0] for k in keys), dtype=np.int64, count=len(keys))
        experts = np.fromiter((k[1] for k in keys), dtype=np.int64, count=len(keys))
        return layers, experts, np.array(cold, dtype=bool)

    def candidates(self, pool: str, below_layer: int | None = None) -> list[tuple[ExpertHandle, bool]]:
        """Evictable versions of `pool` in eviction order, each with whether it is cold."""
        layers, experts, cold = self._evictable(pool, below_layer)
        if not len(layers):
            return []
        order = eviction_order(self.rule, np.arange(len(layers)), self.stats.prob[layers, experts],
                               self.stats.visits[layers, experts], first=cold)  # fmt: skip
        return [(self.handles[layers[i]][experts[i]], bool(cold[i])) for i in order.tolist()]

    def victim(self, pool: str, cold_only: bool = False) -> ExpertHandle | None:
        """The version the rule evicts first, `candidates(pool)[0]` (`cold_only`: only one the
        precision policy no longer wants there: a precision change waits for a slot rather than undo
        another), found without ranking them all. A rule that ranks by recency alone stops at the
        first cold candidate in LRU order."""
        if self.rule.recency_only:
            return self._first_in_lru(pool, cold_only)
        layers, experts, cold = self._evictable(pool)
        pick = np.flatnonzero(cold) if cold.any() else None if cold_only else np.arange(len(layers))
        if pick is None or not len(pick):
            return None
        ls, es = layers[pick], experts[pick]
        i = first_victim(self.rule, pick, self.stats.prob[ls, es], self.stats.visits[ls, es])
        return self.handles[int(ls[i])][int(es[i])]

    def _first_in_lru(self, pool: str, cold_only: bool) -> ExpertHandle | None:
        prefer_cold = self.prefer_cold and pool != "lo"
        protected, first_warm = self.stats.protected, None
        for layer, expert in self.lru[pool]:
            if protected[layer, expert] != UNPROTECTED:
                continue
            h = self.handles[layer][expert]
            if not self.publish_if_ready(h.versions[pool]):
                continue
            if not prefer_cold or h.target != pool:
                return h
            if first_warm is None:
                first_warm = h
        return None if cold_only else first_warm

    def victim_queue(self, pool: str, below_layer: int | None = None):
        """For a burst of copies: `next_victim()` over every candidate ranked once, skipping those
        evicted, protected or used since the ranking."""
        queue_ = deque(h for h, _cold in self.candidates(pool, below_layer))
        tick = self.tick
        protected = self.stats.protected

        def next_victim() -> ExpertHandle | None:
            while queue_:
                h = queue_.popleft()
                v = h.versions.get(pool)
                if v is None or protected[h.layer, h.expert] != UNPROTECTED or v.last_use > tick:
                    continue
                return h
            return None

        return next_victim

    def victim_queues(self, below_layer: int | None = None):
        """`pool -> next_victim` for a burst over several pools, each ranked on first use."""
        queues: dict = {}

        def for_pool(pool: str):
            if pool not in queues:
                queues[pool] = self.victim_queue(pool, below_layer)
            return queues[pool]

        return for_pool

    def take_slot(self, pool: str, fence, *, may_evict: bool, next_victim=None, cold_only: bool = False):
        """A slot of `pool` with its bytes reserved, evicting (through `next_victim`, or the rule's
        first victim) when none is free; None when none can be had now (no victim, a victim's slot
        still fenced, or the budget refuses: admission control)."""
        p = self.pools[pool]
        if p.num_slots == 0:
            return None
        p.reclaim()
        for _ in range(3):
            if p.free_slots:
                return p.take()
            if not may_evict:
                return None
            victim = next_victim() if next_victim is not None else self.victim(pool, cold_only)
            if victim is not None:
                self.evict(victim, pool, fence)
            if not p.reclaim():
                return None
        return None

