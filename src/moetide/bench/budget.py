"""Memory budgets named relative to a model: `25%` = the fixed part + 25 % of all experts in hi precision.

A benchmark compares policies at the same cap on models whose fixed part (non-expert weights, KV
reservation, activation workspace) differs by orders of magnitude, so a relative budget is the one
that means the same thing on the demo model and on a 47 B-parameter shape. The fixed part is
computed exactly as the residency core computes it (`residency.fixed_costs`), from transformers'
model built on the meta device: no weights are read.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import EngineConfig, parse_bytes
from ..errors import ConfigError
from ..residency.budget import FixedCosts


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """What a budget is made of for one model and engine configuration (bytes)."""

    fixed: FixedCosts
    hi_expert_bytes: int  # one expert (gate, up, down) in the compute dtype
    num_experts_total: int  # MoE layers x experts per layer

    @property
    def all_experts_hi_bytes(self) -> int:
        return self.hi_expert_bytes * self.num_experts_total


def model_bytes(config: EngineConfig) -> ModelBytes:
    """Fixed costs and expert sizes of `config`'s model on `config`'s device, without loading weights."""
    from ..models.checkpoint import inspect_checkpoint
    from ..models.loader import build_empty_model, moe_blocks, resolve_device, resolve_dtype
    from ..residency import fixed_costs

    info = inspect_checkpoint(config.model_path)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, info.config, device)
    model = build_empty_model(info.config, dtype)
    if getattr(info.config, "tie_word_embeddings", False):
        model.tie_weights()  # as the loader does: a tied head is one tensor on the device
    blocks = moe_blocks(model, info.adapter)
    elt = torch.empty((), dtype=dtype).element_size()
    # the loader keeps every parameter but the routed experts on the device (the meta model holds
    # them as fused `experts.*` parameters, which the managed experts module replaces)
    expert_params = {id(p) for _, block in blocks for p in block.experts.parameters()}
    weights = sum(p.numel() * elt for p in model.parameters() if id(p) not in expert_params)
    hi_bytes = 3 * info.adapter.expert_intermediate(info.config) * info.config.hidden_size * elt
    budget_hint = config.gpu_memory_bytes or (1 << 40)
    fixed = fixed_costs(config, info.config, model, dtype, hi_bytes, budget_hint)  # meta weights count 0
    fixed = dataclasses.replace(fixed, non_expert_weights=fixed.non_expert_weights + weights)
    return ModelBytes(fixed, hi_bytes, len(blocks) * info.adapter.num_experts(info.config))


def resolve_budget(spec: str | None, config: EngineConfig) -> int | None:
    """Bytes for a `--gpu-memory` entry: None / "none" (no cap), "6GiB", or "NN%" (relative, see module doc)."""
    if spec is None or str(spec).strip().lower() in ("", "none", "uncapped"):
        return None
    text = str(spec).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100.0
        except ValueError:
            raise ConfigError(f"cannot read budget {spec!r}; write it like 25% or 6GiB") from None
        if share <= 0:
            raise ConfigError(f"a relative budget must be > 0%, got {spec!r}")
        mb = model_bytes(config)
        return mb.fixed.total + int(share * mb.all_experts_hi_bytes)
    return parse_bytes(text)
