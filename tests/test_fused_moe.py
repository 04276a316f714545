"""The fused MoE kernel (`compute/fused_moe.py`) equals the per-expert PyTorch reference, for any
number of tokens, every slot format (dense, int4, int2, int2 gate_up + int4 down), slot tables
that mix pools in one layer and each packed tile product (`fused_moe.PACKED_TILES`: the default in
every test, the others in `test_fused_kernel_packed_tile_products`).

Kernel tests run compiled on CUDA; on CPU they run under Triton's interpreter in a fresh process
(`test_fused_kernel_under_interpreter`; see `triton_interpreter.py`).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import (
    CUDA,
    HAS_TRITON,
    INTERPRETING,
    assert_kernel_tests_passed,
    kernel_device,
    kernel_module,
)

from moetide.compute.expert_compute import reference_moe
from moetide.compute.fused_moe_config import KernelConfig, config_for, default_config, t_bucket
from moetide.residency.slot_table import NOT_RESIDENT, Pool, dense_format, packed_format
from moetide.store import quant

MIN_INTERPRETER_PASSES = 55


@pytest.fixture(scope="module")
def kernel():
    return kernel_module("moetide.compute.fused_moe", "test_fused_kernel_under_interpreter")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(CUDA or INTERPRETING, reason="the kernel tests run in this process")
def test_fused_kernel_under_interpreter(interpreter_run):
    assert_kernel_tests_passed(interpreter_run, "test_fused_moe.py", MIN_INTERPRETER_PASSES)


def random_expert(inter, hidden, g):
    return torch.randn(2 * inter, hidden, generator=g) * 0.05, torch.randn(hidden, inter, generator=g) * 0.05


def make_pool(num_rows, inter, hidden, precision, dtype, seed=0, group_size=None):
    """A `Pool` of `num_rows` random experts: dense rows in `dtype` ("hi") or packed rows."""
    g = torch.Generator().manual_seed(seed)
    rows, meta = [], None
    for _ in range(num_rows):
        gate_up, down = random_expert(inter, hidden, g)
        if precision == "hi":
            gate_up, down = gate_up.to(dtype), down.to(dtype)
        buf, meta = quant.pack_expert(gate_up, down, precision, group_size=group_size, quant_method="rtn")
        rows.append(buf)
    arena = torch.stack(rows).to(kernel_device())
    if precision == "hi":
        return Pool(arena, dense_format(hidden, inter, dtype))
    return Pool(arena, packed_format(meta, dtype))


def mixed_pool(num_rows, inter, hidden, dtype, seed=0):
    """Packed rows with int2 gate_up and int4 down (per-tensor precision), built from an int4 and an
    int2 layout: the down matrix of the int4 version is copied into a row laid out for both."""
    g = torch.Generator().manual_seed(seed)
    gu_meta = dn_meta = None
    rows = []
    for _ in range(num_rows):
        gate_up, down = random_expert(inter, hidden, g)
        lo2, gu_meta = quant.pack_expert(gate_up, down, "int2", quant_method="rtn")
        lo4, dn_meta = quant.pack_expert(gate_up, down, "int4", quant_method="rtn")
        rows.append(torch.cat([lo2, lo4]))
    arena = torch.stack(rows).to(kernel_device())
    f2, f4 = packed_format(gu_meta, dtype), packed_format(dn_meta, dtype)
    shift_u8, shift_f16 = gu_meta.nbytes, gu_meta.nbytes // 2
    down = type(f4.down)(
        f4.down.bits,
        f4.down.group_size,
        f4.down.data_offset + shift_u8,
        f4.down.scale_offset + shift_f16,
        f4.down.offset_offset + shift_f16,
    )
    return Pool(arena, type(f2)(f2.gate_up, down, hidden, inter, dtype))


def routing(num_tokens, num_experts, top_k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, ids = torch.topk(F.softmax(logits, dim=-1), top_k, dim=-1)
    dev = kernel_device()
    return ids.to(dev), weights.to(dtype).to(dev)


def table(num_experts, pools_rows, seed):
    """A mixed slot table: each expert in a random pool (or none) at a random distinct row."""
    g = torch.Generator().manual_seed(seed)
    pool_of = torch.randint(-1, len(pools_rows), (num_experts,), generator=g, dtype=torch.int32)
    slot_of = torch.zeros(num_experts, dtype=torch.int32)
    for p, rows in enumerate(pools_rows):
        members = (pool_of == p).nonzero().flatten()
        slot_of[members] = torch.randperm(rows, generator=g)[: members.numel()].to(torch.int32)
    dev = kernel_device()
    return pool_of.to(dev), slot_of.to(dev)


def assert_close(out, ref, dtype):
    assert not torch.isnan(out).any()
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), float(err)


def assert_same_up_to_summation_order(out, other):
    """Two paths that sum the same float32 products in another order: equal to float32 rounding, and
    to a flipped last bit of a few elements once rounded to bf16 / fp16."""
    err = (out.double() - other.double()).norm() / other.double().norm().clamp_min(1e-12)
    assert err < (1e-5 if out.dtype == torch.float32 else 4e-3), float(err)


E, TOP_K, H, I = 8, 2, 64, 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 33, 256, 2048])
def test_fused_kernel_mixed_table(kernel, dtype, num_tokens):
    """hi, int4 and int2+4 pools in one layer, some experts in none: equals the reference."""
    pools = [
        make_pool(6, I, H, "hi", dtype, seed=1),
        make_pool(5, I, H, "int4", dtype, seed=2),
        mixed_pool(4, I, H, dtype, seed=3),
    ]
    pool_of, slot_of = table(E, [6, 5, 4], seed=num_tokens)
    ids, weights = routing(num_tokens, E, TOP_K, dtype, seed=num_tokens)
    hidden = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(7)).to(dtype)
    hidden = hidden.to(kernel_device())
    out = kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, pools)
    ref = reference_moe(hidden, ids, weights, pool_of, slot_of, pools, F.silu)
    assert out.shape == hidden.shape and out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize(
    "packed_tile,dtype",
    [("v3", d) for d in (torch.float32, torch.bfloat16, torch.float16)]
    + [(t, d) for t in ("v4", "v5", "v6", "v7") for d in (torch.bfloat16, torch.float16)]
    + [("v4", torch.float32), ("v6", torch.float32), ("v7", torch.float32)],
)
@pytest.mark.parametrize("num_tokens", [1, 3, 33, 80])
def test_fused_kernel_packed_tile_products(kernel, packed_tile, dtype, num_tokens):
    """The factored packed tile products equal the reference for int4, int2 and int2 gate_up + int4 down
    pools beside a dense one in one layer: GEMV tiles (T=1), 16-row blocks with a padded last block
    (T=3, 33) and 64-row blocks (T=80). H=128, I=64: int2's tiles take tl.dot in both projections
    (16 bytes of codes per K-tile), gate_up has two K-tiles per row, inside one group (int2) or one
    group each (int4). v3 converts the codes without int-to-float conversions (float16 exercises it
    under the interpreter, bfloat16 on CUDA: the interpreter's bf16 takes float32 codes); v6's
    GEMV tiles set them into float32 mantissas and sum once (every dtype at T=1), v7's over a whole
    K-step of groups at once."""
    # under the interpreter bf16 codes take v3's float32 path (its bf16 arithmetic is wrong)
    if not CUDA and dtype == torch.bfloat16 and packed_tile in ("v4", "v5", "v6", "v7"):
        pytest.skip("CUDA only: under the interpreter the same path as v3's bf16 case")
    if not CUDA and packed_tile in ("v6", "v7") and num_tokens > 1:
        pytest.skip("CUDA only: under the interpreter v6's and v7's dot tiles are v5's (float16) or v3's (float32) case")
    hidden_size, inter = 128, 64
    pools = [
        make_pool(3, inter, hidden_size, "hi", dtype, seed=1),
        make_pool(3, inter, hidden_size, "int4", dtype, seed=2),
        make_pool(3, inter, hidden_size, "int2", dtype, seed=3),
        mixed_pool(3, inter, hidden_size, dtype, seed=4),
    ]
    pool_of, slot_of = table(E, [3, 3, 3, 3], seed=num_tokens)
    ids, weights = routing(num_tokens, E, TOP_K, dtype, seed=num_tokens)
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(7)).to(dtype)
    hidden = hidden.to(kernel_device())
    out = kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, pools, packed_tile=packed_tile)
    ref = reference_moe(hidden, ids, weights, pool_of, slot_of, pools, F.silu)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


def test_fused_kernel_packed_tile_names(kernel):
    pools = [make_pool(2, I, H, "int4", torch.float32)]
    ids, weights = routing(2, E, TOP_K, torch.float32, seed=9)
    pool_of = torch.zeros(E, dtype=torch.int32, device=kernel_device())
    hidden = torch.randn(2, H).to(kernel_device())
    with pytest.raises(ValueError, match="packed_tile"):
        kernel.fused_moe(hidden, ids, weights, pool_of, pool_of, pools, packed_tile="v0")
    from moetide.compute.fused_moe_config import _table

    assert {c.packed_tile for c in _table().values()} <= set(kernel.PACKED_TILES)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_fused_kernel_ladder_table_reads_its_middle_pool(kernel, num_tokens):
    """A three-tier ladder's pools as the residency lists them: hi (id 0), lo int2 (1), no host pool
    (2), the middle tier int4 (3), one slot row per pool. The kernel computes every pool's experts,
    the third's included (other weights in its slots change the output), and equals the reference."""
    dtype, dev = torch.float32, kernel_device()
    pools = [make_pool(3, I, H, "hi", dtype, seed=1), make_pool(E, I, H, "int2", dtype, seed=2), None,
             make_pool(4, I, H, "int4", dtype, seed=3)]  # fmt: skip
    pool_of = torch.tensor([0, 3, 1, 3, 1, 0, 3, NOT_RESIDENT], dtype=torch.int32, device=dev)
    slot_of = torch.zeros(4, E, dtype=torch.int32)
    slot_of[0, [0, 5]] = torch.tensor([2, 0], dtype=torch.int32)
    slot_of[1] = torch.arange(E, dtype=torch.int32)
    slot_of[3, [1, 3, 6]] = torch.tensor([3, 0, 1], dtype=torch.int32)
    slot_of = slot_of.to(dev)
    pairs = torch.tensor([[1, 0], [3, 2], [6, 7], [5, 4]])
    ids = pairs.repeat(-(-num_tokens // 4), 1)[:num_tokens].to(dev)
    weights = torch.rand(num_tokens, TOP_K, generator=torch.Generator().manual_seed(5)).to(dev)
    hidden = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(6)).to(dev)
    out = kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, pools)
    assert_close(out, reference_moe(hidden, ids, weights, pool_of, slot_of, pools, F.silu), dtype)
    other = [*pools[:3], make_pool(4, I, H, "int4", dtype, seed=4)]
    assert not torch.allclose(kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, other), out)


