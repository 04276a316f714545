"""Decode ahead (`EngineConfig.decode_ahead`): a decode step is launched with the tokens the step before
sampled, still on the device, and the host reads them while it runs. Nothing but timing may change:
the same tokens, finish reasons and prefix-cache contents as reading every step's tokens first."""

from __future__ import annotations

import pytest

import moetide

PROMPTS = ["How do I reverse a list in Python?", "Write a haiku about the sea.", "What is 17 times 23?"]


class _Mode:
    """One static-int2 engine on the demo model (CPU), run with decode ahead on or off."""

    def __init__(self, llm, ahead: bool):
        self.llm, self.ahead = llm, ahead

    def __getattr__(self, name):
        self.llm.engine.decode_ahead = self.ahead
        return getattr(self.llm, name)


@pytest.fixture(scope="module")
def engines():
    llm = moetide.LLM(policy="static-int2", device="cpu", gpu_memory="128MiB")
    assert llm.engine.decode_ahead  # the default, where nothing follows the steps as they run
    yield {"auto": _Mode(llm, True), "off": _Mode(llm, False)}
    llm.close()


def run(llm, prompts, params) -> list[tuple[list[int], str, str]]:
    return [(o.token_ids, o.finish_reason, o.text) for o in llm.generate(prompts, params)]


def test_decode_ahead_gives_the_tokens_of_reading_every_step(engines):
    """Different lengths (a sequence leaving the batch while others decode on), outputs that cross
    KV blocks (their blocks are hashed for the prefix cache only once their token ids are read), and a
    stop token hit mid-run (the step run ahead for that sequence is dropped)."""
    plain = [moetide.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (22, 6, 17)]
    off = run(engines["off"], PROMPTS, plain)
    text = off[0][2]
    stop = text[len(text) // 3 :][:4]  # text the first prompt reaches a third of the way: it stops there
    params = list(plain)
    params[0] = moetide.SamplingParams(max_tokens=22, temperature=0, ignore_eos=True, stop=stop)
    expected = run(engines["off"], PROMPTS, params)
    assert expected[0][1] == "stop" and 0 < len(expected[0][0]) < 22
    before = engines["auto"].engine.ahead_steps
    assert run(engines["auto"], PROMPTS, params) == expected
    assert engines["auto"].engine.ahead_steps - before >= 8  # it did run ahead
    # the prefix cache holds the same blocks: a prompt extended by its own output reuses them
    again = [PROMPTS[2] + expected[2][2]]
    one = moetide.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert run(engines["auto"], again, one) == run(engines["off"], again, one)


def test_a_request_arriving_while_tokens_are_ahead_is_admitted_and_decodes_the_same(engines):
    params = moetide.SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    outputs = {}
    for mode, llm in engines.items():
        engine = llm.engine
        first = engine.add_request(llm.tokenizer.encode(PROMPTS[0]), params)
        for _ in range(5):  # the prefill, then decode steps (ahead in "auto")
            engine.step()
        late = engine.add_request(llm.tokenizer.encode(PROMPTS[1]), params)
        while engine.has_unfinished():
            engine.step()
        outputs[mode] = (first.output_ids, late.output_ids)
    assert outputs["auto"] == outputs["off"]
    assert all(len(ids) == 9 for ids in outputs["auto"])


def test_an_abort_while_a_token_is_ahead_ends_that_sequence_alone(engines):
    params = moetide.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = engines["auto"]
    engine = llm.engine
    seqs = [engine.add_request(llm.tokenizer.encode(p), params) for p in PROMPTS]
    for _ in range(4):
        engine.step()
    assert seqs[1].ahead == 1  # its last sampled token is on the device only
    assert engine.abort(seqs[1].request_id)
    while engine.has_unfinished():
        engine.step()
    assert seqs[1].finish_reason == "abort" and seqs[1].ahead == 0
    kept = engines["off"].generate([PROMPTS[0], PROMPTS[2]], params)
    assert [seqs[0].output_ids, seqs[2].output_ids] == [o.token_ids for o in kept]
    assert not engine.running and engine.blocks.num_used == 0


def test_sampled_rows_and_layer_feed_policies_read_every_step_first(engines):
    """A row that samples (not greedy) has its tokens read every step: no step runs ahead of it. The
    layer-feed policies (finemoe, lru, moe-infinity) follow each step as it runs: never ahead."""
    seeded = moetide.SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    before = engines["auto"].engine.ahead_steps
    assert run(engines["auto"], PROMPTS[:2], seeded) == run(engines["off"], PROMPTS[:2], seeded)
    assert engines["auto"].engine.ahead_steps == before
    llm = moetide.LLM(policy="lru", device="cpu", gpu_memory="128MiB")
    try:
        assert not llm.engine.decode_ahead
    finally:
        llm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("policy,budget", [("no-offload", None), ("static-int2", "1GiB")])
def test_decode_ahead_on_cuda_graphs_gives_the_tokens_of_reading_every_step(policy, budget):
    """On the device: the step replayed from its CUDA graph takes its input tokens from the step
    before's samples (a device copy into the graph's buffer), and no forward syncs with the host."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    params = [moetide.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 9, 23)]
    out = {}
    for mode in ("off", "auto"):
        llm = moetide.LLM(device="cuda", policy=policy, gpu_memory=budget, dtype="bfloat16", decode_ahead=mode)
        try:
            out[mode] = [o.token_ids for o in llm.generate(PROMPTS, params)]
            stats = llm.engine.runner.graph_stats()
            assert stats["replays"] > 20 and stats["failed"] is None, stats
            assert llm.metrics.host_syncs == 0
            if mode == "auto":
                assert llm.engine.ahead_steps >= 15
        finally:
            llm.close()
    assert out["auto"] == out["off"]


def test_a_kv_pool_that_ends_full_runs_as_far_ahead_as_a_roomy_one():
    """Ahead steps stop only where a decode needs a block the pool does not have: sequences whose last
    tokens fill every block still chain each step, as in a pool with room to spare."""
    params = moetide.SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)
    prompts = [[5 + i] * 20 for i in range(3)]  # 20 + 28 tokens each: 3 blocks, the last one full
    runs = {}
    for kv_tokens in (3 * 48, 16 * 48):
        llm = moetide.LLM(policy="static-int2", device="cpu", gpu_memory="128MiB", max_model_len=64,
                          kv_cache_tokens=kv_tokens)  # fmt: skip
        try:
            engine = llm.engine
            assert engine.blocks.num_blocks == kv_tokens // 16
            seqs = [engine.add_request(ids, params) for ids in prompts]
            while engine.has_unfinished():
                engine.step()
            runs[kv_tokens] = ([s.output_ids for s in seqs], engine.ahead_steps)
        finally:
            llm.close()
    (tight, tight_ahead), (roomy, roomy_ahead) = runs.values()
    assert tight == roomy and all(len(ids) == 28 for ids in tight)
    assert tight_ahead == roomy_ahead >= 20
