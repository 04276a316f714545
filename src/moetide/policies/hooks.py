"""Drive `ExpertPolicy` objects from a plain transformers MoE model with forward hooks.

The engine attaches its policy through them (`engine/llm.attach_policy`); the offline tools record
traces with them (`analysis/trace.record_trace`). Nothing is patched: hooks go on the embedding layer, on each MoE block's router
(`mlp.<adapter.router_attr>`, which returns `(router_logits (T, J), top_k_weights, top_k_index (T, k))`)
and on the decoder stack (end of a step).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import ExpertPolicy


def _mean_gate_probs(logits: torch.Tensor) -> torch.Tensor:
    """(..., J) router logits -> (J,) float32: the step's mean softmax (on the logits' device)."""
    return torch.softmax(logits.float(), dim=-1).reshape(-1, logits.shape[-1]).mean(0)


def _host_gate_probs(logits: torch.Tensor) -> torch.Tensor:
    """`_mean_gate_probs` of (T, J) host logits, with a two-op path for one token (batch-1 decode:
    this runs on the forward thread once per MoE layer, at several microseconds per torch op)."""
    if logits.dim() == 2 and logits.shape[0] == 1:
        row = logits[0]
        return torch.softmax(row if row.dtype == torch.float32 else row.float(), dim=0)
    return _mean_gate_probs(logits)


class NullSink:
    """A sink that drops every request (for policies that only observe, such as `TraceRecorder`)."""

    capacity_experts = 0

    def prefetch(self, layer, experts, *, iteration, priorities=None, protect=False) -> None:
        pass

    def protect(self, layer, experts, *, iteration) -> None:
        pass

    def set_precision(self, layer, expert, precision) -> None:
        pass


def moe_layers(hf_model, adapter) -> list[tuple[int, torch.nn.Module]]:
    """`[(model layer index, mlp block)]` of the layers whose MLP has the adapter's router."""
    layers = hf_model.model.layers
    return [(i, layer.mlp) for i, layer in enumerate(layers) if hasattr(layer.mlp, adapter.router_attr)]


