"""The policy registry: one `PolicySpec` per `--policy` name, and the only place that knows them.

Config validation, the CLI's choices, the residency's memory mode, the lo precision, the on-miss
default, the eviction rule and which policies need a policy object attached all read `POLICY_SPECS`.
Nothing else compares policy names.

Memory modes (see residency/budget.py):
    all-hi     every expert in hi on the device (no offloading)
    all-lo     every expert in lo on the device (static quantization)
    hi-cache   a device cache of hi versions; misses copy from the host
    lo+hi      every lo version resident, plus a hi cache (DynaExq's precision residency)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


DETERMINISTIC_UPDATE_STEPS = 8  # DynaExq's T_u in steps under --deterministic (no clock time)


def step_clock() -> Callable[[], float]:
    """A clock that advances by one at each call (DynaExq reads it once per step): under
    --deterministic its updates fall on fixed step boundaries, whatever the wall time."""
    steps = iter(range(1 << 62))
    return lambda: float(next(steps))


@dataclass(frozen=True)
class PolicyOptions:
    """What a factory may use to build a policy object (engine or simulator)."""

    prefetch_distance: int = 2
    n_hi: int | list[int] | None = None  # hi experts per layer (DynaExq's hot-set size)
    n_mid: tuple = ()  # a deeper ladder's middle tiers, hottest first: experts per layer of each
    update_interval_s: float = 1.0
    hysteresis_margin: float = 0.25
    max_transitions_per_update: int | None = None
    map_store_capacity: int = 1000
    map_store_path: str | None = None  # a saved FineMoE store to start from, where the file exists
    synchronous: bool = False  # FineMoE's searcher inline (simulation, tests, --deterministic)
    # steps between an observed step and the first step its decisions reach (the engine's sync-free
    # steps: residency.core.TABLE_LAG); 0 = decisions within the running step (FineMoE's paper form)
    lookahead: int = 0
    searcher: str = "process"
    # DynaExq's clock: seconds (time-based updates), or under --deterministic a count of steps
    clock: Callable[[], float] | None = time.monotonic


@dataclass(frozen=True)
class PolicySpec:
    """One policy, declared once.

    memory_mode: the residency's mode (module docstring).
    lo_precision: the lo precision it fixes ("int4", "int2"), or None for the config's choice.
    on_miss: the on-miss rule it fixes ("lo", "zero-copy"), or None for the config's choice.
    eviction: the device cache's eviction rule ("lru", or "prob-freq": FineMoE's probability x visits).
    predicts: a policy object observes the routers and steers the residency (else the memory mode
        alone is the policy).
    hi_share: the share of hi slots (and of each middle tier's, with a deeper ladder) given to
        DynaExq's tiers (the rest is left to prefetches).
    in_step: it predicts a step's later layers from its earlier ones, so in the engine it observes
        each layer as the step runs (`policies.in_step.LayerFeed`), not a step later. combined does
        too: its FineMoE part brings predicted experts into hi within the step, where a prediction
        made a step late is for a step that has passed (the feed cost 22 % of combined's compiled
        batch-1 step on the H200: 294.8 against 378.0 tok/s).
    factory: builds the policy object from `PolicyOptions`.
    """

    name: str
    memory_mode: str
    factory: Callable[[PolicyOptions], object]
    lo_precision: str | None = None
    on_miss: str | None = None
    eviction: str = "lru"
    predicts: bool = False
    hi_share: float | None = None
    in_step: bool = False

    @property
    def needs_lo(self) -> bool:
        """A lo version of every expert is kept (on the host, and resident in these modes)."""
        return self.memory_mode in ("all-lo", "lo+hi")

    def build(self, options: PolicyOptions | None = None):
        return self.factory(options or PolicyOptions())


def _finemoe(o: PolicyOptions):
    from .finemoe import FineMoEPolicy

    p = FineMoEPolicy(
        prefetch_distance=o.prefetch_distance,
        map_store_capacity=o.map_store_capacity,
        synchronous=o.synchronous,
        searcher=o.searcher,
        lookahead=o.lookahead,
    )
    if o.map_store_path and Path(o.map_store_path).is_file():
        p.load_store(o.map_store_path)
    return p


def _dynaexq(o: PolicyOptions, name: str = "dynaexq"):
    from .dynaexq import DynaExqScheduler

    if o.n_hi is None:
        raise ValueError(f"policy {name!r} needs n_hi (hi experts per layer, from the memory budget)")
    return DynaExqScheduler(
        o.n_hi,
        n_mid=o.n_mid,
        update_interval_s=o.update_interval_s,
        hysteresis_margin=o.hysteresis_margin,
        max_transitions_per_update=o.max_transitions_per_update,
        clock=o.clock,
    )


def _combined(o: PolicyOptions):
    from .dynaexq import CombinedPolicy

    return CombinedPolicy(_finemoe(o), _dynaexq(o, "combined"))


def _on_demand(_o: PolicyOptions):
    from .baselines import OnDemandPolicy

    return OnDemandPolicy()


def _no_offload(_o: PolicyOptions):
    from .baselines import NoOffloadPolicy

    return NoOffloadPolicy()


def _static(name: str):
    def build(_o: PolicyOptions):
        from .baselines import StaticPrecisionPolicy

        return StaticPrecisionPolicy("lo", name)

    return build


def _lru(o: PolicyOptions):
    from .baselines import LRUSpeculativePolicy

    return LRUSpeculativePolicy(o.prefetch_distance)


def _moe_infinity(o: PolicyOptions):
    from .baselines import MoEInfinityPolicy

    return MoEInfinityPolicy(o.prefetch_distance)


POLICY_SPECS: dict[str, PolicySpec] = {
    s.name: s
    for s in (
        PolicySpec(
            "combined", "lo+hi", _combined, eviction="prob-freq", predicts=True, hi_share=0.5, in_step=True
        ),
        PolicySpec("finemoe", "hi-cache", _finemoe, eviction="prob-freq", predicts=True, in_step=True),
        PolicySpec("dynaexq", "lo+hi", _dynaexq, on_miss="lo", predicts=True, hi_share=1.0),
        PolicySpec("on-demand", "hi-cache", _on_demand),
        PolicySpec("lru", "hi-cache", _lru, predicts=True, in_step=True),
        PolicySpec("moe-infinity", "hi-cache", _moe_infinity, predicts=True, in_step=True),
        PolicySpec("static-int4", "all-lo", _static("static-int4"), lo_precision="int4"),
        PolicySpec("static-int2", "all-lo", _static("static-int2"), lo_precision="int2"),
        PolicySpec("no-offload", "all-hi", _no_offload),
    )
}
POLICY_NAMES = tuple(POLICY_SPECS)
DEFAULT_POLICY = "combined"


def policy_spec(name: str) -> PolicySpec:
    """The spec of a `--policy` name; an unknown name is a ValueError that lists the known ones."""
    spec = POLICY_SPECS.get(name)
    if spec is None:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(POLICY_NAMES)}")
    return spec