@pytest.mark.parametrize("precision", ["int4", "int2"])
@pytest.mark.parametrize(
    "config,num_tokens,packed_tile",
    [(KernelConfig(1, 16, 32), 5, None), (KernelConfig(16, 32, 64), 5, None), (KernelConfig(32, 16, 16), 5, None),
     (KernelConfig(1, 32, 64), 2, "v6"), (KernelConfig(1, 32, 64), 2, "v7"), (KernelConfig(1, 16, 128), 1, "v7"),
     (KernelConfig(16, 32, 64), 2, None)],
)  # fmt: skip
def test_fused_kernel_tiles(kernel, precision, config, num_tokens, packed_tile):
    """Every tile shape computes the same function: K-steps of one group (16, 32) or two (64: gate_up's
    K is 64, down's 32, cut to 32), GEMV tiles (the table's product, and v6's partial sums, whose
    words hold 16 int2 / 8 int4 codes: 2 or 4 words per group; v7's whole K-steps of two groups, or of
    one group cut short at down's K of 32), and dot tiles over sorted blocks
    (5 tokens) or over one-pair blocks (2 tokens, no sort; int2's 64-wide steps of 32-code groups
    leave it GEMV tiles)."""
    pools = [make_pool(E, I, H, precision, torch.float32, seed=4, group_size=32)]
    pool_of = torch.arange(E, dtype=torch.int32, device=kernel_device())
    slot_of = torch.arange(E - 1, -1, -1, dtype=torch.int32, device=kernel_device())
    ids, weights = routing(num_tokens, E, TOP_K, torch.float32, seed=5)
    hidden = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(8)).to(kernel_device())
    out = kernel.fused_moe(hidden, ids, weights, pool_of * 0, slot_of, pools, config=config, packed_tile=packed_tile)
    ref = reference_moe(hidden, ids, weights, pool_of * 0, slot_of, pools, F.silu)
    assert_close(out, ref, torch.float32)


