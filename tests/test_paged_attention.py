"""Decode attention straight from the paged pools (engine/paged_attention.py).

The kernel against dense attention over each row's tokens in order, and the engine's decode steps
through it against the gather + SDPA path, for every family whose attention it takes. Kernel tests
run compiled on CUDA; on CPU they run under Triton's interpreter in the one interpreter-mode process
of the session (`test_paged_kernel_under_interpreter`; see triton_interpreter.py).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, save_tiny_model
from triton_interpreter import (
    CUDA,
    HAS_TRITON,
    INTERPRETING,
    assert_kernel_tests_passed,
    kernel_device,
    kernel_module,
)

MIN_INTERPRETER_PASSES = 8
BLOCK = 16


@pytest.fixture(scope="module")
def kernel():
    return kernel_module("moetide.engine.paged_attention", "test_paged_kernel_under_interpreter")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(CUDA or INTERPRETING, reason="the kernel tests run in this process")
def test_paged_kernel_under_interpreter(interpreter_run):
    assert_kernel_tests_passed(interpreter_run, "test_paged_attention.py", MIN_INTERPRETER_PASSES)


def _paged_case(lengths, query_heads, kv_heads, dim, dtype, width=None, seed=0):
    """Random pools of one layer, each row's blocks at shuffled places (block 0 is the pad),
    its query, and the dense reference `(B, Hq, D)` float32 over its tokens in order."""
    g = torch.Generator().manual_seed(seed)
    dev = kernel_device()
    width = width or max(-(-n // BLOCK) for n in lengths)
    num_blocks = 1 + sum(-(-n // BLOCK) for n in lengths)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, n in enumerate(lengths):
        need = -(-n // BLOCK)
        tables[r, :need] = torch.tensor([order.pop() for _ in range(need)])
    keys = torch.randn(num_blocks * BLOCK, kv_heads, dim, generator=g)
    values = torch.randn(num_blocks * BLOCK, kv_heads, dim, generator=g)
    keys[:BLOCK] = float("nan")  # the pad block: never attended to
    values[:BLOCK] = float("nan")
    query = torch.randn(len(lengths), query_heads, dim, generator=g)
    scale = dim**-0.5
    want = []
    for r, n in enumerate(lengths):
        slots = (tables[r, : -(-n // BLOCK)].view(-1, 1) * BLOCK + torch.arange(BLOCK)).view(-1)[:n]
        k = keys[slots].repeat_interleave(query_heads // kv_heads, dim=1)  # (n, Hq, D)
        v = values[slots].repeat_interleave(query_heads // kv_heads, dim=1)
        k, v = k.to(dtype).float(), v.to(dtype).float()
        scores = torch.einsum("hd,nhd->hn", query[r].to(dtype).float(), k) * scale
        want.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    to = lambda t: t.to(dev, dtype)  # noqa: E731
    lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    return to(query), to(keys), to(values), tables.to(dev), lens, scale, torch.stack(want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lengths, heads, width",
    [
        ([1, 17, 40, 16], (4, 2, 16), None),  # GQA; a row of one token; a row ending on a block edge
        ([5, 70], (2, 2, 32), None),  # MHA; a row over two 64-token steps
        ([3, 150], (8, 1, 16), 16),  # one kv head for 8 query heads; a table wider than any row (splits)
    ],
)
def test_paged_kernel_matches_dense_attention_over_each_rows_tokens(kernel, lengths, heads, width, dtype):
    query, keys, values, tables, lens, scale, want = _paged_case(lengths, *heads, dtype, width=width)
    got = kernel.paged_decode_attention(query, keys, values, tables, lens, scale, BLOCK)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


def test_paged_kernel_splits_a_long_table_and_combines_the_splits(kernel):
    """A wide table with one short and one long row: several splits per row, empty ones included."""
    query, keys, values, tables, lens, scale, want = _paged_case([2, 250], 2, 1, 16, torch.float32, width=24)
    assert kernel.num_splits(2, 1, 24 * BLOCK, query.device) > 1
    got = kernel.paged_decode_attention(query, keys, values, tables, lens, scale, BLOCK)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_paged_kernel_operator_compiles_into_one_graph_and_attends_as_the_function(kernel):
    """`torch.ops.moetide.paged_decode_attention` traces without a graph break (its fake gives the
    output's shape and dtype) and computes what `paged_decode_attention` does, for a strided query
    (transformers' `(B, Hq, T, D)` sliced at T = 0): the compiled decode step's attention."""
    query, keys, values, tables, lens, scale, want = _paged_case([9, 33], 4, 2, 16, torch.float32)
    query_4d = query.unsqueeze(2).expand(-1, -1, 3, -1).contiguous()  # (B, Hq, T = 3, D)

    def attend(q4):
        return torch.ops.moetide.paged_decode_attention(q4[:, :, 0] * 1.0 + 0.0, keys, values, tables, lens,
                                                        scale, BLOCK) * 2.0  # fmt: skip

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    got = compiled(query_4d)
    assert got.shape == want.shape and got.dtype == query.dtype
    torch.testing.assert_close(got.cpu() / 2.0, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, 2.0 * kernel.paged_decode_attention(query, keys, values, tables, lens, scale, BLOCK))


def test_paged_kernel_refuses_heads_it_does_not_take(kernel):
    query, keys, values, tables, lens, scale, _ = _paged_case([3], 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="power-of-two head dim"):
        narrow = [t[..., :12] for t in (query, keys, values)]
        kernel.paged_decode_attention(*narrow, tables, lens, scale, BLOCK)


# -- the engine ----------------------------------------------------------------------------------------------
# the tiny families with 16-wide heads (the kernel's smallest); DeepSeek-V2's latent keys keep the gather
KERNEL_FAMILIES = [f for f in FAMILIES if f != "deepseek_v2"]


@pytest.fixture(scope="module")
def wide_head_checkpoints(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(f"{family}_heads16")
        extra = {"head_dim": 16} if family == "qwen3_moe" else {}
        save_tiny_model(family, path, hidden_size=64, **extra)
        out[family] = path
    return out


def _greedy(path, mode):
    import moetide
    from moetide.engine import paged_cache

    calls = []
    original = paged_cache.paged_attention_forward

    def counting(module, query, key, *args, **kwargs):
        calls.append(key.dim())
        return original(module, query, key, *args, **kwargs)

    paged_cache.paged_attention_forward = counting
    try:
        llm = moetide.LLM(str(path), device=kernel_device(), dtype="float32", decode_attention=mode,
                            lo_kernel="dequant")  # fmt: skip
        try:
            params = moetide.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
            outs = llm.generate([[5, 6, 7], [9] * 20, list(range(3, 40))], params)
            return [o.token_ids for o in outs], calls
        finally:
            llm.close()
    finally:
        paged_cache.paged_attention_forward = original


@pytest.mark.parametrize("family", KERNEL_FAMILIES)
def test_paged_kernel_decode_gives_the_gather_paths_tokens(kernel, wide_head_checkpoints, family):
    """fp32: every family's greedy tokens are the same with decode steps read straight from the
    pools, and the kernel really ran (layers handed the 3D pools) next to gathered prefills."""
    want, _ = _greedy(wide_head_checkpoints[family], "gather")
    got, calls = _greedy(wide_head_checkpoints[family], "kernel")
    assert got == want
    assert calls.count(3) >= 4 * 2 and calls.count(4) >= 2, calls  # 4 decode steps x 2 layers; prefills


def test_paged_kernel_is_refused_for_latent_attention(kernel, wide_head_checkpoints):
    import moetide
    from moetide.errors import ConfigError

    with pytest.raises(ConfigError, match="decode_attention='kernel' cannot run here"):
        path = wide_head_checkpoints["deepseek_v2"]
        moetide.LLM(str(path), device=kernel_device(), decode_attention="kernel")
