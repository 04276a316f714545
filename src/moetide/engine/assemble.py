"""Assemble the runtime around a loaded model: managed experts, residency, the iteration hook.

`models/loader.load_weights` leaves every MoE block's experts as a placeholder and the experts'
weights in the host store. Here each placeholder is replaced, on the instance, by a `ManagedExperts`
of one shared `ExpertRuntime`, whose residency core decides where each expert's weights come from.
"""

from __future__ import annotations

import torch
from torch import nn

from ..compute.observations import StepObservations
from ..compute.projections import fuse_qkv
from ..compute.routing import fuse_routers
from ..compute.runtime import ExpertRuntime, ManagedExperts
from ..models.loader import LoadedModel, load_weights, moe_blocks
from ..residency.metrics import ExpertMetrics
from ..residency.protocol import StaticResidency


def load_model(
    path,
    *,
    device: str | torch.device | None = None,
    dtype: str = "auto",
    residency_factory=None,
    progress: bool = True,
    host_budget=None,
    map_hi: bool = False,
) -> LoadedModel:
    """Load a local HF MoE checkpoint through transformers' modeling code with managed experts.

    `residency_factory(store, metrics, device, model, config) -> residency` chooses how experts reach
    the device; it runs after the non-expert weights are placed (they count in the budget). The
    default keeps every expert in hi at a fixed slot (`StaticResidency`: no budget).
    """
    loaded = load_weights(path, device=device, dtype=dtype, progress=progress, host_budget=host_budget,
                          map_hi=map_hi)  # fmt: skip
    assemble_runtime(loaded, residency_factory)
    return loaded


def assemble_runtime(loaded: LoadedModel, residency_factory=None) -> ExpertRuntime:
    """Swap the experts placeholders for managed experts and attach the residency core."""
    adapter, config, store = loaded.adapter, loaded.config, loaded.store
    metrics = ExpertMetrics(len(loaded.moe_layers))
    runtime = ExpertRuntime(None, metrics, loaded.act_fn, store.num_experts, adapter.top_k(config))
    for i, (_, block) in enumerate(moe_blocks(loaded.model, adapter)):
        block.experts = ManagedExperts(i, runtime)
    loaded.fused_routers = fuse_routers(loaded.model, adapter, loaded.device)  # before any hook is attached
    loaded.fused_qkv = fuse_qkv(loaded.model)
    if residency_factory is None:
        runtime.residency = StaticResidency(store, metrics, loaded.device)
    else:
        runtime.residency = residency_factory(store, metrics, loaded.device, loaded.model, config)
    hidden = loaded.model.get_input_embeddings().embedding_dim
    runtime.observations = StepObservations(
        len(loaded.moe_layers), store.num_experts, adapter.top_k(config), hidden, loaded.device
    )
    _install_hooks(loaded.model, runtime)
    loaded.runtime = runtime
    return runtime


def _install_hooks(model: nn.Module, runtime: ExpertRuntime) -> None:
    """Forward hooks (on the instances) on the embedding layer and the decoder stack: a forward run
    outside the engine's runner (which brackets its own) opens and closes a step."""
    model.get_input_embeddings().register_forward_hook(lambda _m, _i, out: runtime.on_embedding(out))
    decoder = getattr(model, "model", model)
    decoder.register_forward_hook(lambda _m, _i, _out: runtime.on_forward_done())
