"""The managed experts module and the runtime it shares across layers.

`ManagedExperts` replaces `block.experts` on each MoE block instance. transformers' own block still
runs the router and the shared experts; moetide computes the routed experts through four stages:

    route            distinct expert ids of the step                     (host sync, counted)
    ensure resident  residency.acquire(layer, ids) -> resolved versions (stalls counted there)
    compute          each expert on its tokens, hi or lo version
    combine          weighted sum into (T, H), same order as transformers' eager experts

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
from ..residency.metrics import ExpertMetrics
from .expert_compute import ActFn, gathered_pairs, grouped_moe, grouped_pairs


def check_lo_kernel(kind: str, device: torch.device) -> None:
    """ConfigError unless `kind` runs on `device`: "triton" needs the triton package and a CUDA device
    (or, for tests on CPU, Triton's interpreter: TRITON_INTERPRET=1)."""
    if kind not in LO_KERNELS:
        raise ConfigError(f"lo kernel must be one of {', '.join(LO_KERNELS)}, got {kind!r}")
    if kind != "triton":
        return  # "auto" falls back to dequant where triton cannot run
    if importlib.util.find_spec("triton") is None:
        raise ConfigError(
            "--lo-kernel triton needs the triton package; install it or use --lo-kernel dequant"
        )
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"--lo-kernel triton needs a CUDA device, got {device}; use --lo-kernel dequant")


