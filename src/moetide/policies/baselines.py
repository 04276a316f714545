"""Baseline policies on the same interface as FineMoE and DynaExq, so a comparison changes one name.

    on-demand      nothing prefetched; misses load on demand (the cache keeps what was used)
    lru            Mixtral-Offloading: LRU cache + speculative prefetch: at layer l, the top-k that
                   layer l+d's router picks from layer l's router input (`observe_speculative`)
    moe-infinity   request-level expert activation matrix (EAM, [L, J] selection counts of this
                   request so far); nearest past request's EAM by cosine (rows normalised per layer);
                   prefetch layer l+d's experts by that EAM's ranked frequency, up to the cache's
                   per-layer share
    hit-count      the paper's ablation step between Speculate and Map(T): MoE-Infinity's request-level
                   counts inside FineMoE's framework (exactly top-k at l+d, predictions protected,
                   FineMoE's eviction)
    static-int4 / static-int2 / no-offload   residency configurations, no prediction: the static ones
                   put every expert in the lo precision once at attach; no-offload does nothing (the
                   residency core sizes the cache to hold every expert)

Every prefetching policy, like FineMoE, predicts layers 0..d-1 at `begin_iteration` where it can and
layer l+d after layer l.
"""

from __future__ import annotations

import torch

from .base import PolicyBase


def _ranked_union(topk_ids: torch.Tensor) -> list[int]:
    """Distinct experts of a (T, k) selection, most selected first (ties: first seen)."""
    flat = topk_ids.reshape(-1)
    if flat.numel() == 0:
        return []
    ids, counts = torch.unique(flat, return_counts=True)
    order = torch.sort(counts, descending=True, stable=True).indices
    return ids[order].tolist()


class OnDemandPolicy(PolicyBase):
    """Prefetch nothing."""

    name = "on-demand"
    preferred_eviction = "lru"


class NoOffloadPolicy(PolicyBase):
    """Every expert resident; nothing to decide."""

    name = "no-offload"
    preferred_eviction = "lru"


class StaticPrecisionPolicy(PolicyBase):
    """Every expert in one precision ("lo": the configured int4/int2 version), set once at attach."""

    preferred_eviction = "lru"

    def __init__(self, precision: str = "lo", name: str = "static-int4"):
        if precision not in ("hi", "lo"):
            raise ValueError(f"precision must be 'hi' or 'lo', got {precision!r}")
        self.precision = precision
        self.name = name

    def attach(self, sink, num_layers, num_experts, top_k) -> None:
        super().attach(sink, num_layers, num_experts, top_k)
        for layer in range(num_layers):
            for expert in range(num_experts):
                sink.set_precision(layer, expert, self.precision)


class LRUSpeculativePolicy(PolicyBase):
    """Mixtral-Offloading: LRU eviction plus speculative prefetch of layer l+d's router guess at layer l.

    Needs `observe_speculative` with distance d (the forward pass or the trace's `spec_topk`).
    """

    name = "lru"
    preferred_eviction = "lru"

    def __init__(self, prefetch_distance: int = 1):
        if prefetch_distance < 1:
            raise ValueError("prefetch_distance must be >= 1")
        self.prefetch_distance = prefetch_distance
        self.speculative_distances = (prefetch_distance,)
        self.prefetches = 0

    def observe_speculative(self, iteration, layer, distance, topk_ids) -> None:
        if distance != self.prefetch_distance or layer + distance >= self.num_layers:
            return
        experts = _ranked_union(topk_ids)
        self.prefetches += 1
        self.sink.prefetch(layer + distance, experts, iteration=iteration)

    def stats(self) -> dict:
        return {"prefetch_requests": self.prefetches}