WIDE_I = 128  # four slices of the narrowest one-launch width


# every (dtype, T, slices, tile product) on CUDA; a cover of each under the interpreter (CPU time)
ONE_LAUNCH_CASES = (
    [(d, t, s, v) for d in (torch.float32, torch.bfloat16) for t in (1, 3, 16)
     for s, v in ((32, "v6"), (64, "v7"), (64, "v1"), (32, "v3"))]
    if CUDA
    else [(torch.float32, 1, 32, "v6"), (torch.bfloat16, 1, 64, "v6"), (torch.float32, 1, 64, "v7"),
          (torch.bfloat16, 3, 64, "v1"), (torch.float32, 5, 32, "v3")]
)  # fmt: skip


@pytest.mark.parametrize("dtype,num_tokens,split_i,packed_tile", ONE_LAUNCH_CASES)
def test_the_one_launch_path_equals_the_reference_and_the_two_launch_path(kernel, dtype, num_tokens, split_i,
                                                                          packed_tile, monkeypatch):  # fmt: skip
    """GEMV tiles with `split_i`: one `_fused_gemv_kernel` launch per pool (gate_up, SiLU·mul and down
    for a slice of I per program; the reduce sums the slices), for a table mixing hi, int4 and int2+4
    pools and experts without a version: equals the reference, and the two-launch path to float32
    summation order."""
    launches = []
    real = kernel._fused_gemv_kernel
    monkeypatch.setattr(kernel, "_fused_gemv_kernel", type("Spy", (), {"__getitem__": lambda _, grid: (
        launches.append(grid), real[grid])[1]})())  # fmt: skip
    pools = [make_pool(6, WIDE_I, H, "hi", dtype, seed=1), make_pool(5, WIDE_I, H, "int4", dtype, seed=2),
             mixed_pool(4, WIDE_I, H, dtype, seed=3)]  # fmt: skip
    pool_of, slot_of = table(E, [6, 5, 4], seed=num_tokens)
    assert (pool_of == NOT_RESIDENT).any()
    ids, weights = routing(num_tokens, E, TOP_K, dtype, seed=num_tokens)
    hidden = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(7)).to(dtype).to(kernel_device())
    one = KernelConfig(1, 64, 64, 4, 2, packed_tile=packed_tile, split_i=split_i)
    out = kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, pools, config=one)
    assert launches == [(num_tokens * TOP_K, WIDE_I // split_i)] * 3
    two = kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, pools, config=replace(one, split_i=0))
    assert len(launches) == 3
    assert_close(out, reference_moe(hidden, ids, weights, pool_of, slot_of, pools, F.silu), dtype)
    assert_same_up_to_summation_order(out, two)


def test_the_one_launch_path_is_shared_by_a_layers_pools_and_bounded():
    """Every pool of a layer takes the lead (lo) pool's slices, halved until they divide I; the one
    launch needs GEMV tiles and at most FUSED_MAX_TOKENS tokens."""
    from moetide.compute import fused_moe as fm
    from moetide.compute.fused_moe_config import FUSED_MAX_TOKENS

    hi = make_pool(1, 96, 64, "hi", torch.float32)
    lo = make_pool(1, 96, 64, "int4", torch.float32)
    lead = KernelConfig(1, 128, 64, split_i=64)
    own = KernelConfig(1, 16, 256)
    assert fm.pool_configs(1, [hi, lo], [own, lead]) == [replace(own, split_i=32, block_n=128), replace(lead, split_i=32)]
    assert fm.pool_configs(FUSED_MAX_TOKENS + 1, [hi, lo], [own, lead]) == [own, replace(lead, split_i=0)]
    assert fm.pool_configs(1, [hi, lo], [replace(own, block_m=16), replace(lead, split_i=0, block_m=16)])[1].split_i == 0
    assert fm._shared_split(128, 1408) == 128 and fm._shared_split(64, 96) == 32 and fm._shared_split(32, 48) == 0
    with pytest.raises(ValueError, match="split_i"):
        KernelConfig(16, 64, 64, split_i=64)
    with pytest.raises(ValueError, match="split_i"):
        KernelConfig(1, 64, 64, split_i=16)


def test_the_scratch_bound_holds_the_one_launch_paths_per_slice_outputs():
    """`moe_scratch_bytes` at the largest prefill covers the one-launch path's intermediate and
    per-(pair, slice) outputs at FUSED_MAX_TOKENS tokens on the narrowest slices."""
    from types import SimpleNamespace

    from moetide.compute.fused_moe_config import FUSED_MAX_TOKENS, MIN_SPLIT_I, moe_scratch_bytes
    from moetide.residency import MAX_PREFILL_TOKENS

    for hidden, inter, experts, top_k in ((2048, 1024, 64, 8), (64, 4096, 4, 2), (2048, 1408, 60, 4)):
        cfg = SimpleNamespace(num_experts_per_tok=top_k, num_experts=experts, hidden_size=hidden)
        expert_bytes = 3 * hidden * inter * 2
        pairs = FUSED_MAX_TOKENS * top_k
        need = pairs * inter * 2 + pairs * (inter // MIN_SPLIT_I) * hidden * 4
        assert moe_scratch_bytes(cfg, expert_bytes, MAX_PREFILL_TOKENS) >= need
        assert moe_scratch_bytes(cfg, expert_bytes, FUSED_MAX_TOKENS) >= need


@pytest.mark.parametrize("num_tokens,split_i", [(1, 0), (5, 0), (2, 32)])
def test_fused_kernel_reads_no_output_row_of_a_pair_without_a_version(kernel, num_tokens, split_i, monkeypatch):
    """The per-pair (per-slice) outputs are never filled: a pair whose expert has no version (pool -1)
    leaves its rows as they were, NaN here, and the reduce must not read them."""
    monkeypatch.setattr(kernel, "_pair_outputs", lambda p, h, dev: torch.full((p, h), float("nan"), device=dev))
    inter = WIDE_I if split_i else I
    pools = [make_pool(E, inter, H, "hi", torch.float32), make_pool(E, inter, H, "int2", torch.float32, seed=1)]
    pool_of, slot_of = table(E, [E, E], seed=13)
    assert (pool_of == NOT_RESIDENT).any() and (pool_of >= 0).any()
    ids, weights = routing(num_tokens, E, TOP_K, torch.float32, seed=14)
    hidden = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(15)).to(kernel_device())
    config = KernelConfig(1, 64, 64, split_i=split_i, packed_tile="v6") if split_i else None
    out = kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, pools, config=config)
    assert_close(out, reference_moe(hidden, ids, weights, pool_of, slot_of, pools, F.silu), torch.float32)


