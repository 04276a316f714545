"""`--deterministic`: residency decisions are a function of the request stream alone, so two identical
runs give identical greedy tokens for every policy, even while copies land at times the engine
does not control (a paced copy thread on the CPU) and FineMoE's searcher would run on its own."""

from __future__ import annotations

import pytest

import moetide
from moetide.policies.registry import step_clock

PROMPTS = ["How do I reverse a list in Python?", "Write a haiku about the sea.", "What is 17 times 23?"]
# a copy of one demo-model hi expert (~0.4 MB) takes ~2 ms at this pace: copies are still in flight
# while later layers run, so what is published when is up to the copy thread's timing
PACED = {"simulated_copy_bytes_per_s": 2e8}


def greedy(policy: str, deterministic: bool) -> tuple[list[list[int]], list[tuple[int, int, int]], int]:
    """(greedy tokens, per-layer (hits, lo runs, misses), copies) of one run of PROMPTS."""
    llm = moetide.LLM(policy=policy, device="cpu", gpu_memory="128MiB", deterministic=deterministic, **PACED)
    try:
        params = moetide.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        tokens = [o.token_ids for o in llm.generate(PROMPTS, params)]
        snap = llm.metrics.snapshot()
        return tokens, [(c["hits"], c["lo_runs"], c["misses"]) for c in snap["per_layer"]], snap["copies"]
    finally:
        llm.close()


@pytest.mark.parametrize("policy", ["combined", "finemoe", "dynaexq", "lru", "moe-infinity", "on-demand"])
def test_two_deterministic_runs_give_identical_tokens_and_decisions(policy):
    """Same tokens, and the same residency decisions layer by layer (what ran hi, what ran lo in its
    place, what missed; how many copies): timing never leaks into a decision."""
    first, second = greedy(policy, True), greedy(policy, True)
    assert first == second


def test_deterministic_mode_publishes_copies_only_at_step_boundaries():
    llm = moetide.LLM(policy="combined", device="cpu", gpu_memory="128MiB", deterministic=True, **PACED)
    try:
        residency = llm.loaded.runtime.residency
        assert residency.options.deterministic
        assert llm.loaded.policy.prefetch_policy.synchronous  # searches inline, on the forward thread
        llm.generate(PROMPTS[:1], moetide.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        residency.set_precision(0, 0, "hi")
        residency.begin_step(residency.iteration + 1)  # issues the promotion of (0, 0)
        residency.end_step()
        version = residency.handles[0][0].versions["hi"]
        version.ready.synchronize()  # landed, yet not visible until the next step starts
        assert not residency.cache.publish_if_ready(version)
        residency.begin_step(residency.iteration + 1)
        assert version.published
        residency.end_step()
    finally:
        llm.close()


def test_step_clock_counts_calls():
    clock = step_clock()
    assert [clock(), clock(), clock()] == [0.0, 1.0, 2.0]
