"""moetide's forward equals transformers' own, family by family (tiny random configs, CPU fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import FAMILIES

import moetide
from moetide.engine.assemble import load_model

GREEDY_32 = moetide.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_checkpoints, family):
    path, reference = tiny_checkpoints[family]
    loaded = load_model(path, device="cpu", progress=False)
    ids = torch.randint(5, 90, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        got = loaded.model(ids).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # the experts really came from moetide's store: every MoE layer ran experts
    per_layer = loaded.runtime.metrics.snapshot()["per_layer"]
    assert len(per_layer) == len(loaded.moe_layers) and all(layer["used"] > 0 for layer in per_layer)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers_generate(tiny_checkpoints, family):
    path, reference = tiny_checkpoints[family]
    llm = moetide.LLM(path, device="cpu")
    prompt = [7, 8, 9, 10, 11, 12, 13]
    expected = reference.generate(
        torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=2
    )[0, len(prompt) :].tolist()
    out = llm.generate([prompt], GREEDY_32)[0]
    assert out.token_ids == expected
    assert len(out.token_ids) == 32 and out.finish_reason == "length"


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v2"])
def test_batch_of_different_lengths_equals_each_alone(tiny_checkpoints, family):
    path, _ = tiny_checkpoints[family]
    llm = moetide.LLM(path, device="cpu")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], list(range(20, 41)), [40, 41, 42, 43]]
    together = llm.generate(prompts, GREEDY_32)
    for prompt, out in zip(prompts, together, strict=True):
        alone = llm.generate([prompt], GREEDY_32)[0]
        assert out.token_ids == alone.token_ids


def test_sequences_join_and_leave_between_steps(qwen3_checkpoint):
    """A request added while others decode gets the same tokens as when run alone."""
    llm = moetide.LLM(qwen3_checkpoint, device="cpu")
    engine = llm.engine
    short = moetide.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = engine.add_request([5, 6, 7], GREEDY_32)
    second = engine.add_request([9, 10, 11, 12, 13], short)
    engine.step()
    engine.step()
    late = engine.add_request([30, 31], GREEDY_32)
    while engine.has_unfinished():
        engine.step()
    assert len(second.output_ids) == 3
    for seq in (first, late):
        alone = llm.generate([seq.prompt_ids], GREEDY_32)[0]
        assert seq.output_ids == alone.token_ids


def test_seeded_sampling_is_reproducible(qwen3_checkpoint):
    llm = moetide.LLM(qwen3_checkpoint, device="cpu")
    params = moetide.SamplingParams(
        max_tokens=12, temperature=0.9, top_p=0.9, top_k=20, seed=123, ignore_eos=True
    )
    a = llm.generate([[5, 6, 7]], params)[0].token_ids
    b = llm.generate([[5, 6, 7]], params)[0].token_ids
    c = llm.generate(
        [[5, 6, 7]], moetide.SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    )
    assert a == b
    assert len(a) == 12 and len(c[0].token_ids) == 12


def test_stop_string_cuts_the_text(qwen3_checkpoint):
    llm = moetide.LLM(qwen3_checkpoint, device="cpu")
    free = llm.generate(["abc"], moetide.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    stop = free.text[3:5]
    cut = llm.generate(
        ["abc"], moetide.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)]


def test_chat_uses_the_template(qwen3_checkpoint):
    llm = moetide.LLM(qwen3_checkpoint, device="cpu")
    messages = [{"role": "user", "content": "hi"}]
    ids = llm.apply_chat_template(messages)
    assert llm.tokenizer.decode(ids) == "U:hi A:"
    out = llm.chat(messages, moetide.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids and len(out.token_ids) == 5


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_bf16_parity(tiny_checkpoints, family):
    """On CUDA in bf16, logits stay within bf16 rounding of transformers' own bf16 forward.

    Tolerance: bf16 has 8 mantissa bits; two different but valid summation orders of the same bf16
    model differ by a few ulps of the logits' magnitude, so we bound the max error by 5e-2 absolute
    and the relative Frobenius error by 1e-2 (both measured well below on the H200).
    """
    path, reference = tiny_checkpoints[family]
    ref = copy.deepcopy(reference).to("cuda", torch.bfloat16)
    loaded = load_model(path, device="cuda", dtype="bfloat16", progress=False)
    ids = torch.randint(5, 90, (3, 17), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        expected = ref(ids).logits.float()
        got = loaded.model(ids).logits.float()
    rel = (got - expected).norm() / expected.norm()
    assert rel < 1e-2, rel
    assert (got - expected).abs().max() < 5e-2


def test_engine_forwards_never_use_cudnn_attention(qwen3_checkpoint):
    """Every engine forward (prefill and decode) runs with cuDNN's attention backend switched off
    (it builds a graph per KV length, so each decode step paid a new build), and the process's
    setting is restored afterwards."""
    llm = moetide.LLM(qwen3_checkpoint, device="cpu")
    seen = []
    handle = llm.loaded.model.register_forward_pre_hook(
        lambda module, args: seen.append(torch.backends.cuda.cudnn_sdp_enabled())
    )
    try:
        before = torch.backends.cuda.cudnn_sdp_enabled()
        llm.generate([[5, 6, 7]], moetide.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finally:
        handle.remove()
        llm.close()
    assert len(seen) == 3 and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.parametrize(
    "temperature, top_k, top_p, expected",
    [
        (1.0, 0, 1.0, [0.5, 0.3, 0.15, 0.05]),
        (0.5, 0, 1.0, [0.25 / 0.365, 0.09 / 0.365, 0.0225 / 0.365, 0.0025 / 0.365]),  # p^2, renormalised
        (2.0, 0, 1.0, None),  # p^(1/2), renormalised (computed below)
        (1.0, 2, 1.0, [0.625, 0.375, 0.0, 0.0]),
        (1.0, 0, 0.7, [0.625, 0.375, 0.0, 0.0]),  # 0.5 < 0.7 <= 0.8: the nucleus is {0, 1}
        (1.0, 0, 0.9, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (0.5, 3, 1.0, [0.25 / 0.3625, 0.09 / 0.3625, 0.0225 / 0.3625, 0.0]),
    ],
)
def test_sampler_honours_temperature_top_k_and_top_p(temperature, top_k, top_p, expected):
    """The empirical distribution of 4000 seeded draws from p = (0.5, 0.3, 0.15, 0.05) matches the one
    each parameter defines (within 0.035, > 4 standard errors); ignoring a parameter moves at least one
    frequency by >= 0.1 (temperature) or puts mass on a token that must never be drawn (top-k, top-p)."""
    from moetide.engine.sampling import sample_next_tokens

    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    if expected is None:
        expected = (p.sqrt() / p.sqrt().sum()).tolist()
    n = 4000
    logits = p.log().expand(n, -1).clone()
    params = [moetide.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n
    tokens = sample_next_tokens(logits, params, [(0, i) for i in range(n)])  # one draw per row
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor(expected), atol=0.035), (freq.tolist(), expected)
    for token, want in enumerate(expected):
        if want == 0.0:
            assert freq[token] == 0.0  # outside top-k / the nucleus: never drawn
