"""The grouped low-bit Triton kernel (`lo_kernel="triton"`) equals dequantize + matmul.

Kernel tests run compiled on CUDA; on CPU they run under Triton's interpreter in a fresh
interpreter-mode process (`test_grouped_kernel_under_interpreter`), because triton reads
TRITON_INTERPRET when it is first imported and transformers imports it early in a full test run.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import (
    CUDA,
    HAS_TRITON,
    INTERPRETING,
    kernel_device,
    run_both_lo_kernels,
)

import moetide
from moetide.cli import build_parser, engine_config_from_args
from moetide.compute.lowbit import dequantize_rows
from moetide.compute.runtime import ExpertRuntime
from moetide.config import EngineConfig
from moetide.errors import ConfigError
from moetide.residency.metrics import ExpertMetrics
from moetide.store import quant

MIN_INTERPRETER_PASSES = 20  # the kernel tests below, as the interpreter process must run them


@pytest.fixture(scope="module")
def kernel():
    """moetide.compute.lowbit_triton: compiled on CUDA, interpreted in an interpreter-mode process."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if not (CUDA or INTERPRETING):
        pytest.skip("on CPU this runs in a subprocess: test_grouped_kernel_under_interpreter")
    return importlib.import_module("moetide.compute.lowbit_triton")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(CUDA or INTERPRETING, reason="the kernel tests run in this process")
def test_grouped_kernel_under_interpreter(interpreter_run):
    run = interpreter_run
    assert run.result.returncode == 0, run.summary
    assert run.passed("test_lowbit_triton.py") >= MIN_INTERPRETER_PASSES, run.summary


device = kernel_device


def lo_pool(num_rows, inter, hidden, precision, group_size=None, seed=0):
    """`(arena (num_rows, nbytes) uint8, meta)`: random experts packed as lo pool rows."""
    g = torch.Generator().manual_seed(seed)
    rows, meta = [], None
    for _ in range(num_rows):
        gate_up = torch.randn(2 * inter, hidden, generator=g) * 0.05
        down = torch.randn(hidden, inter, generator=g) * 0.05
        buf, meta = quant.pack_expert(gate_up, down, precision, group_size=group_size, quant_method="rtn")
        rows.append(buf)
    return torch.stack(rows).to(device()), meta


