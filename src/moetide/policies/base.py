"""Interfaces between the forward pass, the policies and the residency core.

The forward pass *publishes* what it observes (one `StepObservation` per iteration, filled layer by
layer) and never waits on a policy. Policies turn observations into *requests* (prefetch, promote,
demote) that they hand to an `ExpertSink`; the residency core (or the trace simulator) executes them.

Shapes (per iteration = one forward step, prefill or one decode step, of a batch of T tokens):
    embedding      (H,)   float32  mean over the step's tokens of the embedding-layer output
    gate_probs[l]  (J,)   float32  mean over the step's tokens of softmax(router logits) at layer l
    topk_ids[l]    (T, k) int64    the experts the router selected for each token at layer l

Why an aggregate per step rather than per-token maps: prefetch acts on the union of experts a step
needs, and the mean of per-token distributions ranks experts by their expected share of that step's
work; with one token per step (batch-1 decode) the two are the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class ExpertSink(Protocol):
    """Where policies send their decisions. Implementations must be thread-safe and non-blocking."""

    def prefetch(self, layer: int, experts: list[int], *, iteration: int) -> None:
        """Ask for `experts` of `layer` to be resident for iteration `iteration` (best effort)."""

    def protect(self, layer: int, experts: list[int], *, iteration: int) -> None:
        """Experts predicted for `iteration`: eviction should spare them while it runs."""

    def set_precision(self, layer: int, expert: int, precision: str) -> None:
        """Ask for (layer, expert) to live in `precision` ("hi" or "lo"); deferred if memory is tight."""


@dataclass
class StepObservation:
    """What one iteration showed, filled in by the forward pass as layers run."""

    iteration: int
    num_tokens: int
    embedding: torch.Tensor | None = None  # (H,) float32, CPU
    gate_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (J,) float32, CPU
    topk_ids: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (T, k) int64, CPU


class ExpertPolicy(Protocol):
    """A policy observes iterations and issues requests to its sink.

    Calls come from the forward thread in this order per iteration:
    `begin_iteration` (after the embedding layer), `observe_layer` for each MoE layer in order,
    `end_iteration`. None of them may block on search or I/O.
    """

    name: str

    def attach(self, sink: ExpertSink, num_layers: int, num_experts: int, top_k: int) -> None: ...

    def begin_iteration(self, iteration: int, embedding: torch.Tensor, num_tokens: int) -> None: ...

    def observe_layer(self, iteration: int, layer: int, gate_probs: torch.Tensor, topk_ids: torch.Tensor) -> None: ...

    def end_iteration(self, iteration: int) -> None: ...

    def close(self) -> None: ...