def test_fused_kernel_empty_table_adds_nothing(kernel):
    pools = [make_pool(2, I, H, "hi", torch.float32)]
    pool_of = torch.full((E,), NOT_RESIDENT, dtype=torch.int32, device=kernel_device())
    ids, weights = routing(4, E, TOP_K, torch.float32, seed=9)
    hidden = torch.randn(4, H).to(kernel_device())
    out = kernel.fused_moe(hidden, ids, weights, pool_of, pool_of * 0, pools)
    assert torch.equal(out, torch.zeros_like(hidden))


def align_pairs_reference(topk_ids, num_experts, block_m):
    """`fused_moe.align_pairs` in plain PyTorch (a stable sort): what the kernel must equal."""
    flat = topk_ids.reshape(-1).to(torch.int64).cpu()
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    rows = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    order = torch.argsort(flat, stable=True)
    rank = torch.arange(num_pairs) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    sorted_pair = torch.full((rows,), num_pairs, dtype=torch.int32)
    sorted_pair[(ends - padded)[flat[order]] + rank] = order.to(torch.int32)
    block_expert = torch.searchsorted(ends, torch.arange(0, rows, block_m), right=True).to(torch.int32)
    return sorted_pair, torch.where(block_expert < num_experts, block_expert, -1)


@pytest.mark.parametrize("block_m", [1, 16, 64])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(37, E, TOP_K), (300, 60, 4), (3, 64, 8), (160, 64, 8)])
def test_fused_kernel_align_pairs(kernel, block_m, num_tokens, num_experts, top_k):
    """The counting sort (a program per expert) equals a stable sort by expert: every pair lands once,
    in pair order within a block of its own expert; padding rows hold the sentinel P, blocks past the
    last -1 (60 experts: a count vector padded to 64; 1,200 or 1,280 pairs: several chunks; 24 pairs
    over 64 experts: most experts without a pair, most rows past the last block). GEMV tiles
    (block_m 1) are the router's ids as they are."""
    ids, _ = routing(num_tokens, num_experts, top_k, torch.float32, seed=11)
    sorted_pair, block_expert = kernel.align_pairs(ids, num_experts, block_m)
    if block_m == 1:
        assert torch.equal(sorted_pair.cpu(), ids.reshape(-1).cpu()) and block_expert is sorted_pair
        return
    want_pairs, want_blocks = align_pairs_reference(ids, num_experts, block_m)
    assert torch.equal(sorted_pair.cpu(), want_pairs)
    assert torch.equal(block_expert.cpu(), want_blocks)
    assert sorted_pair.numel() == kernel.aligned_rows(ids.numel(), num_experts, block_m)


