"""Sync-free steps for every policy: the forward pass never waits for the host.

On the demo model at `--gpu-memory 128MiB` every dynamic policy reads the device table (misses run
the resident lo version, or read the hi version zero-copy from host memory), and each step's uses
reach the residency one step later from the step's device buffers. (That no host sync happens on a
GPU is checked there: tests/test_gpu.py counts the reference path's syncs, the only ones a step has.)
"""

from __future__ import annotations

import pytest

import moetide
from moetide.policies.registry import POLICY_NAMES, policy_spec

PROMPTS = ["How do I reverse a list in Python?", "Écris un poème sur la mer."]
PARAMS = moetide.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_generates_and_accounts_every_use_one_step_late(policy):
    budget = None if policy == "no-offload" else "128MiB"  # no-offload holds every expert: no cap here
    llm = moetide.LLM(device="cpu", gpu_memory=budget, policy=policy, searcher="thread")
    try:
        out = llm.generate(PROMPTS, PARAMS)
        m = llm.metrics
    finally:
        llm.close()
    assert all(len(o.token_ids) == 6 for o in out)
    used = sum(c.used for c in m.layers)
    if policy_spec(policy).memory_mode in ("all-hi", "all-lo"):  # a static table: the CPU counts hits
        assert used == m.hits
        return
    assert m.steps_observed == m.steps == 6  # every step's routing reached the host (one prefill)
    assert used > 0 and used == m.hits + m.lo_runs + m.misses  # every use accounted, one step late


def test_on_miss_lo_is_refused_where_no_lo_version_is_kept():
    with pytest.raises(moetide.errors.ConfigError, match="use --on-miss zero-copy"):
        moetide.LLM(device="cpu", gpu_memory="128MiB", policy="on-demand", on_miss="lo")


def test_a_step_whose_forward_fails_is_never_accounted_and_the_engine_goes_on():
    """A forward that raises in its third MoE layer leaves that step's routing buffers partly
    unwritten: the step is dropped from the accounting (which would otherwise read garbage expert
    ids) and the next requests run and are accounted as usual."""
    llm = moetide.LLM(device="cpu", gpu_memory="128MiB", policy="lru")
    try:
        engine, runtime = llm.engine, llm.loaded.runtime
        layer = llm.loaded.model.model.layers[llm.loaded.moe_layers[2]]
        prompt = llm.tokenizer.encode(PROMPTS[0])
        # poison the buffers the failing step would have filled: without the drop they are read
        runtime.observations.views(len(prompt))["buffer"].fill_(0xAB)

        def fail(*_):
            raise RuntimeError("injected router failure")

        hook = layer.mlp.register_forward_pre_hook(fail)
        engine.add_request(prompt, PARAMS)
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
        hook.remove()
        engine.fail_running("error")
        runtime.flush_observations()
        failed_steps = runtime.metrics.steps - runtime.metrics.steps_observed
        out = llm.generate(PROMPTS, PARAMS)
        m = llm.metrics
    finally:
        llm.close()
    assert failed_steps == 1
    assert all(len(o.token_ids) == 6 for o in out)
    assert m.steps - m.steps_observed == 1 and sum(c.used for c in m.layers) > 0


def test_waiting_for_copies_in_flight_keeps_the_tokens_and_the_sync_free_step():
    """--wait-for-copies with copies slow enough to be in flight when their layer runs (100 MB/s):
    those layers wait for the copy on the "device" instead of reading host memory; the tokens are
    the zero-copy run's (the same hi weights), no host sync, and the waited copies count as hits."""
    params = moetide.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = {}
    for wait in (False, True):
        llm = moetide.LLM(device="cpu", gpu_memory="128MiB", policy="lru", wait_for_copies=wait,
                          simulated_copy_bytes_per_s=1e8)  # fmt: skip
        try:
            runs[wait] = ([o.token_ids for o in llm.generate(PROMPTS, params)], llm.metrics)
        finally:
            llm.close()
    (plain, m0), (waited, m1) = runs[False], runs[True]
    assert waited == plain
    assert m1.host_syncs == 0 and m1.hits_in_flight > 0 and m0.hits_in_flight == 0
    assert m1.hit_rate > m0.hit_rate
