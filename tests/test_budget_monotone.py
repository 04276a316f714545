"""More device memory never lowers the hi hit rate (demo model, CPU, deterministic counts).

The routing of every step is forced from one trace recorded on the demo model (`bench.replay`), so
every budget sees the same expert choices, and `--deterministic` publishes copies at step
boundaries only: the counts depend on the budget and the policy alone, never on timing. The hi hit
rate is `hits / experts_used` of `ExpertMetrics` (an expert that ran from a hi version on the device).
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
POLICIES = ("combined", "dynaexq", "lru", "on-demand", "finemoe")
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


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(policy=st.sampled_from(POLICIES), low=st.integers(0, 110), extra=st.integers(1, 150))
def test_a_larger_budget_never_gives_a_lower_hi_hit_rate(ordered, policy, low, extra):
    smallest = minimum_budget(_config(policy, None), model_bytes(_config(policy, None)))
    small = smallest + low * MIB
    large = small + extra * MIB
    assert hi_hit_rate(policy, large, ordered) >= hi_hit_rate(policy, small, ordered)


@pytest.mark.parametrize("policy", ["combined", "lru"])
def test_a_cap_that_holds_every_expert_in_hi_behaves_as_no_cap(ordered, policy):
    """1 GiB and 6 GiB: every expert resident in hi, as with no cap (the CPU's uncapped run keeps the
    checkpoint's tensors where they are: every use a hit)."""
    for budget in (ALL_HI, 1 << 30, 6 << 30):
        assert hi_hit_rate(policy, budget, ordered) == 1.0
