"""Expert math in plain PyTorch: the readable per-expert reference of the fused kernel.

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

from ..residency.slot_table import slot_in_pool

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
    used expert's weights read through the slot table (`pool_of` (E,), `slot_of` (E,) or one row
    per pool (P, E): see `slot_table.slot_in_pool`) from its
    `slot_table.Pool`, dequantized if packed, run on its tokens and combined in transformers' order.
    Experts with no pool add nothing. -> `(T, H)`. It reads the used ids on the host: the CPU
    engine's path (no device to sync with) and the tests' reference, never a CUDA decode step."""
    used = torch.unique(top_k_index).tolist()
    pool_ids = pool_of.tolist()  # read once: the slot of each expert is then read in its pool's row
    present = [e for e in used if 0 <= pool_ids[e] < len(pools) and pools[pool_ids[e]] is not None]
    slots = {e: int(slot_in_pool(slot_of, pool_ids[e], e)) for e in present}

    def run_expert(e: int, x: torch.Tensor) -> torch.Tensor:  # one expert's dense weights at a time
        return expert_mlp(x, *pools[pool_ids[e]].weights(slots[e], hidden.dtype), act_fn)

    return combine_experts(hidden, top_k_index, top_k_weights, run_expert, present)