class PolicyHooks:
    """Forward hooks that publish each step of `hf_model` to `policies`.

    Per forward: the embedding hook calls `begin_iteration` (pooled embedding, token count,
    `self.request_ids`), each router hook `observe_layer` (mean softmax of the logits in fp32, top-k
    ids) and, for policies that ask, `observe_speculative` (router l+d applied to router l's input),
    and the decoder-stack hook `end_iteration`. Policies are attached to `sink` (a `NullSink` if none).

    `runtime` (the engine's `ExpertRuntime`, only for policies without speculative distances): the
    router hook then only starts a non-blocking host copy of the router logits, and the layer is
    published when the runtime has the top-k ids on the host anyway (`runtime.on_host_ids`, right
    after its own host sync for residency), so observing adds no host sync and no reduction kernels to
    the decode step; the mean softmax is computed on the host. A layer the runtime computes without a
    host sync (every expert at a fixed slot) is published, with a sync, at the next hook.
    """

    def __init__(self, hf_model, adapter, policies: Sequence[ExpertPolicy], sink=None, runtime=None):
        self.model = hf_model
        self.policies = list(policies)
        self.request_ids: tuple[int, ...] = ()
        self.iteration = 0
        self.enabled = True  # False: every hook returns at once (the policies see nothing)
        self.hook_time_s = 0.0  # forward-thread seconds spent inside these hooks
        layers = moe_layers(hf_model, adapter)
        if not layers:
            raise ValueError(f"no MoE block with a '{adapter.router_attr}' router in this model")
        self.moe_layer_ids = [i for i, _ in layers]
        self.routers = [getattr(mlp, adapter.router_attr) for _, mlp in layers]
        config = hf_model.config
        num_experts, top_k = adapter.num_experts(config), adapter.top_k(config)
        sink = sink if sink is not None else NullSink()
        self._observe_sink = getattr(sink, "observe_gate_probs", None)  # prob-freq eviction's input
        hidden_size = hf_model.get_input_embeddings().embedding_dim
        for p in self.policies:
            p.attach(sink, len(self.routers), num_experts, top_k)
            if hasattr(p, "prepare"):
                p.prepare(hidden_size)
        self._distances = sorted({d for p in self.policies for d in getattr(p, "speculative_distances", ())})
        self._speculating = False
        self._runtime = runtime if runtime is not None and not self._distances else None
        self._pending: tuple | None = None  # (iteration, ordinal, host logits, device top-k ids)
        self._pinned: torch.Tensor | None = None  # host buffer the router logits are copied into
        self._host_views: dict = {}  # (shape, dtype) -> view of `_pinned`
        if self._runtime is not None:
            self._runtime.on_host_ids = self._on_host_ids
        self._handles = [hf_model.get_input_embeddings().register_forward_hook(self._on_embedding)]
        for ordinal, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._router_hook(ordinal)))
        decoder = getattr(hf_model, "model", hf_model)
        self._handles.append(decoder.register_forward_hook(self._on_decoder_done))

    def _on_embedding(self, module, inputs, output) -> None:
        if not self.enabled:
            self.iteration += 1  # keep counting forwards: iterations stay those of the runtime
            return
        t0 = time.perf_counter()
        self._flush_pending()
        self.iteration += 1
        h = output.detach().reshape(-1, output.shape[-1])
        pooled = h.float().mean(dim=0).cpu()
        for p in self.policies:
            p.begin_iteration(self.iteration, pooled, h.shape[0], request_ids=self.request_ids)
        self.hook_time_s += time.perf_counter() - t0

    def _router_hook(self, ordinal: int):
        def hook(module, inputs, output) -> None:
            if self._speculating or not self.enabled:
                return
            t0 = time.perf_counter()
            try:
                observe(inputs, output)
            finally:
                self.hook_time_s += time.perf_counter() - t0

        def observe(inputs, output) -> None:
            logits, _, top_k_index = output
            if self._runtime is not None:
                self._flush_pending()
                host_logits = self._host_copy(logits.detach())  # lands before the runtime's sync
                self._pending = (self.iteration, ordinal, host_logits, top_k_index)
                return
            probs = _mean_gate_probs(logits.detach()).cpu()
            ids = top_k_index.detach().reshape(-1, top_k_index.shape[-1]).cpu()
            self._publish(ordinal, probs, ids)
            if not self._distances:
                return
            hidden = inputs[0].detach()
            self._speculating = True
            try:
                for d in self._distances:
                    if ordinal + d >= len(self.routers):
                        break
                    spec_ids = self.routers[ordinal + d](hidden)[2]
                    spec_ids = spec_ids.detach().reshape(-1, spec_ids.shape[-1]).cpu()
                    for p in self.policies:
                        if d in getattr(p, "speculative_distances", ()):
                            p.observe_speculative(self.iteration, ordinal, d, spec_ids)
            finally:
                self._speculating = False

        return hook

    def _host_copy(self, logits: torch.Tensor) -> torch.Tensor:
        """Start a non-blocking copy of `logits` into a pinned host buffer kept for it (one copy launch,
        no allocation; one layer is pending at a time, and it is read before the next copy starts)."""
        if logits.device.type != "cuda":
            return logits
        key = (logits.shape, logits.dtype)
        host = self._host_views.get(key)  # a view per shape: slicing costs as much as the copy launch
        if host is None:
            n = logits.numel()
            buf = self._pinned
            if buf is None or buf.numel() < n or buf.dtype != logits.dtype:
                buf = self._pinned = torch.empty(max(n, 1 << 14), dtype=logits.dtype, pin_memory=True)
                self._host_views.clear()
            host = self._host_views[key] = buf[:n].view(logits.shape)
        host.copy_(logits, non_blocking=True)
        return host

    def _publish(self, ordinal: int, probs: torch.Tensor, ids: torch.Tensor) -> None:
        for p in self.policies:
            p.observe_layer(self.iteration, ordinal, probs, ids)
        if self._observe_sink is not None:
            self._observe_sink(ordinal, probs.numpy())

    def _on_host_ids(self, ordinal: int, ids_cpu: torch.Tensor) -> None:
        """The runtime's callback after its host copy of layer `ordinal`'s top-k ids (a device sync,
        so the earlier non-blocking copy of the logits has landed too)."""
        pending = self._pending
        if pending is None or pending[0] != self.iteration or pending[1] != ordinal:
            return
        t0 = time.perf_counter()
        self._pending = None
        ids = ids_cpu.reshape(-1, ids_cpu.shape[-1])
        self._publish(ordinal, _host_gate_probs(pending[2]), ids)
        self.hook_time_s += time.perf_counter() - t0

    def _flush_pending(self) -> None:
        """Publish a layer the runtime computed without a host sync (so it never called back)."""
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        _, ordinal, host_logits, top_k_index = pending
        ids = top_k_index.reshape(-1, top_k_index.shape[-1]).cpu()  # NOTE: host sync (the logits land too)
        self._publish(ordinal, _host_gate_probs(host_logits), ids)

    def _on_decoder_done(self, module, inputs, output) -> None:
        if not self.enabled:
            return
        t0 = time.perf_counter()
        self._flush_pending()
        for p in self.policies:
            p.end_iteration(self.iteration)
        self.hook_time_s += time.perf_counter() - t0

    def remove(self) -> None:
        if self._runtime is not None and self._runtime.on_host_ids == self._on_host_ids:
            self._runtime.on_host_ids = None
        self._pending = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
