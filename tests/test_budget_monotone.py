"""More device memory never lowers the hi hit rate (demo model, CPU, deterministic counts).

The routing of every step is forced from one trace recorded on the demo model (`bench.replay`), so
every budget sees the same expert choices, and `--deterministic` publishes copies at step
boundaries only: the counts depend on the budget and the policy alone, never on timing. The hi hit
rate is `hits / experts_used` of `ExpertMetrics` (an expert that ran from a hi version on the device).

The lo precision is fixed (`--lo int2`): with `--lo auto` a larger budget may widen every expert's
lo version (int2+2 -> int2+4 -> int4), which takes bytes from the hi pool, so the hi hit rate dips
there by design (dynaexq, 3 -> 4 MiB above its smallest budget: 10 -> 8 hi slots, 5.7 % -> 4.7 %).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from moetide.analysis.trace import record_trace
from moetide.bench.replay import TraceReplay, trace_requests
from moetide.bench.runs import drive_engine
from moetide.config import EngineConfig
from moetide.engine.llm import build_engine, demo_model_path
from moetide.engine.memory import minimum_budget, model_bytes
from moetide.models.checkpoint import load_tokenizer
from moetide.models.registry import get_adapter

MIB = 1 << 20
POLICIES = ("combined", "dynaexq", "lru", "on-demand")
PROMPTS = ("How do I reverse a list in Python?", "Write a haiku about the sea.")
TOKENS = 12  # per request: one prefill step, then decode steps
ALL_HI = 200 * MIB  # above it every expert fits in hi on the demo model (96 MiB of float32 experts)


@pytest.fixture(scope="module")
def trace():
    path = demo_model_path()
    tokenizer = load_tokenizer(path)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    config = EngineConfig(model=str(path), device="cpu")
    return record_trace(
        model, get_adapter("qwen3_moe"), prompts, TOKENS, spec_distances=(config.prefetch_distance,)
    )


def _config(policy: str, budget: int | None) -> EngineConfig:
    return EngineConfig(
        model=str(demo_model_path()),
        device="cpu",
        policy=policy,
        gpu_memory_bytes=budget,
        deterministic=True,
        lo_precision="int2",  # see the module docstring
        max_num_seqs=1,
        max_model_len=256,
    )


def hi_hit_rate(policy: str, budget: int | None, trace) -> float:
    """The hi hit rate of `policy` at `budget` over the trace's requests, one at a time."""
    loaded, engine, _ = build_engine(_config(policy, budget), progress=False)
    replay = TraceReplay(loaded.model, loaded.adapter, trace)
    try:
        requests, _ = trace_requests(trace, loaded.config.vocab_size)
        loaded.runtime.metrics.reset()
        drive_engine(engine, requests, closed_loop=True)
        m = loaded.runtime.metrics.snapshot()
        assert replay.stats()["steps_replayed"] == len(trace)
        return m["hits"] / m["experts_used"]
    finally:
        replay.remove()
        if loaded.policy is not None:
            loaded.policy.close()
        loaded.runtime.residency.close()


@pytest.fixture(scope="module")
def ordered(trace):
    return trace_requests(trace, 8192)[1]


ANCHORS = (0, 4, 64)  # MiB above the smallest budget: a hi pool of top-k slots, of a dozen, of most


@pytest.fixture(scope="module")
def rates(ordered):
    """`rate(policy, budget)`: `hi_hit_rate`, each measured once per module."""
    cache: dict[tuple[str, int], float] = {}

    def rate(policy: str, budget: int) -> float:
        if (policy, budget) not in cache:
            cache[policy, budget] = hi_hit_rate(policy, budget, ordered)
        return cache[policy, budget]

    return rate


# combined, from its smallest budget to ~7 MiB above it: the hi pool stays at its 4 slots while the
# lo pool grows from 0 to 227 of 256 experts, and FineMoE's in-step prefetches into those 4 slots
# hit 0.0135-0.0174 of uses, not monotone in the budget (0.0155 at +0, 0.0135 at +1 and +4 MiB)
MONOTONE_CASES = [
    pytest.param("combined", marks=pytest.mark.xfail(strict=True, reason="not monotone near its smallest budget")),
    *POLICIES[1:],
]


@pytest.mark.parametrize("policy", MONOTONE_CASES)
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=st.integers(0, 150))
def test_a_larger_budget_never_gives_a_lower_hi_hit_rate(rates, policy, drawn):
    """Over the anchors and a drawn budget between the smallest and every expert in hi, sorted."""
    smallest = minimum_budget(_config(policy, None), model_bytes(_config(policy, None)))
    budgets = sorted({smallest + mib * MIB for mib in (*ANCHORS, drawn)})
    hit = [rates(policy, b) for b in budgets]
    for (b0, h0), (b1, h1) in zip(zip(budgets, hit), zip(budgets[1:], hit[1:])):
        assert h1 >= h0, f"{policy}: {b1 / MIB:.1f} MiB hit rate {h1:.4f} < {h0:.4f} at {b0 / MIB:.1f} MiB"


@pytest.mark.parametrize("policy", ["combined", "lru"])
def test_a_cap_that_holds_every_expert_in_hi_behaves_as_no_cap(ordered, policy):
    """1 GiB and 6 GiB: every expert resident in hi, as with no cap (the CPU's uncapped run keeps the
    checkpoint's tensors where they are: every use a hit)."""
    for budget in (ALL_HI, 1 << 30, 6 << 30):
        assert hi_hit_rate(policy, budget, ordered) == 1.0
