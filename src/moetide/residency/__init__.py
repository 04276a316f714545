"""Where experts live (device or host) and in which precision: pools, handles, transfers, budget."""

from __future__ import annotations

from ..config import EngineConfig
from ..errors import ConfigError
from .direct import DirectResidency
from .metrics import ExpertMetrics


def build_residency(config: EngineConfig, store, metrics: ExpertMetrics, device):
    """The residency core for `config.policy` over `store` on `device`."""
    if config.policy == "on-demand" and config.gpu_memory_bytes is None:
        return DirectResidency(store, metrics)
    raise ConfigError(
        f"policy {config.policy!r} with a memory budget needs the residency core, which is not built yet;"
        " use --policy on-demand without --gpu-memory"
    )
