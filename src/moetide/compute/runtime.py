"""The managed experts module and the runtime it shares across layers.

`ManagedExperts` replaces `block.experts` on each MoE block instance. transformers' own block still
runs the router and the shared experts; moetide computes the routed experts in one path:

    table    the layer's device slot table: expert -> (pool, slot), see `slot_table`: the
             residency's device table (`residency.step_table`), fixed for good (no-offload,
             static-int4/int2) or written between steps (every other policy, with misses run
             from lo or read zero-copy from host memory); no host decision in the step
    compute  `fused_moe.fused_moe` (Triton, on CUDA) or `expert_compute.reference_moe` (PyTorch,
             per expert: the CPU path and the tests' reference) over that table
    combine  inside the kernel (routing weights) and one reduce over each token's k pairs

Steps: the engine's runner brackets every forward with `begin_step` / `end_step`. Each layer writes
its routing into the step's device buffers (`observations.StepObservations`), copied to the host
after the step. At the next `begin_step` the residency accounts the finished step (hits, LRU,
misses to cache), applies what the policies asked and writes the table; at its `end_step`, while the
device computes, the policies (`policies.hooks.PolicyHooks`) observe the finished step. So a policy
decides between steps, and its decisions reach the table two steps after the step it observed
(`residency.core.TABLE_LAG`). A forward run outside the engine opens and closes its own step from
the embedding and decoder hooks.
"""

from __future__ import annotations

import importlib.util
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LO_KERNELS
from ..errors import ConfigError
from ..residency.slot_table import WAITED
from .expert_compute import ActFn, reference_moe
from .observations import StepObservations, StepRecord


