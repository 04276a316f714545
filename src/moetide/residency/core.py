"""The residency core: where each expert version lives, driven by the policies, read by every step.

`ResidencyManager` composes the parts, each with one job:

    pool.SlotPool             fixed slots per tier, budget-reserved, freed through fences
    cache.VersionCache        handles, LRU order, eviction candidates (eviction.py's rules)
    table.DeviceTable         the (pool, slot) table every MoE layer reads, and its publish protocol
    transitions.TransitionQueue  the policies' requests: prefetches, protections, precision changes
    reserve.InStepReserve     versions parked for the layer feed's in-step prefetches
    accounting.account_step   a finished step's uses: hits, lo runs, misses, LRU, miss fills

A step never waits for the host: between steps (`begin_step`) the core drains the policies'
requests, issues copies on the copy stream (prefetches in full, precision changes up to the rate
limit), evicts (a slot is reused only after the compute marker of the last step that could read it)
and writes the device table in one copy. A copy that lands during a step publishes its own entry on
its stream (slot word, then pool word), so later layers read it; under `deterministic` copies become
visible only at step boundaries. A step's uses reach the core one step later (`observe_step`).

Locking: the forward thread's step boundaries and the layer feed's thread (`in_step`) take turns
under `_lock`; the policies' requests go through the queue's own thread-safe queue.

A precision ladder of more than two tiers (lo+hi mode, `ResidencyOptions.mid_precisions`) adds one
pool per middle tier ("mid1", "mid2", ...) between hi and lo. Each expert's target is one tier; the
table sends it to its hottest published version. A move to a colder tier drops the hotter version at
once (the coldest is always resident) and copies the target's; a move to a hotter tier keeps the
version it has until the new one is published, after which the old one is first in line ("cold")
when its pool needs a slot.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import torch

from ..policies.base import tier_names, tier_rank
from ..store.host_store import HostExpertStore, hi_views
from .accounting import account_step
from .budget import BudgetTracker, MemoryPlan
from .cache import VersionCache
from .eviction import ExpertStats, cold_victims, eviction_rule
from .handles import DeviceVersion, ExpertHandle
from .host_source import copy_source, fence, staged_source, unhold
from .metrics import ExpertMetrics
from .options import ON_MISS_RULES, TABLE_LAG, ResidencyOptions  # noqa: F401 - re-exported
from .pool import SlotPool
from .reserve import InStepReserve
from .slot_table import NOT_RESIDENT
from .table import DeviceTable
from .transfer import PRIORITY_MIGRATION, PRIORITY_PREFETCH
from .transitions import TransitionQueue


class ResidencyManager:
    """Where each expert version lives; the `Residency` the engine reads and the `ExpertSink` the
    policies write to."""

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
        L, E = store.num_layers, store.num_experts
        self._make_pools(plan, options, device)
        self.stats = ExpertStats.zeros(L, E)
        self._lo_hi = options.mode == "lo+hi"
        self.cache = VersionCache(L, E, self.pools, self.stats, eviction_rule(options.eviction),
                                  prefer_cold=self._lo_hi, metrics=metrics, deterministic=options.deterministic)  # fmt: skip
        self.handles = self.cache.handles
        cap = options.max_inflight_prefetches or 2 * L
        self.queue = TransitionQueue(self.stats, cap, deterministic=options.deterministic)
        self.table = DeviceTable(L, len(self.pool_ids), E, device, landed_slots=self.pools["hi"].num_slots)
        self.reserve = InStepReserve(self.pools)
        self.iteration = 0
        self._kernel_pools = None  # (dtype, pools) of `kernel_pools`
        self._static_table = None  # (pool_of, slot_of) (L, E) when every slot is fixed for good
        self.waits = options.wait_for_copies and not options.deterministic
        self._step_marker = None  # compute marker after the last step: the fence of slot reuse
        self._lock = threading.RLock()
        self.in_step_fed = False  # a layer feed calls `in_step` (set by it): keep a reserve of slots
        self.cache.changed.update((l, e) for l in range(L) for e in range(E))
        keeps_lo = options.mode in ("lo+hi", "all-lo")
        if keeps_lo:
            for row in self.handles:
                for h in row:
                    h.target = "lo"
        # (L, E): the precision policy keeps the expert in lo (`ExpertHandle.target`, mirrored where set)
        self._kept_lo = np.full((L, E), keeps_lo)

    def _make_pools(self, plan: MemoryPlan, options: ResidencyOptions, device: torch.device) -> None:
        """The ladder's pools, hottest first (`tiers`: "hi", the middle tiers' "mid1", ..., "lo"),
        what each holds (`precision_of`) and their ids in the kernel's pool list (`pool_ids`)."""
        self.tiers = tier_names(2 + len(options.mid_precisions))
        middle = self.tiers[1:-1]
        sizes = {"hi": (plan.hi_slots, plan.hi_slot_bytes), "lo": (plan.lo_slots, plan.lo_slot_bytes)}
        sizes.update(zip(middle, zip(plan.mid_slots, plan.mid_slot_bytes, strict=True), strict=True))
        self.pools = {name: SlotPool(name, *sizes[name], device, self.budget) for name in self.tiers}
        # "host": zero-copy reads of the host store's hi arena
        self._precisions = {"hi": options.hi_precision, "lo": options.lo_precision, "host": "hi"}
        self._precisions.update(zip(middle, options.mid_precisions, strict=True))
        # a version's pool -> its index in `kernel_pools` and the slot tables; the middle tiers come
        # after the three every ladder has
        self.pool_ids = {"hi": 0, "lo": 1, "host": 2}
        self.pool_ids.update((name, 3 + i) for i, name in enumerate(middle))
        self._has_slots = {name: pool.num_slots > 0 for name, pool in self.pools.items()}

    # -- ExpertSink (any thread; never blocks) -----------------------------------------------------
    @property
    def capacity_experts(self) -> int:
        """hi experts the device holds at once (all layers)."""
        return self.plan.hi_slots

    def prefetch(
        self, layer: int, experts: list[int], *, iteration: int, priorities=None, protect: bool = False
    ) -> None:
        self.queue.put_prefetch(layer, experts, iteration, priorities, protect)

    def has_requests(self) -> bool:
        """Whether a policy has asked for something since the requests were last drained."""
        return self.queue.has_requests()

    def observe_gate_probs(self, layer: int | None, probs) -> None:
        """The mean gate probabilities `(E,)` of `layer` in the running step (for prob-freq eviction);
        `layer` None: every layer's at once, `(L, E)`."""
        self.queue.put_observed(layer, probs)

    def protect(self, layer: int, experts: list[int], *, iteration: int) -> None:
        self.queue.put_protect(layer, experts, iteration)

    def set_precision(self, layer: int, expert: int, precision: str) -> None:
        """`precision`: a tier of this ladder ("hi", "mid<t>", "lo"); anything else means "lo"."""
        self.queue.put_precision(layer, expert, precision if precision in self.tiers else "lo")

    # -- the Residency protocol ------------------------------------------------------------------------
    @property
    def accounts(self) -> bool:
        """Each step's uses are observed (`observe_step`): the table changes between steps."""
        return self._static_table is None

    def begin_step(self, iteration: int) -> None:
        """Between steps: apply what the policies asked for since the last step (prefetches, precision
        changes, evictions), publish the copies that have landed, and write the device table the next
        step's layers read. No host sync: a copy is published only once its event has completed
        (under `deterministic`, every copy in flight is waited for here, at the step boundary)."""
        with self._lock:
            if self.options.deterministic:
                self.cache.publish_all()
                self.queue.retire_all()
            self.iteration = iteration
            self.stats.unprotect(iteration - self.options.protect_iterations - TABLE_LAG)
            self._drain()
            for pool in self.pools.values():
                pool.reclaim()
            self._issue_background(self.options.max_background_copies * self.store.num_layers)
            if self.in_step_fed:
                evicting = {n: p for n, p in self.pools.items() if self.cache.evicts(n)}
                self.cache.changed |= self.reserve.park(iteration, evicting, self._parking_victims)
            self._write_table()
            self._note_peak()

    def end_step(self) -> None:
        """The step's work has been issued: its compute marker fences the reuse of every slot the
        table pointed at, and every protection for this iteration has served."""
        with self._lock:
            self._step_marker = self.transfer.compute_marker()
            self.stats.unprotect(self.iteration)

    def in_step(self, iteration: int, routed: int, used=None) -> int:
        """Within a step (the layer feed's thread): MoE layer `routed` of step `iteration` has routed on
        the device, so every layer before it has finished computing. The policies' requests are drained
        and the prefetches for this step's later layers start at once; they publish themselves when
        they land, so a layer that runs after that reads them. Their slots are free ones, parked ones
        or those of versions only layers before `routed` could read in this step. Nothing for a step
        that is not the latest begun, or under `deterministic`. `used`: the experts layer `routed`
        chose (any shape), touched now for the LRU order. Returns the copies started."""
        with self._lock:
            if self.options.deterministic or iteration != self.iteration:
                return 0
            if used is not None and routed >= 0:
                for expert in np.unique(used).tolist():
                    h = self.handles[routed][expert]
                    for pool in list(h.versions):
                        if self.cache.evicts(pool):
                            self.cache.touch(h, pool)
            self._drain()
            self.stats.unprotect(iteration, layers=slice(0, routed))  # their protection has served
            later, started = deque(), 0
            victims = self.cache.victim_queues(below_layer=routed)
            while self.queue.prefetches:
                request = self.queue.prefetches.popleft()
                it, layer, expert = request
                # for a later step, or a miss fill (for the next steps): a begin_step issues it
                if it > iteration or (layer <= routed and (layer, expert) in self.queue.fills):
                    later.append(request)
                elif layer > routed:  # (its layer running or done: too late)
                    started += self._issue_prefetch(*request, in_step=victims)
            self.queue.prefetches = later
            self._note_peak()
            return started

    def step_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(pool_of (E,), slot_of (P, E) or (E,))` int32 device views of `layer`'s entries."""
        if self._static_table is not None:
            return self.static_table(layer)
        return self.table.layer_view(layer)

    def step_waits(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """`(wait_of (E,), landed (hi slots,), the hi pool's id)`, int32 device views (wait_for_copies):
        an expert the table sends to the hi pool is read once `landed[slot] == wait_of[e]` when
        `wait_of[e]` is not 0; else None."""
        if not self.waits or self._static_table is not None:
            return None
        return self.table.wait_view(layer), self.table.landed, self.pool_ids["hi"]

    def observe_step(self, ran: np.ndarray, iteration: int) -> None:
        """Account one finished step, read one step late: `ran (L, E)` the pool each expert ran from
        as its layer read the table (`accounting.account_step`)."""
        with self._lock:
            account_step(self, ran, iteration)

    def static_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(pool_of, slot_of)` (E,) int32 device tensors of `layer` when every expert has a version at
        a fixed slot for good (no-offload: hi at layer*E + e; static-int4/int2: lo there); else None."""
        if self._static_table is None:
            return None
        pool_of, slot_of = self._static_table
        return pool_of[layer], slot_of[layer]

    def kernel_pools(self, dtype: torch.dtype) -> list:
        """The pools as the MoE kernel reads them (`slot_table.Pool`, indexed by `pool_ids`: hi, lo,
        the zero-copy host pool, then a ladder's middle tiers; None for a pool without slots)."""
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

    def precision_of(self, pool: str) -> str:
        """The precision a pool's versions hold ("hi" or a `store.formats.FORMATS` name)."""
        return self._precisions[pool]

    def preload(self, pool: str, count: int | None = None, progress=None) -> None:
        """Copy versions into `pool` up front (no-offload, static lo, the lo tier of dynaexq)."""
        slots_left = self.pools[pool].num_slots if count is None else count
        issued = []
        for row in self.handles:
            for h in row:
                if slots_left <= 0:
                    break
                slot = self.cache.take_slot(pool, None, may_evict=False)
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
            L = self.store.num_layers
            slots = torch.arange(L * E, dtype=torch.int32, device=self.device).view(L, E)
            pool_of = torch.full((L, E), self.pool_ids[pool], dtype=torch.int32, device=self.device)
            self._static_table = (pool_of, slots)

    def settle(self) -> None:
        """Apply every queued request now, without the rate limit, and wait for all copies (for
        evaluation and tests; the serving path never calls this)."""
        with self._lock:
            self._drain()
            self._issue_background(1 << 30)
            for row in self.handles:
                for h in row:
                    for v in h.versions.values():
                        if not v.published:
                            v.ready.synchronize()
                            v.published = True

    def resident_counts(self) -> dict[str, int]:
        counts = {name: 0 for name in self.tiers}
        for pool, lru in self.cache.lru.items():
            counts[pool] = sum(1 for layer, e in lru if self.handles[layer][e].published(pool) is not None)
        return counts

    def close(self) -> None:
        self.transfer.close()

    # -- requests and transitions ------------------------------------------------------------------------
    def _drain(self) -> None:
        self.queue.drain(self._worth_prefetching)

    def _worth_prefetching(self, layer: int, experts) -> list:
        """The requested experts whose prefetch can do anything. In the lo+hi mode with no hi slots and a
        lo pool that holds every expert, one the precision policy keeps in lo is already where a
        prefetch would bring it, so it is not queued. With hi slots every prediction is kept: it is
        brought into hi for its layer (`_prefetch_pool`)."""
        lo_everywhere = self._has_slots["lo"] and not self.cache.evicts("lo")
        if not (self._lo_hi and lo_everywhere) or self._has_slots["hi"] or self.reserve.any_parked("lo"):
            return list(experts)
        what = np.fromiter(experts, dtype=np.int64, count=len(experts))
        return what[~self._kept_lo[layer, what]].tolist()

    def _issue_background(self, budget: int) -> None:
        """Issue every queued prefetch (the policy sized them), then up to `budget` precision changes."""
        if self.queue.prefetches:
            victims_for = self.cache.victim_queues()
            while self.queue.prefetches:
                self._issue_prefetch(*self.queue.prefetches.popleft(), victims_for=victims_for)
        self.queue.issue_precision(budget, self._apply_precision)

    def _issue_prefetch(
        self, iteration: int, layer: int, expert: int, victims_for=None, in_step=None
    ) -> bool:
        """Start one queued prefetch; True if it started a copy. Requests made more than `TABLE_LAG`
        steps ago are dropped. `victims_for`: pool -> `next_victim` for a burst between steps;
        `in_step`: the same within a step (victims only of layers already run, whose slots change
        hands at once)."""
        fill = self.queue.take_fill(layer, expert)  # caching a miss: not a prediction, never dropped
        if iteration < self.iteration - TABLE_LAG:
            return False
        h = self.handles[layer][expert]
        pool = self._prefetch_pool(h)
        if pool is None:
            return False
        if pool in h.versions:  # (most requests of a busy step: kept cheap)
            if self.cache.evicts(pool):
                self.cache.touch(h, pool)
            # predicted after all: no in-step prefetch may take its slot; within a step its entry is
            # back at once (the slot was never given away), else in the next table
            if self.reserve.unpark(pool, (layer, expert)) and in_step is not None:
                self._republish(h, pool)
            return False
        if not fill and self.queue.link_full():
            self.metrics.bump("deferred")
            return False
        src = staged_source(self.store, self.precision_of(pool), layer, expert, self.options.deterministic)
        if src is False:  # its hi version is only on disk: the stager reads it, a later request copies it
            self.metrics.bump("deferred")
            return False
        # a prediction beside the precision policy's choice (lo+hi: into hi, its target lo) takes only
        # a slot that policy does not want (free, or a version whose target is another tier)
        beside = self._lo_hi and h.target != pool
        if in_step is not None:
            slot = self._take_slot_in_step(pool, cold_victims(pool, in_step(pool), beside))
        else:
            victims = victims_for(pool) if victims_for is not None else None
            if victims is not None:
                victims = cold_victims(pool, victims, beside)
            slot = self.cache.take_slot(
                pool, self._step_marker, may_evict=True, next_victim=victims, cold_only=beside
            )
        if slot is None:
            unhold(self.store, src)
            self.metrics.bump("deferred")
            return False
        version = self._start_copy(h, pool, slot, PRIORITY_PREFETCH, src)
        version.issued_at = self.iteration
        version.prefetched = not fill
        self.metrics.bump("miss_fills" if fill else "prefetches_issued")
        self.queue.started(version)
        if in_step is not None and version.gen:
            self._waiting_entry(h, version)
        return True

    def _prefetch_pool(self, h: ExpertHandle) -> str | None:
        """The pool a prefetch of `h` fills: the hi pool when there is one. In the lo+hi mode (combined)
        an expert whose target is a hotter tier is brought into that tier (FineMoE says when, DynaExq
        in what precision); one whose target is lo is brought into hi beside DynaExq's hot set, in the
        slots that set leaves (`_cold_victims`), and runs lo where none is left. None: no pool."""
        has_slots = self._has_slots
        lo = "lo" if has_slots["lo"] else None
        if self._lo_hi and h.target != "lo" and has_slots[h.target]:
            return h.target
        return "hi" if has_slots["hi"] else lo

    def _parking_victims(self, pool: str):
        """The versions `InStepReserve.park` may take out of the next step's table (lo+hi: never one
        of the precision policy's hot set)."""
        return cold_victims(pool, self.cache.victim_queue(pool), self._lo_hi)

    def _take_slot_in_step(self, pool: str, next_victim) -> int | None:
        """Within a step: a free slot of `pool` with its bytes reserved, else the slot of a parked
        version, else that of the victim `next_victim()` gives (a version no reader still needs: it
        changes hands without waiting)."""
        p = self.pools[pool]
        p.reclaim()
        self.reserve.wanted(pool)
        if p.free_slots:
            return p.take()
        key = self.reserve.take(pool, lambda k: pool in self.handles[k[0]][k[1]].versions)
        victim = self.handles[key[0]][key[1]] if key is not None else next_victim()
        if victim is None:
            return None
        self.reserve.unpark(pool, (victim.layer, victim.expert))
        self.table.withdraw(victim.layer, victim.expert)  # until the next write recomputes it
        return self.cache.hand_over(victim, pool)

    def _apply_precision(self, key: tuple[int, int], target: str) -> str:
        """One precision change of `TransitionQueue.issue_precision` (the lo+hi mode; elsewhere the
        mode fixes the precision)."""
        if not self._lo_hi:
            return "done"
        layer, expert = key
        h = self.handles[layer][expert]
        h.target = target
        self._kept_lo[layer, expert] = target == "lo"
        return self._move_to_target(h)

    def _move_to_target(self, h: ExpertHandle) -> str:
        """Bring `h` to its target tier: versions of hotter tiers are dropped at once where a colder
        published one remains to run (a copy still in flight is left to land; it is then cold, the
        first to go when its pool needs a slot); the target's version is copied into a slot of its
        pool, evicting only versions the precision policy no longer wants there. Returns "copied",
        "deferred" (no slot can be had now: the forward pass keeps its current version) or "done"."""
        target, rank = h.target, tier_rank(h.target)
        for version in h.versions.values():  # landed copies count as what the expert has
            self.cache.publish_if_ready(version)
        best = h.resolve()
        before = tier_rank(best.pool) if best is not None else None
        dropped = False
        for pool in [p for p in h.versions if p != "lo" and tier_rank(p) < rank]:
            colder = any(v.published for q, v in h.versions.items() if tier_rank(q) > tier_rank(pool))
            if not colder or not self.cache.publish_if_ready(h.versions[pool]):
                continue
            self.cache.evict(h, pool, self._step_marker)
            dropped = True
        outcome = "done"
        if target != "lo" and target not in h.versions and self.pools[target].num_slots:
            src = staged_source(
                self.store, self.precision_of(target), h.layer, h.expert, self.options.deterministic
            )
            if src is False:  # only on disk: staged in the background, the change stays queued
                self.metrics.bump("deferred")
                return "deferred"
            slot = self.cache.take_slot(target, self._step_marker, may_evict=True, cold_only=True)
            if slot is None:  # admission control: no reservation, no copy; what is resident keeps serving
                unhold(self.store, src)
                self.metrics.bump("deferred")
                return "deferred"
            self._start_copy(h, target, slot, PRIORITY_MIGRATION, src)
            outcome = "copied"
        # one count per change of tier (the precision policy's, not cache evictions)
        if outcome == "copied" and (before is None or rank < before):
            self.metrics.bump("promotions")
        elif (dropped or outcome == "copied") and before is not None and rank > before:
            self.metrics.bump("demotions")
        return outcome

    # -- copies and the table -----------------------------------------------------------------------------
    def _start_copy(
        self, handle: ExpertHandle, pool: str, slot: int, priority: int, src=None
    ) -> DeviceVersion:
        """Copy `handle`'s version of `pool`'s precision into `slot` on the copy stream; in table mode
        the copy then publishes its own entry (`_publishing_words`). `src`: the host buffer to copy
        from (`host_source.staged_source`), or None: the store's (`host_source.copy_source`)."""
        precision = self.precision_of(pool)
        src = copy_source(self.store, precision, handle.layer, handle.expert, src)
        dst = self.pools[pool].buffer(slot)[: src.numel()]
        then, number = self._publishing_words(handle, pool, slot), 0
        if self.waits and pool == "hi" and self._static_table is None:
            number = self.table.next_copy_number()
            then = [self.table.landed_word(slot, number)] + then  # right after the data
        event = self.transfer.copy(dst, src, priority, then=then)
        fence(self.store, precision, src, event)  # a staged slot is not reused before the copy has read it
        self.metrics.add_copy(src.numel())
        if precision == "hi":
            views, meta = hi_views(dst, self.store.shape), None
        else:
            from ..store import quant

            meta = self.store.meta[precision]
            views = quant.expert_views(dst, meta)
        version = DeviceVersion(pool, precision, slot, event, views, meta, gen=number)
        self.cache.add(handle, version)
        return version

    def _publishing_words(self, handle: ExpertHandle, pool: str, slot: int) -> list:
        """The device-table words a copy writes after itself, on its own stream, so that its version
        is live from the moment it lands, even in the middle of a step. None under `deterministic`
        (versions appear at step boundaries only) or where the entry would not change to this
        version (a hotter version is kept: the table sends an expert to its hottest)."""
        if self.options.deterministic or self._static_table is not None or self._hotter_kept(handle, pool):
            return []
        # the host's table takes the new slot at once: no reader looks in this pool's row for the
        # expert before its pool word says so, and a whole-table write between the copy's two words
        # must not put the old slot back under a pool word that is about to point here
        pid = self.pool_ids[pool]
        self.table.set_slot(handle.layer, handle.expert, pid, slot)
        return self.table.publish_words(handle.layer, handle.expert, pid, slot)

    def _point_entry(self, handle: ExpertHandle, pool: str, slot: int, wait: int | None = None) -> None:
        """Within a step: the host's table and, at once on the demand stream, the device's send
        `handle` to `slot` of `pool` (and, given, to wait for copy `wait`)."""
        layer, expert, pid = handle.layer, handle.expert, self.pool_ids[pool]
        master = self.table.master
        master[layer, 0, expert] = pid
        master[layer, 1 + pid, expert] = slot
        if wait is not None:
            master[layer, self.table.wait_row, expert] = wait
        self.transfer.write_words(self.table.publish_words(layer, expert, pid, slot, wait))

    def _waiting_entry(self, handle: ExpertHandle, version: DeviceVersion) -> None:
        """Within a step (wait_for_copies): send `handle`'s later layer to its hi copy that has just
        started, with the copy's number: the layer waits on the device for the copy's landed word."""
        if not any(v.published for v in handle.versions.values()):
            self._point_entry(handle, "hi", version.slot, wait=version.gen)

    def _republish(self, handle: ExpertHandle, pool: str) -> None:
        """Within a step: point the device table at `handle`'s landed version in `pool` now (a parked
        version predicted after all)."""
        version = handle.versions[pool]
        if not self.cache.publish_if_ready(version) or self._hotter_kept(handle, pool):
            return
        self._point_entry(handle, pool, version.slot)
        self.metrics.bump("unparked")

    @staticmethod
    def _hotter_kept(handle: ExpertHandle, pool: str) -> bool:
        """A version in a hotter tier than `pool` is kept: the table sends the expert there, not here."""
        return any(tier_rank(other) < tier_rank(pool) for other in handle.versions)

    def _entry(self, h: ExpertHandle) -> tuple[int, int, int]:
        """Where the table sends expert `h`, `(pool id, slot, copy to wait for)`: its hottest published
        version (hi, a middle tier's, lo) not parked; else (wait_for_copies) its hi version still
        being copied, whose landing the layer waits for; else (zero-copy) its hi version in host
        memory; else nowhere."""
        key = (h.layer, h.expert)
        for pool in self.tiers:
            v = h.versions.get(pool)
            if v is not None and not self.reserve.is_parked(pool, key) and self.cache.publish_if_ready(v):
                return self.pool_ids[pool], v.slot, 0
        v = h.versions.get("hi")
        if v is not None and v.gen and not v.published and not self.reserve.is_parked("hi", key):
            return self.pool_ids["hi"], v.slot, v.gen  # its copy is on the way: the layer waits for it
        if self.options.on_miss == "zero-copy":
            return self.pool_ids["host"], self.store.row(h.layer, h.expert), 0
        return NOT_RESIDENT, 0, 0

    def _write_table(self) -> None:
        """Recompute the entries that may have changed, then one copy of the table to the device."""
        changed = self.cache.changed
        if not changed:
            return
        settled = []
        for layer, expert in changed:
            h = self.handles[layer][expert]
            self.table.set_entry(layer, expert, *self._entry(h))
            if all(v.published for v in h.versions.values()):
                settled.append((layer, expert))
        changed.difference_update(settled)
        self.table.write()

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

    def _note_peak(self) -> None:
        self.metrics.peak_device_bytes = max(self.metrics.peak_device_bytes, self.budget.peak_bytes)