def test_config_table_and_defaults():
    assert t_bucket(1) == 1 and t_bucket(3) == 4 and t_bucket(10**6) == 4096
    assert default_config(1).block_m == 1 and default_config(32).block_m == 16
    assert default_config(2048).block_m == 64
    assert config_for(7, 12345, 678, "int4") == default_config(7)  # not in the table
    with pytest.raises(ValueError):
        KernelConfig(block_m=8)


def test_each_pool_of_a_mixed_layer_takes_its_own_formats_tiles_and_they_share_block_m():
    """Per-tensor precision: with bf16 hi slots and int2 lo rows in one layer (combined), each pool's
    launches take its own format's tiles and tile product from the table (the int2 rows ran on the
    bf16 tiles before); block_m is the lo pool's for both, since one alignment of the pairs serves
    every pool. A config given explicitly (the tuner) serves every pool."""
    from moetide.compute.fused_moe import pool_configs

    hi = make_pool(1, 1024, 2048, "hi", torch.bfloat16)
    lo = make_pool(1, 1024, 2048, "int2", torch.bfloat16)
    differ = 0
    for T in (1, 8, 32, 128):
        got = pool_configs(T, [hi, lo, None])
        want_lo = config_for(T, 2048, 1024, lo.format.name)
        want_hi = replace(config_for(T, 2048, 1024, hi.format.name, beside="int2"), block_m=want_lo.block_m)
        if want_lo.split_i:  # the hi launch joins the lo pool's one-launch slices, on its down chunks
            want_hi = replace(want_hi, split_i=want_lo.split_i,
                              block_n=want_hi.block_n if want_hi.split_i else want_lo.block_n)  # fmt: skip
        assert got == [want_hi, want_lo, None]
        differ += want_hi != want_lo
    assert differ  # the table holds different tiles for the two formats
    given = KernelConfig(block_m=16, block_n=32, block_k=64)
    assert pool_configs(8, [hi, lo, None], given) == [given, given, None]
    own = KernelConfig(block_m=32, block_n=16, block_k=128)
    assert pool_configs(8, [hi, lo, None], [own, given, None]) == [replace(own, block_m=16), given, None]


