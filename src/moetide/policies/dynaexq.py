"""DynaExq's precision scheduler, and the combined FineMoE + DynaExq policy.

Scheduler (per (layer, expert), from the router's top-k ids only):
    count      c[l, e] += times the router picked e at layer l in the current interval
    update     every `update_interval_s` seconds of the clock (time-based, not token-based):
               S <- alpha * S + (1 - alpha) * c * g ;  c <- 0
               g[l, e] = what promoting the expert buys (`set_promotion_gain`: the drop in its
               weights' squared error from the lo to the hi version, mean 1 per layer; 1 without
               it, the paper's plain counts). The engine sets it: with int4 hot over int2+4 cold on
               the demo model at the int2/int4 halfway memory, the calibrated hot set recovers
               0.769 of the int2 -> int4 perplexity gap, against 0.752 unweighted
               (results/eval_cpu_ladders_frozen; with the scheduler adapting during measurement
               0.733-0.745 either way, run-to-run noise of the time-based updates).
    select     per layer, the hi set H_l has n_hi[l] members (capacity fixed by the memory budget);
               a ladder of more tiers (`n_mid`) adds one set per middle tier, each of its own size:
               the hottest experts in hi, the next in mid1, ..., the rest in lo (every expert keeps
               its lo version resident, so lo has no size)
    hysteresis at each tier t, the hottest expert o of the tiers below it replaces the weakest member
               w only if S[o] > S[w] + margin_l (o and w trade tiers), with margin_l =
               hysteresis_margin * mean_e S[l, e] (a margin of 0 is plain top-n); a free slot of
               tier t is filled by the hottest expert below it with S > 0
    rate limit moves are applied one at a time, the largest score gap (S[o] - S[w], or S[o] for a
               fill) of all layers and tiers first, each layer's next move planned from its state
               after the last; at most `max_transitions_per_update` experts change tier per update
               (a swap is 2); a layer whose next move does not fit waits for the next update
With two tiers this is the paper's top-n_hi with hysteresis. A hot expert climbs every tier in one
update (o swaps into the top, the member it displaced then competes one tier down, and so on), and
moves that cancel out cost nothing. The changes go to the sink as `set_precision(layer, expert,
tier)` (`base.tier_names`: "hi", "mid1", ..., "lo"), every demotion first (freeing memory); the
residency core does admission control (`try_reserve`) and copies in the background, so the forward
pass never waits for a precision change. The scheduler's work is O(L*T*J) per update plus O(T*J) per
move (T tiers), run from `end_iteration` (or `tick(now)` with an injected time in tests/simulation).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .base import PolicyBase, tier_names


def n_hi_from_budget(
    expert_budget_bytes: int, num_layers: int, num_experts: int, hi_bytes: int, lo_bytes: int
) -> int:
    """Per-layer hi capacity when every expert keeps exactly one version resident (hi or lo):
    L * (n_hi * hi_bytes + (J - n_hi) * lo_bytes) <= expert_budget_bytes. Clipped to [0, J]."""
    if hi_bytes <= lo_bytes:
        raise ValueError("hi_bytes must exceed lo_bytes")
    per_layer = expert_budget_bytes / num_layers - num_experts * lo_bytes
    if per_layer < 0:
        raise ValueError(
            f"the budget ({expert_budget_bytes} B) cannot even hold every expert in lo precision "
            f"({num_layers * num_experts * lo_bytes} B)"
        )
    return int(min(num_experts, per_layer // (hi_bytes - lo_bytes)))


def per_layer_hi_slots(hi_slots: int, num_layers: int, num_experts: int) -> list[int]:
    """`hi_slots` hot experts split over the layers as evenly as they go: every layer gets the
    quotient, and the remainder goes one each to layers spread over the depth (a budget of 21 hot
    experts on 8 layers is 3, 2, 3, 2, 3, 2, 3, 3 rather than 2 each and 5 slots left empty)."""
    base, extra = divmod(max(0, hi_slots), num_layers)
    counts = [base + ((layer + 1) * extra // num_layers - layer * extra // num_layers) for layer in range(num_layers)]
    return [min(num_experts, n) for n in counts]


class DynaExqScheduler(PolicyBase):
    """DynaExq's hotness tracker and budget-feasible top-n selection per tier with hysteresis.

    Args:
        n_hi: hi slots per layer (an int for every layer, or one per layer); see `n_hi_from_budget`.
        n_mid: a deeper ladder's middle tiers, hottest first: the slots per layer of each (an int or
            one per layer). () = the two tiers hi and lo.
        update_interval_s: T_u, seconds between updates of the clock.
        alpha: EMA weight of the old score. Default 0.7: measured on the demo model's code->chat shift
            (docs/policies.md), 0.7 reaches 90% overlap with the new hot set in 5.6 update intervals
            against 23.7 for the authors' 0.9, at the same hi-expert hit share (0.624 vs 0.622).
        hysteresis_margin: margin in units of the layer's mean score (0 = plain top-n).
        max_transitions_per_update: experts changing tier per update at most (None = no limit).
        clock: seconds; `end_iteration` calls `tick(clock())`. None: only explicit `tick(now)` calls.
    """

    name = "dynaexq"

    def __init__(
        self,
        n_hi: int | Sequence[int],
        *,
        n_mid: Sequence[int | Sequence[int]] = (),
        update_interval_s: float = 1.0,
        alpha: float = 0.7,
        hysteresis_margin: float = 0.25,
        max_transitions_per_update: int | None = None,
        clock: Callable[[], float] | None = time.monotonic,
    ):
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {alpha}")
        if update_interval_s <= 0:
            raise ValueError("update_interval_s must be > 0")
        if hysteresis_margin < 0:
            raise ValueError("hysteresis_margin must be >= 0")
        if max_transitions_per_update is not None and max_transitions_per_update < 1:
            raise ValueError("max_transitions_per_update must be >= 1 or None")
        self._sizes_arg = (n_hi, *n_mid)
        self.tiers = tier_names(2 + len(n_mid))  # "hi", "mid1", ..., "lo"
        self.update_interval_s = update_interval_s
        self.alpha = alpha
        self.hysteresis_margin = hysteresis_margin
        self.max_transitions_per_update = max_transitions_per_update
        self.clock = clock
        self.n_hi: list[int] = []
        self.capacity: np.ndarray | None = None  # (T - 1, L) int: slots per layer of each tier above lo
        self.counts: torch.Tensor | None = None  # (L, J) float64, current interval
        self.scores: torch.Tensor | None = None  # (L, J) float64, EMA
        # (T - 1, L, J) bool: the tier above lo each expert was asked into (none: lo); `hi` is its row 0
        self.members: torch.Tensor | None = None
        self.hi: torch.Tensor | None = None  # (L, J) bool, the hi set as requested
        self._last_update_s: float | None = None
        self.updates = 0
        self.promotions = 0
        self.demotions = 0
        self.deferred_moves = 0
        self.log: list[tuple[float, int, int, str]] = []  # (time, layer, expert, tier)
        self.promotion_gain: torch.Tensor | None = None  # (L, J) float64, mean 1 per layer

    def set_promotion_gain(self, gain: torch.Tensor | None) -> None:
        """Weigh each expert's selections by what promoting it buys: `gain (L, J)` >= 0, e.g. the
        drop in its weights' squared error from the lo to the hi version (`HostExpertStore.
        promotion_gain`; with a deeper ladder the same weight ranks experts for every tier).
        Normalized to mean 1 per layer, so scores keep their scale and the hysteresis margin its
        meaning; None = plain counts (the paper's)."""
        if gain is None:
            self.promotion_gain = None
            return
        gain = gain.to(torch.float64).clamp_min(0)
        self.promotion_gain = gain / gain.mean(dim=1, keepdim=True).clamp_min(1e-30)

    def attach(self, sink, num_layers, num_experts, top_k) -> None:
        super().attach(sink, num_layers, num_experts, top_k)
        sizes = []
        for name, n in zip(self.tiers, self._sizes_arg):
            per_layer = [int(n)] * num_layers if isinstance(n, int) else [int(x) for x in n]
            if len(per_layer) != num_layers or any(not 0 <= x <= num_experts for x in per_layer):
                raise ValueError(f"n_{name} must be one int or {num_layers} ints in [0, {num_experts}]")
            sizes.append(per_layer)
        self.capacity = np.array(sizes, dtype=np.int64)
        self.n_hi = sizes[0]
        self._reset_counts(num_layers, num_experts)
        if self.scores is None or self.scores.shape != (num_layers, num_experts):
            self.scores = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.members = torch.zeros(len(sizes), num_layers, num_experts, dtype=torch.bool)
        self.hi = self.members[0]  # a view: writing it moves experts into or out of hi

    # -- observation (forward thread) ---------------------------------------------------------------
    def observe_layer(self, iteration, layer, gate_probs, topk_ids) -> None:
        # numpy on the counts' shared memory: one call, a sixth of torch's bincount + cast + add
        self._counts_np[layer] += np.bincount(topk_ids.numpy().reshape(-1), minlength=self.num_experts)

    def observe_step(self, iteration, gate_probs, topk_ids) -> None:
        """Every layer's counts in one bincount: `topk_ids (L, T, k)` offset by layer."""
        ids = topk_ids.numpy().reshape(len(topk_ids), -1)
        L, J = self._counts_np.shape
        offsets = (np.arange(L) * J)[:, None]
        self._counts_np += np.bincount((ids + offsets).reshape(-1), minlength=L * J).reshape(L, J)

    def _reset_counts(self, num_layers: int, num_experts: int) -> None:
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._counts_np = self.counts.numpy()  # the same memory

    def end_iteration(self, iteration) -> None:
        if self.clock is not None:
            self.tick(self.clock())

    # -- the scheduler ------------------------------------------------------------------------------
    def tick(self, now_s: float) -> list[tuple[int, int, str]]:
        """Run an update if `update_interval_s` has elapsed since the last one (the first call starts
        the clock). Returns the precision changes sent."""
        if self._last_update_s is None:
            self._last_update_s = now_s
            return []
        if now_s - self._last_update_s < self.update_interval_s:
            return []
        self._last_update_s = now_s
        return self.update(now_s)

    def tier_of(self, layer: int) -> np.ndarray:
        """(J,) int64: each expert's tier in `layer` as requested (0 = hi, ..., T - 1 = lo)."""
        m = self.members[:, layer].numpy()
        return np.where(m.any(axis=0), m.argmax(axis=0), len(m))

    def update(self, now_s: float = 0.0) -> list[tuple[int, int, str]]:
        """EMA step, then moves with hysteresis under the rate limit; sends and returns the changes."""
        counts = self.counts
        self._reset_counts(*counts.shape)
        if self.promotion_gain is not None:
            counts = counts * self.promotion_gain
        self.scores = self.alpha * self.scores + (1.0 - self.alpha) * counts
        self.updates += 1
        S = self.scores.numpy()
        margins = self.hysteresis_margin * S.mean(axis=1)
        start = [self.tier_of(layer) for layer in range(self.num_layers)]
        tiers = [t.copy() for t in start]
        changed: dict[tuple[int, int], None] = {}  # experts off their starting tier, in order of first move
        heap = []
        for layer in range(self.num_layers):
            self._push_move(heap, layer, S[layer], tiers[layer], margins[layer])
        budget = self.max_transitions_per_update
        while heap:
            _, layer, _, experts, new = heapq.heappop(heap)
            t = tiers[layer]
            after = {e: (new_t != start[layer][e]) for e, new_t in zip(experts, new, strict=True)}
            cost = sum(after.values()) - sum((layer, e) in changed for e in experts)
            if budget is not None and len(changed) + cost > budget:
                self.deferred_moves += 1  # this layer waits for the next update
                continue
            for e, new_t in zip(experts, new, strict=True):
                t[e] = new_t
                if after[e]:
                    changed.setdefault((layer, e), None)
                else:
                    changed.pop((layer, e), None)
            self._push_move(heap, layer, S[layer], t, margins[layer])
        return self._send(now_s, start, tiers, changed)

    def _push_move(self, heap: list, layer: int, S: np.ndarray, tier: np.ndarray, margin: float) -> None:
        """Push `layer`'s best move from its current tiers (if any) as `(-gap, layer, tier, experts,
        their new tiers)`: ties go to the lower layer, then the hotter tier."""
        move = self.best_move(layer, S, tier, margin)
        if move is not None:
            heapq.heappush(heap, (-move[0], layer, move[1], move[2], move[3]))

    def best_move(self, layer: int, S: np.ndarray, tier: np.ndarray, margin: float):
        """The largest-gap move of one layer: `(gap, tier t, experts, their new tiers)` or None.

        At each tier t above lo, with the experts of tiers below t as outsiders: more members than
        slots (its size shrank) -> the weakest goes one tier down (gap inf); a free slot -> the
        hottest outsider with S > 0 comes up (gap S[o]); full -> the hottest outsider o and the
        weakest member w trade tiers if S[o] > S[w] + margin (gap S[o] - S[w]). Ties: the lower
        expert id is the hotter outsider and the weaker member, as a stable sort orders them."""
        best = None
        for t in range(len(self.capacity)):
            inside, below = tier == t, tier > t
            n, cap = int(inside.sum()), int(self.capacity[t, layer])
            move = None
            if n > cap:
                w = int(np.where(inside, S, np.inf).argmin())
                move = (float("inf"), t, (w,), (t + 1,))
            elif below.any():
                o = int(np.where(below, S, -np.inf).argmax())
                if n < cap and S[o] > 0:
                    move = (float(S[o]), t, (o,), (t,))
                elif n == cap and n > 0:
                    w = int(np.where(inside, S, np.inf).argmin())
                    if S[o] > S[w] + margin:
                        move = (float(S[o] - S[w]), t, (o, w), (t, int(tier[o])))
            if move is not None and (best is None or move[0] > best[0]):
                best = move
        return best

    def _send(self, now_s: float, start, tiers, changed) -> list[tuple[int, int, str]]:
        """Record and send each changed expert's new tier: demotions first (they free memory)."""
        down = [(l, e) for l, e in changed if tiers[l][e] > start[l][e]]
        up = [(l, e) for l, e in changed if tiers[l][e] < start[l][e]]
        sent: list[tuple[int, int, str]] = []
        for layer, expert in (*down, *up):
            new, old = int(tiers[layer][expert]), int(start[layer][expert])
            if old < len(self.capacity):
                self.members[old, layer, expert] = False
            if new < len(self.capacity):
                self.members[new, layer, expert] = True
            if new < old:
                self.promotions += 1
            else:
                self.demotions += 1
            precision = self.tiers[new]
            sent.append((layer, expert, precision))
            self.log.append((now_s, layer, expert, precision))
            self.sink.set_precision(layer, expert, precision)
        return sent

    def hi_set(self, layer: int) -> list[int]:
        return torch.nonzero(self.hi[layer]).flatten().tolist()

    def tier_set(self, layer: int, tier: int) -> list[int]:
        """The experts of `layer` asked into tier `tier` (0 = hi; the last tier, lo, holds the rest)."""
        return np.nonzero(self.tier_of(layer) == tier)[0].tolist()

    def warm_up(self, trace) -> None:
        """Seed the scores with a recorded trace's selection counts (as if it were one interval)."""
        m = trace.meta
        ids = trace.topk_ids.long()
        counts = torch.zeros(m.num_layers, m.num_experts, dtype=torch.float64)
        for layer in range(m.num_layers):
            counts[layer] = torch.bincount(ids[:, layer].reshape(-1), minlength=m.num_experts).to(
                torch.float64
            )
        self.scores = counts / max(len(trace), 1)

    def stats(self) -> dict:
        members = self.members
        return {
            "updates": self.updates,
            "promotions": self.promotions,
            "demotions": self.demotions,
            "transitions": self.promotions + self.demotions,
            "deferred_moves": self.deferred_moves,
            "hi_experts": int(self.hi.sum()) if self.hi is not None else 0,
            "tier_experts": {
                name: int(members[t].sum()) if members is not None else 0
                for t, name in enumerate(self.tiers[:-1])
            },
        }


class CombinedPolicy(PolicyBase):
    """FineMoE decides what to fetch and when; DynaExq decides each expert's precision.

    Every call fans out to both (FineMoE first: its publishing is the latency-critical part).
    """

    name = "combined"

    def __init__(self, prefetch, precision: DynaExqScheduler):
        self.prefetch_policy = prefetch
        self.precision_policy = precision
        self.parts = (prefetch, precision)
        self.speculative_distances = tuple(
            sorted({d for p in self.parts for d in getattr(p, "speculative_distances", ())})
        )
        self.prefetch_distance = getattr(prefetch, "prefetch_distance", None)
        self.preferred_eviction = getattr(prefetch, "preferred_eviction", "lru")

    @property
    def synchronous(self) -> bool:
        return all(getattr(p, "synchronous", True) for p in self.parts)

    def attach(self, sink, num_layers, num_experts, top_k) -> None:
        super().attach(sink, num_layers, num_experts, top_k)
        for p in self.parts:
            p.attach(sink, num_layers, num_experts, top_k)

    def prepare(self, hidden_size: int) -> None:
        for p in self.parts:
            if hasattr(p, "prepare"):
                p.prepare(hidden_size)

    def begin_iteration(self, iteration, embedding, num_tokens, request_ids=()) -> None:
        for p in self.parts:
            p.begin_iteration(iteration, embedding, num_tokens, request_ids=request_ids)

    def observe_layer(self, iteration, layer, gate_probs, topk_ids) -> None:
        for p in self.parts:
            p.observe_layer(iteration, layer, gate_probs, topk_ids)

    def observe_step(self, iteration, gate_probs, topk_ids) -> None:
        for p in self.parts:
            p.observe_step(iteration, gate_probs, topk_ids)

    def observe_speculative(self, iteration, layer, distance, topk_ids) -> None:
        for p in self.parts:
            if distance in getattr(p, "speculative_distances", ()):
                p.observe_speculative(iteration, layer, distance, topk_ids)

    def poll(self) -> None:
        if hasattr(self.prefetch_policy, "poll"):
            self.prefetch_policy.poll()

    def end_iteration(self, iteration) -> None:
        for p in self.parts:
            p.end_iteration(iteration)

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def warm_up(self, trace) -> None:
        for p in self.parts:
            if hasattr(p, "warm_up"):
                p.warm_up(trace)

    def stats(self) -> dict:
        return {p.name: p.stats() for p in self.parts if hasattr(p, "stats")}