def reference(hidden, slots_of_pairs, routing, arena, meta, pairs=None):
    """Dequantize + matmul, one pair at a time, float64: `(T, H)`. pairs: flat pair indices (None = all);
    slots_of_pairs (T*k,) the pool row of every pair."""
    num_tokens, k = routing.shape
    gate_up, down = dequantize_rows(arena.index_select(0, slots_of_pairs), meta, hidden.dtype)
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float64, device=hidden.device)
    for p in range(num_tokens * k) if pairs is None else pairs:
        gate, up = (hidden[p // k].double() @ gate_up[p].double().T).chunk(2)
        out[p // k] += routing.reshape(-1)[p].double() * ((F.silu(gate) * up) @ down[p].double().T)
    return out


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def dtypes(num_tokens):
    # The interpreter multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584), so on
    # CPU the multi-token (tl.dot) path is checked in float16 and float32 only.
    if CUDA or num_tokens == 1:
        return [torch.float32, torch.float16, torch.bfloat16]
    return [torch.float32, torch.float16]


TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("precision", ["int4", "int2"])
@pytest.mark.parametrize("num_tokens", [17, 40])
def test_grouped_kernel_runs_longer_than_a_row_tile(kernel, precision, num_tokens):
    """More tokens than one program's row tile (16): a run of pairs sharing an expert is split into
    chunks (here expert 0 has every token, so its run is num_tokens long)."""
    arena, meta = lo_pool(4, 32, 64, precision, seed=num_tokens)
    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack(
        [torch.tensor([0, 1 + int(torch.randint(3, (1,), generator=g))]) for _ in range(num_tokens)]
    )
    ids = ids.to(device())
    routing = torch.rand(num_tokens, 2, generator=g).to(device())
    x = torch.randn(num_tokens, 64, generator=g).to(device())
    chunks = kernel._chunk_starts(kernel.topk_pairs(ids)[0], kernel.ROW_TILE)
    assert int(chunks.sum()) > 4  # three runs start, and expert 0's run is split
    pair_slot, pair_index = kernel.topk_pairs(ids)
    got = kernel.grouped_lowbit_moe(x, routing, pair_slot, pair_index, arena, meta)
    expected = reference(x, ids.reshape(-1), routing, arena, meta)
    assert rel(got, expected) < 1e-5


@pytest.mark.parametrize("block_n", [16, 64])
@pytest.mark.parametrize("precision", ["int4", "int2"])
def test_grouped_kernel_tiles(kernel, precision, block_n):
    """The tile widths `GroupedConfig.for_tokens` picks give the same result, at 1 and 3 tokens."""
    arena, meta = lo_pool(5, 64, 128, precision, seed=11)
    g = torch.Generator().manual_seed(block_n)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(3)]).to(device())
    routing = torch.rand(3, 2, generator=g).to(device())
    x = torch.randn(3, 128, generator=g).to(device())
    config = kernel.GroupedConfig(block_n=block_n)
    for tokens in (1, 3):
        pair_slot, pair_index = kernel.topk_pairs(ids[:tokens])
        got = kernel.grouped_lowbit_moe(x[:tokens], routing[:tokens], pair_slot, pair_index, arena, meta,
                                        config=config)  # fmt: skip
        expected = reference(x[:tokens], ids[:tokens].reshape(-1), routing[:tokens], arena, meta)
        assert rel(got, expected) < 1e-5, tokens


@pytest.mark.parametrize("precision", ["int4", "int2"])
@pytest.mark.parametrize("hidden_size", [64, 128])
@pytest.mark.parametrize("num_tokens", [1, 2, 3])
def test_grouped_kernel_matches_dequantize(kernel, precision, hidden_size, num_tokens):
    """Every pair of top_k_index through `topk_pairs`, rows at an offset (`slot_base`), as the
    static lo path calls it; T > 1 shares experts between tokens (runs of several pairs)."""
    experts, k, base = 4, 2, 3
    arena, meta = lo_pool(base + experts, 64, hidden_size, precision, seed=num_tokens)
    g = torch.Generator().manual_seed(hidden_size + num_tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(num_tokens)]).to(device())
    ids[-1] = ids[0]  # at T > 1 some expert has several tokens
    routing = torch.rand(num_tokens, k, generator=g).to(device())
    pair_slot, pair_index = kernel.topk_pairs(ids)
    for dtype in dtypes(num_tokens):
        x = torch.randn(num_tokens, hidden_size, generator=g).to(device(), dtype)
        got = kernel.grouped_lowbit_moe(x, routing, pair_slot, pair_index, arena, meta, slot_base=base)
        assert got.shape == x.shape and got.dtype == dtype
        expected = reference(x, ids.reshape(-1) + base, routing, arena, meta)
        assert rel(got, expected) < TOLERANCE[dtype], dtype


@pytest.mark.parametrize("precision", ["int4", "int2"])
def test_grouped_kernel_subset_of_pairs(kernel, precision):
    """The dynamic path: only some experts' pairs (the lo-resident ones), at arbitrary pool slots."""
    arena, meta = lo_pool(9, 64, 64, precision, seed=5)
    ids = torch.tensor([[0, 1], [2, 0], [1, 3]])
    slot_of = {0: 7, 1: 2, 3: 4}  # expert 2 is computed elsewhere (say hi-resident)
    routing = torch.rand(3, 2, generator=torch.Generator().manual_seed(1)).to(device())
    slots = torch.tensor([slot_of.get(e, -1) for e in ids.reshape(-1).tolist()])
    keep = (slots >= 0).nonzero().squeeze(1)
    order = keep[torch.argsort(slots[keep], stable=True)]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(device())
    got = kernel.grouped_lowbit_moe(x, routing, slots[order].to(device()), order.to(device()), arena, meta)
    expected = reference(x, slots.clamp_min(0).to(device()), routing, arena, meta, order.tolist())
    assert rel(got, expected) < 1e-5