def test_a_pool_beside_the_lo_pool_takes_its_mixed_cell_and_alone_its_own(monkeypatch):
    """The hi pool of a mixed layer runs a few hot experts' pairs: the table's `@int2` cell for it
    there, its format's own cell where it runs alone (no-offload), and the own cell where no mixed
    cell was tuned."""
    from moetide.compute import fused_moe as fm
    from moetide.compute import fused_moe_config as fmc

    hi = make_pool(1, 1024, 2048, "hi", torch.bfloat16)
    lo = make_pool(1, 1024, 2048, "int2", torch.bfloat16)
    alone = KernelConfig(block_m=16, block_n=64, block_k=128)
    mixed = KernelConfig(block_m=16, block_n=16, block_k=256, num_warps=2)
    lead = KernelConfig(block_m=16, block_n=128, block_k=128, packed_tile="v5")
    table = {fmc.table_key(32, 2048, 1024, "bfloat16"): alone, fmc.table_key(32, 2048, 1024, "int2"): lead,
             fmc.table_key(32, 2048, 1024, "bfloat16", beside="int2"): mixed}  # fmt: skip
    monkeypatch.setattr(fmc, "_table", lambda: table)
    fm._pool_configs.cache_clear()
    try:
        assert fm.pool_configs(32, [hi, lo]) == [mixed, lead]
        assert fm.pool_configs(32, [hi]) == [alone]
        assert fm.pool_configs(32, [hi, lo], mixed_cells=False) == [alone, lead]  # the format's own cell
        del table[fmc.table_key(32, 2048, 1024, "bfloat16", beside="int2")]
        fm._pool_configs.cache_clear()
        assert fm.pool_configs(32, [hi, lo]) == [alone, lead]
    finally:
        fm._pool_configs.cache_clear()


def test_a_layout_whose_groups_are_not_the_default_has_its_own_table_name():
    """The tile table's names: a packed matrix in its width's default groups is named by its bits, one in
    other groups gets them named (int2+2's down in groups of 32 runs products a quarter as wide as
    int2's, so it must not take int2's tuned tiles)."""
    from moetide.residency.slot_table import dense_format, packed_format
    from moetide.store import quant

    gate_up, down = torch.randn(2 * 128, 256) * 0.02, torch.randn(256, 128) * 0.02
    names = {}
    for precision in ("int4", "int2+4", "int2+2", "int2"):
        _row, meta = quant.pack_expert(gate_up, down, precision, quant_method="rtn")
        names[precision] = packed_format(meta, torch.bfloat16).name
    assert names == {"int4": "int4", "int2+4": "int2+int4", "int2+2": "int2+int2g32", "int2": "int2"}
    assert dense_format(256, 128, torch.bfloat16).name == "bfloat16"


