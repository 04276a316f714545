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
    select     per layer, the hi set H_l has n_hi[l] members (capacity fixed by the memory budget)
    hysteresis an outsider o replaces the weakest member w only if S[o] > S[w] + margin_l, with
               margin_l = hysteresis_margin * mean_e S[l, e] (a margin of 0 is plain top-n); free hi
               slots are filled by the hottest outsiders with S > 0
    rate limit all layers' moves are ordered by score gap (S[o] - S[w], or S[o] for a fill), largest
               first, and at most `max_transitions_per_update` precision changes (a swap is 2) are
               sent per update; the rest wait for the next update
Moves go to the sink as `set_precision(layer, expert, "lo")` (the demotion first, freeing memory) then
`"hi"`; the residency core does admission control (`try_reserve`) and copies in the background, so
the forward pass never waits for a precision change. The scheduler's own work is O(L*J log J) once
per interval, run from `end_iteration` (or `tick(now)` with an injected time in tests/simulation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .base import PolicyBase


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
    """DynaExq's hotness tracker and budget-feasible top-n_hi selection with hysteresis.

    Args:
        n_hi: hi slots per layer (an int for every layer, or one per layer); see `n_hi_from_budget`.
        update_interval_s: T_u, seconds between updates of the clock.
        alpha: EMA weight of the old score. Default 0.7: measured on the demo model's code->chat shift
            (docs/policies.md), 0.7 reaches 90% overlap with the new hot set in 5.6 update intervals
            against 23.7 for the authors' 0.9, at the same hi-expert hit share (0.624 vs 0.622).
        hysteresis_margin: margin in units of the layer's mean score (0 = plain top-n).
        max_transitions_per_update: precision changes sent per update at most (None = no limit).
        clock: seconds; `end_iteration` calls `tick(clock())`. None: only explicit `tick(now)` calls.
    """

    name = "dynaexq"

    def __init__(
        self,
        n_hi: int | Sequence[int],
        *,
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
        self._n_hi_arg = n_hi
        self.update_interval_s = update_interval_s
        self.alpha = alpha
        self.hysteresis_margin = hysteresis_margin
        self.max_transitions_per_update = max_transitions_per_update
        self.clock = clock
        self.n_hi: list[int] = []
        self.counts: torch.Tensor | None = None  # (L, J) float64, current interval
        self.scores: torch.Tensor | None = None  # (L, J) float64, EMA
        self.hi: torch.Tensor | None = None  # (L, J) bool, the hi set as requested
        self._last_update_s: float | None = None
        self.updates = 0
        self.promotions = 0
        self.demotions = 0
        self.deferred_moves = 0
        self.log: list[tuple[float, int, int, str]] = []  # (time, layer, expert, precision)
        self.promotion_gain: torch.Tensor | None = None  # (L, J) float64, mean 1 per layer

    def set_promotion_gain(self, gain: torch.Tensor | None) -> None:
        """Weigh each expert's selections by what promoting it buys: `gain (L, J)` >= 0, e.g. the
        drop in its weights' squared error from the lo to the hi version (`HostExpertStore.
        promotion_gain`). Normalized to mean 1 per layer, so scores keep their scale and the
        hysteresis margin its meaning; None = plain counts (the paper's)."""
        if gain is None:
            self.promotion_gain = None
            return
        gain = gain.to(torch.float64).clamp_min(0)
        self.promotion_gain = gain / gain.mean(dim=1, keepdim=True).clamp_min(1e-30)

    def attach(self, sink, num_layers, num_experts, top_k) -> None:
        super().attach(sink, num_layers, num_experts, top_k)
        n = self._n_hi_arg
        n_hi = [int(n)] * num_layers if isinstance(n, int) else [int(x) for x in n]
        if len(n_hi) != num_layers or any(not 0 <= x <= num_experts for x in n_hi):
            raise ValueError(f"n_hi must be one int or {num_layers} ints in [0, {num_experts}]")
        self.n_hi = n_hi
        self._reset_counts(num_layers, num_experts)
        if self.scores is None or self.scores.shape != (num_layers, num_experts):
            self.scores = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.hi = torch.zeros(num_layers, num_experts, dtype=torch.bool)

    # -- observation (forward thread) ---------------------------------------------------------------
    def observe_layer(self, iteration, layer, gate_probs, topk_ids) -> None:
        # numpy on the counts' shared memory: one call, a sixth of torch's bincount + cast + add
        self._counts_np[layer] += np.bincount(topk_ids.numpy().reshape(-1), minlength=self.num_experts)

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

    def update(self, now_s: float = 0.0) -> list[tuple[int, int, str]]:
        """EMA step, selection with hysteresis and rate limit; sends and returns the changes."""
        counts = self.counts
        self._reset_counts(*counts.shape)
        if self.promotion_gain is not None:
            counts = counts * self.promotion_gain
        self.scores = self.alpha * self.scores + (1.0 - self.alpha) * counts
        self.updates += 1
        moves = []  # (gap, layer, promote, demote or None)
        for layer in range(self.num_layers):
            moves.extend(self.plan_layer(layer))
        moves.sort(key=lambda m: -m[0])
        budget = self.max_transitions_per_update
        sent: list[tuple[int, int, str]] = []
        for _, layer, promote, demote in moves:
            cost = (promote is not None) + (demote is not None)
            if budget is not None and len(sent) + cost > budget:
                self.deferred_moves += 1
                continue
            if demote is not None:
                sent.append((layer, demote, "lo"))
            if promote is not None:
                sent.append((layer, promote, "hi"))
        for layer, expert, precision in sent:
            self.hi[layer, expert] = precision == "hi"
            if precision == "hi":
                self.promotions += 1
            else:
                self.demotions += 1
            self.log.append((now_s, layer, expert, precision))
            self.sink.set_precision(layer, expert, precision)
        return sent

    def plan_layer(self, layer: int) -> list[tuple[float, int, int | None, int | None]]:
        """Moves for one layer from the current scores: fills of free hi slots, then hysteresis swaps.

        Returns [(gap, layer, expert to promote or None, expert to demote or None)].
        """
        S = self.scores[layer]
        hi = self.hi[layer]
        inside = torch.nonzero(hi).flatten()
        outside = torch.nonzero(~hi).flatten()
        out_order = outside[torch.sort(S[outside], descending=True, stable=True).indices].tolist()
        in_order = inside[torch.sort(S[inside], stable=True).indices].tolist()  # weakest first
        moves: list[tuple[float, int, int | None, int | None]] = []
        free = self.n_hi[layer] - len(in_order)
        while free > 0 and out_order and float(S[out_order[0]]) > 0:
            o = out_order.pop(0)
            moves.append((float(S[o]), layer, o, None))
            free -= 1
        while free < 0 and in_order:  # the layer holds more than n_hi (n_hi shrank): demote the weakest
            moves.append((float("inf"), layer, None, in_order.pop(0)))
            free += 1
        margin = self.hysteresis_margin * float(S.mean())
        for o, w in zip(out_order, in_order, strict=False):
            if float(S[o]) > float(S[w]) + margin:
                moves.append((float(S[o] - S[w]), layer, o, w))
            else:
                break
        return moves

    def hi_set(self, layer: int) -> list[int]:
        return torch.nonzero(self.hi[layer]).flatten().tolist()

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
        return {
            "updates": self.updates,
            "promotions": self.promotions,
            "demotions": self.demotions,
            "transitions": self.promotions + self.demotions,
            "deferred_moves": self.deferred_moves,
            "hi_experts": int(self.hi.sum()) if self.hi is not None else 0,
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
