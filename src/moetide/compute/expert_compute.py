"""Expert math in plain PyTorch: the readable per-expert reference of the fused kernel.

Shapes: T tokens, H hidden, I expert intermediate, k experts per token, n distinct experts this step.
    hidden        (T, H)   compute dtype
    top_k_index   (T, k)   int64, expert ids chosen by the router
    top_k_weights (T, k)   routing weights (fp32 for Mixtral/DeepSeek, compute dtype otherwise)
    expert weights: gate_up (2I, H), down (H, I)
"""

from __future__ import annotations

import time
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


LANDING_TIMEOUT_S = 30.0


def wait_for_landing(landed: torch.Tensor, slot: int, number: int) -> None:
    """Until copy `number` has landed in `slot` (`landed[slot] == number`); the CPU's part of what the
    fused kernel's programs do on the device. A copy that never lands is a bug: RuntimeError."""
    deadline = time.monotonic() + LANDING_TIMEOUT_S
    while int(landed[slot]) != number:
        if time.monotonic() > deadline:
            raise RuntimeError(f"copy {number} never landed in slot {slot} (it holds {int(landed[slot])})")
        time.sleep(20e-6)


def reference_moe(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    pool_of: torch.Tensor,
    slot_of: torch.Tensor,
    pools: list,
    act_fn: ActFn,
    waits: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """The per-expert reference of the fused kernel (`fused_moe.fused_moe`), in plain PyTorch: each
    used expert's weights read through the slot table (`pool_of` (E,), `slot_of` (E,) or one row
    per pool (P, E): see `slot_table.slot_in_pool`) from its
    `slot_table.Pool`, dequantized if packed, run on its tokens and combined in transformers' order.
    Experts with no pool add nothing. -> `(T, H)`. It reads the used ids on the host: the CPU
    engine's path (no device to sync with) and the tests' reference, never a CUDA decode step.
    `waits` (`wait_of` (E,), `landed` (slots,), pool id): an expert in that pool whose `wait_of` is
    not 0 is read only once `landed[slot]` says its copy has landed (the copy worker writes it)."""
    used = torch.unique(top_k_index).tolist()
    pool_ids = pool_of.tolist()  # read once: the slot of each expert is then read in its pool's row
    present = [e for e in used if 0 <= pool_ids[e] < len(pools) and pools[pool_ids[e]] is not None]
    slots = {e: int(slot_in_pool(slot_of, pool_ids[e], e)) for e in present}
    if waits is not None:
        wait_of, landed, wait_pool = waits
        for e in present:
            if pool_ids[e] == wait_pool and int(wait_of[e]):
                wait_for_landing(landed, slots[e], int(wait_of[e]))

    def run_expert(e: int, x: torch.Tensor) -> torch.Tensor:  # one expert's dense weights at a time
        return expert_mlp(x, *pools[pool_ids[e]].weights(slots[e], hidden.dtype), act_fn)

    return combine_experts(hidden, top_k_index, top_k_weights, run_expert, present)