@pytest.mark.parametrize("precision,group_size", [("int2", 32), ("int4", 16)])
def test_grouped_kernel_small_groups(kernel, precision, group_size):
    """K-tiles under 16 bytes (no tl.dot there): the broadcast-reduce path, at 1 and 3 tokens."""
    arena, meta = lo_pool(3, 32, 32, precision, group_size=group_size, seed=6)
    ids = torch.tensor([[0, 2], [1, 2], [2, 0]]).to(device())
    routing = torch.rand(3, 2, generator=torch.Generator().manual_seed(3)).to(device())
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4)).to(device())
    for tokens in (1, 3):
        pair_slot, pair_index = kernel.topk_pairs(ids[:tokens])
        got = kernel.grouped_lowbit_moe(x[:tokens], routing[:tokens], pair_slot, pair_index, arena, meta)
        expected = reference(x[:tokens], ids[:tokens].reshape(-1), routing[:tokens], arena, meta)
        assert rel(got, expected) < 1e-5, tokens


def test_grouped_kernel_rejects_what_it_cannot_run(kernel):
    arena, meta = lo_pool(2, 64, 64, "int4")
    too_many = kernel.MAX_TOKENS + 1
    pairs = kernel.topk_pairs(torch.zeros(too_many, 1, dtype=torch.long, device=device()))
    with pytest.raises(ValueError, match="tokens"):
        kernel.grouped_lowbit_moe(
            torch.zeros(too_many, 64, device=device()), torch.ones(too_many, 1), *pairs, arena, meta
        )
    odd = quant.expert_layout("int4", 48, 48, torch.float32, group_size=48)
    with pytest.raises(ValueError, match="power-of-two"):
        kernel.check_layout(odd)


def _tiny_olmoe(tmp_path_factory) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import save_tiny_model

    path = tmp_path_factory.mktemp("olmoe_lowbit")
    save_tiny_model("olmoe", path)
    return path


@pytest.fixture(scope="module")
def tiny_olmoe(tmp_path_factory) -> Path:
    return _tiny_olmoe(tmp_path_factory)


def _lo_heavy_budget(path, dev) -> int:
    """A combined budget with every expert lo-resident and room for 4 hi versions only."""
    roomy = moetide.LLM(path, device=dev, policy="combined", gpu_memory="64MiB")
    plan = roomy.loaded.runtime.residency.plan
    roomy.close()
    return plan.fixed.total + plan.lo_slots * plan.lo_slot_bytes + 4 * plan.hi_slot_bytes


@pytest.mark.parametrize("policy", ["static-int2", "combined"])
def test_grouped_engine_triton_equals_dequant(kernel, tiny_olmoe, monkeypatch, policy):
    """End to end (the interpreter on CPU, compiled on CUDA): same logits and greedy tokens with
    lo_kernel triton as with dequant, and the kernel really ran (static-int2: no host sync; combined:
    lo-resident experts of the dynamic path, lo = auto). int4 rows against dequantize: the kernel
    tests above."""
    dev = device()
    dtype = "bfloat16" if CUDA else "float32"
    budget = _lo_heavy_budget(tiny_olmoe, dev) if policy == "combined" else None
    ids = torch.randint(5, 90, (1, 7), generator=torch.Generator().manual_seed(4)).to(dev)
    new_tokens = 10 if CUDA else 4  # the interpreter runs every kernel call in Python
    results, calls = run_both_lo_kernels(kernel, monkeypatch, tiny_olmoe, ids, new_tokens, device=dev,
                                         dtype=dtype, policy=policy, gpu_memory=budget)  # fmt: skip
    assert calls, "the grouped kernel never ran"
    (ref_logits, ref_tokens, lo_runs), (logits, tokens, _) = results["dequant"], results["triton"]
    if policy == "combined":
        assert lo_runs > 0
    assert rel(logits, ref_logits) < (1e-5 if dtype == "float32" else 3e-2)
    # bf16: another valid summation order may flip a near-tie late in the sequence
    agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
    assert agree >= (len(tokens) if dtype == "float32" else 6), (tokens, ref_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int4", "int2"])
@pytest.mark.parametrize("num_tokens", [1, 4, 8, 32])
def test_grouped_kernel_olmoe_shape_on_cuda(kernel, precision, num_tokens):
    """OLMoE experts (H 2048, I 1024, top-8 of 64) in bf16: the kernel against dequantize + bmm
    (the engine's current path) and against float64."""
    experts, k, hidden_size, inter = 64, 8, 2048, 1024
    arena, meta = lo_pool(experts, inter, hidden_size, precision, seed=num_tokens)
    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(num_tokens)]).cuda()
    routing = torch.softmax(torch.randn(num_tokens, k, generator=g), -1).cuda()
    x = torch.randn(num_tokens, hidden_size, generator=g).cuda().bfloat16()
    got = kernel.grouped_lowbit_moe(x, routing, *kernel.topk_pairs(ids), arena, meta)
    gate_up, down = dequantize_rows(arena.index_select(0, ids.reshape(-1)), meta, torch.bfloat16)
    xs = x.repeat_interleave(k, 0).unsqueeze(1)
    gate, up = torch.bmm(xs, gate_up.transpose(1, 2)).chunk(2, -1)
    y = torch.bmm(F.silu(gate) * up, down.transpose(1, 2)).squeeze(1) * routing.reshape(-1, 1)
    dequant_path = y.view(num_tokens, k, -1).float().sum(1)
    exact = reference(x.float(), ids.reshape(-1), routing, arena, meta)
    assert rel(got, exact) < 2e-2 and rel(dequant_path, exact) < 2e-2
    assert rel(got, dequant_path) < 2e-2