def test_a_bucket_the_table_lacks_takes_its_nearest_tuned_bucket_inside_the_tuned_range(monkeypatch):
    """Decode batches between tuned buckets (2, 4, 16, 64 sequences) run on the nearest tuned bucket's
    tiles of the same shape and format (a tie: the smaller bucket), not on the untuned default; past
    the tuned range (prefill chunks), and for a format with no tuned cell, the default stays."""
    from moetide.compute import fused_moe_config as fmc

    one = KernelConfig(block_m=1, block_n=16, block_k=512, packed_tile="v6")
    eight = KernelConfig(block_m=16, block_n=128, block_k=128, packed_tile="v4")
    big = KernelConfig(block_m=32, block_n=128, block_k=128, packed_tile="v5")
    table = {fmc.table_key(1, 2048, 1024, "int2"): one, fmc.table_key(8, 2048, 1024, "int2"): eight,
             fmc.table_key(128, 2048, 1024, "int2"): big}  # fmt: skip
    monkeypatch.setattr(fmc, "_table", lambda: table)
    fmc.nearest_bucket.cache_clear()
    try:
        got = {t: fmc.config_for(t, 2048, 1024, "int2") for t in (1, 2, 3, 8, 16, 32, 33, 64, 128, 256)}
        assert got == {1: one, 2: one, 3: eight, 8: eight, 16: eight, 32: eight, 33: big, 64: big, 128: big,
                       256: fmc.default_config(256)}  # fmt: skip
        assert fmc.config_for(16, 2048, 1024, "int4") == fmc.default_config(16)  # no int4 cell at all
        assert fmc.config_for(16, 4096, 1024, "int2") == fmc.default_config(16)  # another shape
    finally:
        fmc.nearest_bucket.cache_clear()


@pytest.mark.parametrize(
    "policy",
    # under the interpreter a token costs ~4.6 s: the CPU runs the int2 engine test only (int4 tiles
    # are checked kernel by kernel above, and end to end on CUDA)
    [pytest.param("static-int4", marks=pytest.mark.skipif(not CUDA, reason="CUDA only: interpreter time")),
     "static-int2"],  # fmt: skip
)
def test_fused_kernel_engine_greedy_equals_the_reference_path(kernel, policy, monkeypatch):
    """The demo model end to end (CUDA: compiled, 32 greedy tokens; CPU: under the interpreter, 2
    tokens): greedy tokens through the fused kernel equal those of the per-expert dequantize reference,
    and the kernel really ran."""
    from triton_interpreter import run_both_kernels

    from moetide.engine.llm import demo_model_path

    # under the interpreter a program costs ~50 ms: on the CPU the forward of 3 tokens takes the blocked
    # path (T bucket 4) and the 1-token prompt the one-pair GEMV path (30 s on the 2-core machine,
    # against 54 s with CUDA's 6-token forward and 4-token prompt)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10] if CUDA else [5, 6, 7]], device=kernel_device())
    tokens, prompt = (32, (5, 6, 7, 8)) if CUDA else (2, (5,))
    got, calls = run_both_kernels(kernel, monkeypatch, demo_model_path(), ids, tokens, prompt=prompt,
                                  device=kernel_device(), dtype="float32", policy=policy,
                                  gpu_memory="512MiB")  # fmt: skip
    assert calls, "the fused kernel never ran"
    (ref_logits, ref_tokens, _), (logits, tokens, _) = got["dequant"], got["fused"]
    assert (logits - ref_logits).norm() / ref_logits.norm() < 1e-4
    assert tokens == ref_tokens