class ExpertRuntime:
    """State shared by all managed experts modules of one model: residency, metrics, policy hooks."""

    def __init__(self, residency, metrics: ExpertMetrics, act_fn: ActFn, num_experts: int, top_k: int):
        self.residency = residency
        self.metrics = metrics
        self.act_fn = act_fn
        self.num_experts = num_experts
        self.top_k = top_k
        self.iteration = 0
        self.lowbit_kernel = None  # the grouped Triton module when lo_kernel is "triton"
        self.lowbit_max_tokens = 0  # the largest T it computes (auto: the measured range only)
        # called as on_host_ids(layer, ids (T, k) on the host) after the layer's host sync (PolicyHooks)
        self.on_host_ids = None

    def set_lo_kernel(self, kind: str, device: torch.device) -> None:
        """How lo experts in the lo pool are computed: "dequant" (batched dequantize + bf16 matmul,
        any device) or "triton" (`lowbit_triton`: packed rows straight into a fused kernel, CUDA)."""
        check_lo_kernel(kind, device)
        if kind == "auto":
            if device.type != "cuda":  # never Triton's interpreter
                self.lowbit_kernel = None
                return
            try:
                self.set_lo_kernel("triton", device)
            except ConfigError:
                self.lowbit_kernel = None  # dequant: CPU, no triton, non-SiLU experts or odd groups
                return
            self.lowbit_max_tokens = self.lowbit_kernel.AUTO_MAX_TOKENS
            return
        if kind == "dequant":
            self.lowbit_kernel = None
            return
        probe = torch.linspace(-4, 4, 9)
        if not torch.allclose(self.act_fn(probe), F.silu(probe)):
            raise ConfigError("--lo-kernel triton computes SiLU-gated experts only; use --lo-kernel dequant")
        from . import lowbit_triton

        lo_rows = self.residency.lo_pool_rows() if self.residency is not None else None
        if lo_rows is not None:
            try:
                lowbit_triton.check_layout(lo_rows[1])
            except ValueError as e:
                raise ConfigError(f"--lo-kernel triton: {e}; use --lo-kernel dequant") from None
        self.lowbit_kernel = lowbit_triton
        self.lowbit_max_tokens = lowbit_triton.MAX_TOKENS

    def decode_is_sync_free(self, num_tokens: int) -> bool:
        """Whether `run_layer` computes a `num_tokens`-token step with no host sync (and no host-side
        decision), so that the step can be captured as a CUDA graph: every expert hi-resident at a
        fixed slot, or lo-resident at a fixed slot with the fused kernel (or one token); and no
        observer waits for each layer's ids on the host (`on_host_ids`: a replay would skip it)."""
        if self.residency is None or self.on_host_ids is not None:
            return False
        static_hi = self.residency.static_hi_groups(0)
        if static_hi is not None:
            # one token: gathered bmm. More: grouped_mm, whose fused kernel takes bf16 only on CUDA;
            # for other dtypes torch loops over the groups on the host (reads offs: a host sync,
            # which made the capture fail in float32, GPU run 12)
            weights = static_hi[1]
            return num_tokens == 1 or weights.device.type != "cuda" or weights.dtype == torch.bfloat16
        if self.residency.static_lo_rows(0) is not None:
            fused = self.lowbit_kernel is not None and num_tokens <= self.lowbit_max_tokens
            return fused or num_tokens == 1
        return False

    def on_embedding(self, embeds: torch.Tensor) -> None:
        """Embedding-layer output starts a new iteration (policies observe through `PolicyHooks`)."""
        self.iteration += 1
        self.residency.begin_iteration(self.iteration)

    # -- the four stages ---------------------------------------------------------------------------------
    def run_layer(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed experts of one MoE layer: `hidden (T, H)` -> `(T, H)`."""
        static = self.residency.static_hi_groups(layer)
        if static is not None:  # every expert resident at a fixed slot: no host sync at all
            group_base, gate_up_all, down_all = static
            if hidden.device.type == "cpu":  # counting is free where there is no device to sync with
                used = int(torch.unique(top_k_index).numel())
                self.metrics.layers[layer].used += used
                self.metrics.layers[layer].hits += used
            return grouped_moe(
                hidden,
                top_k_index,
                top_k_weights,
                top_k_index + group_base,
                gate_up_all,
                down_all,
                self.act_fn,
            )
        static_lo = self.residency.static_lo_rows(layer)
        if static_lo is not None and self._lowbit_fits(hidden):  # fused kernel: no host sync
            base, arena, meta = static_lo
            pair_slot, pair_index = self.lowbit_kernel.topk_pairs(top_k_index)
            return self.lowbit_kernel.grouped_lowbit_moe(
                hidden, top_k_weights, pair_slot, pair_index, arena, meta, slot_base=base
            )
        if static_lo is not None and top_k_index.numel() <= self.top_k:  # one token: no host sync
            base, arena, meta = static_lo
            return self._pairs_from_rows(hidden, top_k_index, top_k_weights, arena, base, meta)
        ids_cpu = top_k_index.cpu()  # NOTE: host sync (counted): residency must know the experts
        self.metrics.host_syncs += 1
        if self.on_host_ids is not None:
            self.on_host_ids(layer, ids_cpu)
        experts = torch.unique(ids_cpu).tolist()
        out = None
        pending = experts
        while pending:  # more than one wave only when the pools cannot hold all `experts` at once
            resolved, pending = self.residency.acquire(layer, pending, hidden.device)
            try:
                part = self._compute(hidden, top_k_index, ids_cpu, top_k_weights, resolved)
            finally:
                self.residency.release(layer, list(resolved))
            out = part if out is None else out + part
        return out

    def _compute(self, hidden, top_k_index, ids_cpu, top_k_weights, resolved) -> torch.Tensor:
        """hi versions: one grouped matmul over the hi pool's slots. lo versions: with lo_kernel
        "triton", those in the lo pool in one grouped fused pass over their packed rows; the rest
        dequantized, at most `top_k` at a time (the dequant scratch of the budget), each chunk one
        grouped matmul."""
        pool_groups = self.residency.hi_pool_groups()
        if pool_groups is None:  # no pool to group over (direct residency on a GPU): the chunked path
            hi, lo = {}, sorted(resolved)
        else:
            hi = {e: v.slot for e, v in resolved.items() if v.precision == "hi"}
            lo = [e for e, v in resolved.items() if v.precision != "hi"]
        out = torch.zeros_like(hidden)
        if hi:
            self._grouped_into(out, hidden, ids_cpu, top_k_weights, hi, *pool_groups)
        lo_rows = self.residency.lo_pool_rows() if lo else None
        if lo_rows is not None and self._lowbit_fits(hidden):  # lo-pool versions: one fused pass
            in_pool = {e: resolved[e].slot for e in lo if resolved[e].pool == "lo"}
            if in_pool:
                out += self._lowbit_pairs(hidden, ids_cpu, top_k_weights, in_pool, *lo_rows)
            lo = [e for e in lo if e not in in_pool]
        for start in range(0, len(lo), self.top_k):
            chunk = lo[start : start + self.top_k]
            if lo_rows is not None and all(resolved[e].pool == "lo" for e in chunk):
                from .lowbit import dequantize_rows

                arena, meta = lo_rows  # the chunk's lo slots, dequantized in one batched pass
                slots = torch.tensor([resolved[e].slot for e in chunk], dtype=torch.long)
                gate_up_all, down_all = dequantize_rows(
                    arena.index_select(0, slots.to(arena.device)), meta, hidden.dtype
                )
            else:
                weights = [self._dense_weights(resolved[e], hidden.dtype) for e in chunk]
                gate_up_all = torch.stack([w[0] for w in weights])
                down_all = torch.stack([w[1] for w in weights])
            self._grouped_into(
                out,
                hidden,
                ids_cpu,
                top_k_weights,
                {e: i for i, e in enumerate(chunk)},
                gate_up_all,
                down_all,
            )
        return out

    def _lowbit_fits(self, hidden: torch.Tensor) -> bool:
        """Whether the grouped Triton kernel computes lo versions for `hidden (T, H)`: lo_kernel is
        "triton" (T <= 64) or "auto" on CUDA (T <= 16, the range measured on the H200), so decode
        batches; prefill is compute-bound and keeps dequantize + grouped matmul."""
        return self.lowbit_kernel is not None and hidden.shape[0] <= self.lowbit_max_tokens

    def _lowbit_pairs(self, hidden, ids_cpu, top_k_weights, slot_of: dict[int, int], arena, meta):
        """The pairs of the experts in `slot_of` (expert -> lo pool slot) through the grouped Triton
        kernel: `(T, H)`. Pairs are selected and sorted by slot on the host, where the ids are."""
        lookup = torch.full((self.num_experts,), -1, dtype=torch.long)
        lookup[list(slot_of)] = torch.tensor(list(slot_of.values()), dtype=torch.long)
        pair_slot = lookup[ids_cpu].reshape(-1)
        keep = (pair_slot >= 0).nonzero().squeeze(1)
        order = keep[torch.argsort(pair_slot[keep], stable=True)]
        dev = hidden.device
        return self.lowbit_kernel.grouped_lowbit_moe(
            hidden,
            top_k_weights,
            pair_slot[order].to(dev, non_blocking=True),
            order.to(dev, non_blocking=True),
            arena,
            meta,
        )

    def _pairs_from_rows(self, hidden, top_k_index, top_k_weights, arena, base, meta) -> torch.Tensor:
        """Every (token, expert) pair dequantized from its lo row and run as a batched matmul:
        `(T, H)`. Used when all lo versions sit at fixed slots and T*k fits the dequant scratch."""
        from .lowbit import dequantize_rows

        k = top_k_index.shape[1]
        rows = arena.index_select(0, top_k_index.reshape(-1) + base)  # (P, nbytes), P = T*k
        gate_up, down = dequantize_rows(rows, meta, hidden.dtype)  # (P, 2I, H), (P, H, I)
        token = torch.arange(top_k_index.numel(), device=hidden.device) // k
        x = hidden.index_select(0, token).unsqueeze(1)  # (P, 1, H)
        gate, up = torch.bmm(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)
        y = torch.bmm(self.act_fn(gate) * up, down.transpose(1, 2)).squeeze(1)  # (P, H)
        y = y * top_k_weights.reshape(-1, 1).to(y.dtype)
        return torch.zeros_like(hidden).index_add_(0, token, y.to(hidden.dtype))

    @staticmethod
    def _dense_weights(version, dtype):
        if version.precision == "hi":
            return version.views["gate_up"], version.views["down"]
        from ..store import quant

        return quant.dequantize(version.views, version.meta, dtype)

    MAX_GROUPS = 1024  # grouped_mm's limit on groups per call

    def _grouped_into(
        self, out, hidden, ids_cpu, top_k_weights, group_of: dict[int, int], gate_up_all, down_all
    ):
        """Add the experts in `group_of` (expert -> group of the weight tensors) to `out (T, H)`.
        Pairs are selected and sorted on the host (the ids are already there), so no device sync.
        Groups are windowed to the range the experts use, `MAX_GROUPS` at a time."""
        first = min(group_of.values())
        if max(group_of.values()) - first >= self.MAX_GROUPS or first > 0:
            windows: dict[int, dict[int, int]] = {}
            for e, g in group_of.items():
                windows.setdefault((g - first) // self.MAX_GROUPS, {})[e] = g
            for w, members in windows.items():
                start = first + w * self.MAX_GROUPS
                stop = min(start + self.MAX_GROUPS, gate_up_all.shape[0])
                self._grouped_into(
                    out,
                    hidden,
                    ids_cpu,
                    top_k_weights,
                    {e: g - start for e, g in members.items()},
                    gate_up_all[start:stop],
                    down_all[start:stop],
                )
            return
        lookup = torch.full((self.num_experts,), -1, dtype=torch.long)
        lookup[list(group_of)] = torch.tensor(list(group_of.values()), dtype=torch.long)
        pair_group = lookup[ids_cpu].reshape(-1)
        keep = (pair_group >= 0).nonzero().squeeze(1)
        order = keep[torch.argsort(pair_group[keep], stable=True)]
        offs = torch.bincount(pair_group[order], minlength=gate_up_all.shape[0]).cumsum(0).to(torch.int32)
        dev = hidden.device
        order_dev = order.to(dev, non_blocking=True)
        pair_weights = top_k_weights.reshape(-1).index_select(0, order_dev)
        pair_token = (order // ids_cpu.shape[1]).to(dev, non_blocking=True)
        if order.numel() <= self.top_k:  # decode batch 1: gather + bmm beats a sparse grouped_mm
            pair_group = pair_group[order].to(dev, non_blocking=True)
            out += gathered_pairs(
                hidden, pair_weights, pair_token, pair_group, gate_up_all, down_all, self.act_fn
            )
            return
        out += grouped_pairs(
            hidden,
            pair_weights,
            pair_token,
            offs.to(dev, non_blocking=True),
            gate_up_all,
            down_all,
            self.act_fn,
        )


class ManagedExperts(nn.Module):
    """Drop-in for transformers' `<Family>Experts`: `forward(hidden (T,H), top_k_index (T,k),
    top_k_weights (T,k)) -> (T,H)`. Holds no weights; the runtime's residency core provides them."""

    def __init__(self, layer: int, runtime: ExpertRuntime):
        super().__init__()
        self.layer = layer
        self.runtime = runtime

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.runtime.run_layer(self.layer, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.runtime.num_experts}, top_k={self.runtime.top_k}"
