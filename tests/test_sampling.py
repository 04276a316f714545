"""The batched sampler (engine/sampling.py) against the row-by-row sampler it replaced.

The reference below is the previous sampler's filtering, row by row: the batched distribution must
equal it on every row of a mixed batch, and with the same noise the same token comes out. The
sampler is one call whose work does not grow with the rows (no per-row op, no host read), and a
row's token depends on its own logits, parameters and key only.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moetide
from moetide.engine.sampling import SamplingParams, filtered_probs, sample_next_tokens, uniform_noise


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The previous sampler's distribution of one row: `(V,)` -> `(V,)`."""
    row = (logits - logits.max()) / max(p.temperature, torch.finfo(torch.float32).tiny)
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= p.top_p
        drop[0] = False
        row = row.clone()
        row[order[drop]] = float("-inf")
    return torch.softmax(row, dim=-1)


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.9),
    SamplingParams(temperature=1e-30, top_k=3),
    SamplingParams(temperature=2.0, top_k=1),
    SamplingParams(temperature=0.9, top_p=1e-46),
    SamplingParams(temperature=1e300, top_k=7, top_p=0.5),
]


def _logits(rows: int, vocab: int = 97, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4


def test_the_batched_distribution_is_the_row_by_row_one():
    logits = _logits(len(PARAMS))
    got = filtered_probs(logits, PARAMS)
    for i, p in enumerate(PARAMS):
        want = reference_probs(logits[i], p)
        assert torch.equal(got[i] == 0, want == 0), f"row {i} ({p}) masks other tokens"
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-7, msg=f"row {i} ({p})")


def test_with_the_same_noise_each_row_draws_the_row_by_row_token():
    """torch.multinomial's one-sample draw is argmax(p / q), q ~ Exp(1): the reference with the
    row's own noise gives the batched sampler's token, for many keys."""
    logits = _logits(len(PARAMS), seed=1)
    for draw in range(25):
        keys = [(1000 + i, draw) for i in range(len(PARAMS))]
        got = sample_next_tokens(logits, PARAMS, keys)
        seeds, draws = torch.tensor([k[0] for k in keys]), torch.tensor([k[1] for k in keys])
        q = -torch.log(uniform_noise(seeds, draws, logits.shape[-1]))
        for i, p in enumerate(PARAMS):
            assert int(got[i]) == int((reference_probs(logits[i], p) / q[i]).argmax()), (draw, i, p)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = _logits(6, seed=2)
    greedy = SamplingParams(temperature=0)
    params = [greedy, PARAMS[0], greedy, PARAMS[3], greedy, PARAMS[1]]
    got = sample_next_tokens(logits, params, [(5, i) for i in range(6)])
    assert got[[0, 2, 4]].tolist() == logits[[0, 2, 4]].argmax(dim=-1).tolist()
    assert sample_next_tokens(logits, [greedy] * 6, [(0, 0)] * 6).tolist() == logits.argmax(dim=-1).tolist()


def test_a_rows_token_depends_on_its_own_key_and_not_on_the_batch():
    logits = _logits(5, seed=3)
    p = SamplingParams(temperature=1.0)
    alone = [int(sample_next_tokens(logits[i : i + 1], [p], [(42, 9)])[0]) for i in range(5)]
    others = [SamplingParams(temperature=0), PARAMS[2], PARAMS[4], p, PARAMS[7]]
    batched = sample_next_tokens(logits, [p] * 5, [(42, 9)] * 5)
    assert batched.tolist() == alone
    mixed = sample_next_tokens(logits, others, [(1, 1), (2, 2), (3, 3), (42, 9), (5, 5)])
    assert int(mixed[3]) == alone[3]
    # another draw of the same seed is new noise: over many draws the tokens vary
    draws = {int(sample_next_tokens(logits[:1], [p], [(42, d)])[0]) for d in range(40)}
    assert len(draws) > 3


def test_the_noise_is_uniform_and_a_function_of_its_key():
    seeds = torch.tensor([0, 1, 2**62 + 5, 2**63 - 1])
    draws = torch.tensor([0, 0, 7, 123456789])
    u = uniform_noise(seeds, draws, 20_000)
    assert u.shape == (4, 20_000) and ((u > 0) & (u < 1)).all()
    assert torch.equal(u, uniform_noise(seeds, draws, 20_000))
    for row in u:
        assert abs(float(row.mean()) - 0.5) < 0.01 and abs(float(row.var()) - 1 / 12) < 0.005
        assert abs(float((row < 0.1).float().mean()) - 0.1) < 0.01
    assert not torch.equal(u[0], u[1])  # seeds differ
    assert not torch.equal(uniform_noise(seeds[:1], torch.tensor([1]), 100), u[:1, :100])  # draws differ


class _Ops(TorchDispatchMode):
    """The aten ops a call runs, in order."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _ops_of(rows: int) -> list[str]:
    logits = _logits(rows, seed=4)
    params = [PARAMS[i % len(PARAMS)] for i in range(rows)]
    with _Ops() as mode:
        sample_next_tokens(logits, params, [(i, 0) for i in range(rows)])
    return mode.ops


def test_one_batched_call_whatever_the_rows_and_no_host_read():
    few, many = _ops_of(len(PARAMS)), _ops_of(8 * len(PARAMS))  # every parameter kind in both
    assert few == many, "the sampler's work grows with the rows: a per-row op"
    assert not [op for op in many if "_local_scalar_dense" in op or "item" in op]  # no .item()/.tolist()


@pytest.fixture(scope="module")
def demo():
    llm = moetide.LLM(device="cpu")
    yield llm
    llm.close()


def test_a_seeded_request_gives_its_tokens_alone_or_batched(demo):
    seeded = moetide.SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    other = moetide.SamplingParams(max_tokens=5, temperature=1.2, top_k=40, ignore_eos=True)
    prompt = "Write a haiku about the sea."
    alone = demo.generate([prompt], seeded)[0].token_ids
    batched = demo.generate(["def add(a, b):", prompt, "Bonjour"], [other, seeded, other])[1].token_ids
    assert batched == alone
    assert demo.generate([prompt], seeded)[0].token_ids == alone