@pytest.mark.parametrize("num_tokens", [1, 33])
def test_fused_kernel_waits_for_a_copy_in_flight(kernel, num_tokens):
    """`waits`: an expert whose wait word names a copy is read only once the slot's landed word says
    it landed. On CUDA the copy of one slot's row is held back on a side stream (a sleep, then the
    copy, then the landed word) while the kernel is launched at once on the compute stream: its
    programs spin and then read the weights, equal to the reference. Under the interpreter the copy
    has landed before the launch (the wait passes through)."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    hidden_size, inter = 64, 32
    pool = make_pool(4, inter, hidden_size, "hi", dtype, seed=5)
    pool_of, slot_of = table(E, [4], seed=3)
    pool_of.fill_(0)
    slot_of.copy_(torch.arange(E, dtype=torch.int32, device=slot_of.device) % 4)
    ids, weights = routing(num_tokens, E, TOP_K, dtype, seed=num_tokens)
    hidden = torch.randn(num_tokens, hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    hidden = hidden.to(kernel_device())
    want = reference_moe(hidden, ids, weights, pool_of, slot_of, [pool], F.silu)
    expert = int(ids[0, 0])
    row = int(slot_of[expert])
    wait_of = torch.zeros(E, dtype=torch.int32, device=pool_of.device)
    wait_of[pool_of == 0] = 0
    wait_of[slot_of == row] = 7  # every expert in that row waits for copy 7
    landed = torch.zeros(4, dtype=torch.int32, device=pool_of.device)
    saved = pool.arena[row].clone()
    if CUDA:
        pool.arena[row].fill_(0xFF)  # poison: NaN weights if read before the copy
        side = torch.cuda.Stream()
        source = saved.cpu().pin_memory()
        word = torch.tensor([7], dtype=torch.int32).pin_memory()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # ~25 ms: the kernel is launched long before the copy
            pool.arena[row].copy_(source, non_blocking=True)
            landed[row : row + 1].copy_(word, non_blocking=True)
        out = kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, [pool], waits=(wait_of, landed, 0))
        torch.cuda.synchronize()
    else:
        landed[row] = 7
        out = kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, [pool], waits=(wait_of, landed, 0))
    assert torch.equal(pool.arena[row], saved)
    assert_close(out, want, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the OLMoE shape's tiled cells: CUDA only")
@pytest.mark.parametrize("num_tokens", [1, 8, 32, 128])
def test_fused_kernel_on_the_tables_mixed_cells_at_the_olmoe_shape(kernel, num_tokens):
    """A combined layer at the OLMoE shape (H 2,048, I 1,024, 64 experts, top 8): a few bf16 hi slots
    on the table's tiles for a pool beside int2 rows (`@int2` cells where tuned), the int2 pool on its
    own: equals the reference."""
    from moetide.compute.fused_moe import pool_configs

    dtype, experts, hidden_size, inter = torch.bfloat16, 64, 2048, 1024
    pools = [make_pool(3, inter, hidden_size, "hi", dtype, seed=1), make_pool(8, inter, hidden_size, "int2", dtype)]
    g = torch.Generator().manual_seed(num_tokens)
    pool_of = torch.ones(experts, dtype=torch.int32)
    pool_of[torch.randperm(experts, generator=g)[:3]] = 0
    slot_of = torch.stack([torch.cumsum(pool_of == 0, 0) - 1, torch.randint(0, 8, (experts,), generator=g)])
    pool_of, slot_of = pool_of.cuda(), slot_of.clamp_min(0).to(torch.int32).cuda()
    ids, weights = routing(num_tokens, experts, 8, dtype, seed=num_tokens)
    hidden = (torch.randn(num_tokens, hidden_size, generator=g) * 0.5).to(dtype).cuda()
    configs = pool_configs(num_tokens, pools)
    assert configs[0].block_m == configs[1].block_m
    out = kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, pools)
    assert_close(out, reference_moe(hidden, ids, weights, pool_of, slot_of, pools, F.silu), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the OLMoE shape's one-launch tiles: CUDA only")
@pytest.mark.parametrize("num_tokens", [1, 2, 8, 16])
@pytest.mark.parametrize("split_i", [64, 128])
def test_the_one_launch_path_at_the_olmoe_shape(kernel, num_tokens, split_i):
    """A combined layer at the OLMoE shape (bf16 hi slots, int2 and int4 rows, 64 experts, top 8) on
    one launch per pool with 128-wide down chunks: equals the reference and the two-launch path."""
    dtype, experts, hidden_size, inter = torch.bfloat16, 64, 2048, 1024
    pools = [make_pool(3, inter, hidden_size, "hi", dtype, seed=1), make_pool(8, inter, hidden_size, "int2", dtype),
             make_pool(8, inter, hidden_size, "int4", dtype, seed=2)]  # fmt: skip
    g = torch.Generator().manual_seed(num_tokens)
    pool_of = torch.randint(0, 3, (experts,), generator=g, dtype=torch.int32)
    slot_of = torch.stack([torch.randint(0, 3, (experts,), generator=g), torch.randint(0, 8, (experts,), generator=g),
                           torch.randint(0, 8, (experts,), generator=g)]).to(torch.int32)  # fmt: skip
    pool_of, slot_of = pool_of.cuda(), slot_of.cuda()
    ids, weights = routing(num_tokens, experts, 8, dtype, seed=num_tokens)
    hidden = (torch.randn(num_tokens, hidden_size, generator=g) * 0.5).to(dtype).cuda()
    one = KernelConfig(1, 128, 512, 4, 2, packed_tile="v6", split_i=split_i)
    out = kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, pools, config=one)
    assert_close(out, reference_moe(hidden, ids, weights, pool_of, slot_of, pools, F.silu), dtype)
    two = kernel.fused_moe(hidden, ids, weights, pool_of, slot_of, pools, config=replace(one, split_i=0))
    assert_same_up_to_summation_order(out, two)