def check_lo_kernel(kind: str, device: torch.device) -> None:
    """ConfigError unless `kind` runs on `device`: "triton" and "cuda" (the fused kernel) need the
    triton package and a CUDA device (or, for "triton" in tests on CPU, Triton's interpreter:
    TRITON_INTERPRET=1)."""
    if kind not in LO_KERNELS:
        raise ConfigError(f"lo kernel must be one of {', '.join(LO_KERNELS)}, got {kind!r}")
    if kind not in ("triton", "cuda"):
        return  # "auto" falls back to the reference where triton cannot run
    if importlib.util.find_spec("triton") is None:
        raise ConfigError(
            f"--lo-kernel {kind} needs the triton package; install it or use --lo-kernel dequant"
        )
    interpreted = kind == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ConfigError(f"--lo-kernel {kind} needs a CUDA device, got {device}; use --lo-kernel dequant")


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
        self.cuda_kernels = (
            True  # the fused kernel may run packed pools on `lo_cuda` (not --lo-kernel triton)
        )
        self.observations: StepObservations | None = None  # set by `engine.assemble`
        self.observing = False  # a policy reads the steps: PolicyHooks records every layer's routing
        self.step_observers: list = []  # observer(StepRecord), called one step late (PolicyHooks)
        self.step_openers: list = []  # opener(iteration, tokens, tags, real) at a step start (the layer feed)
        self.step_tags: tuple = ()  # request ids of the next step (tools that replay requests set it)
        self._in_step = False
        self._auto_step = False
        self.real_tokens: int | None = None  # the running step's real tokens (None: all of them)
        self._to_observe: list[StepRecord] = []  # accounted at this step's start, observed at its end

    def set_lo_kernel(self, kind: str, device: torch.device) -> None:
        """How the experts are computed (`EngineConfig.lo_kernel`): "cuda" or "triton" (the fused kernel
        over the slot table, with or without the tensor-core kernels for packed pools), "dequant"
        (the per-expert PyTorch reference: dequantize, then matmul) or "auto" ("cuda" on CUDA where
        the experts are SiLU-gated, else the reference)."""
        check_lo_kernel(kind, device)
        self.cuda_kernels = kind != "triton"
        if kind == "dequant" or (kind == "auto" and device.type != "cuda"):
            self.fused = None
            return
        if not _is_silu(self.act_fn):
            if kind == "auto":
                self.fused = None
                return
            raise ConfigError(f"--lo-kernel {kind} computes SiLU-gated experts only; use --lo-kernel dequant")
        if importlib.util.find_spec("triton") is None:  # auto on a CUDA machine without triton
            self.fused = None
            return
        from . import fused_moe

        self.fused = fused_moe

    def decode_is_sync_free(self, num_tokens: int) -> bool:
        """Whether `run_layer` computes a `num_tokens`-token step with no host sync (and no host-side
        decision), so that the step can be captured as a CUDA graph: every layer reads the
        residency's device table (static, or written between steps) and the fused kernel computes
        the experts (or the device is the CPU, where the reference path's host reads cost nothing).
        Observers read the step's device buffers one step later, so they do not stand in the way."""
        if self.residency is None:
            return False
        # the reference path reads the used ids on the host: a sync on CUDA, free on the CPU
        return self.fused is not None or self.residency.step_table(0)[0].device.type == "cpu"

    # -- steps ----------------------------------------------------------------------------------------
    def accounts(self) -> bool:
        """The residency accounts each step's uses from its observations (a table written between
        steps); a static table needs no accounting beyond the CPU's free count."""
        return self.residency.accounts

    def begin_step(
        self, num_tokens: int | None = None, *, real_tokens: int | None = None, auto: bool = False
    ) -> None:
        """Before a forward of `num_tokens` tokens: the residency applies the policies' requests and
        writes the table this step reads (no-op inside a step). `real_tokens`: the first that many
        are real (all unless given), the rest pad rows of a padded decode step, which no policy,
        counter or metric sees. `auto`: opened by the embedding hook (a forward run outside the
        engine's runner); the decoder hook closes it."""
        if self._in_step:
            return
        t0 = time.perf_counter()
        self._in_step, self._auto_step = True, auto
        self.real_tokens = real_tokens if real_tokens is not None else num_tokens
        self.iteration += 1
        self.metrics.steps += 1
        if self.observations is not None:  # the step before has finished: account it first
            for record in self.observations.take_ready():
                self._account(record)
                self._to_observe.append(record)
        self.residency.begin_step(self.iteration)
        if self.observations is not None:
            accounts = self.accounts()
            if accounts and not self.observations.want_pools:  # the first step, before any capture
                self.observations.want(pools=True)
            # T up front: a replayed CUDA graph writes the step's buffers with no Python to tell
            tokens = num_tokens if accounts or self.observing else None
            real = self.real_tokens if tokens is not None else None
            self.observations.begin_step(self.iteration, (accounts, self.step_tags), tokens, real)
            for opener in self.step_openers:
                opener(self.iteration, tokens, self.step_tags, real)
        self.metrics.step_host_s += time.perf_counter() - t0

    def end_step(self, failed: bool = False) -> None:
        """After a forward has been issued: mark the end of its reads, queue its observations' copy
        to the host, and show the policies the step(s) this step's start accounted. `failed`: the
        forward raised part-way; its observations (partly unwritten buffers) are dropped."""
        if not self._in_step:
            return
        t0 = time.perf_counter()
        self._in_step = False
        self.residency.end_step()
        if self.observations is not None:
            self.observations.finish_step(discard=failed)
        self._observe_taken()  # the policies' part runs while the device computes this step
        self.metrics.step_host_s += time.perf_counter() - t0

    def _observe_taken(self) -> None:
        records, self._to_observe = self._to_observe, []
        for record in records:
            for observer in self.step_observers:
                observer(record)

    def flush_observations(self) -> None:
        """Publish every step still in flight (the end of a run: metrics and policies up to date)."""
        if self.observations is not None and not self._in_step:
            for record in self.observations.flush():
                self._account(record)
                self._to_observe.append(record)
            self._observe_taken()

    def _account(self, record: StepRecord) -> None:
        """The residency's part of a finished step: its uses counted, LRU touched, misses cached."""
        self.metrics.steps_observed += 1
        accounts, _tags = record.context
        if accounts:
            self.residency.observe_step(record.ran_from(), record.iteration)

    def on_embedding(self, embeds: torch.Tensor) -> None:
        """The embedding layer ran: a forward outside the engine's runner opens its own step."""
        self.begin_step(auto=True)

    def on_forward_done(self) -> None:
        if self._auto_step:
            self.end_step()

    def run_layer(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed experts of one MoE layer: `hidden (T, H)` -> `(T, H)`."""
        accounts = self.accounts()
        table = self.residency.step_table(layer)
        waits = self.residency.step_waits(layer)
        if self.observations is not None and accounts:  # device copies, read one step later
            self.observations.record_ids(layer, top_k_index)
            ran = table[0]
            if waits is not None:  # a hi entry naming a copy in flight: recorded as such (still a hit)
                ran = ran + WAITED * ((waits[0] != 0) & (ran == waits[2])).to(torch.int32)
            self.observations.record_pools(layer, ran, top_k_index)
            self.observations.publish_layer(layer)  # the layer feed's copy (where a policy decides in-step)
            # (where the residency accounts nothing, an attached policy's router hook records the ids)
        if not accounts and hidden.device.type == "cpu":  # a static table; counting is free here
            used = int(torch.unique(top_k_index[: self.real_tokens]).numel())  # not the pad rows
            self.metrics.layers[layer].used += used
            self.metrics.layers[layer].hits += used
        return self._compute(hidden, top_k_index, top_k_weights, *table, waits=waits)

    def _compute(self, hidden, top_k_index, top_k_weights, pool_of, slot_of, waits=None) -> torch.Tensor:
        pools = self.residency.kernel_pools(hidden.dtype)
        if self.fused is not None:
            return self.fused.fused_moe(hidden, top_k_index, top_k_weights, pool_of, slot_of, pools,
                                        waits=waits, cuda_kernels=self.cuda_kernels)  # fmt: skip
        if hidden.device.type == "cuda":  # NOTE: host sync (counted): the reference reads the used ids
            self.metrics.host_syncs += 1
        return reference_moe(hidden, top_k_index, top_k_weights, pool_of, slot_of, pools, self.act_fn,
                             waits=waits)  # fmt: skip


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
