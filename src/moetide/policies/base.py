"""Interfaces between the forward pass, the policies and the residency core.

The forward pass *publishes* what it observes (one `StepObservation` per iteration, filled layer by
layer) and never waits on a policy. Policies turn observations into *requests* (prefetch, promote,
demote) that they hand to an `ExpertSink`; the residency core (or the trace simulator) executes them.

Layers are numbered by MoE layer ordinal 0..L-1 (the k-th layer whose MLP is a sparse MoE block); for
every family whose layers are all MoE this is the model's layer index. DeepSeek-style dense first
layers are skipped and have no ordinal.

Shapes (per iteration = one forward step, prefill or one decode step, of a batch of T tokens):
    embedding      (H,)   float32  mean over the step's tokens of the embedding-layer output
    gate_probs[l]  (J,)   float32  mean over the step's tokens of softmax(router logits) at layer l
    topk_ids[l]    (T, k) int64    the experts the router selected for each token at layer l

Why an aggregate per step rather than per-token maps: prefetch acts on the union of experts a step
needs, and the mean of per-token distributions ranks experts by their expected share of that step's
work; with one token per step (batch-1 decode) the two are the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


def tier_names(depth: int) -> tuple[str, ...]:
    """The names of a precision ladder's `depth` tiers, hottest first, as `ExpertSink.set_precision`
    and the residency's pools know them: "hi" (the top), "mid1" ... "mid{depth-2}", "lo" (the
    coldest, resident for every expert). `tier_names(2)` = ("hi", "lo")."""
    if depth < 2:
        raise ValueError(f"a ladder has at least two tiers, got {depth}")
    return ("hi", *(f"mid{t}" for t in range(1, depth - 1)), "lo")


def tier_rank(name: str) -> int:
    """A tier name's place in any ladder, hottest first: "hi" 0, "mid<t>" t, "lo" after every other."""
    if name == "hi":
        return 0
    if name.startswith("mid"):
        return int(name[3:])
    return 1 << 20


class ExpertSink(Protocol):
    """Where policies send their decisions. Implementations must be thread-safe and non-blocking.

    `capacity_experts`: how many experts (hi precision) the device cache holds, all layers together;
    policies that prefetch "up to the cache's share" (MoE-Infinity) read it.
    """

    capacity_experts: int

    def prefetch(
        self,
        layer: int,
        experts: list[int],
        *,
        iteration: int,
        priorities: Sequence[float] | None = None,
        protect: bool = False,
    ) -> None:
        """Ask for `experts` of `layer` to be resident for iteration `iteration` (best effort).

        `experts` is in priority order. `priorities` (optional, aligned with `experts`, in [0, 1]) is
        the policy's predicted probability of each expert; eviction rules that rank by it use it.
        `protect=True` also protects them, first (what `protect` then `prefetch` would do, in one
        request: the prefetch cannot evict its own experts).
        """

    def protect(self, layer: int, experts: list[int], *, iteration: int) -> None:
        """Experts predicted for `iteration`: eviction should spare them until `layer` has run."""

    def set_precision(self, layer: int, expert: int, precision: str) -> None:
        """Ask for (layer, expert) to live in `precision`, a tier of the ladder (`tier_names`: "hi",
        "mid<t>", "lo"); deferred if memory is tight. Its coldest version stays resident either way."""


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
    `begin_iteration` (after the embedding layer), `observe_layer` for each MoE layer in order
    (each followed, for policies with `speculative_distances`, by `observe_speculative` per distance),
    `end_iteration`. None of them may block on search or I/O. In the engine (sync-free steps) the
    whole iteration is delivered after it ran, at the end of the next step, and requests reach the
    device table two steps after the observed iteration (`residency.core.TABLE_LAG`); offline tools
    on a plain model deliver each layer as it runs.

    `request_ids`: the requests whose tokens are in this step (empty when the caller does not know);
    request-level policies (MoE-Infinity) use it to tell requests apart.

    `speculative_distances`: distances d for which the policy wants, at layer l, the top-k that layer
    l+d's router would pick from layer l's router input (Mixtral-Offloading's speculative prefetch).
    The forward pass computes them by calling router l+d on the hidden state it already has, and
    delivers them through `observe_speculative`; `()` (most policies) means never.
    """

    name: str
    speculative_distances: tuple[int, ...]

    def attach(self, sink: ExpertSink, num_layers: int, num_experts: int, top_k: int) -> None: ...

    # optional: `prepare(hidden_size)`, called once after `attach` (see `PolicyBase.prepare`), and
    # `observe_step(iteration, gate_probs (L, J), topk_ids (L, T, k))`, a whole step in place of its
    # `observe_layer` calls (see `PolicyBase.observe_step`)

    def begin_iteration(
        self, iteration: int, embedding: torch.Tensor, num_tokens: int, request_ids: Sequence[int] = ()
    ) -> None: ...

    def observe_layer(
        self, iteration: int, layer: int, gate_probs: torch.Tensor, topk_ids: torch.Tensor
    ) -> None: ...

    def observe_speculative(
        self, iteration: int, layer: int, distance: int, topk_ids: torch.Tensor
    ) -> None: ...

    def end_iteration(self, iteration: int) -> None: ...

    def close(self) -> None: ...


class PolicyBase:
    """No-op implementation of `ExpertPolicy`: subclasses override what they use.

    `attach` stores the sink and the model's geometry as `sink`, `num_layers`, `num_experts`, `top_k`.
    """

    name = "base"
    speculative_distances: tuple[int, ...] = ()

    sink: ExpertSink | None = None
    num_layers = 0
    num_experts = 0
    top_k = 0

    def attach(self, sink: ExpertSink, num_layers: int, num_experts: int, top_k: int) -> None:
        self.sink = sink
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k

    def prepare(self, hidden_size: int) -> None:
        """Called once after `attach` by whoever drives the policy from a model (`PolicyHooks`), with
        the embedding size H: start-up work that needs it (FineMoE's searcher process) starts here,
        before the first step, rather than during it."""

    def begin_iteration(
        self, iteration: int, embedding: torch.Tensor, num_tokens: int, request_ids: Sequence[int] = ()
    ) -> None:
        pass

    def observe_layer(
        self, iteration: int, layer: int, gate_probs: torch.Tensor, topk_ids: torch.Tensor
    ) -> None:
        pass

    def observe_speculative(self, iteration: int, layer: int, distance: int, topk_ids: torch.Tensor) -> None:
        pass

    def observe_step(self, iteration: int, gate_probs: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Every MoE layer of a step that has run, at once (the engine publishes a step after it ran,
        for policies without `speculative_distances`): `gate_probs (L, J)`, `topk_ids (L, T, k)`.
        By default `observe_layer` for each layer in order; policies override it with one batched
        update (the engine's host part of a step)."""
        for layer in range(gate_probs.shape[0]):
            self.observe_layer(iteration, layer, gate_probs[layer], topk_ids[layer])

    def end_iteration(self, iteration: int) -> None:
        pass

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        """Counters for reports (JSON-able)."""
        return {}
