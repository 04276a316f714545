"""Expert math: the stages route -> compute -> combine, as pure functions over tensors.

Shapes: T tokens, H hidden, I expert intermediate, k experts per token, n distinct experts this step.
    hidden        (T, H)   compute dtype
    top_k_index   (T, k)   int64, expert ids chosen by the router
    top_k_weights (T, k)   routing weights (fp32 for Mixtral/DeepSeek, compute dtype otherwise)
    expert weights: gate_up (2I, H), down (H, I)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ActFn = Callable[[torch.Tensor], torch.Tensor]


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn: ActFn) -> torch.Tensor:
    """One expert on its tokens: `x (t, H)` -> `(t, H)`; `down(act(gate(x)) * up(x))`."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act_fn(gate) * up, down)


def combine_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    run_expert: Callable[[int, torch.Tensor], torch.Tensor],
    experts: list[int],
) -> torch.Tensor:
    """Weighted sum over each token's experts: `(T, H)`.

    `run_expert(e, x (t, H)) -> (t, H)` computes expert e. Experts are visited in ascending id and
    accumulated with `index_add_` in the same order as transformers' eager experts, so that fp32
    results match transformers bit for bit.
    """
    out = torch.zeros_like(hidden)
    for e in experts:
        token_idx, k_pos = torch.where(top_k_index == e)
        if token_idx.numel() == 0:
            continue
        y = run_expert(e, hidden[token_idx]) * top_k_weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def grouped_moe(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    group_ids: torch.Tensor,
    gate_up_all: torch.Tensor,
    down_all: torch.Tensor,
    act_fn: ActFn,
) -> torch.Tensor:
    """All of a layer's routed experts with no host sync: `(T, H)`.

    group_ids (T, k): the group (a slot of `gate_up_all (G, 2I, H)` / `down_all (G, H, I)`) holding
    each chosen expert. Token-expert pairs are sorted by group so that each group's rows are
    contiguous; `offs` marks where each group's rows end (empty groups cost nothing).
    """
    k = top_k_index.shape[1]
    flat = group_ids.reshape(-1)
    if flat.numel() <= k:  # one token: gather its k experts, no sort needed
        pair_token = torch.zeros_like(flat)
        return gathered_pairs(
            hidden, top_k_weights.reshape(-1), pair_token, flat, gate_up_all, down_all, act_fn
        )
    order = torch.argsort(flat, stable=True)
    offs = group_ends(flat.index_select(0, order), gate_up_all.shape[0])
    return grouped_pairs(
        hidden,
        top_k_weights.reshape(-1).index_select(0, order),
        order // k,
        offs,
        gate_up_all,
        down_all,
        act_fn,
    )


def group_ends(sorted_groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """`(G,)` int32: where each group's pairs end in `sorted_groups (N,)` (ascending group ids).
    A binary search on the device: unlike `bincount`, no host sync (CUDA graphs can capture it)."""
    bounds = torch.arange(num_groups, device=sorted_groups.device, dtype=sorted_groups.dtype)
    return torch.searchsorted(sorted_groups, bounds, right=True).to(torch.int32)


def gathered_pairs(
    hidden: torch.Tensor,
    pair_weights: torch.Tensor,
    pair_token: torch.Tensor,
    pair_group: torch.Tensor,
    gate_up_all: torch.Tensor,
    down_all: torch.Tensor,
    act_fn: ActFn,
) -> torch.Tensor:
    """Few pairs (P <= top_k): gather each pair's expert weights and run two batched matmuls.

    At decode batch 1, grouped_mm over mostly empty groups is launch- and tile-bound (measured on
    the H200: see BENCHMARKS.md); copying P experts' weights (P * expert bytes of scratch) and one
    `bmm` each way is faster. -> `(T, H)`.
    """
    gate_up = gate_up_all.index_select(0, pair_group)  # (P, 2I, H)
    down = down_all.index_select(0, pair_group)  # (P, H, I)
    x = hidden.index_select(0, pair_token).unsqueeze(1)  # (P, 1, H)
    gate, up = torch.bmm(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(act_fn(gate) * up, down.transpose(1, 2)).squeeze(1)  # (P, H)
    y = y * pair_weights.unsqueeze(1).to(y.dtype)
    return torch.zeros_like(hidden).index_add_(0, pair_token, y.to(hidden.dtype))


def grouped_pairs(
    hidden: torch.Tensor,
    pair_weights: torch.Tensor,
    pair_token: torch.Tensor,
    offs: torch.Tensor,
    gate_up_all: torch.Tensor,
    down_all: torch.Tensor,
    act_fn: ActFn,
) -> torch.Tensor:
    """Token-expert pairs already sorted by group: `pair_token (N,)` token of each pair,
    `pair_weights (N,)` its routing weight, `offs (G,)` int32 end of each group's pairs. -> `(T, H)`."""
    x = hidden.index_select(0, pair_token)
    gate_up = F.grouped_mm(x, gate_up_all.transpose(1, 2), offs=offs)
    gate, up = gate_up.chunk(2, dim=-1)
    y = F.grouped_mm(act_fn(gate) * up, down_all.transpose(1, 2), offs=offs)
    y = y * pair_weights.unsqueeze(1).to(y.dtype)
    out = torch.zeros_like(hidden)
    return out.index_add_(0, pair_token, y.to(out.dtype))


def reference_moe(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    pool_of: torch.Tensor,
    slot_of: torch.Tensor,
    pools: list,
    act_fn: ActFn,
) -> torch.Tensor:
    """The per-expert reference of the fused kernel (`fused_moe.fused_moe`), in plain PyTorch: each
    used expert's weights read through the slot table (`pool_of`, `slot_of` (E,)) from its
    `slot_table.Pool`, dequantized if packed, run on its tokens and combined in transformers' order.
    Experts with no pool add nothing. -> `(T, H)`. It reads the used ids on the host: the CPU
    engine's path (no device to sync with) and the tests' reference, never a CUDA decode step."""
    used = torch.unique(top_k_index).tolist()
    pool_ids, slots = pool_of.tolist(), slot_of.tolist()
    weights = {}
    for e in used:
        if 0 <= pool_ids[e] < len(pools):
            weights[e] = pools[pool_ids[e]].weights(slots[e], hidden.dtype)

    def run_expert(e: int, x: torch.Tensor) -> torch.Tensor:
        return expert_mlp(x, *weights[e], act_fn)

    return combine_experts(hidden, top_k_index, top_k_weights, run_expert, list(weights))
