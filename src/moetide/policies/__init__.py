"""Expert policies the engine runs: what to prefetch, when, and in which precision.

`registry.py` declares every `--policy` name once (`PolicySpec`); `make_policy(name, ...)` builds its
policy object. See `docs/policies.md` for the algorithms; the offline simulator, traces and synthetic
workloads are in `moetide.analysis`.
"""

from __future__ import annotations

from .registry import PolicyOptions, policy_spec

__all__ = ["ExpertPolicy", "ExpertSink", "PolicyBase", "StepObservation", "make_policy"]

_BASE_NAMES = ("ExpertPolicy", "ExpertSink", "PolicyBase", "StepObservation")


def __getattr__(name: str):
    """The policy base classes, imported on first use: the registry alone (the CLI's choices, config
    validation) needs no torch."""
    if name in _BASE_NAMES:
        from . import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    **options,
):
    """The policy object for a `--policy` name (its `PolicySpec.factory` in `registry.py`).

    `n_hi` (hi experts per layer, see `dynaexq.n_hi_from_budget`) is required by "dynaexq" and
    "combined"; `n_mid=(per tier, ...)` (a `PolicyOptions` field) sizes a deeper ladder's middle
    tiers. `map_store_path`: a saved FineMoE store to start from (FineMoE, combined).
    `searcher`: where FineMoE's searcher runs ("process", "thread"; `synchronous` runs it inline).
    """
    return policy_spec(name).build(
        PolicyOptions(
            prefetch_distance=prefetch_distance,
            n_hi=n_hi,
            update_interval_s=update_interval_s,
            hysteresis_margin=hysteresis_margin,
            max_transitions_per_update=max_transitions_per_update,
            map_store_capacity=map_store_capacity,
            map_store_path=map_store_path,
            synchronous=synchronous,
            searcher=searcher,
            **options,  # other `PolicyOptions` fields (`clock`)
        )
    )