# -- configuration (no triton needed) ------------------------------------------------------------------------
def test_lo_kernel_config_and_cli():
    with pytest.raises(ConfigError, match="lo-kernel"):
        EngineConfig(model="m", lo_kernel="cutlass")
    args = build_parser().parse_args(["generate", "hi", "--lo-kernel", "triton"])
    assert engine_config_from_args(args).lo_kernel == "triton"
    assert EngineConfig(model="m").lo_kernel == "auto"


def test_auto_lo_kernel_falls_back_to_dequant():
    """auto: the Triton kernel only on CUDA with SiLU experts (and triton installed), else dequant."""
    runtime = ExpertRuntime(None, ExpertMetrics(1), F.silu, num_experts=4, top_k=2)
    runtime.set_lo_kernel("auto", torch.device("cpu"))
    assert runtime.lowbit_kernel is None
    gelu = ExpertRuntime(None, ExpertMetrics(1), torch.nn.GELU(), num_experts=4, top_k=2)
    gelu.set_lo_kernel("auto", torch.device("cuda"))
    assert gelu.lowbit_kernel is None
    if HAS_TRITON:
        runtime.set_lo_kernel("auto", torch.device("cuda"))
        assert runtime.lowbit_kernel is not None


@pytest.mark.skipif(CUDA or INTERPRETING, reason="CPU without the interpreter only")
def test_triton_lo_kernel_on_cpu_is_a_clear_error(tiny_olmoe):
    expected = "needs a CUDA device" if HAS_TRITON else "needs the triton package"
    with pytest.raises(ConfigError, match=expected):
        moetide.LLM(tiny_olmoe, device="cpu", policy="static-int2", lo_kernel="triton")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_lo_kernel_needs_silu_experts():
    runtime = ExpertRuntime(None, ExpertMetrics(1), torch.nn.GELU(), num_experts=4, top_k=2)
    with pytest.raises(ConfigError, match="SiLU"):
        runtime.set_lo_kernel("triton", torch.device("cuda"))
    runtime.set_lo_kernel("dequant", torch.device("cpu"))
    assert runtime.lowbit_kernel is None


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_lo_kernel_refuses_a_layout_it_cannot_run():
    odd = quant.expert_layout("int4", 48, 48, torch.float32, group_size=48)

    class Rows:
        def lo_pool_rows(self):
            return torch.zeros(2, odd.nbytes, dtype=torch.uint8), odd

    runtime = ExpertRuntime(Rows(), ExpertMetrics(1), F.silu, num_experts=4, top_k=2)
    with pytest.raises(ConfigError, match="power-of-two"):
        runtime.set_lo_kernel("triton", torch.device("cuda"))
