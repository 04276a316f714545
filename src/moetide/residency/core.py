"""The residency core: handles, pools, budget and copies, driven by policies, used by the forward pass.

All state changes happen on the forward thread, inside `acquire` (start of each MoE layer), so no
lock guards the handles. Policies (possibly on their own threads) only enqueue requests through the
`ExpertSink` methods; `acquire` drains them, issues the prefetches that target its own layer, makes
the layer's experts resident, ends the layer's protection, and then issues the prefetches for later
layers (which can no longer evict an expert the layer runs) and at most `max_background_copies`
precision changes (the migration rate limit):

    hit            the wanted version is published                   -> use it
    late prefetch  a prefetch copy is in flight                      -> wait for its event (stall)
    lo on miss     hi missing, lo published, on_miss == "lo"        -> run lo (no stall)
    miss           nothing usable                                     -> demand copy (stall)

Slots are taken from fixed pools after `BudgetTracker.try_reserve`; when a pool is full the least
recently used version that is neither in use nor protected (predicted for this iteration) is
evicted. A slot goes back to its free list only after the compute that last read it has finished.

A precision ladder of more than two tiers (lo+hi mode, `ResidencyOptions.mid_precisions`) adds one
pool per middle tier ("mid1", "mid2", ...: `policies.base.tier_names`) between hi and lo. Each
expert's target is one tier; the table sends it to its hottest published version. A move to a
colder tier drops the hotter version at once (the coldest is always resident) and copies the
target's; a move to a hotter tier keeps the version it has until the new one is published, after
which the old one is first in line when its pool needs a slot.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import BudgetError
from ..policies.base import tier_names, tier_rank
from ..store.host_store import HostExpertStore, hi_views
from .budget import BudgetTracker, MemoryPlan
from .handles import DeviceVersion, ExpertHandle
from .metrics import ExpertMetrics
from .pool import SlotPool
from .slot_table import NOT_RESIDENT, UNUSED, WAITED
from .transfer import PRIORITY_DEMAND, PRIORITY_MIGRATION, PRIORITY_PREFETCH


@dataclass(frozen=True)
class ResidencyOptions:
    """Behaviour of the core for one policy.

    mode: memory mode of `plan_memory` ("all-hi", "all-lo", "hi-cache", "lo+hi").
    lo_precision: precision of lo versions (a low-bit name of `store.formats.FORMATS`).
    on_miss: what a step does with an expert that has no version on the device:
        "lo"         run its resident lo version (the lo+hi and all-lo modes keep one of each);
        "zero-copy"  the kernel reads its hi version straight from pinned host memory;
        "stall"      copy it over and wait (the one mode that syncs with the host in every layer).
        With "lo" or "zero-copy" the core keeps a device table (`step_table`) that every layer
        reads, changed only between steps (`begin_step`), and nothing in a step waits for the host.
    max_background_copies: precision changes (promotions) issued per layer at most (migration rate
        limit). Prefetches are not queued behind a limit: the policy sized them (FineMoE's delta),
        and a queue left them until they were stale (measured: more copies, fewer of them used).
    max_inflight_prefetches: predicted copies in flight at once (None: two per layer); beyond it a
        prediction is dropped, not queued (MoE-Infinity's per-layer share moved 61 GB in 64 steps).
        Copies that cache a miss are not predictions and are never dropped for it.
    protect_iterations: a `protect` request holds for this many iterations.
    eviction: "lru", or "prob-freq" (FineMoE's rule: the lowest probability x visit count goes first,
        probability being the latest estimate for the expert, from a prefetch's predicted priority or
        the gate probability observed when its layer last ran; ties by LRU).
    """

    mode: str = "hi-cache"
    lo_precision: str = "int4"
    on_miss: str = "stall"
    max_background_copies: int = 8
    # prefetch copies in flight at once, at most (None: two per layer); a prediction past it is
    # dropped: it would land after the step it was for, and it takes the link a miss reads over
    max_inflight_prefetches: int | None = None
    protect_iterations: int = 1
    hi_precision: str = "hi"  # the version the hi pool holds: "hi" (checkpoint precision) or a FORMATS name
    # a deeper ladder's tiers between hi and lo, hottest first (pools "mid1", "mid2", ...; lo+hi mode)
    mid_precisions: tuple[str, ...] = ()
    eviction: str = "lru"
    # publish copies only at step boundaries, after waiting for them (EngineConfig.deterministic)
    deterministic: bool = False
    # the table sends a layer to a hi copy still in flight, whose landing the kernel waits for
    # (EngineConfig.wait_for_copies)
    wait_for_copies: bool = False

    def __post_init__(self) -> None:
        if self.on_miss not in ON_MISS_RULES:
            raise ValueError(f"on_miss must be one of {ON_MISS_RULES}, got {self.on_miss!r}")
        if self.eviction not in EVICTION_RULES:
            raise ValueError(f"eviction must be one of {EVICTION_RULES}, got {self.eviction!r}")


EVICTION_RULES = ("lru", "prob-freq")
ON_MISS_RULES = ("lo", "zero-copy", "stall")
UNPROTECTED = -(1 << 62)  # `_protected`'s entry for an expert no prediction spares (below any iteration)
TABLE_LAG = 2  # a request made from step i's observations first reaches the table of step i + 2


class _LazyVictims:
    """pool -> `next_victim` for the prefetches of one `in_step` call, each pool's versions ranked
    only once a prefetch needs a victim there (most calls need none)."""

    def __init__(self, manager, routed: int):
        self._manager, self._routed, self._queues = manager, routed, {}

    def __getitem__(self, pool: str):
        def next_victim():
            if pool not in self._queues:
                self._queues[pool] = self._manager._victim_queue(pool, below_layer=self._routed)
            return self._queues[pool]()

        return next_victim


class ResidencyManager:
    """Where each expert version lives; implements `ExpertSink` for the policies."""

    def __init__(
        self,
        store: HostExpertStore,
        metrics: ExpertMetrics,
        plan: MemoryPlan,
        budget: BudgetTracker,
        transfer,
        device: torch.device,
        options: ResidencyOptions,
    ):
        self.store = store
        self.metrics = metrics
        self.plan = plan
        self.budget = budget
        self.transfer = transfer
        self.device = device
        self.options = options
        self._make_pools(plan, options, device)
        self.handles = [
            [ExpertHandle(l, e) for e in range(store.num_experts)] for l in range(store.num_layers)
        ]
        self._lru = {name: OrderedDict() for name in self.tiers}  # (layer, expert) -> None, oldest first
        self._pending_free: deque = deque()  # (pool, slot, handle, event) waiting for their readers
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._prefetch_queue: deque = deque()  # (iteration, layer, expert)
        self._precision_queue: OrderedDict = OrderedDict()  # (layer, expert) -> a tier name
        # (L, E) int64: the iteration each expert is protected for (`UNPROTECTED`: none)
        self._protected = np.full((store.num_layers, store.num_experts), UNPROTECTED, dtype=np.int64)
        # prob-freq eviction: latest probability estimate and uses of each (layer, expert), (L, E)
        self._prob = np.zeros((store.num_layers, store.num_experts), dtype=np.float32)
        self._visits = np.zeros((store.num_layers, store.num_experts), dtype=np.int64)
        self._layers_done = -1  # the last layer acquired in this iteration (its protection has served)
        self.iteration = 0
        self._tick = 0
        self._kernel_pools = None  # (dtype, pools) of `kernel_pools`
        self._static_table = None  # (pool_of, slot_of) (L, E) when every slot is fixed for good
        L, E = store.num_layers, store.num_experts
        # the device table (step-table mode): what each step's layers read, written between steps
        self.table_mode = options.on_miss != "stall" or options.mode in ("all-hi", "all-lo")
        # per layer: row 0 the pool id of each expert, row 1 + p its slot in pool p (slot_table.py),
        # the last row the number of the copy its layer must see landed first (0: none; wait_for_copies)
        self._wait_row = 1 + len(self.pool_ids)
        shape = (L, 2 + len(self.pool_ids), E)
        self._table_master = np.full(shape, NOT_RESIDENT, dtype=np.int32)
        self._table_master[:, 1:] = 0
        self._table_device = torch.from_numpy(self._table_master.copy()).to(device)
        pin = device.type == "cuda"
        self._table_staging = [torch.empty(shape, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        # pinned words the copy stream writes into the device table after a copy (mid-step publishing)
        self._entry_words = torch.zeros(1 << 16, dtype=torch.int32, pin_memory=pin)
        self._entry_next = 0
        # per hi slot, the number of the last copy that landed there (written by the copy stream)
        self.waits = options.wait_for_copies and self.table_mode and not options.deterministic
        self._landed = torch.zeros(max(1, self.pools["hi"].num_slots), dtype=torch.int32, device=device)
        self._copy_number = 0
        self._table_events: list = [None, None]
        self._table_turn = 0
        self._watch: set[tuple[int, int]] = set()  # handles whose entry may have changed
        self._step_marker = None  # compute marker after the last step (gates slot reuse in table mode)
        self._host_pool = None
        # the layer feed's thread (`in_step`) and the forward thread's step boundaries take turns
        self._lock = threading.RLock()
        self.in_step_fed = False  # a layer feed calls `in_step` (set by it): keep a reserve of slots
        self._in_step_short: dict[str, int] = {}  # pool -> in-step prefetches that wanted a slot, this step
        self._reserve: dict[str, float] = {}  # pool -> slots begin_step parks for them (EMA)
        # pool -> {(layer, expert)}: versions kept out of this step's table for in-step prefetches
        self._parked: dict[str, dict[tuple[int, int], None]] = {name: {} for name in self.pools}
        self._inflight: deque = deque()  # prefetch versions issued, oldest first (pruned as they land)
        self._parked_in_step: dict[int, dict] = {}  # iteration -> what was parked in it (metrics)
        self._fills: set[tuple[int, int]] = set()  # queued requests that cache a miss (hi-cache)
        if self.table_mode:
            self._watch = {(l, e) for l in range(L) for e in range(E)}
        if options.mode == "lo+hi" or options.mode == "all-lo":
            for row in self.handles:
                for h in row:
                    h.target = "lo"
        # (L, E): the precision policy keeps the expert in lo (`ExpertHandle.target`, mirrored where set)
        self._kept_lo = np.full((L, E), options.mode in ("lo+hi", "all-lo"))

    def _make_pools(self, plan: MemoryPlan, options: ResidencyOptions, device: torch.device) -> None:
        """The ladder's pools, hottest first (`tiers`: "hi", the middle tiers' "mid1", ..., "lo"),
        what each holds (`precision_of`) and their ids in the kernel's pool list (`pool_ids`)."""
        self.tiers = tier_names(2 + len(options.mid_precisions))
        middle = self.tiers[1:-1]
        sizes = {"hi": (plan.hi_slots, plan.hi_slot_bytes), "lo": (plan.lo_slots, plan.lo_slot_bytes)}
        sizes.update(zip(middle, zip(plan.mid_slots, plan.mid_slot_bytes, strict=True), strict=True))
        self.pools = {name: SlotPool(name, *sizes[name], device) for name in self.tiers}
        # "host": zero-copy reads of the host store's hi arena
        self._precisions = {"hi": options.hi_precision, "lo": options.lo_precision, "host": "hi"}
        self._precisions.update(zip(middle, options.mid_precisions, strict=True))
        # a version's pool -> its index in `kernel_pools` and the slot tables; the middle tiers come
        # after the three every ladder has
        self.pool_ids = {"hi": 0, "lo": 1, "host": 2}
        self.pool_ids.update((name, 3 + i) for i, name in enumerate(middle))
        # fixed with the pools (read per prefetch request: hundreds a step at batch 32)
        self._has_slots = {name: pool.num_slots > 0 for name, pool in self.pools.items()}
        self._evicting = {name: self._evicts(name) for name in self.pools}
        self._lo_hi = options.mode == "lo+hi"

    # -- ExpertSink (any thread; never blocks) -----------------------------------------------------
    @property
    def capacity_experts(self) -> int:
        """hi experts the device holds at once (all layers)."""
        return self.plan.hi_slots

    def prefetch(
        self, layer: int, experts: list[int], *, iteration: int, priorities=None, protect: bool = False
    ) -> None:
        priorities = None if priorities is None else tuple(priorities)
        self._requests.put(("prefetch", layer, tuple(experts), (iteration, priorities, protect)))

    def has_requests(self) -> bool:
        """Whether a policy has asked for something since the requests were last drained."""
        return not self._requests.empty()

    def observe_gate_probs(self, layer: int | None, probs) -> None:
        """The mean gate probabilities `(E,)` of `layer` in the running step (for prob-freq eviction);
        `layer` None: every layer's at once, `(L, E)`."""
        where = slice(None) if layer is None else layer
        self._requests.put(("observed", where, None, np.asarray(probs, dtype=np.float32)))

    def protect(self, layer: int, experts: list[int], *, iteration: int) -> None:
        self._requests.put(("protect", layer, tuple(experts), iteration))

    def set_precision(self, layer: int, expert: int, precision: str) -> None:
        """`precision`: a tier of this ladder ("hi", "mid<t>", "lo"); anything else means "lo"."""
        self._requests.put(("precision", layer, expert, precision if precision in self.tiers else "lo"))

    # -- iteration bookkeeping ----------------------------------------------------------------------
    def begin_iteration(self, iteration: int) -> None:
        if self.options.deterministic:
            self._publish_all_copies()
            self._inflight.clear()
        self.iteration = iteration
        self._layers_done = -1
        lag = TABLE_LAG if self.table_mode else 0
        stale = self.iteration - self.options.protect_iterations - lag
        self._unprotect(self._protected, stale)

    def _drain_requests(self) -> None:
        while True:
            try:
                kind, layer, what, arg = self._requests.get_nowait()
            except queue.Empty:
                return
            if kind == "prefetch":
                iteration, priorities, protect = arg
                if protect:
                    self._protect(layer, what, iteration)
                if priorities is not None:  # the prediction is the experts' latest probability estimate
                    self._prob[layer, list(what)] = priorities
                self._prefetch_queue.extend((iteration, layer, e) for e in self._worth_prefetching(layer, what))
                self.metrics.bump("prefetches_issued", len(what))
            elif kind == "observed":
                self._prob[layer] = arg
            elif kind == "protect":
                self._protect(layer, what, arg)
            else:
                self._precision_queue[(layer, what)] = arg

    @staticmethod
    def _unprotect(protected: np.ndarray, up_to: int) -> None:
        """End the protections (of a view of `_protected`) for iterations up to `up_to`, in place."""
        protected[protected <= up_to] = UNPROTECTED

    def _worth_prefetching(self, layer: int, experts):
        """The requested experts whose prefetch can do anything. In the lo+hi mode, with a lo pool that
        holds every expert, one the precision policy keeps in lo is already where a prefetch would
        bring it (most of a busy step's requests: hundreds at batch 32), so it is not queued."""
        if not (self._lo_hi and self._has_slots["lo"] and not self._evicting["lo"]) or self._parked["lo"]:
            return experts  # (a lo pool with a slot per expert is preloaded with every one)
        what = np.fromiter(experts, dtype=np.int64, count=len(experts))
        return what[~self._kept_lo[layer, what]].tolist()

    def _protect(self, layer: int, experts, iteration: int) -> None:
        if not self.table_mode and iteration == self.iteration and layer <= self._layers_done:
            return  # that layer has already run in this iteration: nothing left to spare it for
        self._protected[layer, list(experts)] = iteration

    # -- slots ------------------------------------------------------------------------------------------
    def _reclaim(self, wait_for_one: bool = False) -> bool:
        """Return slots whose last readers finished to their free lists; optionally wait for the oldest."""
        freed = False
        for _ in range(len(self._pending_free)):
            pool, slot, handle, event = self._pending_free[0]
            if event is not None and not event.query():
                if not (wait_for_one and not freed):
                    break
                start = time.perf_counter()
                event.synchronize()
                self.metrics.layers[handle.layer].stall_s += time.perf_counter() - start
            self._pending_free.popleft()
            self.pools[pool].give(slot)
            self.budget.release(self.pools[pool].slot_bytes, f"expert_{pool}")
            handle.evicting -= 1
            freed = True
        return freed

    def _evict(self, handle: ExpertHandle, pool: str) -> None:
        version = handle.versions.pop(pool)
        self._lru[pool].pop((handle.layer, handle.expert), None)
        handle.evicting += 1
        # a version still being copied was never read: its slot is free once the copy has landed;
        # in table mode a published one may have been read by any step so far, the last included
        if not version.published:
            gate = version.ready
        elif self.table_mode and self._step_marker is not None:
            gate = self._step_marker
        else:
            gate = version.last_read
        self._watch.add((handle.layer, handle.expert))
        self._pending_free.append((pool, version.slot, handle, gate))
        self.metrics.bump("evictions")

    def _candidates(self, pool: str, *, protect_all: bool):
        """Evictable versions of `pool` in LRU order (landed, not in use, not protected when
        `protect_all`): yields `(handle, cold, score)`. cold: in a pool above lo in the lo+hi mode,
        the precision policy wants the expert in another tier (those go first); score: probability x
        visits with prob-freq eviction, else 0."""
        prefer_cold = pool != "lo" and self.options.mode == "lo+hi"
        scored = self.options.eviction == "prob-freq"
        for layer, expert in self._lru[pool]:
            h = self.handles[layer][expert]
            if h.in_use or (protect_all and self._protected[layer, expert] != UNPROTECTED):
                continue
            if not self._publish_if_ready(h.versions[pool]):  # a landed prefetch is evictable too
                continue
            score = float(self._prob[layer, expert]) * int(self._visits[layer, expert]) if scored else 0.0
            yield h, not prefer_cold or h.target != pool, score

    def _victim(self, pool: str, *, protect_all: bool, cold_only: bool = False) -> ExpertHandle | None:
        """The evictable version the eviction rule ranks first: least recently used, or with
        "prob-freq" the lowest probability x visits (ties: least recently used); cold ones first.
        `cold_only`: never one the precision policy wants in this pool (a precision change waits
        for a slot rather than undo another)."""
        by_score = self.options.eviction == "prob-freq"
        best = {True: None, False: None}  # cold? -> (score, handle)
        for h, cold, score in self._candidates(pool, protect_all=protect_all):
            if cold_only and not cold:
                continue
            if not by_score:
                if cold:
                    return h
                best[False] = best[False] or (0.0, h)
            elif best[cold] is None or score < best[cold][0]:  # strict: ties keep the older one
                best[cold] = (score, h)
        chosen = best[True] or best[False]
        return chosen[1] if chosen else None

    def _victim_queue(self, pool: str, below_layer: int | None = None):
        """For a burst of prefetches: every evictable version ranked once, in the order `_victim`
        would pick them (sparing protected ones); returns `next_victim()`, which skips versions that
        were evicted, used, protected or touched since. One ranking instead of one scan per copy.
        `below_layer`: only versions of layers before it (`in_step`)."""
        ranked = [(not cold, score, i, h) for i, (h, cold, score) in enumerate(
            self._candidates(pool, protect_all=True)) if below_layer is None or h.layer < below_layer]  # fmt: skip
        ranked.sort(key=lambda r: r[:3])
        queue_ = deque(r[3] for r in ranked)
        tick = self._tick

        def next_victim() -> ExpertHandle | None:
            while queue_:
                h = queue_.popleft()
                v = h.versions.get(pool)
                protected = self._protected[h.layer, h.expert] != UNPROTECTED
                if v is None or h.in_use or protected or v.last_use > tick:
                    continue
                return h
            return None

        return next_victim

    def _take_slot(
        self, pool: str, *, may_evict: bool, may_wait: bool, next_victim=None, cold_only: bool = False
    ) -> int | None:
        """A free slot of `pool` with its budget reserved, evicting (and, if `may_wait`, waiting for
        a copy or a reader) when needed; None if none can be had. `next_victim`: a `_victim_queue`
        for a burst of prefetches (used instead of a scan when no waiting is allowed). `cold_only`:
        evict only versions the precision policy no longer wants there (`_victim`)."""
        p = self.pools[pool]
        if p.num_slots == 0:
            return None
        self._reclaim()
        for _ in range(3):
            found, slot = self._take_free(pool)
            if found:
                return slot
            if may_evict:
                if next_victim is not None and not may_wait:
                    victim = next_victim()
                else:
                    victim = self._victim(pool, protect_all=True, cold_only=cold_only) or (
                        self._victim(pool, protect_all=False, cold_only=cold_only) if may_wait else None
                    )
                if victim is None and may_wait:
                    victim = self._finish_oldest_copy(pool)
                if victim is not None:
                    self._evict(victim, pool)
            if not self._reclaim(wait_for_one=may_wait):
                return None
        return None

    def _take_free(self, pool: str) -> tuple[bool, int | None]:
        """A free slot of `pool` with its budget reserved: `(True, slot)`; `(True, None)` when one is
        free but the budget refuses it (admission control: no copy); `(False, None)` when none is."""
        p = self.pools[pool]
        slot = p.take()
        if slot is None:
            return False, None
        if self.budget.try_reserve(p.slot_bytes, f"expert_{pool}"):
            return True, slot
        p.give(slot)
        return True, None

    RESERVE_SHARE = 3  # at most 1/3 of a pool is parked for in-step prefetches

    def _keep_reserve(self) -> None:
        """Between steps, with a layer feed: park versions for the prefetches the next step makes as
        it runs. Within a step `in_step` may only evict versions that the step can no longer read;
        without a reserve that singles out the first layers' experts. A parked version is taken out
        of the step's table (its expert runs as if it were not resident: lo, zero-copy) but keeps its
        slot: an in-step prefetch takes the slot at once, else the version comes back at the next
        step boundary, uncopied. As many as the last steps' in-step prefetches wanted (smoothed), at
        most a share of the pool, chosen by the eviction rule over every layer."""
        for parked in self._parked.values():
            self._watch.update(parked)
        self._parked = {name: {} for name in self.pools}
        self._parked_in_step = {it: keys for it, keys in self._parked_in_step.items() if it > self.iteration - 4}
        self._parked_in_step[self.iteration] = self._parked  # (for the accounting a step later)
        for name, p in self.pools.items():
            if not self._evicting[name]:
                continue
            wanted = self._in_step_short.pop(name, 0)
            target = self._reserve[name] = 0.7 * self._reserve.get(name, 0.0) + 0.3 * wanted
            want = min(int(round(target)), p.num_slots // self.RESERVE_SHARE) - p.free_slots
            if want <= 0:
                continue
            next_victim = self._victim_queue(name)
            while want > 0 and (victim := next_victim()) is not None:
                self._parked[name][(victim.layer, victim.expert)] = None
                self._watch.add((victim.layer, victim.expert))
                want -= 1

    def _take_slot_in_step(self, pool: str, next_victim) -> int | None:
        """Within a step: a free slot of `pool` with its budget reserved, else the slot of a parked
        version, else that of the victim `next_victim()` gives (a version no reader still needs: it
        changes hands without waiting)."""
        self._reclaim()
        self._in_step_short[pool] = self._in_step_short.get(pool, 0) + 1
        found, slot = self._take_free(pool)
        if found:
            return slot
        victim, parked = None, self._parked[pool]
        while parked and victim is None:
            layer, expert = next(iter(parked))
            del parked[(layer, expert)]
            h = self.handles[layer][expert]
            if pool in h.versions and not h.in_use:
                victim = h
        victim = victim or next_victim()
        if victim is None:
            return None
        self._parked[pool].pop((victim.layer, victim.expert), None)
        version = victim.versions.pop(pool)
        self._lru[pool].pop((victim.layer, victim.expert), None)
        self._watch.add((victim.layer, victim.expert))
        self._table_master[victim.layer, 0, victim.expert] = NOT_RESIDENT  # until the next write recomputes it
        self.metrics.bump("evictions")
        return version.slot  # its reservation carries over to the new version

    def _finish_oldest_copy(self, pool: str) -> ExpertHandle | None:
        """Every slot holds a copy in flight: wait for the oldest, publish it, offer it for eviction."""
        for layer, expert in self._lru[pool]:
            h = self.handles[layer][expert]
            v = h.versions[pool]
            if not v.published and not h.in_use:
                start = time.perf_counter()
                v.ready.synchronize()
                v.published = True
                self.metrics.layers[layer].stall_s += time.perf_counter() - start
                return h
        return None

    # -- copies -----------------------------------------------------------------------------------------
    def precision_of(self, pool: str) -> str:
        """The precision a pool's versions hold ("hi" or a `store.formats.FORMATS` name)."""
        return self._precisions[pool]

    def _start_copy(self, handle: ExpertHandle, pool: str, slot: int, priority: int) -> DeviceVersion:
        precision = self.precision_of(pool)
        src = self.store.buffer(handle.layer, handle.expert, precision)
        dst = self.pools[pool].buffer(slot)[: src.numel()]
        then, number = self._publishing_words(handle, pool, slot), 0
        if self.waits and pool == "hi" and self._static_table is None:
            self._copy_number = number = self._copy_number % (2**31 - 1) + 1
            then = [(self._landed[slot : slot + 1], self._pinned_word(number))] + then  # right after the data
        event = self.transfer.copy(dst, src, priority, then=then)
        self.metrics.add_copy(src.numel())
        if precision == "hi":
            views, meta = hi_views(dst, self.store.shape), None
        else:
            from ..store import quant

            meta = self.store.meta[precision]
            views = quant.expert_views(dst, meta)
        version = DeviceVersion(pool, precision, slot, event, views, meta, last_use=self._tick, gen=number)
        handle.versions[pool] = version
        self._lru[pool][(handle.layer, handle.expert)] = None
        self._watch.add((handle.layer, handle.expert))
        return version

    def _publishing_words(self, handle: ExpertHandle, pool: str, slot: int) -> list:
        """In table mode, the device-table words a copy writes after itself, on its own stream, so
        that its version is live from the moment it lands, even in the middle of a step: the slot in
        this pool's row first, then the pool id (slot_table.py: a reader sees the old version or the
        new one). None under `deterministic` (versions appear at step boundaries only) or where the
        entry would not change to this version (a copy under a hotter version kept: the table sends
        an expert to its hottest)."""
        if not self.table_mode or self.options.deterministic or self._static_table is not None:
            return []
        if self._hotter_kept(handle, pool):
            return []
        # the host's table takes the new slot at once: no reader looks in this pool's row for the
        # expert before its pool word says so, and a whole-table write between the copy's two words
        # must not put the old slot back under a pool word that is about to point here
        self._table_master[handle.layer, 1 + self.pool_ids[pool], handle.expert] = slot
        return self._entry_words_for(handle.layer, handle.expert, pool, slot)

    def _pinned_word(self, value: int) -> torch.Tensor:
        """A pinned int32 word holding `value`, from the ring the copy side writes device words from."""
        i = self._entry_next
        self._entry_next = (i + 1) % self._entry_words.numel()
        word = self._entry_words[i : i + 1]
        word[0] = value
        return word

    def _waiting_entry(self, handle: ExpertHandle, version: DeviceVersion) -> None:
        """Within a step (wait_for_copies): send `handle`'s later layer to its hi copy that has just
        started, now, with the copy's number: the layer waits on the device for the copy's landed word."""
        if any(v.published for v in handle.versions.values()):
            return  # it has a version to run already
        self._point_entry(handle, "hi", version.slot, wait=version.gen)

    def _entry_words_for(self, layer: int, expert: int, pool: str, slot: int, wait: int | None = None) -> list:
        """The `(device word, pinned word)` writes that point `(layer, expert)`'s device entry at `slot`
        of `pool`: the slot in the pool's row first, then (given) the copy to wait for, then the pool
        word (a reader sees the old entry or the new one), from a ring of pinned words."""
        pid = self.pool_ids[pool]
        row = self._table_device[layer]
        words = [(row[1 + pid, expert : expert + 1], self._pinned_word(slot))]
        if wait is not None:
            words.append((row[self._wait_row, expert : expert + 1], self._pinned_word(wait)))
        return words + [(row[0, expert : expert + 1], self._pinned_word(pid))]

    def _point_entry(self, handle: ExpertHandle, pool: str, slot: int, wait: int | None = None) -> None:
        """Within a step: the host's table and, at once on the demand stream, the device's send
        `handle` to `slot` of `pool` (and, given, to wait for copy `wait`); the next whole-table write
        keeps what the host's table says."""
        layer, expert, pid = handle.layer, handle.expert, self.pool_ids[pool]
        self._table_master[layer, 0, expert] = pid
        self._table_master[layer, 1 + pid, expert] = slot
        if wait is not None:
            self._table_master[layer, self._wait_row, expert] = wait
        self.transfer.write_words(self._entry_words_for(layer, expert, pool, slot, wait))

    def _republish(self, handle: ExpertHandle, pool: str) -> None:
        """Within a step: point the device table at `handle`'s landed version in `pool` now (a parked
        version predicted after all)."""
        version = handle.versions[pool]
        if not self._publish_if_ready(version) or self._hotter_kept(handle, pool):
            return
        self._point_entry(handle, pool, version.slot)
        self.metrics.bump("unparked")

    @staticmethod
    def _hotter_kept(handle: ExpertHandle, pool: str) -> bool:
        """A version in a hotter tier than `pool` is kept: the table sends the expert there, not here."""
        return any(tier_rank(other) < tier_rank(pool) for other in handle.versions)

    def _publish_if_ready(self, version: DeviceVersion) -> bool:
        # deterministic: a copy becomes visible at the next step boundary, whenever it lands
        if not version.published and not self.options.deterministic and version.ready.query():
            version.published = True
        return version.published

    def _publish_all_copies(self) -> None:
        """Wait for every copy in flight and publish it (a step boundary under `deterministic`)."""
        for pool in self._lru.values():
            for layer, expert in pool:
                for version in self.handles[layer][expert].versions.values():
                    if not version.published:
                        version.ready.synchronize()
                        version.published = True

    def _issue_prefetch(self, iteration: int, layer: int, expert: int, victims_for=None, in_step=None) -> bool:
        """Start one queued prefetch; True if it started a copy. Requests older than the previous
        iteration, or for a layer that has already run in this one, are dropped. `victims_for`: a
        `_victim_queues()` for a burst. `in_step`: pool -> `_victim_queue(below_layer=...)` within a
        step (`in_step`): a victim's slot is reused at once, its readers being done."""
        if self.table_mode:  # made from a step's observations, for the steps after it
            if iteration < self.iteration - TABLE_LAG:
                return False
        elif iteration < self.iteration - 1 or (iteration == self.iteration and layer <= self._layers_done):
            return False
        h = self.handles[layer][expert]
        pool = self._prefetch_pool(h)
        if pool is None:
            return False
        if pool in h.versions:  # (most requests of a busy step: kept cheap)
            if self._evicting[pool]:  # a pool that holds every expert keeps no LRU order worth a touch
                self._touch(h, pool)
            # predicted after all: no in-step prefetch may take its slot; within a step its entry is
            # back at once (the slot was never given away), else in the next table
            parked = self._parked[pool]
            if parked and (layer, expert) in parked:
                del parked[(layer, expert)]
                if in_step is not None:
                    self._republish(h, pool)
            return False
        fill = (layer, expert) in self._fills  # caching a miss: not a prediction, never dropped for the link
        self._fills.discard((layer, expert))
        if not fill and self._prefetch_link_full():
            self.metrics.bump("deferred")
            return False
        if in_step is not None:
            slot = self._take_slot_in_step(pool, in_step[pool])
        else:
            victims = victims_for(pool) if victims_for is not None else None
            slot = self._take_slot(pool, may_evict=True, may_wait=False, next_victim=victims)
        if slot is None:
            self.metrics.bump("deferred")
            return False
        version = self._start_copy(h, pool, slot, PRIORITY_PREFETCH)
        version.prefetched = True
        version.issued_at = self.iteration
        self._inflight.append(version)
        if in_step is not None and version.gen:
            self._waiting_entry(h, version)
        return True

    def _prefetch_link_full(self) -> bool:
        """Whether `max_inflight_prefetches` copies are still under way (landed ones are pruned)."""
        cap = self.options.max_inflight_prefetches or 2 * self.store.num_layers
        # (deterministic: only step boundaries retire copies, whenever they land: no timing enters)
        while self._inflight and not self.options.deterministic and self._inflight[0].ready.query():
            self._inflight.popleft()
        return len(self._inflight) >= cap

    def _prefetch_pool(self, h: ExpertHandle) -> str | None:
        """The pool a prefetch of `h` fills: the hi pool when there is one, except in the lo+hi mode
        (combined), where the precision policy's target tier decides (a prefetch brings the expert
        in the precision DynaExq chose; FineMoE only says when). None: no pool to fill."""
        has_slots = self._has_slots
        lo = "lo" if has_slots["lo"] else None
        if self._lo_hi:
            return h.target if h.target != "lo" and has_slots[h.target] else lo
        return "hi" if has_slots["hi"] else lo

    def _victim_queues(self):
        """`pool -> next_victim` for a burst of prefetches, each pool ranked once, on first use."""
        queues: dict = {}

        def for_pool(pool: str):
            if pool not in queues:
                queues[pool] = self._victim_queue(pool)
            return queues[pool]

        return for_pool

    def _issue_prefetches_for(self, layer: int) -> None:
        """Before `layer`'s own demand: the queued prefetches that target it (semantic predictions of
        the first layers, or ones the searcher published late), ahead of the rest of the queue."""
        mine = [r for r in self._prefetch_queue if r[1] == layer]
        if not mine:
            return
        self._prefetch_queue = deque(r for r in self._prefetch_queue if r[1] != layer)
        for request in mine:
            self._issue_prefetch(*request)

    def _issue_background(self, budget: int | None = None) -> None:
        """Issue every queued prefetch (the policy sized them: FineMoE's delta), then precision changes
        up to `budget` (default: the per-layer rate limit)."""
        if self._prefetch_queue:
            victims_for = self._victim_queues()
            while self._prefetch_queue:
                self._issue_prefetch(*self._prefetch_queue.popleft(), victims_for=victims_for)
        budget = self.options.max_background_copies if budget is None else budget
        waiting = []  # changes without a slot yet: asked again at the next call (admission control)
        while budget > 0 and self._precision_queue:
            (layer, expert), target = self._precision_queue.popitem(last=False)
            if self.options.mode != "lo+hi":
                continue  # precision is fixed by the mode
            h = self.handles[layer][expert]
            h.target = target
            self._kept_lo[layer, expert] = target == "lo"
            outcome = self._move_to_target(h)
            if outcome == "deferred":
                waiting.append(((layer, expert), target))
            elif outcome == "copied":
                budget -= 1
        for key, target in waiting:  # (a newer request for the same expert, queued since, wins)
            self._precision_queue.setdefault(key, target)

    def _move_to_target(self, h: ExpertHandle) -> str:
        """Bring `h` to its target tier (lo+hi mode): versions of hotter tiers are dropped at once
        where a colder published one remains to run (a copy still in flight is left to land; it is
        then cold, the first to go when its pool needs a slot); the target's version is copied into
        a slot of its pool, evicting only versions their precision policy no longer wants there.
        Returns "copied", "deferred" (no slot can be had now: the forward pass keeps its current
        version) or "done" (nothing to copy)."""
        target, rank = h.target, tier_rank(h.target)
        for version in h.versions.values():  # landed copies count as what the expert has
            self._publish_if_ready(version)
        best = h.resolve()
        before = tier_rank(best.pool) if best is not None else None
        dropped = False
        for pool in [p for p in h.versions if p != "lo" and tier_rank(p) < rank]:
            colder = any(v.published for q, v in h.versions.items() if tier_rank(q) > tier_rank(pool))
            if h.in_use or not colder or not self._publish_if_ready(h.versions[pool]):
                continue
            self._evict(h, pool)
            dropped = True
        outcome = "done"
        if target != "lo" and target not in h.versions and self.pools[target].num_slots:
            slot = self._take_slot(target, may_evict=True, may_wait=False, cold_only=True)
            if slot is None:  # admission control: no reservation, no copy; what is resident keeps serving
                self.metrics.bump("deferred")
                return "deferred"
            self._start_copy(h, target, slot, PRIORITY_MIGRATION)
            outcome = "copied"
        # one count per change of tier (the precision policy's, not cache evictions)
        if outcome == "copied" and (before is None or rank < before):
            self.metrics.bump("promotions")
        elif (dropped or outcome == "copied") and before is not None and rank > before:
            self.metrics.bump("demotions")
        return outcome

    def _evicts(self, pool: str) -> bool:
        """Whether `pool` can ever need a victim: it has slots, fewer than there are experts."""
        return 0 < self.pools[pool].num_slots < self.store.num_layers * self.store.num_experts

    def _touch(self, handle: ExpertHandle, pool: str) -> None:
        self._tick += 1
        handle.versions[pool].last_use = self._tick
        self._lru[pool].move_to_end((handle.layer, handle.expert))

    # -- the forward pass's side --------------------------------------------------------------------------
    def acquire(
        self, layer: int, experts: list[int], device: torch.device
    ) -> tuple[dict[int, DeviceVersion], list[int]]:
        """Make `experts` of `layer` usable. Returns `(resolved {e: version}, not yet resolved)`;
        the second list is non-empty only when the pools cannot hold all of them at once (the caller
        computes what it got, releases it, and asks again)."""
        self._drain_requests()
        self._issue_prefetches_for(layer)
        counters = self.metrics.layers[layer]
        resolved: dict[int, DeviceVersion] = {}
        remaining: list[int] = []
        demand_pool = "lo" if self.options.mode == "all-lo" else "hi"
        for e in experts:
            h = self.handles[layer][e]
            version = self._usable(h, demand_pool, counters)
            if version is None:
                pool = demand_pool
                if self.options.on_miss == "lo" and demand_pool == "hi" and self.pools["lo"].num_slots:
                    pool = "lo"  # a lo copy is 4-8x smaller than hi: the cheaper stall
                slot = self._take_slot(pool, may_evict=True, may_wait=True)
                if slot is None:
                    remaining.append(e)
                    continue
                start = time.perf_counter()
                version = self._start_copy(h, pool, slot, PRIORITY_DEMAND)
                version.ready.synchronize()  # the stall: the layer cannot run without this expert
                version.published = True
                counters.stall_s += time.perf_counter() - start
                counters.misses += 1
            elif version.pool != demand_pool:
                counters.lo_runs += 1  # lo ran in place of hi, without a stall: neither hit nor miss
                counters.mid_runs += version.pool != "lo"  # (a middle tier's version, of a ladder)
            else:
                counters.hits += 1
            h.in_use += 1
            version.uses += 1
            self._visits[layer, e] += 1
            self._touch(h, version.pool)
            resolved[e] = version
        counters.used += len(resolved)
        self._end_protection(layer)
        self._issue_background()
        self.metrics.peak_device_bytes = max(self.metrics.peak_device_bytes, self.budget.peak_bytes)
        if not resolved and remaining:
            raise BudgetError(
                f"no expert slot can be freed for layer {layer}: the memory budget is too small"
            )
        return resolved, remaining

    def _end_protection(self, layer: int) -> None:
        """`layer` has run in this iteration: its experts' protection has served (FineMoE spares the
        experts predicted for what is still to come in the iteration, not those already used)."""
        self._layers_done = max(self._layers_done, layer)
        self._unprotect(self._protected[layer], self.iteration)

    def _usable(self, h: ExpertHandle, demand_pool: str, counters) -> DeviceVersion | None:
        """A version of `h` to run now without a demand copy (the wanted one, or in its place the
        hottest published one below it: a middle tier's, else lo); None on a miss."""
        wanted = h.versions.get(demand_pool)
        lo = None
        if demand_pool == "hi":
            below = (h.versions.get(name) for name in self.tiers[1:])
            lo = next((v for v in below if v is not None and self._publish_if_ready(v)), None)
        run_lo = lo is not None and self.options.on_miss == "lo"
        if wanted is not None:
            if not self._publish_if_ready(wanted):
                if run_lo:  # its hi copy is still under way: run lo, never wait
                    return lo
                start = time.perf_counter()
                wanted.ready.synchronize()  # late prefetch: wait for the copy already under way
                wanted.published = True
                counters.stall_s += time.perf_counter() - start
            if wanted.prefetched:
                wanted.prefetched = False
                self.metrics.bump("prefetches_used")
            return wanted
        if run_lo:
            return lo
        return None

    def release(self, layer: int, experts: list[int]) -> None:
        """The layer's compute for `experts` has been issued: mark the end of their reads."""
        marker = self.transfer.compute_marker()
        for e in experts:
            h = self.handles[layer][e]
            h.in_use -= 1
            for v in h.versions.values():
                if v.published:
                    v.last_read = marker

    # -- step-table mode: the device table every layer reads, written between steps -------------------
    def begin_step(self, iteration: int) -> None:
        """Between steps: apply what the policies asked for since the last step (prefetches, precision
        changes, evictions), publish the copies that have landed, and write the device table the next
        step's layers read. No host sync: a copy is published only once its event has completed
        (under `deterministic`, every copy in flight is waited for here, at the step boundary)."""
        with self._lock:
            self.begin_iteration(iteration)
            if not self.table_mode:
                return
            self._drain_requests()
            self._reclaim()
            self._issue_background(self.options.max_background_copies * self.store.num_layers)
            if self.in_step_fed:
                self._keep_reserve()
            self._write_table()
            self.metrics.peak_device_bytes = max(self.metrics.peak_device_bytes, self.budget.peak_bytes)

    def end_step(self) -> None:
        """The step's work has been issued: its compute marker gates the reuse of every slot the
        table pointed at, and every protection for this iteration has served."""
        with self._lock:
            self._step_marker = self.transfer.compute_marker()
            self._layers_done = self.store.num_layers - 1
            self._unprotect(self._protected, self.iteration)

    def in_step(self, iteration: int, routed: int, used=None) -> int:
        """Within a step (the layer feed's thread): MoE layer `routed` of step `iteration` has routed on
        the device, so every layer before it has finished computing. The policies' requests are drained
        and the prefetches for this step's later layers start at once; they publish themselves when
        they land (`_publishing_words`), so a layer that runs after that reads them. The slots they
        take are free ones, or those of versions that only layers before `routed` could read in this
        step (nothing else reads them any more: the next step's table is written from the host's,
        under this lock). Nothing for a step that is not the latest begun, or under `deterministic`.
        `used`: the experts layer `routed` chose (any shape): their versions are touched now, so
        that the LRU order this step's evictions follow knows them (the step's accounting comes a
        step later). Returns the copies started."""
        with self._lock:
            if not self.table_mode or self.options.deterministic or iteration != self.iteration:
                return 0
            if used is not None and routed >= 0:
                for expert in np.unique(used).tolist():
                    h = self.handles[routed][expert]
                    for pool in h.versions:
                        if self._evicting[pool]:
                            self._touch(h, pool)
            self._drain_requests()
            # the layers that have run in this step: their protection has served
            self._unprotect(self._protected[:routed], iteration)
            if not self._prefetch_queue:
                return 0
            later, started = deque(), 0
            victims = _LazyVictims(self, routed)
            while self._prefetch_queue:
                request = self._prefetch_queue.popleft()
                it, layer, expert = request
                if it > iteration:  # for a later step: its begin_step issues it
                    later.append(request)
                    continue
                if layer <= routed:  # its layer is running or has run in this step: too late
                    continue
                started += self._issue_prefetch(*request, in_step=victims)
            self._prefetch_queue = later
            self.metrics.peak_device_bytes = max(self.metrics.peak_device_bytes, self.budget.peak_bytes)
            return started

    def step_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(pool_of, slot_of)` (E,) int32 device views of `layer`'s entries in the device table, or
        None when the layer must resolve its experts on the host (`on_miss="stall"`)."""
        if self._static_table is not None:
            return self.static_table(layer)
        if not self.table_mode:
            return None
        return self._table_device[layer, 0], self._table_device[layer, 1 : self._wait_row]

    def step_waits(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """`(wait_of (E,), landed (hi slots,), the hi pool's id)`, int32 device views (wait_for_copies):
        an expert the table sends to the hi pool is read once `landed[slot] == wait_of[e]` when
        `wait_of[e]` is not 0 (the wait word means nothing for another pool: a reader may see it
        before the pool word that goes with it); else None."""
        if not self.waits or self._static_table is not None:
            return None
        return self._table_device[layer, self._wait_row], self._landed, self.pool_ids["hi"]

    def _entry(self, h: ExpertHandle) -> tuple[int, int, int]:
        """Where the table sends expert `h`, `(pool id, slot, copy to wait for)`: its hottest published
        version (hi, a middle tier's, lo); else (wait_for_copies) its hi version still being copied,
        whose landing the layer waits for; else (zero-copy) its hi version in host memory; else
        nowhere."""
        for pool in self.tiers:
            v = h.versions.get(pool)
            if v is not None and (h.layer, h.expert) not in self._parked[pool] and self._publish_if_ready(v):
                return self.pool_ids[pool], v.slot, 0
        v = h.versions.get("hi")
        if v is not None and v.gen and not v.published and (h.layer, h.expert) not in self._parked["hi"]:
            return self.pool_ids["hi"], v.slot, v.gen  # its copy is on the way: the layer waits for it
        if self.options.on_miss == "zero-copy":
            return self.pool_ids["host"], self.store.row(h.layer, h.expert), 0
        return NOT_RESIDENT, 0, 0

    def _write_table(self) -> None:
        """Recompute the watched entries, then one copy of the table to the device (from a pinned
        staging buffer whose previous copy has finished)."""
        if not self._watch:
            return
        settled = []
        for layer, expert in self._watch:
            h = self.handles[layer][expert]
            pool, slot, wait = self._entry(h)
            self._table_master[layer, 0, expert] = pool
            self._table_master[layer, self._wait_row, expert] = wait
            if pool >= 0:
                self._table_master[layer, 1 + pool, expert] = slot
            if all(v.published for v in h.versions.values()):
                settled.append((layer, expert))
        self._watch.difference_update(settled)
        if self._table_device.device.type != "cuda":
            self._table_device.copy_(torch.from_numpy(self._table_master))
            return
        turn = self._table_turn
        self._table_turn ^= 1
        staging, event = self._table_staging[turn], self._table_events[turn]
        if event is not None and not event.query():
            event.synchronize()  # two steps back: in practice long done
        staging.numpy()[...] = self._table_master
        self._table_device.copy_(staging, non_blocking=True)
        event = self._table_events[turn] = torch.cuda.Event()
        event.record()

    def observe_step(self, ran: np.ndarray, iteration: int) -> None:
        with self._lock:
            self._observe_step(ran, iteration)

    def _observe_step(self, ran: np.ndarray, iteration: int) -> None:
        """Account one finished step (table mode, read one step late): `ran (L, E)` the pool each
        expert ran from as its layer read the table (`StepRecord.ran_from`; -2: not used). Each use
        is a hit (the wanted version), a lo run (lo, or a ladder's middle tier, in place of hi) or a
        miss (read from host memory); used versions are touched for LRU and counted for prob-freq
        eviction, and a miss asks for its expert to be cached for the next steps."""
        waited = ran >= WAITED  # sent to a copy in flight (wait_for_copies): it ran from that pool
        if waited.any():
            ran = np.where(waited, ran - WAITED, ran)
            self.metrics.bump("hits_in_flight", int(waited.sum()))
        used = ran != UNUSED
        hi_id, lo_id, host_id = self.pool_ids["hi"], self.pool_ids["lo"], self.pool_ids["host"]
        wanted = lo_id if self.options.mode == "all-lo" else hi_id
        hits = (ran == wanted).sum(axis=1)
        mid_ids = [self.pool_ids[name] for name in self.tiers[1:-1]]
        mid_runs = np.isin(ran, mid_ids).sum(axis=1) if mid_ids else np.zeros(len(ran), dtype=np.int64)
        lo_runs = (ran == lo_id).sum(axis=1) + mid_runs if wanted != lo_id else np.zeros(len(ran), int)
        misses = ((ran == host_id) | (ran == NOT_RESIDENT)).sum(axis=1)
        per_layer = zip(used.sum(axis=1).tolist(), hits.tolist(), lo_runs.tolist(), mid_runs.tolist(),
                        misses.tolist(), strict=True)  # fmt: skip
        for counters, (n_used, n_hits, n_lo, n_mid, n_miss) in zip(self.metrics.layers, per_layer, strict=True):
            counters.used += n_used
            counters.hits += n_hits
            counters.lo_runs += n_lo
            counters.mid_runs += n_mid
            counters.misses += n_miss
        self._visits += used
        names = {self.pool_ids[name]: name for name in self.tiers}
        # only pools that evict need their LRU order kept (a lo pool holding every expert never does),
        # and only misses ask for anything: the rest of a batch-32 step's ~1,000 uses cost nothing here
        watched = (ran == host_id) | (ran == NOT_RESIDENT)
        for pid, name in names.items():
            if self._evicting[name]:
                watched |= ran == pid
        layers, experts = np.nonzero(watched)
        for layer, expert, pid in zip(layers.tolist(), experts.tolist(), ran[layers, experts].tolist(), strict=True):
            pool = names.get(pid)
            h = self.handles[layer][expert]
            version = h.versions.get(pool) if pool is not None else None
            if version is not None:
                self._touch(h, pool)
                if version.prefetched:
                    version.prefetched = False
                    self.metrics.bump("prefetches_used")
            elif pool is None and self.options.mode == "hi-cache" and "hi" not in h.versions:
                self._prefetch_queue.append((iteration, layer, expert))  # cache what was used
                self._fills.add((layer, expert))
            hi = h.versions.get("hi")
            if pool != "hi" and hi is not None:  # it ran from lo or host memory with a hi version kept
                if hi.prefetched and hi.issued_at <= iteration:
                    self.metrics.bump("prefetches_late")  # predicted in time, landed too late
                elif (layer, expert) in self._parked_in_step.get(iteration, {}).get("hi", ()):
                    self.metrics.bump("parked_misses")  # its slot was parked for in-step prefetches

    # -- set-up and reporting ---------------------------------------------------------------------------
    def preload(self, pool: str, count: int | None = None, progress=None) -> None:
        """Copy versions into `pool` up front (no-offload, static lo, the lo tier of dynaexq)."""
        slots_left = self.pools[pool].num_slots if count is None else count
        issued = []
        for row in self.handles:
            for h in row:
                if slots_left <= 0:
                    break
                slot = self._take_slot(pool, may_evict=False, may_wait=False)
                if slot is None:
                    break
                issued.append(self._start_copy(h, pool, slot, PRIORITY_MIGRATION))
                slots_left -= 1
                if progress is not None:
                    progress.update(1)
        for version in issued:
            version.ready.synchronize()
            version.published = True
        self.metrics.reset()
        E = self.store.num_experts
        in_order = all(
            v.slot == h.layer * E + h.expert for row in self.handles for h in row for v in h.versions.values()
        )
        complete = len(issued) == self.store.num_layers * E
        fixed_mode = {"all-lo": "lo", "all-hi": "hi"}.get(self.options.mode)
        if fixed_mode == pool and in_order and complete:
            self._fix_static_table(pool)

    def kernel_pools(self, dtype: torch.dtype) -> list:
        """The pools as the MoE kernel reads them (`compute.slot_table.Pool`, indexed by `pool_ids`:
        hi, lo, the zero-copy host pool, then a ladder's middle tiers; None for a pool without
        slots), packed formats dequantized to `dtype`."""
        if self._kernel_pools is None or self._kernel_pools[0] != dtype:
            from .slot_table import pool_for

            pools = []
            for name in sorted(self.pool_ids, key=self.pool_ids.get):
                if name == "host":
                    pools.append(self._zero_copy_pool(dtype))
                    continue
                pool, precision = self.pools[name], self.precision_of(name)
                meta = self.store.meta.get(precision) if precision != "hi" else None
                pools.append(pool_for(pool.arena, meta, self.store.shape, dtype) if pool.num_slots else None)
            self._kernel_pools = (dtype, pools)
        return self._kernel_pools[1]

    def _zero_copy_pool(self, dtype: torch.dtype):
        """The host store's hi arena as a pool the kernel reads in place (`on_miss="zero-copy"`): on a
        GPU its pinned memory is device-addressable (UVA), so a miss costs PCIe reads, not a sync."""
        if self.options.on_miss != "zero-copy" or "hi" not in self.store.versions:
            return None
        from .slot_table import device_alias, pool_for

        arena = self.store.versions["hi"]
        if self.device.type == "cuda":
            arena = device_alias(arena, self.device)
        return pool_for(arena, None, self.store.shape, dtype)

    def static_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(pool_of, slot_of)` (E,) int32 device tensors of `layer` when every expert has a version at
        a fixed slot for good (no-offload: hi at layer*E + e; static-int4/int2: lo there): the forward
        pass then needs no host decision. None otherwise."""
        if self._static_table is None:
            return None
        pool_of, slot_of = self._static_table
        return pool_of[layer], slot_of[layer]

    def _fix_static_table(self, pool: str) -> None:
        L, E = self.store.num_layers, self.store.num_experts
        slots = torch.arange(L * E, dtype=torch.int32, device=self.device).view(L, E)
        pool_of = torch.full((L, E), self.pool_ids[pool], dtype=torch.int32, device=self.device)
        self._static_table = (pool_of, slots)

    def settle(self) -> None:
        """Apply every queued request now, without the rate limit, and wait for all copies (for
        evaluation and tests; the serving path never calls this)."""
        self._drain_requests()
        limit = self.options.max_background_copies
        object.__setattr__(self.options, "max_background_copies", 1 << 30)
        try:
            self._issue_background()
        finally:
            object.__setattr__(self.options, "max_background_copies", limit)
        for row in self.handles:
            for h in row:
                for v in h.versions.values():
                    if not v.published:
                        v.ready.synchronize()
                        v.published = True

    def resident_counts(self) -> dict[str, int]:
        counts = {name: 0 for name in self.tiers}
        for pool, lru in self._lru.items():
            counts[pool] = sum(1 for layer, e in lru if self.handles[layer][e].published(pool) is not None)
        return counts

    def close(self) -> None:
        self.transfer.close()
