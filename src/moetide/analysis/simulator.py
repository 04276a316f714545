"""CPU trace simulator: replay a routing trace against a policy and a simulated device expert cache.

For every step of the trace, the simulator calls the policy exactly as the forward pass would
(`begin_iteration`, then per MoE layer `observe_layer` and `observe_speculative`, then
`end_iteration`), acting itself as the policy's `ExpertSink`. Per step and layer it counts *demands*:
the distinct experts the step's tokens picked at that layer. A demand is a *hit* when the expert is
resident when the layer runs; a miss is loaded on demand (the engine reads it from host memory or
runs lo, and caches it for the next steps).

No timing model. A prefetch becomes resident at once, i.e. before the layer it targets runs, but only
within the cache's capacity (it evicts by the cache's rule and never evicts an expert protected for
the current iteration; if no slot can be freed it is dropped). The prefetch distance d is what keeps
this honest: after layer p has run, a prefetch may only target layers >= p + d (it would arrive too
late for nearer layers; such requests are dropped and counted as `late`). Before the first layer
(`begin_iteration`, p = -1) any layer may be targeted: the paper's semantic search prefetches the
first d layers from there.

Cache: `capacity_experts` slots, either one pool for all layers (`scope="global"`) or the same share
per layer (`scope="layer"`, Mixtral-Offloading's layout). Eviction: the engine's rules
(`residency.eviction.RULES`: "lru", or FineMoE's "prob-freq": lowest probability x visit count,
where probability is the latest estimate for that expert: the predicted one a prefetch carried, or
the observed gate probability when its layer last ran; ties by LRU), ranked by the same function.
Experts being used by the running layer are never evicted.

Reported: hit rate (all, prefill, decode, per layer), prefetch precision = predicted-and-used /
predicted and recall = predicted-and-used / demanded (per step and layer), bytes moved (on-demand +
prefetch), wasted prefetch loads (loaded by a prefetch, evicted or left unused), and, for precision
policies, hi-precision transitions and the share of token selections that hit a hi expert.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from ..policies.base import ExpertPolicy
from ..policies.finemoe import FineMoEConfig, FineMoEPolicy
from ..residency.eviction import eviction_rule, first_victim
from .trace import Trace, TraceStep

CACHE_SCOPES = ("global", "layer")


class VirtualClock:
    """Simulated time in seconds; the simulator advances it by each step's simulated duration."""

    def __init__(self, start_s: float = 0.0):
        self.now = start_s

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def layer_capacities(capacity_experts: int, num_layers: int) -> list[int]:
    """Per-layer share of a cache of `capacity_experts` slots (remainder to the first layers)."""
    base, extra = divmod(capacity_experts, num_layers)
    return [base + (1 if l < extra else 0) for l in range(num_layers)]


