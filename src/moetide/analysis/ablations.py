"""The FineMoE paper's ablation steps, for the trace simulator (`analysis.simulator`):
Speculate < Hit-count < Map(T) < Map(T+S) < Map(T+S+delta). Speculate is `lru`, Map(T+S+delta) is
`finemoe`; the steps between are defined here. The engine runs none of them."""

from __future__ import annotations

from ..policies.baselines import MoEInfinityPolicy


class HitCountPolicy(MoEInfinityPolicy):
    """Ablation "Hit-count": request-level counts, FineMoE's framework (top-k at l+d, protected)."""

    name = "hit-count"
    preferred_eviction = "prob-freq"

    def __init__(self, prefetch_distance: int = 1, eamc_capacity: int = 1000):
        super().__init__(prefetch_distance, eamc_capacity, per_layer=None, protect_predictions=True)

    def _share(self) -> int:
        return self.top_k


# FineMoEConfig switches of the Map steps
ABLATIONS: dict[str, dict] = {
    "map-t": {"use_semantic": False, "use_trajectory": True, "adaptive_delta": False},
    "map-ts": {"use_semantic": True, "use_trajectory": True, "adaptive_delta": False},
    "map-ts-delta": {"use_semantic": True, "use_trajectory": True, "adaptive_delta": True},
}
