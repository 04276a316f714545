"""Expert math: the stages route -> compute -> combine, as pure functions over tensors.

Shapes: T tokens, H hidden, I expert intermediate, k experts per token, n distinct experts this step.
    hidden        (T, H)   compute dtype
    top_k_index   (T, k)   int64, expert ids chosen by the router
    top_k_weights (T, k)   routing weights (fp32 for Mixtral/DeepSeek, compute dtype otherwise)
    expert weights: gate_up (2I, H), down (H, I)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

ActFn = Callable[[torch.Tensor], torch.Tensor]


def distinct_experts(top_k_index: torch.Tensor) -> list[int]:
    """Sorted distinct expert ids in `top_k_index (T, k)`.

    NOTE: host sync — the residency core must know which experts to make resident.
    """
    return torch.unique(top_k_index).tolist()


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


def combine_with_weights(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
    act_fn: ActFn,
) -> torch.Tensor:
    """`combine_experts` with resident bf16/fp32 weights `{e: (gate_up, down)}`: `(T, H)`."""

    def run(e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = weights[e]
        return expert_mlp(x, gate_up, down, act_fn)

    return combine_experts(hidden, top_k_index, top_k_weights, run, sorted(weights))
