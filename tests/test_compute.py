"""The slot-table reference path equals the readable reference loop (transformers' order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetide.compute.expert_compute import combine_experts, expert_mlp, reference_moe
from moetide.residency.slot_table import Pool, dense_format, packed_format
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


def _dense_pool(gate_up, down, rows, slots):
    """A dense `Pool` of `rows` random rows, with experts e at rows slots[e]."""
    num, inter2, hidden = gate_up.shape
    filler_gu, filler_dn = _experts(rows, inter2 // 2, hidden, seed=99)
    filler_gu[slots], filler_dn[slots] = gate_up, down
    arena = torch.cat([filler_gu.reshape(rows, -1), filler_dn.reshape(rows, -1)], dim=1).view(torch.uint8)
    return Pool(arena.contiguous(), dense_format(hidden, inter2 // 2, torch.float32))


@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_table_reference_equals_the_reference_loop(tokens):
    """The slot-table reference reads each expert from its (pool, slot), bit for bit in fp32."""
    num, k, hidden, inter = 8, 2, 32, 16
    gate_up, down = _experts(num, inter, hidden, seed=tokens)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(num, generator=g)[:k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    slots = torch.tensor([13, 2, 19, 5, 0, 9, 7, 11])
    pool = _dense_pool(gate_up, down, 20, slots)
    got = reference_moe(x, ids, w, torch.zeros(num, dtype=torch.int32), slots.int(), [pool], F.silu)
    torch.testing.assert_close(got, _reference(x, ids, w, gate_up, down), atol=0, rtol=0)


def test_experts_without_a_pool_add_nothing():
    num, k, hidden, inter = 6, 2, 32, 16
    gate_up, down = _experts(num, inter, hidden, seed=7)
    pool = _dense_pool(gate_up, down, num, torch.arange(num))
    x = torch.randn(5, hidden)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 4], [5, 0]])
    w = torch.rand(5, k)
    pool_of = torch.tensor([0, -1, 0, 0, -1, 0], dtype=torch.int32)
    got = reference_moe(x, ids, w, pool_of, torch.arange(num, dtype=torch.int32), [pool], F.silu)
    kept = torch.where(pool_of[ids] >= 0, w, torch.zeros_like(w))
    torch.testing.assert_close(got, _reference(x, ids, kept, gate_up, down), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("precision", ["int4", "int2"])
def test_packed_pool_rows_dequantize_as_the_store_does(precision):
    gate_up, down = _experts(3, 32, 64, seed=3)
    rows, meta = [], None
    for e in range(3):
        buf, meta = quant.pack_expert(gate_up[e], down[e], precision)
        rows.append(buf)
    pool = Pool(torch.stack(rows), packed_format(meta, torch.float32))
    for e in range(3):
        one_gu, one_dn = quant.dequantize(quant.expert_views(rows[e], meta), meta, torch.float32)
        got_gu, got_dn = pool.weights(e, torch.float32)
        torch.testing.assert_close(got_gu, one_gu, atol=0, rtol=0)
        torch.testing.assert_close(got_dn, one_dn, atol=0, rtol=0)
