"""The transition pipeline: what the policies ask for, queued until the residency core acts on it.

Policies (possibly on their own threads) only put requests (`prefetch`, `protect`, `set_precision`,
`observe_gate_probs`) into a thread-safe queue; the core drains it at step boundaries and within a
step (the layer feed). Draining applies protections and probability estimates at once
(`ExpertStats`) and sorts the rest into two queues:

    prefetches  (iteration, layer, expert) to copy in, issued in full (the policy sized them:
                FineMoE's delta), but never more than `inflight_cap` predicted copies on the link at
                once (past it a prediction is dropped, not queued: it would land after its step)
    precision   (layer, expert) -> target tier, issued at most `budget` copies per call (the
                migration rate limit); a change with no slot to be had (admission control: nothing
                reserved, nothing copied) stays queued for the next call, unless a newer request
                for the same expert replaced it
"""

from __future__ import annotations

import queue
from collections import OrderedDict, deque
from collections.abc import Callable

import numpy as np

from .eviction import ExpertStats


class TransitionQueue:
    """Requests from the policies and the transitions waiting for the core (see module docstring)."""

    def __init__(self, stats: ExpertStats, inflight_cap: int, deterministic: bool = False):
        self.stats = stats
        self.inflight_cap = inflight_cap
        self.deterministic = deterministic
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.prefetches: deque = deque()  # (iteration, layer, expert)
        self.precision: OrderedDict = OrderedDict()  # (layer, expert) -> a tier name
        self.fills: set[tuple[int, int]] = set()  # queued prefetches that cache a miss (not predictions)
        self._inflight: deque = deque()  # predicted copies under way, oldest first (pruned as they land)

    # -- the policies' side (any thread; never blocks) ----------------------------------------------
    def put_prefetch(self, layer: int, experts, iteration: int, priorities=None, protect: bool = False) -> None:
        priorities = None if priorities is None else tuple(priorities)
        self._requests.put(("prefetch", layer, tuple(experts), (iteration, priorities, protect)))

    def put_protect(self, layer: int, experts, iteration: int) -> None:
        self._requests.put(("protect", layer, tuple(experts), iteration))

    def put_precision(self, layer: int, expert: int, tier: str) -> None:
        self._requests.put(("precision", layer, expert, tier))

    def put_observed(self, layer: int | None, probs) -> None:
        where = slice(None) if layer is None else layer
        self._requests.put(("observed", where, None, np.asarray(probs, dtype=np.float32)))

    def has_requests(self) -> bool:
        return not self._requests.empty()

    # -- the core's side (the forward thread, or the layer feed's under the core's lock) ------------
    def drain(self, worth_prefetching: Callable[[int, tuple], list]) -> None:
        """Apply every queued request: protections and probabilities now, prefetches (those
        `worth_prefetching(layer, experts)` keeps) and precision changes into their queues."""
        while True:
            try:
                kind, layer, what, arg = self._requests.get_nowait()
            except queue.Empty:
                return
            if kind == "prefetch":
                iteration, priorities, protect = arg
                if protect:
                    self.stats.protect(layer, what, iteration)
                if priorities is not None:  # the prediction is the experts' latest probability estimate
                    self.stats.prob[layer, list(what)] = priorities
                self.prefetches.extend((iteration, layer, e) for e in worth_prefetching(layer, what))
            elif kind == "observed":
                self.stats.prob[layer] = arg
            elif kind == "protect":
                self.stats.protect(layer, what, arg)
            else:
                self.precision[(layer, what)] = arg

    def cache_miss(self, iteration: int, layer: int, expert: int) -> None:
        """Queue a copy that caches an expert a step ran from host memory (not a prediction)."""
        self.prefetches.append((iteration, layer, expert))
        self.fills.add((layer, expert))

    def take_fill(self, layer: int, expert: int) -> bool:
        """Whether the queued prefetch of `(layer, expert)` caches a miss (and forget that it does)."""
        if (layer, expert) in self.fills:
            self.fills.discard((layer, expert))
            return True
        return False

    def link_full(self) -> bool:
        """Whether `inflight_cap` predicted copies are still under way (landed ones are pruned;
        under `deterministic` only step boundaries retire them, so that no timing enters)."""
        while self._inflight and not self.deterministic and self._inflight[0].ready.query():
            self._inflight.popleft()
        return len(self._inflight) >= self.inflight_cap

    def started(self, version) -> None:
        """A predicted copy of `version` is under way (counts against the link)."""
        self._inflight.append(version)

    def retire_all(self) -> None:
        """Every copy in flight has been waited for (a step boundary under `deterministic`)."""
        self._inflight.clear()

    def issue_precision(self, budget: int, apply: Callable[[tuple[int, int], str], str]) -> None:
        """Up to `budget` precision changes, oldest first: `apply(key, tier)` returns "copied"
        (counts against the budget), "deferred" (kept for the next call) or "done"."""
        waiting = []
        while budget > 0 and self.precision:
            key, tier = self.precision.popitem(last=False)
            outcome = apply(key, tier)
            if outcome == "deferred":
                waiting.append((key, tier))
            elif outcome == "copied":
                budget -= 1
        for key, tier in waiting:  # (a newer request for the same expert, queued since, wins)
            self.precision.setdefault(key, tier)
