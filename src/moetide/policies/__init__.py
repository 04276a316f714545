"""Expert policies (what to prefetch, when, in which precision), traces and the trace simulator.

`make_policy(name, ...)` builds the policy behind each `--policy` name of `config.POLICIES`; see
`docs/policies.md` for the algorithms and the simulator.
"""

from __future__ import annotations

from .base import ExpertPolicy, ExpertSink, PolicyBase, StepObservation

__all__ = ["ExpertPolicy", "ExpertSink", "PolicyBase", "StepObservation", "make_policy"]


def make_policy(
    name: str,
    *,
    prefetch_distance: int = 2,
    n_hi: int | list[int] | None = None,
    update_interval_s: float = 1.0,
    hysteresis_margin: float = 0.25,
    max_transitions_per_update: int | None = None,
    map_store_capacity: int = 1000,
    map_store_path: str | None = None,
    synchronous: bool = False,
    searcher: str = "process",
):
    """The policy object for a `--policy` name.

    `n_hi` (hi experts per layer, see `dynaexq.n_hi_from_budget`) is required by "dynaexq" and
    "combined". `map_store_path`: a saved FineMoE store to start from (FineMoE, combined).
    `searcher`: where FineMoE's searcher runs ("process", "thread"; `synchronous` runs it inline).
    """
    from .baselines import (
        LRUSpeculativePolicy,
        MoEInfinityPolicy,
        NoOffloadPolicy,
        OnDemandPolicy,
        StaticPrecisionPolicy,
    )
    from .dynaexq import CombinedPolicy, DynaExqScheduler
    from .finemoe import FineMoEPolicy

    def finemoe() -> FineMoEPolicy:
        p = FineMoEPolicy(
            prefetch_distance=prefetch_distance,
            map_store_capacity=map_store_capacity,
            synchronous=synchronous,
            searcher=searcher,
        )
        if map_store_path:
            p.load_store(map_store_path)
        return p

    def dynaexq() -> DynaExqScheduler:
        if n_hi is None:
            raise ValueError(f"policy {name!r} needs n_hi (hi experts per layer, from the memory budget)")
        return DynaExqScheduler(
            n_hi,
            update_interval_s=update_interval_s,
            hysteresis_margin=hysteresis_margin,
            max_transitions_per_update=max_transitions_per_update,
        )

    builders = {
        "finemoe": finemoe,
        "dynaexq": dynaexq,
        "combined": lambda: CombinedPolicy(finemoe(), dynaexq()),
        "on-demand": OnDemandPolicy,
        "lru": lambda: LRUSpeculativePolicy(prefetch_distance),
        "moe-infinity": lambda: MoEInfinityPolicy(prefetch_distance),
        "static-int4": lambda: StaticPrecisionPolicy("lo", "static-int4"),
        "static-int2": lambda: StaticPrecisionPolicy("lo", "static-int2"),
        "no-offload": NoOffloadPolicy,
    }
    if name not in builders:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(builders)}")
    return builders[name]()
