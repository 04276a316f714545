"""Fused q/k/v projections (`compute/projections.py`): one matmul per attention call, the same outputs,
no extra memory, no graph break under torch.compile, and a fallback where a projection reads
another input."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES
from torch import nn

from moetide.compute.projections import PRODUCT, fuse_qkv


class Attention(nn.Module):
    """The shape of transformers' attention modules: three projections of the first input."""

    def __init__(self, hidden=32, heads=(32, 16, 16), bias=False, other_input=False):
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads[0], bias=bias)
        self.k_proj = nn.Linear(hidden, heads[1], bias=bias)
        self.v_proj = nn.Linear(hidden, heads[2], bias=bias)
        self.o_proj = nn.Linear(heads[0], hidden, bias=False)
        self.other_input = other_input

    def forward(self, hidden_states, scale=1.0):
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states * 2 if self.other_input else hidden_states)
        v = self.v_proj(hidden_states)
        return self.o_proj(q * scale) + torch.cat([k, v], dim=-1)


def _linear_calls(module, *args, **kwargs) -> tuple[torch.Tensor, int]:
    calls = []
    real = torch.nn.functional.linear
    torch.nn.functional.linear = lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw)
    try:
        return module(*args, **kwargs), len(calls)
    finally:
        torch.nn.functional.linear = real


def test_three_projections_become_one_matmul_with_the_same_outputs_and_views_of_one_weight():
    torch.manual_seed(0)
    model = nn.Sequential(Attention(bias=True), Attention(bias=True))
    x = torch.randn(3, 5, 32)
    want, calls_before = _linear_calls(model, x)
    params_before = sum(p.numel() for p in model.parameters())
    assert fuse_qkv(model) == 2
    got, calls_after = _linear_calls(model, x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert (calls_before, calls_after) == (8, 4)  # per module: q, k, v, o -> qkv, o
    assert sum(p.numel() for p in model.parameters()) == params_before
    attn = model[0]
    bases = {attn.q_proj.weight.untyped_storage().data_ptr(), attn.k_proj.weight.untyped_storage().data_ptr(),
             attn.v_proj.weight.untyped_storage().data_ptr()}  # fmt: skip
    assert len(bases) == 1  # one (64, 32) tensor, each projection's weight a view of its rows
    assert getattr(attn, PRODUCT) is None  # the product is dropped after the call


def test_a_projection_of_another_input_computes_its_own_product():
    torch.manual_seed(1)
    attn = Attention(other_input=True)
    x = torch.randn(4, 32)
    want = attn(x, scale=0.5)
    fuse_qkv(attn)
    torch.testing.assert_close(attn(hidden_states=x, scale=0.5), want, rtol=1e-6, atol=1e-6)


def test_mismatched_projections_are_left_alone():
    attn = Attention()
    attn.k_proj = nn.Linear(32, 16, bias=True)  # a bias on one projection only
    assert fuse_qkv(attn) == 0
    assert fuse_qkv(Attention()) == 1


def test_a_compiled_model_traces_the_fused_projections_whole():
    """torch.compile of the enclosing model (as the engine compiles a decode step) traces the pre-hook,
    the columns of its product and the forward hook inline, in one graph (fullgraph: a break raises),
    with one matmul of the input for each module's three projections, and no recompile."""
    torch.manual_seed(2)
    model = nn.Sequential(Attention(), Attention())
    x = torch.randn(2, 32)
    want = model(x)
    fuse_qkv(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled(x), want, rtol=1e-6, atol=1e-6)
    assert len(graphs) == 1
    linears = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert len(linears) == 4  # per module: qkv, o
    assert all(getattr(m, PRODUCT) is None for m in model)


def test_the_demo_model_fuses_every_attention_and_gives_the_unfused_logits(monkeypatch):
    """The engine fuses every attention's projections; the logits equal those of the same model
    assembled without the fusion (`fuse_qkv` skipped)."""
    import moetide
    from moetide.engine import assemble
    from moetide.engine.llm import demo_model_path

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    logits, fused = {}, {}
    for fuse in (False, True):
        with monkeypatch.context() as patch:
            if not fuse:
                patch.setattr(assemble, "fuse_qkv", lambda model: 0)
            llm = moetide.LLM(demo_model_path(), policy="no-offload", dtype="float32")
        with torch.no_grad():
            logits[fuse] = llm.loaded.model(ids).logits.float()
        fused[fuse] = llm.loaded.fused_qkv
        layers = llm.loaded.config.num_hidden_layers
        llm.close()
    assert fused == {False: 0, True: layers}
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_transformers_logits_with_its_projections_fused(tiny_checkpoints, family):
    """Each supported family's attention (biases on q/k/v in some, grouped kv heads in others) fused
    where it has the triplet, and the logits of transformers' own model; DeepSeek-V2's low-rank
    attention has none and is left as it is."""
    import moetide

    path, reference = tiny_checkpoints[family]
    llm = moetide.LLM(str(path), policy="no-offload", dtype="float32")
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        got = llm.loaded.model(ids).logits.float()
        want = reference(ids).logits.float()  # (the fixture's float32 model, shared: not converted)
    fused = llm.loaded.fused_qkv
    llm.close()
    assert fused == (0 if family == "deepseek_v2" else reference.config.num_hidden_layers)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
