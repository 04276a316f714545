"""The managed experts module and the runtime it shares across layers.

`ManagedExperts` replaces `block.experts` on each MoE block instance. transformers' own block still
runs the router and the shared experts; moetide computes the routed experts in one path:

    table    the layer's device slot table: expert -> (pool, slot), see `slot_table`
             (fixed for good: the residency's static table; otherwise the host resolves the
             step's experts through `residency.acquire` and writes a table for this step)
    compute  `fused_moe.fused_moe` (Triton, on CUDA) or `expert_compute.reference_moe` (PyTorch,
             per expert: the CPU path and the tests' reference) over that table
    combine  inside the kernel (routing weights) and one reduce over each token's k pairs

A forward hook on the embedding layer starts each iteration; policies observe the routers through
`policies.hooks.PolicyHooks` (forward hooks too: no class patching).
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LO_KERNELS
from ..errors import ConfigError
from .expert_compute import ActFn, reference_moe
from ..residency.slot_table import NOT_RESIDENT


def check_lo_kernel(kind: str, device: torch.device) -> None:
    """ConfigError unless `kind` runs on `device`: "triton" (the fused kernel) needs the triton
    package and a CUDA device (or, for tests on CPU, Triton's interpreter: TRITON_INTERPRET=1)."""
    if kind not in LO_KERNELS:
        raise ConfigError(f"lo kernel must be one of {', '.join(LO_KERNELS)}, got {kind!r}")
    if kind != "triton":
        return  # "auto" falls back to the reference where triton cannot run
    if importlib.util.find_spec("triton") is None:
        raise ConfigError(
            "--lo-kernel triton needs the triton package; install it or use --lo-kernel dequant"
        )
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"--lo-kernel triton needs a CUDA device, got {device}; use --lo-kernel dequant")


def _is_silu(act_fn: ActFn) -> bool:
    probe = torch.linspace(-4, 4, 9)
    return torch.allclose(act_fn(probe), F.silu(probe))


class ExpertRuntime:
    """State shared by all managed experts modules of one model: residency, metrics, policy hooks."""

    def __init__(self, residency, metrics, act_fn: ActFn, num_experts: int, top_k: int):
        self.residency = residency
        self.metrics = metrics
        self.act_fn = act_fn
        self.num_experts = num_experts
        self.top_k = top_k
        self.iteration = 0
        self.fused = None  # the fused Triton module (`compute.fused_moe`) when it computes the experts
        # called as on_host_ids(layer, ids (T, k) on the host) after the layer's host sync (PolicyHooks)
        self.on_host_ids = None

    def set_lo_kernel(self, kind: str, device: torch.device) -> None:
        """How the experts are computed: "triton" (the fused kernel over the slot table), "dequant"
        (the per-expert PyTorch reference: dequantize, then matmul) or "auto" (triton on CUDA where
        the experts are SiLU-gated, else the reference)."""
        check_lo_kernel(kind, device)
        if kind == "dequant" or (kind == "auto" and device.type != "cuda"):
            self.fused = None
            return
        if not _is_silu(self.act_fn):
            if kind == "auto":
                self.fused = None
                return
            raise ConfigError("--lo-kernel triton computes SiLU-gated experts only; use --lo-kernel dequant")
        if importlib.util.find_spec("triton") is None:  # auto on a CUDA machine without triton
            self.fused = None
            return
        from . import fused_moe

        self.fused = fused_moe

    def decode_is_sync_free(self, num_tokens: int) -> bool:
        """Whether `run_layer` computes a `num_tokens`-token step with no host sync (and no host-side
        decision), so that the step can be captured as a CUDA graph: the residency's slot table is
        fixed for good and the fused kernel computes the experts (or the device is the CPU, where
        the reference path's host reads cost nothing); and no observer waits for each
        layer's ids on the host (`on_host_ids`: a replay would skip it)."""
        if self.residency is None or self.on_host_ids is not None:
            return False
        table = self.residency.static_table(0)
        # the reference path reads the used ids on the host: a sync on CUDA, free on the CPU
        return table is not None and (self.fused is not None or table[0].device.type == "cpu")

    def on_embedding(self, embeds: torch.Tensor) -> None:
        """Embedding-layer output starts a new iteration (policies observe through `PolicyHooks`)."""
        self.iteration += 1
        self.residency.begin_iteration(self.iteration)

    def run_layer(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed experts of one MoE layer: `hidden (T, H)` -> `(T, H)`."""
        table = self.residency.static_table(layer)
        if table is not None:  # every expert has a version at a fixed slot: no host sync at all
            if hidden.device.type == "cpu":  # counting is free where there is no device to sync with
                used = int(torch.unique(top_k_index).numel())
                self.metrics.layers[layer].used += used
                self.metrics.layers[layer].hits += used
            return self._compute(hidden, top_k_index, top_k_weights, *table)
        ids_cpu = top_k_index.cpu()  # NOTE: host sync (counted): residency must know the experts
        self.metrics.host_syncs += 1
        if self.on_host_ids is not None:
            self.on_host_ids(layer, ids_cpu)
        out = None
        pending = torch.unique(ids_cpu).tolist()
        while pending:  # more than one wave only when the pools cannot hold all experts at once
            resolved, pending = self.residency.acquire(layer, pending, hidden.device)
            try:
                pool_of, slot_of = self._step_table(resolved, hidden.device)
                part = self._compute(hidden, top_k_index, top_k_weights, pool_of, slot_of)
            finally:
                self.residency.release(layer, list(resolved))
            out = part if out is None else out + part
        return out

    def _compute(self, hidden, top_k_index, top_k_weights, pool_of, slot_of) -> torch.Tensor:
        pools = self.residency.kernel_pools(hidden.dtype)
        if self.fused is not None:
            return self.fused.fused_moe(hidden, top_k_index, top_k_weights, pool_of, slot_of, pools)
        return reference_moe(hidden, top_k_index, top_k_weights, pool_of, slot_of, pools, self.act_fn)

    def _step_table(self, resolved: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`(pool_of, slot_of)` (E,) int32 on `device` for this step's resolved versions (expert ->
        `DeviceVersion`); the other experts have no pool."""
        pool_of = torch.full((self.num_experts,), NOT_RESIDENT, dtype=torch.int32)
        slot_of = torch.zeros(self.num_experts, dtype=torch.int32)
        pool_id = self.residency.pool_ids
        for e, version in resolved.items():
            pool_of[e] = pool_id[version.pool]
            slot_of[e] = version.slot
        return pool_of.to(device, non_blocking=True), slot_of.to(device, non_blocking=True)


class ManagedExperts(nn.Module):
    """Drop-in for transformers' `<Family>Experts`: `forward(hidden (T,H), top_k_index (T,k),
    top_k_weights (T,k)) -> (T,H)`. Holds no weights; the runtime's residency core provides them."""

    def __init__(self, layer: int, runtime: ExpertRuntime):
        super().__init__()
        self.layer = layer
        self.runtime = runtime

    @torch.compiler.disable  # a compiled decode step breaks here: the layer stays the fused kernel
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.runtime.run_layer(self.layer, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.runtime.num_experts}, top_k={self.runtime.top_k}"
