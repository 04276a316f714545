"""The layer feed: policies that predict a step's later layers see each layer while the step runs.

The device copies each MoE layer's routing row to a pinned mirror, then the step's number into
that layer's word; a thread publishes the layer to the policies and lets the residency start the
prefetches for later layers within the step (`ResidencyManager.in_step`). Here: the words and the
torn-read check of `StepObservations`, and the engine on the CPU (the same code path as CUDA: the
"device" copies land when the call returns, the thread is woken instead of polling).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moetide
from moetide.compute.observations import StepObservations

L, E, K, H = 3, 8, 2, 4


def _observations():
    obs = StepObservations(L, E, K, H, "cpu", decode_tokens=4)
    obs.want(logits=True, spec=True, embed=True, pools=True, feed=True)
    return obs


def _write_step(obs, iteration: int, tokens: int, layers: int):
    obs.begin_step(iteration, None, tokens)
    obs.record_embedding(torch.full((tokens, H), float(iteration)))
    obs.publish_embedding()
    for layer in range(layers):
        ids = torch.full((tokens, K), iteration % E, dtype=torch.int64) + torch.arange(K)
        obs.record_logits(layer, torch.full((tokens, E), float(layer)))
        obs.record_spec(layer, ids)
        obs.record_ids(layer, ids)
        obs.publish_layer(layer)


def test_each_published_layer_reads_back_with_its_step_and_the_rest_is_not_there_yet():
    obs = _observations()
    _write_step(obs, 5, tokens=2, layers=2)  # the step is at its third layer
    assert [obs.feed_seq(slot) for slot in range(1 + L)] == [5, 5, 5, -1]
    embed = obs.feed_read(0, 5, 2)["embed"]
    assert np.all(embed == 5.0)
    layer1 = obs.feed_read(2, 5, 2)
    assert layer1["ids"].tolist() == [[5, 6], [5, 6]] and np.all(layer1["logits"] == 1.0)
    assert layer1["spec"].tolist() == [[5, 6], [5, 6]]
    assert obs.feed_read(3, 5, 2) is None  # layer 2 has not routed
    assert obs.feed_read(2, 4, 2) is None  # not that step's
    obs.finish_step()
    # the step's record (one step later) reads the same bytes through the layer-major layout
    (record,) = obs.flush()
    assert record.ids[1].tolist() == [[5, 6], [5, 6]] and np.all(record.logits[1] == 1.0)


def test_a_read_the_next_step_has_begun_to_overwrite_is_refused():
    obs = _observations()
    _write_step(obs, 5, tokens=1, layers=L)
    obs.finish_step()
    _write_step(obs, 6, tokens=1, layers=0)  # step 6 has published its embedding, no layer yet
    # layer 0's slot still says step 5, but step 6 may be writing its row: the read is refused
    assert obs.feed_seq(1) == 5
    assert obs.feed_read(1, 5, 1) is None


def test_a_padded_steps_pad_rows_reach_neither_its_record_nor_the_feed_nor_its_embedding():
    """A step of 4 rows whose last is a pad row (`real=3`): the record and the feed hold rows 0..2,
    and the embedding is their mean, counted on the device, so the next step of the same buffers
    with all 4 rows real (a replayed graph) gets its own mean."""
    obs = _observations()
    for iteration, real in ((5, 3), (6, 4)):
        obs.begin_step(iteration, None, 4, real)
        obs.record_embedding(torch.tensor([[1.0], [2.0], [6.0], [100.0]]).expand(4, H))
        obs.publish_embedding()
        for layer in range(L):
            ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
            obs.record_logits(layer, torch.arange(4 * E, dtype=torch.float32).view(4, E))
            obs.record_spec(layer, ids)
            obs.record_ids(layer, ids)
            obs.record_pools(layer, torch.arange(E, dtype=torch.int32), ids)
            obs.publish_layer(layer)
        fed = obs.feed_read(2, iteration, 4, real)
        assert fed["ids"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]][:real]
        assert fed["logits"].shape == (real, E) and fed["spec"].shape == (real, K)
        embed = obs.feed_read(0, iteration, 4, real)["embed"]
        np.testing.assert_allclose(embed, 3.0 if real == 3 else 109.0 / 4)
        obs.finish_step()
    padded, whole = obs.flush()
    assert padded.num_tokens == 3 and padded.ids.shape == (L, 3, K) and padded.pools.shape == (L, 3, K)
    assert padded.logits.shape == (L, 3, E) and padded.spec.shape == (L, 3, K)
    assert padded.ids[0].tolist() == [[0, 1], [2, 3], [4, 5]] and np.all(padded.embed == 3.0)
    assert sorted(np.unique(padded.ran_from()[0]).tolist()) == [-2, 0, 1, 2, 3, 4, 5]  # experts 6, 7 unused
    assert whole.num_tokens == 4 and whole.ids.shape == (L, 4, K)


@pytest.mark.parametrize("policy", ["finemoe", "lru"])
def test_in_step_policies_follow_every_step_as_it_runs_and_start_copies_within_it(policy):
    llm = moetide.LLM(device="cpu", gpu_memory="128MiB", policy=policy, searcher="thread")
    try:
        out = llm.generate(["How do I reverse a list in Python?"], moetide.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        feed = llm.loaded.policy_hooks.feed
        assert feed is not None and feed.idle(10)
        stats, m = feed.stats(), llm.metrics
        searches = llm.loaded.policy.stats().get("trajectory_searches")
    finally:
        llm.close()
    assert len(out[0].token_ids) == 6 and m.host_syncs == 0
    assert stats["errors"] == 0
    assert stats["steps_seen"] + stats["steps_cut"] == m.steps  # every step followed
    assert stats["layers_seen"] >= stats["steps_seen"] * len(llm.loaded.moe_layers)
    assert stats["copies_started"] > 0  # prefetches started within the steps they were for
    if policy == "finemoe":
        assert searches > 0  # the paper's in-step form: trajectory searches on the running step


def test_deterministic_runs_have_no_feed():
    llm = moetide.LLM(device="cpu", gpu_memory="128MiB", policy="finemoe", deterministic=True)
    try:
        assert llm.loaded.policy_hooks.feed is None
        assert llm.loaded.policy.config.lookahead > 0  # it decides a step behind instead
    finally:
        llm.close()
