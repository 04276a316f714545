"""Drive `ExpertPolicy` objects from a plain transformers MoE model with forward hooks.

The engine attaches its policy through them (`engine/llm.attach_policy`); the offline tools record
traces with them (`analysis/trace.record_trace`). Nothing is patched: hooks go on the embedding layer, on each MoE block's router
(`mlp.<adapter.router_attr>`, which returns `(router_logits (T, J), top_k_weights, top_k_index (T, k))`)
and on the decoder stack (end of a step).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from .base import ExpertPolicy


def _mean_gate_probs(logits: torch.Tensor) -> torch.Tensor:
    """(..., J) router logits -> (J,) float32: the step's mean softmax (on the logits' device)."""
    return torch.softmax(logits.float(), dim=-1).reshape(-1, logits.shape[-1]).mean(0)


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

    Per step, policies see `begin_iteration` (pooled embedding, token count, request ids), then for
    each MoE layer `observe_layer` (mean softmax of the router logits in fp32, top-k ids) and, for
    policies that ask, `observe_speculative` (router l+d applied to router l's input), then
    `end_iteration`. Policies are attached to `sink` (a `NullSink` if none).

    With `runtime` (the engine's `ExpertRuntime`) the hooks only write into the step's device buffers
    (`runtime.observations`: router logits, speculative ids, the pooled embedding; the runtime writes
    the ids), so they add no host sync, run inside captured CUDA graphs, and the step is published to
    the policies one step later from its host copy (`runtime.step_observers`): every policy
    decides between steps. With `in_step` as well, a thread (`in_step.LayerFeed`) publishes each
    layer while the step runs, from a host mirror the device writes as each layer routes, and the
    residency acts on the requests within the step (`sink.in_step`); the step-late publication then
    only accounts. Without a runtime (offline tools on a plain transformers model) each layer is
    published as it runs, with a host copy per layer.
    """

    def __init__(
        self, hf_model, adapter, policies: Sequence[ExpertPolicy], sink=None, runtime=None, in_step: bool = False
    ):
        self.model = hf_model
        self.policies = list(policies)
        self.iteration = 0
        self.enabled = True  # False: every hook returns at once (the policies see nothing)
        self.hook_time_s = 0.0  # forward-thread seconds spent inside these hooks and publishing
        self.feed_time_s = 0.0  # the layer feed's thread: seconds spent publishing to the policies
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
        if len(self._distances) > 1 and runtime is not None:
            raise ValueError("the engine records one speculative distance per step")
        self._speculating = False
        self._runtime = runtime
        self._request_ids: tuple[int, ...] = ()
        self._obs = runtime.observations if runtime is not None else None
        # the routing ids: written by the runtime where its residency accounts every step, else here
        self._record_ids = runtime is not None and not runtime.accounts()
        if self._obs is not None:
            self._obs.want(logits=True, spec=bool(self._distances), embed=True)
            runtime.observing = True
            runtime.step_observers.append(self._on_step)
        self.feed = None
        if in_step and self._obs is not None:
            from .in_step import LayerFeed

            self.feed = LayerFeed(self, self._obs, sink, len(self.routers))
            runtime.step_openers.append(self.feed.announce)
        self._handles = [hf_model.get_input_embeddings().register_forward_hook(self._on_embedding)]
        for ordinal, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._router_hook(ordinal)))
        decoder = getattr(hf_model, "model", hf_model)
        self._handles.append(decoder.register_forward_hook(self._on_decoder_done))

    @property
    def request_ids(self) -> tuple[int, ...]:
        """The requests whose tokens the next step holds (set by tools that replay requests)."""
        return self._request_ids

    @request_ids.setter
    def request_ids(self, value) -> None:
        self._request_ids = tuple(value)
        if self._runtime is not None:
            self._runtime.step_tags = self._request_ids  # tagged on the step, published a step later

    # -- the forward pass ----------------------------------------------------------------------------
    def _on_embedding(self, module, inputs, output) -> None:
        if not self.enabled:
            if self._obs is None:
                self.iteration += 1  # keep counting forwards: iterations stay those of the runtime
            return
        t0 = time.perf_counter()
        if self._obs is not None:
            self._obs.record_embedding(output.detach())
            self._obs.publish_embedding()
        else:
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
                if self._obs is not None:
                    record(inputs, output)
                else:
                    observe(inputs, output)
            finally:
                self.hook_time_s += time.perf_counter() - t0

        def record(inputs, output) -> None:
            logits, _, top_k_index = output
            self._obs.record_logits(ordinal, logits.detach())
            if self._record_ids:
                self._obs.record_ids(ordinal, top_k_index.detach().reshape(-1, top_k_index.shape[-1]))
            if self._distances:
                d = self._distances[0]
                if ordinal + d < len(self.routers):
                    self._speculating = True
                    try:
                        self._obs.record_spec(ordinal, self.routers[ordinal + d](inputs[0].detach())[2])
                    finally:
                        self._speculating = False

        def observe(inputs, output) -> None:
            logits, _, top_k_index = output
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
                    self._speculative(ordinal, d, spec_ids)
            finally:
                self._speculating = False

        return hook

    def _speculative(self, ordinal: int, distance: int, spec_ids: torch.Tensor) -> None:
        for p in self.policies:
            if distance in getattr(p, "speculative_distances", ()):
                p.observe_speculative(self.iteration, ordinal, distance, spec_ids)

    def _publish(self, ordinal: int, probs: torch.Tensor, ids: torch.Tensor) -> None:
        for p in self.policies:
            p.observe_layer(self.iteration, ordinal, probs, ids)
        if self._observe_sink is not None:
            self._observe_sink(ordinal, probs.numpy())

    def _on_decoder_done(self, module, inputs, output) -> None:
        if not self.enabled or self._obs is not None:
            return
        t0 = time.perf_counter()
        for p in self.policies:
            p.end_iteration(self.iteration)
        self.hook_time_s += time.perf_counter() - t0

    # -- within the step (the layer feed's thread) ----------------------------------------------------
    def publish_begin(self, iteration: int, embed, num_tokens: int, request_ids) -> None:
        """The step's embedding has landed on the host (`embed (H,)` float32 numpy, or None)."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        self.iteration = iteration
        embedding = torch.from_numpy(embed) if embed is not None else None
        for p in self.policies:
            p.begin_iteration(iteration, embedding, num_tokens, request_ids=request_ids)
        self.feed_time_s += time.perf_counter() - t0

    def publish_layer(self, iteration: int, ordinal: int, data: dict) -> None:
        """MoE layer `ordinal` has routed: `data` "ids" (T, k) int32, "logits" (T, E), "spec" (T, k)."""
        if not self.enabled:
            return
        t0 = time.perf_counter()
        probs = _mean_gate_probs(torch.from_numpy(data["logits"]))
        self._publish(ordinal, probs, torch.from_numpy(data["ids"].astype(np.int64)))
        if "spec" in data and ordinal + self._distances[0] < len(self.routers):
            self._speculative(ordinal, self._distances[0], torch.from_numpy(data["spec"].astype(np.int64)))
        self.feed_time_s += time.perf_counter() - t0

    def publish_end(self, iteration: int) -> None:
        if not self.enabled:
            return
        for p in self.policies:
            p.end_iteration(iteration)

    # -- one step late (engine) ----------------------------------------------------------------------
    def _on_step(self, record) -> None:
        """Publish a finished step from its host copy (`observations.StepRecord`); with the layer
        feed the policies have seen it already, as it ran."""
        if not self.enabled or record.logits is None or self.feed is not None:
            return
        t0 = time.perf_counter()
        self.iteration = record.iteration
        _, request_ids = record.context
        embedding = torch.from_numpy(record.embed.copy())
        for p in self.policies:
            p.begin_iteration(self.iteration, embedding, record.num_tokens, request_ids=request_ids)
        # the whole step at once: one softmax over (L, T, E), one cast of the ids, one sink request
        probs = torch.from_numpy(record.gate_probs())  # (L, E)
        ids = torch.from_numpy(record.ids.astype(np.int64))  # (L, T, k)
        spec = torch.from_numpy(record.spec.astype(np.int64)) if record.spec is not None else None
        # batched where a policy takes the whole step (`PolicyBase.observe_step`) and no speculative
        # ids interleave with the layers; layer by layer otherwise
        batched = [p for p in self.policies if spec is None and hasattr(p, "observe_step")]
        for p in batched:
            p.observe_step(self.iteration, probs, ids)
        per_layer = [p for p in self.policies if p not in batched]
        for ordinal in range(len(self.routers) if per_layer else 0):
            for p in per_layer:
                p.observe_layer(self.iteration, ordinal, probs[ordinal], ids[ordinal])
            if spec is not None and ordinal + self._distances[0] < len(self.routers):
                self._speculative(ordinal, self._distances[0], spec[ordinal])
        if self._observe_sink is not None:
            self._observe_sink(None, probs.numpy())
        for p in self.policies:
            p.end_iteration(self.iteration)
        self.hook_time_s += time.perf_counter() - t0

    def remove(self) -> None:
        if self.feed is not None:
            self.feed.close()
            if self.feed.announce in self._runtime.step_openers:
                self._runtime.step_openers.remove(self.feed.announce)
            self.feed = None
        runtime = self._runtime
        if runtime is not None and self._on_step in runtime.step_observers:
            runtime.flush_observations()
            runtime.step_observers.remove(self._on_step)
            runtime.observing = bool(runtime.step_observers)
        for h in self._handles:
            h.remove()
        self._handles.clear()