class MoEInfinityPolicy(PolicyBase):
    """MoE-Infinity's request-level activation-matrix matching.

    EAMC: up to `eamc_capacity` past requests' EAMs; when full, the least-matched entry is replaced.
    A request's EAM (L, J) counts its selections so far (all its steps, the current one up to the
    observed layer). Matching: cosine between EAMs with every layer's row normalised to a
    distribution (rows with no counts yet are zero). Before a request has any count, the sum of all
    stored EAMs (global popularity) stands in for the match.
    `per_layer`: experts prefetched per layer; None = the cache's share, max(top_k, capacity // L).
    """

    name = "moe-infinity"
    preferred_eviction = "lru"

    def __init__(
        self,
        prefetch_distance: int = 1,
        eamc_capacity: int = 1000,
        per_layer: int | None = None,
        protect_predictions: bool = False,
    ):
        if prefetch_distance < 1 or eamc_capacity < 1:
            raise ValueError("prefetch_distance and eamc_capacity must be >= 1")
        self.prefetch_distance = prefetch_distance
        self.eamc_capacity = eamc_capacity
        self.per_layer = per_layer
        self.protect_predictions = protect_predictions
        self._eamc: torch.Tensor | None = None  # (C, L, J) counts
        self._access = torch.zeros(eamc_capacity, dtype=torch.int64)
        self._size = 0
        self._current: torch.Tensor | None = None  # (L, J) counts of the running request
        self._request_key: tuple | None = None
        self._auto_request = 0
        self.matches = 0
        self.prefetches = 0

    def attach(self, sink, num_layers, num_experts, top_k) -> None:
        super().attach(sink, num_layers, num_experts, top_k)
        if self._eamc is None:
            self._eamc = torch.zeros(self.eamc_capacity, num_layers, num_experts)
        self._current = torch.zeros(num_layers, num_experts)

    def _share(self) -> int:
        if self.per_layer is not None:
            return self.per_layer
        capacity = getattr(self.sink, "capacity_experts", 0) or 0
        return max(self.top_k, capacity // max(self.num_layers, 1))

    # -- EAMC ---------------------------------------------------------------------------------------
    def add_request_matrix(self, matrix: torch.Tensor) -> None:
        """Store a finished request's EAM (L, J) counts."""
        if self._eamc is None:
            self._eamc = torch.zeros(self.eamc_capacity, *matrix.shape)
        if float(matrix.sum()) == 0:
            return
        if self._size < self.eamc_capacity:
            row = self._size
            self._size += 1
        else:
            row = int(torch.argmin(self._access))
        self._eamc[row] = matrix
        self._access[row] = 1

    def warm_up(self, trace) -> int:
        """Add one EAM per request of a recorded `Trace`. Returns the number of requests added."""
        m = trace.meta
        if self._eamc is None:
            self._eamc = torch.zeros(self.eamc_capacity, m.num_layers, m.num_experts)
        n = 0
        for rid in trace.requests():
            sub = trace.select_requests([rid])
            counts = torch.zeros(m.num_layers, m.num_experts)
            ids = sub.topk_ids.long()  # (N, L, k)
            for layer in range(m.num_layers):
                counts[layer] += torch.bincount(ids[:, layer].reshape(-1), minlength=m.num_experts).float()
            self.add_request_matrix(counts)
            n += 1
        return n

    @staticmethod
    def _row_normalize(x: torch.Tensor) -> torch.Tensor:
        return x / x.sum(dim=-1, keepdim=True).clamp_min(1e-12)

    def _match(self) -> torch.Tensor | None:
        """The matched EAM (L, J), or None when nothing is stored."""
        if self._size == 0:
            return None
        stored = self._eamc[: self._size]
        if float(self._current.sum()) == 0:
            return stored.sum(0)
        q = self._row_normalize(self._current).reshape(-1)
        keys = self._row_normalize(stored).reshape(self._size, -1)
        scores = (keys @ q) / (keys.norm(dim=1) * q.norm()).clamp_min(1e-12)
        row = int(torch.argmax(scores))
        self._access[row] += 1
        self.matches += 1
        return stored[row]

    # -- ExpertPolicy -------------------------------------------------------------------------------
    def _finish_request(self) -> None:
        if self._current is not None and float(self._current.sum()) > 0:
            self.add_request_matrix(self._current.clone())
        if self._current is not None:
            self._current.zero_()

    def begin_iteration(self, iteration, embedding, num_tokens, request_ids=()) -> None:
        if request_ids:
            key = tuple(sorted(int(r) for r in request_ids))
        else:  # unknown requests: a multi-token step (a prefill) starts a new one
            if num_tokens > 1:
                self._auto_request += 1
            key = ("auto", self._auto_request)
        if key != self._request_key:
            self._finish_request()
            self._request_key = key
        matched = self._match()
        if matched is None:
            return
        for layer in range(min(self.prefetch_distance, self.num_layers)):
            self._prefetch(iteration, layer, matched[layer])

    def observe_layer(self, iteration, layer, gate_probs, topk_ids) -> None:
        self._current[layer] += torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts).float()
        target = layer + self.prefetch_distance
        if target >= self.num_layers:
            return
        matched = self._match()
        if matched is not None:
            self._prefetch(iteration, target, matched[target])

    def _select(self, counts: torch.Tensor) -> list[int]:
        order = torch.sort(counts, descending=True, stable=True).indices
        nonzero = int((counts > 0).sum())
        return order[: min(self._share(), nonzero)].tolist()

    def _prefetch(self, iteration: int, layer: int, counts: torch.Tensor) -> None:
        experts = self._select(counts)
        if not experts:
            return
        total = float(counts.sum())
        priorities = [float(counts[e]) / total for e in experts]
        self.prefetches += 1
        if self.protect_predictions:  # first, so that the prefetch cannot evict its own experts
            self.sink.protect(layer, experts, iteration=iteration)
        self.sink.prefetch(layer, experts, iteration=iteration, priorities=priorities)

    def close(self) -> None:
        self._finish_request()

    def stats(self) -> dict:
        return {"eamc_size": self._size, "matches": self.matches, "prefetch_requests": self.prefetches}
