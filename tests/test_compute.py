"""The fast expert paths equal the readable reference loop (transformers' order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetide.compute.expert_compute import combine_experts, expert_mlp, grouped_moe
from moetide.compute.lowbit import dequantize_rows
from moetide.store import quant


def _experts(num: int, inter: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num, 2 * inter, hidden, generator=g) * 0.1, torch.randn(
        num, hidden, inter, generator=g
    ) * 0.1


def _reference(hidden, ids, weights, gate_up, down):
    def run(e, x):
        return expert_mlp(x, gate_up[e], down[e], F.silu)

    return combine_experts(hidden, ids, weights, run, torch.unique(ids).tolist())


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_grouped_and_gathered_paths_equal_the_reference_loop(tokens):
    num, k, hidden, inter = 8, 2, 32, 16
    gate_up, down = _experts(num, inter, hidden, seed=tokens)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(num, generator=g)[:k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    got = grouped_moe(x, ids, w, ids, gate_up, down, F.silu)  # tokens == 1 takes the gather + bmm path
    torch.testing.assert_close(got, _reference(x, ids, w, gate_up, down), atol=1e-5, rtol=1e-5)


def test_groups_can_be_slots_of_a_larger_pool():
    """The expert -> group map may point anywhere in a pool (offloaded experts live in arbitrary slots)."""
    num, k, hidden, inter = 6, 2, 32, 16
    gate_up, down = _experts(num, inter, hidden, seed=7)
    pool_gu, pool_dn = _experts(20, inter, hidden, seed=8)
    slots = torch.tensor([13, 2, 19, 5, 0, 9])
    pool_gu[slots], pool_dn[slots] = gate_up, down
    x = torch.randn(5, hidden)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 4], [5, 0]])
    w = torch.rand(5, k)
    got = grouped_moe(x, ids, w, slots[ids], pool_gu, pool_dn, F.silu)
    torch.testing.assert_close(got, _reference(x, ids, w, gate_up, down), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["int4", "int2"])
def test_batched_row_dequantization_equals_the_per_expert_one(precision):
    gate_up, down = _experts(3, 32, 64, seed=3)
    rows, metas = [], []
    for e in range(3):
        buf, meta = quant.pack_expert(gate_up[e], down[e], precision)
        rows.append(buf)
        metas.append(meta)
    batched_gu, batched_dn = dequantize_rows(torch.stack(rows), metas[0], torch.float32)
    for e in range(3):
        one_gu, one_dn = quant.dequantize(quant.expert_views(rows[e], metas[e]), metas[e], torch.float32)
        torch.testing.assert_close(batched_gu[e], one_gu, atol=0, rtol=0)
        torch.testing.assert_close(batched_dn[e], one_dn, atol=0, rtol=0)
