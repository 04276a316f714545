"""A `--cpu-memory` budget: the host memory moetide allocates for expert versions, checked before the load.

What a policy keeps in host memory (`host_needs`):
    every hi version, whole      hi-cache policies (their misses read hi from host memory in
                                 place) and a CPU run with no `--gpu-memory` (the experts run
                                 from the host store)
    the lo versions + staged hi  combined / dynaexq with bf16 hot experts, no-offload: the hi
                                 versions are read from the mapped checkpoint into a fixed number
                                 of staged slots (at least top-k)
    the lo versions + one batch  static-int4/int2, and combined / dynaexq with low-bit hot experts:
                                 hi is read from the map only to quantize, one batch at a time
With a cap below the whole layout (every hi version + the lo versions) and a policy that can read hi
from the map, the store maps the checkpoint (`store/mapped.py`); a cap below `minimum` is refused.
The default cap is what the machine can spare: MemAvailable less max(2 GiB, 10 % of MemTotal).
"""

from __future__ import annotations

import dataclasses

from ..config import EngineConfig, format_bytes
from ..errors import BudgetError, ConfigError
from ..policies.registry import policy_spec
from ..store.host_ram import machine_spare_bytes, rss_bytes  # noqa: F401 - re-exported
from .memory import ModelBytes, model_bytes, typed_size


@dataclasses.dataclass(frozen=True)
class HostNeeds:
    """What one policy keeps in host memory for one model (bytes)."""

    full: int  # the whole layout: every hi version + the lo versions
    minimum: int  # the smallest cap that works
    maps: bool  # it can read hi versions from the mapped checkpoint
    staged_slots: int  # the fewest staged hi slots it needs when it maps (0: it stages none)
    kept: tuple[str, ...]  # the low-bit versions it keeps of every expert


def _auto_lo(config: EngineConfig, mb: ModelBytes) -> str:
    """The lo precision "auto" resolves to, from the model's sizes (`residency.lo_precision_for`)."""
    from ..residency import lo_precision_of_sizes

    if config.gpu_memory_bytes is None:
        return lo_precision_of_sizes(config, None, None)
    room = config.gpu_memory_bytes - mb.fixed_at(config.gpu_memory_bytes).total
    return lo_precision_of_sizes(config, (mb.num_experts_total, mb.slot_bytes), room)


def host_needs(config: EngineConfig, mb: ModelBytes, device_type: str) -> HostNeeds:
    """What `config.policy` keeps in host memory on a `device_type` ("cpu", "cuda") device."""
    spec = policy_spec(config.policy)
    mode = spec.memory_mode
    n, hi = mb.num_experts_total, mb.hi_expert_bytes
    static = device_type == "cpu" and config.gpu_memory_bytes is None and mode != "all-lo"
    if static or mode == "hi-cache":
        return HostNeeds(n * hi, n * hi, False, 0, ())
    kept: list[str] = []
    if spec.needs_lo:
        lo = spec.lo_precision or config.lo_precision
        kept.append(_auto_lo(config, mb) if lo == "auto" else lo)
    if mode == "lo+hi":
        kept += [p for p in (config.hi_precision, *config.mid_precisions) if p != "hi" and p not in kept]
    lo_bytes = sum(n * mb.slot_bytes(p) for p in kept)
    stages = mode == "all-hi" or (mode == "lo+hi" and config.hi_precision == "hi")
    slots = mb.top_k if stages else 0
    return HostNeeds(n * hi + lo_bytes, lo_bytes + max(slots, 1) * hi, True, slots, tuple(kept))


def host_cap(config: EngineConfig) -> int:
    """The cap in force: `config.cpu_memory_bytes`, else what the machine can spare."""
    return config.cpu_memory_bytes if config.cpu_memory_bytes is not None else machine_spare_bytes()


def check_host_budget(config: EngineConfig, device_type: str, mb: ModelBytes | None = None) -> bool:
    """Refuse, before the load, a cap too small for the policy (naming the smallest that works);
    True when the store is to map the checkpoint (the cap is below the whole layout)."""
    mb = mb or model_bytes(config)
    needs, cap = host_needs(config, mb, device_type), host_cap(config)
    if cap >= needs.full:
        return False
    if cap < needs.minimum:
        given = "--cpu-memory" if config.cpu_memory_bytes is not None else "what this machine can spare"
        raise BudgetError(
            f"{config.policy} keeps {format_bytes(needs.minimum)} of expert versions in host memory at"
            f" least, more than {given} ({format_bytes(cap)}); the smallest host budget for"
            f" {config.policy} is --cpu-memory {typed_size(needs.minimum)}"
        )
    return True


def describe_needs(config: EngineConfig, device_type: str) -> list[str]:
    """`moetide info`'s table: per policy, the smallest --gpu-memory and the host memory it needs."""
    from ..policies.registry import POLICY_NAMES
    from .memory import minimum_budget

    rows = [
        f"{'policy':<14} {'min --gpu-memory':>17} {'host, whole':>12} {'min --cpu-memory':>17}  host tier"
    ]
    for name in POLICY_NAMES:
        try:
            c = dataclasses.replace(config, policy=name)
        except ConfigError:  # a policy the other options rule out (e.g. --on-miss lo with a hi cache)
            continue
        mb = model_bytes(c)
        gpu = minimum_budget(c, mb)
        needs = host_needs(c, mb, device_type)
        tier = (
            "hi read from the map, staged" if needs.staged_slots
            else "hi read from the map to quantize" if needs.maps
            else "every hi version in host memory"
        )  # fmt: skip
        rows.append(
            f"{name:<14} {typed_size(gpu) if gpu else '-':>17} {typed_size(needs.full):>12}"
            f" {typed_size(needs.minimum):>17}  {tier}"
        )
    return rows