class SimulatedExpertCache:
    """Residency of (layer, expert) slots, with LRU or FineMoE eviction and protection.

    Keys are flat: key = layer * J + expert. All arrays are (L * J,).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        capacity_experts: int,
        scope: str = "global",
        eviction: str = "lru",
    ):
        if scope not in CACHE_SCOPES:
            raise ValueError(f"scope must be one of {CACHE_SCOPES}, got {scope!r}")
        self.rule = eviction_rule(eviction)
        if capacity_experts < 0:
            raise ValueError("capacity_experts must be >= 0")
        self.L, self.J = num_layers, num_experts
        n = num_layers * num_experts
        self.capacity = min(capacity_experts, n)
        self.scope = scope
        self.eviction = eviction
        self.layer_capacity = layer_capacities(self.capacity, num_layers)
        self.resident = np.zeros(n, dtype=bool)
        self.last_use = np.zeros(n, dtype=np.int64)
        self.visits = np.zeros(n, dtype=np.int64)
        self.prob = np.ones(n, dtype=np.float64)
        self.protected = np.zeros(n, dtype=bool)
        self.pinned = np.zeros(n, dtype=bool)
        self.prefetched_unused = np.zeros(n, dtype=bool)
        self.layer_count = np.zeros(num_layers, dtype=np.int64)
        self.clock = 0
        self.evictions = 0
        self.wasted_prefetches = 0

    def key(self, layer: int, expert: int) -> int:
        return layer * self.J + expert

    def _has_free_slot(self, layer: int) -> bool:
        if self.scope == "layer":
            return self.layer_count[layer] < self.layer_capacity[layer]
        return int(self.layer_count.sum()) < self.capacity

    def _victim(self, layer: int, spare_protected: bool) -> int | None:
        cand = self.resident & ~self.pinned
        if spare_protected:
            cand &= ~self.protected
        if self.scope == "layer":
            mask = np.zeros_like(cand)
            mask[layer * self.J : (layer + 1) * self.J] = True
            cand &= mask
        if not cand.any():
            return None
        keys = np.flatnonzero(cand)
        return int(keys[first_victim(self.rule, self.last_use[keys], self.prob[keys], self.visits[keys])])

    def _evict(self, key: int) -> None:
        self.resident[key] = False
        self.layer_count[key // self.J] -= 1
        self.evictions += 1
        if self.prefetched_unused[key]:
            self.wasted_prefetches += 1
            self.prefetched_unused[key] = False

    def insert(self, key: int, *, prefetch: bool) -> bool:
        """Make `key` resident, evicting if needed. False if no slot could be freed.

        A prefetch never evicts a protected expert; a demand load evicts one only as a last resort.
        """
        if self.resident[key]:
            return True
        layer = key // self.J
        if not self._has_free_slot(layer):
            victim = self._victim(layer, spare_protected=True)
            if victim is None and not prefetch:
                victim = self._victim(layer, spare_protected=False)
            if victim is None:
                return False
            self._evict(victim)
        self.resident[key] = True
        self.layer_count[layer] += 1
        self.prefetched_unused[key] = prefetch
        if prefetch:
            self.clock += 1
            self.last_use[key] = self.clock
        return True

    def touch(self, keys: np.ndarray) -> None:
        """Keys used by the running layer: most recently used, one more visit each."""
        self.clock += 1
        self.last_use[keys] = self.clock
        self.visits[keys] += 1
        self.prefetched_unused[keys] = False

    def finish(self) -> None:
        """Count prefetched experts still unused at the end of the run as wasted."""
        self.wasted_prefetches += int(self.prefetched_unused.sum())
        self.prefetched_unused[:] = False


@dataclass
class SimulationResult:
    """Counters of one simulated run (JSON-able through `to_dict`)."""

    policy: str
    capacity_experts: int
    scope: str
    eviction: str
    prefetch_distance: int | None
    steps: int = 0
    demands: int = 0
    hits: int = 0
    prefill_demands: int = 0
    prefill_hits: int = 0
    decode_demands: int = 0
    decode_hits: int = 0
    layer_demands: list[int] = field(default_factory=list)
    layer_hits: list[int] = field(default_factory=list)
    predictions: int = 0  # distinct (step, layer, expert) predicted by in-time prefetches
    predictions_used: int = 0
    on_demand_loads: int = 0
    prefetch_loads: int = 0
    prefetch_dropped_capacity: int = 0
    late_prefetches: int = 0
    stale_requests: int = 0
    wasted_prefetches: int = 0
    evictions: int = 0
    bytes_per_expert: int = 1
    promotions: int = 0
    demotions: int = 0
    hi_selections: int = 0
    selections: int = 0
    policy_stats: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.demands if self.demands else float("nan")

    @property
    def precision(self) -> float:
        return self.predictions_used / self.predictions if self.predictions else float("nan")

    @property
    def recall(self) -> float:
        return self.predictions_used / self.demands if self.demands else float("nan")

    @property
    def bytes_moved(self) -> int:
        return (self.on_demand_loads + self.prefetch_loads) * self.bytes_per_expert

    @property
    def hi_share(self) -> float:
        return self.hi_selections / self.selections if self.selections else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in (
            "hit_rate",
            "precision",
            "recall",
            "bytes_moved",
            "hi_share",
        ):
            d[name] = getattr(self, name)
        return d


StepTime = Callable[[TraceStep], float]


def default_step_time(step: TraceStep, decode_s: float = 0.03, prefill_token_s: float = 0.0005) -> float:
    """Simulated wall time of a step: a decode step costs `decode_s`, a prefill `prefill_token_s`/token more."""
    return decode_s + (prefill_token_s * step.num_tokens if step.kind == "prefill" else 0.0)


class TraceSimulator:
    """Replays `trace` through `policy`; is the policy's `ExpertSink`. Use synchronous policies.

    Args:
        capacity_experts: cache slots (experts) for all layers together.
        scope: "global" (one pool) or "layer" (an equal share per layer).
        eviction: "lru", "prob-freq", or "policy" (the policy's `preferred_eviction`, else "lru").
        prefetch_distance: d for the late-prefetch rule; None = the policy's `prefetch_distance`
            attribute; 0 disables the rule.
        bytes_per_expert: bytes one expert load moves.
        clock: a `VirtualClock` advanced by `step_time(step)` after each step (pass the same clock to
            time-based policies such as DynaExq).
        on_step: callback(step_index, simulator) after each step (for timelines).
        decision_lag: 0 = decisions within the running step (the paper's FineMoE: the policy sees
            each layer as it runs and its prefetches serve later layers of the same step). k > 0 =
            the engine's sync-free steps: the policy sees a step after all its layers ran, its
            requests reach the cache k steps after the step it observed (the engine: 2,
            `residency.core.TABLE_LAG`), and a miss is cached for the next step on (the engine
            reads it zero-copy and copies it in at the next step boundary).
    """

    def __init__(
        self,
        trace: Trace,
        policy: ExpertPolicy,
        capacity_experts: int,
        *,
        scope: str = "global",
        eviction: str = "policy",
        prefetch_distance: int | None = None,
        bytes_per_expert: int = 1,
        clock: VirtualClock | None = None,
        step_time: StepTime = default_step_time,
        on_step: Callable[[int, TraceSimulator], None] | None = None,
        decision_lag: int = 0,
    ):
        m = trace.meta
        self.decision_lag = int(decision_lag)
        self._deferred: list[tuple[int, str, tuple]] = []  # (apply at step, kind, args)
        self._missed: list[int] = []  # keys missed in the running step (decision_lag > 0)
        self.trace = trace
        self.policy = policy
        if eviction == "policy":
            eviction = getattr(policy, "preferred_eviction", "lru")
        self.cache = SimulatedExpertCache(m.num_layers, m.num_experts, capacity_experts, scope, eviction)
        self.capacity_experts = self.cache.capacity
        if prefetch_distance is None:
            prefetch_distance = getattr(policy, "prefetch_distance", 0) or 0
        self.prefetch_distance = int(prefetch_distance)
        self.clock = clock if clock is not None else VirtualClock()
        self.step_time = step_time
        self.on_step = on_step
        self.hi = np.zeros((m.num_layers, m.num_experts), dtype=bool)
        self.result = SimulationResult(
            policy=getattr(policy, "name", type(policy).__name__),
            capacity_experts=self.cache.capacity,
            scope=scope,
            eviction=eviction,
            prefetch_distance=self.prefetch_distance or None,
            bytes_per_expert=bytes_per_expert,
            layer_demands=[0] * m.num_layers,
            layer_hits=[0] * m.num_layers,
        )
        self.step_hi_selections: list[int] = []
        self.step_selections: list[int] = []
        self.step_times: list[float] = []
        self._lock = threading.RLock()
        self._iteration = -1
        self._observed_layer = -1
        self._predicted: list[set[int]] = [set() for _ in range(m.num_layers)]
        if not getattr(policy, "synchronous", True):
            raise ValueError(
                f"{self.result.policy}: simulate a policy in synchronous mode (synchronous=True)"
            )
        policy.attach(self, m.num_layers, m.num_experts, m.top_k)

    # -- ExpertSink ---------------------------------------------------------------------------------
    def _admissible(self, layer: int, iteration: int) -> bool:
        if iteration != self._iteration:
            self.result.stale_requests += 1
            return False
        if not 0 <= layer < self.trace.meta.num_layers:
            return False
        p = self._observed_layer
        if layer <= p or (p >= 0 and layer < p + self.prefetch_distance):
            self.result.late_prefetches += 1
            return False
        return True

    def prefetch(self, layer, experts, *, iteration, priorities=None, protect=False) -> None:
        if self.decision_lag and not self._applying:
            at = self._iteration + self.decision_lag
            self._deferred.append((at, "prefetch", (layer, tuple(experts), iteration, priorities, protect)))
            return
        if protect:
            self.protect(layer, experts, iteration=iteration)
        with self._lock:
            if not self.decision_lag and not self._admissible(layer, iteration):
                return
            J = self.cache.J
            for i, e in enumerate(experts):
                e = int(e)
                self._predicted[layer].add(e)
                key = layer * J + e
                if priorities is not None:
                    self.cache.prob[key] = float(priorities[i])
                if self.cache.resident[key]:
                    continue
                if self.cache.insert(key, prefetch=True):
                    self.result.prefetch_loads += 1
                else:
                    self.result.prefetch_dropped_capacity += 1

    def protect(self, layer, experts, *, iteration) -> None:
        if self.decision_lag and not self._applying:
            self._deferred.append((self._iteration + self.decision_lag, "protect", (layer, tuple(experts), iteration)))
            return
        with self._lock:
            if not self.decision_lag and (iteration != self._iteration or layer <= self._observed_layer):
                return
            J = self.cache.J
            for e in experts:
                self.cache.protected[layer * J + int(e)] = True

    def set_precision(self, layer, expert, precision) -> None:
        with self._lock:
            want_hi = precision == "hi"
            if self.hi[layer, expert] == want_hi:
                return
            self.hi[layer, expert] = want_hi
            if want_hi:
                self.result.promotions += 1
            else:
                self.result.demotions += 1

    # -- replay -------------------------------------------------------------------------------------
    def _run_layer(self, step: TraceStep, layer: int) -> None:
        r, cache, J = self.result, self.cache, self.cache.J
        ids = step.layer_topk(layer)  # (T, k)
        demand = torch.unique(ids).numpy()
        keys = layer * J + demand
        resident = cache.resident[keys]
        hits = int(resident.sum())
        n = len(keys)
        r.demands += n
        r.hits += hits
        r.layer_demands[layer] += n
        r.layer_hits[layer] += hits
        if step.kind == "prefill":
            r.prefill_demands += n
            r.prefill_hits += hits
        else:
            r.decode_demands += n
            r.decode_hits += hits
        predicted = self._predicted[layer]
        if predicted:
            r.predictions += len(predicted)
            r.predictions_used += len(predicted.intersection(demand.tolist()))
        cache.pinned[keys] = True
        for key in keys[~resident]:
            r.on_demand_loads += 1
            if self.decision_lag:
                self._missed.append(int(key))  # read in place now, cached from the next step on
            else:
                cache.insert(int(key), prefetch=False)  # when all slots are pinned it streams through
        cache.touch(keys)
        cache.prob[layer * J : (layer + 1) * J] = step.gate_probs[layer].numpy()
        cache.protected[layer * J : (layer + 1) * J] = False  # this layer's protection has served
        # precision accounting (token-level selections on hi experts)
        flat = ids.reshape(-1).numpy()
        r.selections += flat.size
        r.hi_selections += int(self.hi[layer, flat].sum())

    _applying = False

    def _show_layer(self, s: int, step, layer: int, spec) -> None:
        """The policy observes one layer of step `s` (and, where it asks, its speculative ids)."""
        self.policy.observe_layer(s, layer, step.gate_probs[layer], step.layer_topk(layer))
        for d in spec:
            ids = step.spec(layer, d)
            if ids is not None:
                self.policy.observe_speculative(s, layer, d, ids)

    def _apply_deferred(self, s: int) -> None:
        """At the start of step `s` (decision_lag > 0): cache last step's misses, then apply the
        requests that have reached the cache by now."""
        for key in self._missed:
            if not self.cache.resident[key]:
                self.cache.insert(key, prefetch=False)
        self._missed.clear()
        due = [d for d in self._deferred if d[0] <= s]
        self._deferred = [d for d in self._deferred if d[0] > s]
        self._applying = True
        try:
            for _, kind, args in due:
                if kind == "prefetch":
                    layer, experts, iteration, priorities, protect = args
                    self.prefetch(
                        layer, list(experts), iteration=iteration, priorities=priorities, protect=protect
                    )
                else:
                    layer, experts, iteration = args
                    self.protect(layer, list(experts), iteration=iteration)
        finally:
            self._applying = False

    def run(self) -> SimulationResult:
        policy, r = self.policy, self.result
        L = self.trace.meta.num_layers
        spec = tuple(getattr(policy, "speculative_distances", ()))
        for s in range(len(self.trace)):
            step = self.trace.step(s)
            sel0, hi0 = r.selections, r.hi_selections
            with self._lock:
                self._iteration = s
                self._observed_layer = -1
                for p in self._predicted:
                    p.clear()
                self.cache.protected[:] = False
            request_ids = (step.request_id,) if step.request_id >= 0 else ()
            in_step = not self.decision_lag  # else the step runs first, then the policy sees it
            if not in_step:
                self._apply_deferred(s)
                for layer in range(L):
                    with self._lock:
                        self._run_layer(step, layer)
                self.cache.pinned[:] = False
            policy.begin_iteration(s, step.embedding, step.num_tokens, request_ids=request_ids)
            for layer in range(L):
                if in_step:
                    with self._lock:
                        self._run_layer(step, layer)
                        self._observed_layer = layer
                self._show_layer(s, step, layer, spec)
                if in_step:
                    with self._lock:
                        self.cache.pinned[layer * self.cache.J : (layer + 1) * self.cache.J] = False
            policy.end_iteration(s)
            dt = self.step_time(step)
            self.clock.advance(dt)
            self.step_times.append(self.clock.now)
            self.step_selections.append(r.selections - sel0)
            self.step_hi_selections.append(r.hi_selections - hi0)
            r.steps += 1
            if self.on_step is not None:
                self.on_step(s, self)
        self.cache.finish()
        r.wasted_prefetches = self.cache.wasted_prefetches
        r.evictions = self.cache.evictions
        if hasattr(policy, "stats"):
            r.policy_stats = policy.stats()
        return r


def simulate(trace: Trace, policy: ExpertPolicy, capacity_experts: int, **kwargs) -> SimulationResult:
    """Replay `trace` through `policy` with a cache of `capacity_experts` slots (see `TraceSimulator`)."""
    return TraceSimulator(trace, policy, capacity_experts, **kwargs).run()


def profile_prefetch_distance(
    warm_trace,
    test_trace,
    capacity_experts: int,
    *,
    distances: Sequence[int] | None = None,
    layer_time_s: float | None = None,
    transfer_time_s: float | None = None,
    search_time_s: float = 0.0,
    config: FineMoEConfig | None = None,
    **simulate_kwargs,
) -> dict:
    """Pick FineMoE's prefetch distance d for a model.

    Simulates FineMoE (store warmed on `warm_trace`, measured on `test_trace`) at each d and picks the
    d with the best hit rate among the *feasible* ones: when `layer_time_s` (measured compute time of
    one layer) and `transfer_time_s` (host->device time of one layer's predicted experts) are given, a
    prefetch issued d layers ahead must arrive in time: d * layer_time_s >= search_time_s +
    transfer_time_s. Ties go to the smaller d. Returns {"best": d, "min_feasible": d0, "table": [...]}.
    """
    L = test_trace.meta.num_layers
    distances = list(distances) if distances is not None else list(range(1, L))
    min_feasible = 1
    if layer_time_s is not None and transfer_time_s is not None and layer_time_s > 0:
        min_feasible = max(1, math.ceil((search_time_s + transfer_time_s) / layer_time_s))
    base = config or FineMoEConfig()
    table = []
    for d in distances:
        policy = FineMoEPolicy(replace(base, prefetch_distance=d, synchronous=True))
        policy.warm_up(warm_trace)
        res = simulate(test_trace, policy, capacity_experts, **simulate_kwargs)
        table.append(
            {
                "d": d,
                "hit_rate": res.hit_rate,
                "feasible": d >= min_feasible,
                "precision": res.precision,
                "recall": res.recall,
            }
        )
    feasible = [row for row in table if row["feasible"]] or table
    best = max(feasible, key=lambda row: (row["hit_rate"], -row["d"]))
    return {"best": best["d"], "min_feasible": min_feasible, "table": table}
