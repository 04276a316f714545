"""Fused routers (compute/routing.py, compute/routing_kernel.py).

The kernel against transformers' softmax + top-k; the probe that decides which routers take the fused
forward, for every family; on CUDA, the engine's greedy tokens with and without fused routers. Kernel
tests run compiled on CUDA; on CPU they run under Triton's interpreter in the one interpreter-mode
process of the session (`test_routing_kernel_under_interpreter`; see triton_interpreter.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from triton_interpreter import (
    CUDA,
    HAS_TRITON,
    INTERPRETING,
    assert_kernel_tests_passed,
    kernel_device,
    kernel_module,
)

import moetide
from moetide.compute import routing

MIN_INTERPRETER_PASSES = 7


@pytest.fixture(scope="module")
def kernel():
    return kernel_module("moetide.compute.routing_kernel", "test_routing_kernel_under_interpreter")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(CUDA or INTERPRETING, reason="the kernel tests run in this process")
def test_routing_kernel_under_interpreter(interpreter_run):
    assert_kernel_tests_passed(interpreter_run, "test_routing.py", MIN_INTERPRETER_PASSES)


@pytest.mark.parametrize(
    "tokens, experts, k, dtype, normalize, out_dtype",
    [
        (1, 64, 8, torch.bfloat16, False, torch.bfloat16),  # OLMoE at batch 1
        (33, 64, 8, torch.bfloat16, True, torch.bfloat16),  # Qwen3-MoE's normalized scores
        (5, 60, 4, torch.float32, False, torch.float32),  # Qwen1.5-MoE's 60 experts (not a power of two)
        (7, 8, 2, torch.bfloat16, True, torch.float32),  # Mixtral: float32 scores
    ],
)
def test_routing_kernel_chooses_and_scores_as_softmax_topk(kernel, tokens, experts, k, dtype, normalize,
                                                           out_dtype):  # fmt: skip
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)).to(kernel_device(), dtype)
    got = kernel.softmax_topk(logits, k, normalize, out_dtype)
    want = routing.softmax_topk_reference(logits, k, normalize, out_dtype)
    assert got[0].dtype == out_dtype and got[1].dtype == torch.int64 and got[0].shape == (tokens, k)
    assert routing.same_routing((logits, *got), (logits, *want))


def test_routing_kernel_breaks_ties_by_the_lower_id(kernel):
    """Equal logits (common in bf16): the lower expert id first, and each id once."""
    logits = torch.zeros(2, 16, device=kernel_device())
    logits[0, [3, 9, 12]] = 2.0
    logits[1, :] = 1.0
    scores, ids = kernel.softmax_topk(logits, 4, False, torch.float32)
    assert ids.tolist() == [[3, 9, 12, 0], [0, 1, 2, 3]]
    torch.testing.assert_close(scores[1], torch.full((4,), 1 / 16, device=logits.device))


def test_routing_kernel_strided_logits_and_no_tokens(kernel):
    """A row stride wider than E (a slice of a wider buffer), and an empty batch."""
    wide = torch.randn(6, 80, generator=torch.Generator().manual_seed(1)).to(kernel_device())
    logits = wide[:, :64]
    got = kernel.softmax_topk(logits, 8, True, torch.float32)
    assert routing.same_routing((logits, *got), (logits, *routing.softmax_topk_reference(logits, 8, True,
                                                                                          torch.float32)))  # fmt: skip
    empty = kernel.softmax_topk(logits[:0], 8, True, torch.float32)
    assert empty[0].shape == (0, 8) and empty[1].shape == (0, 8)


def test_routing_kernel_operator_compiles_into_one_graph(kernel):
    """`torch.ops.moetide.softmax_topk` traces without a graph break (its fake gives shapes and dtypes)
    and gives the reference's routing."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(kernel_device(), torch.bfloat16)

    def route(x):
        scores, ids = torch.ops.moetide.softmax_topk(x * 1.0, 8, False, torch.bfloat16)
        return scores * 1.0, ids

    got = torch.compile(route, fullgraph=True, backend="aot_eager")(logits)
    assert routing.same_routing((logits, *got), (logits, *routing.softmax_topk_reference(logits, 8, False,
                                                                                          torch.bfloat16)))  # fmt: skip


# -- the probe (CPU: the operator's CPU implementation is the reference) ----------------------------------


def _routers(model):
    from moetide.models.loader import moe_blocks
    from moetide.models.registry import get_adapter

    adapter = get_adapter(model.config.model_type)
    return [getattr(block, adapter.router_attr) for _, block in moe_blocks(model, adapter)]


@pytest.mark.parametrize(
    "family, normalize",
    [("olmoe", False), ("qwen3_moe", False), ("qwen2_moe", False), ("mixtral", True), ("phimoe", None),
     ("deepseek_v2", False)],  # fmt: skip
)
def test_probe_fuses_the_plain_softmax_topk_routers_only(tiny_checkpoints, family, normalize):
    """OLMoE's, the Qwen MoEs' and Mixtral's routers take the fused forward (with their own
    normalization and score dtype), and DeepSeek-V2's greedy one in float32 (the tiny model's dtype,
    in which its float32 logits are the fused forward's); PhiMoE's sparse mixer does not."""
    _, model = tiny_checkpoints[family]
    for router in _routers(model):
        spec = routing.matching_spec(router)
        if normalize is None:
            assert spec is None
        else:
            assert spec == (normalize, torch.float32)


class _DoubledScores(nn.Module):
    """A router like OLMoE's whose scores are twice the softmax's: not a plain router."""

    def __init__(self, router):
        super().__init__()
        self.inner, self.weight, self.top_k = router, router.weight, router.top_k

    def forward(self, x):
        logits, scores, ids = self.inner(x)
        return logits, scores * 2, ids


def test_probe_refuses_a_router_that_computes_something_else(tiny_checkpoints):
    router = _routers(tiny_checkpoints["olmoe"][1])[0]
    assert routing.matching_spec(router) is not None
    assert routing.matching_spec(_DoubledScores(router)) is None


def test_no_router_is_fused_on_cpu(tiny_checkpoints):
    path, _ = tiny_checkpoints["olmoe"]
    llm = moetide.LLM(str(path), device="cpu", policy="no-offload")
    assert llm.loaded.fused_routers == 0
    assert all("forward" not in vars(r) for r in _routers(llm.loaded.model))
    llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="fused routers run on CUDA")
@pytest.mark.parametrize("family", ["olmoe", "mixtral"])
def test_fused_routers_on_cuda_give_the_tokens_of_the_routers_own_forward(tiny_checkpoints, family,
                                                                         monkeypatch):  # fmt: skip
    """Every MoE block's router fused on CUDA; greedy tokens (CUDA graphs) equal those of the same model
    assembled with the routers' own forward (`fuse_routers` skipped), for a static policy and combined."""
    from moetide.engine import assemble

    fuse_routers = assemble.fuse_routers
    path, _ = tiny_checkpoints[family]
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    params = moetide.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for policy in ("no-offload", "combined"):
        budget = None if policy == "no-offload" else "64MiB"
        outs = {}
        for fused in (True, False):
            monkeypatch.setattr(assemble, "fuse_routers", fuse_routers if fused else lambda *args: 0)
            llm = moetide.LLM(str(path), device="cuda", dtype="bfloat16", policy=policy, gpu_memory=budget)
            assert llm.loaded.fused_routers == (len(_routers(llm.loaded.model)) if fused else 0)
            outs[fused] = [o.token_ids for o in llm.generate(prompts, params)]
            llm.close()
        assert outs[True] == outs[False], policy
