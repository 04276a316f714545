"""The paged KV cache: block allocation and the prefix cache (engine/kv_blocks.py), attention over
block tables (engine/paged_cache.py), chunked prefill and recompute preemption (engine/scheduler.py).

Greedy outputs are checked against transformers' own `generate` on each prompt alone (fp32, CPU),
for every family, prompts of 3 to 1,500 tokens batched together (the long ones prefilled in
chunks interleaved with the others' decodes), and pools small enough to preempt."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, save_tiny_model

import moetide
from moetide.engine.kv_blocks import BlockAllocator
from moetide.errors import ConfigError

# -- the allocator ------------------------------------------------------------------------------------


def test_blocks_are_reference_counted_and_the_pad_block_is_never_handed_out():
    blocks = BlockAllocator(4, block_size=4, prefix_caching=False)
    table, cached = blocks.allocate(list(range(10)))  # 3 blocks
    assert cached == 0 and len(table) == 3 and 0 not in table
    assert blocks.num_used == 3 and blocks.num_available == 1
    assert blocks.allocate(list(range(8))) is None  # 2 blocks: only 1 left, nothing taken
    assert blocks.num_used == 3
    assert blocks.append_slot(table, 13) and len(table) == 4  # token 13 starts block 4
    assert not blocks.append_slot(table, 17)  # no block left
    blocks.free(table)
    assert table == [] and blocks.num_used == 0 and blocks.num_available == 4


def test_a_request_reuses_the_longest_cached_prefix_and_always_computes_one_token():
    blocks = BlockAllocator(8, block_size=4)
    first = list(range(100, 110))  # blocks [100..103] [104..107] [108, 109]
    table, cached = blocks.allocate(first)
    assert cached == 0
    assert blocks.commit(table, first, num_computed=10, hashed=0) == 2  # two full blocks hashed
    shared = first[:8] + [7, 7, 7]
    other, cached = blocks.allocate(shared)
    assert cached == 8 and other[:2] == table[:2] and other[2] not in table
    assert blocks.num_used == 4  # the two prefix blocks are shared, not copied
    # a prompt made of cached full blocks only still computes its last block (its logits are needed)
    exact, cached = blocks.allocate(first[:8])
    assert cached == 4 and exact[0] == table[0] and exact[1] != table[1]
    # same tokens after a different prefix: no hit (the hash chains the prefix)
    _, cached = blocks.allocate([0, 0, 0, 0, *first[4:8], 1])
    assert cached == 0
    assert blocks.stats()["prefix_cache_hits"] == 12


def test_cached_blocks_survive_their_sequence_and_are_evicted_least_recently_freed_first():
    blocks = BlockAllocator(4, block_size=2)
    a = [1, 2, 3, 4, 5]
    table, _ = blocks.allocate(a)  # 3 blocks
    blocks.commit(table, a, num_computed=5, hashed=0)
    blocks.free(table)
    assert blocks.num_used == 0 and blocks.num_cached == 2  # [1,2] [3,4] kept; [5] freed
    again, cached = blocks.allocate(a)
    assert cached == 4  # the prefix came back from the cache after its sequence finished
    blocks.free(again)
    # two blocks are free; a third evicts a cached one: the table's tail ([3, 4]) before its head
    taken, _ = blocks.allocate([9] * 5)
    assert len(taken) == 3 and blocks.evictions == 1
    assert len(blocks.match_prefix(a)) == 1  # [1, 2] is still cached, [3, 4] is gone


# -- the engine, against transformers' generate ----------------------------------------------------------


@pytest.fixture(scope="module")
def long_checkpoints(tmp_path_factory):
    """Every family's tiny random checkpoint with a context of 2,048 positions."""
    root = tmp_path_factory.mktemp("long")
    return {
        family: (root / family, save_tiny_model(family, root / family, max_position_embeddings=2048))
        for family in FAMILIES
    }


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(5, 90, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> moetide.SamplingParams:
    return moetide.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _reference(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2
    )
    return out[0, len(prompt) :].tolist()


def _run_checking_blocks(engine, requests, on_step=None) -> list[list[int]]:
    """Add `(prompt, max_tokens)` requests, step until done; after every step the blocks in use
    stay within Σ ceil(tokens / block) + 1 over the running sequences (`on_step(seqs)` sees them)."""
    seqs = [engine.add_request(prompt, _greedy(n)) for prompt, n in requests]
    while engine.has_unfinished():
        engine.step()
        assert engine.blocks.num_used <= engine.scheduler.used_block_bound()
        if on_step is not None:
            on_step(seqs)
    assert engine.blocks.num_used == len({b for s in engine.running for b in s.block_table})
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_of_3_to_1500_tokens_batched_give_transformers_greedy_tokens(long_checkpoints, family):
    """Four prompts admitted together: the 1,500-token one is prefilled in chunks (512 tokens a
    step, the first shared with the short prompts) while the short ones already decode."""
    path, reference = long_checkpoints[family]
    lengths = [(3, 8), (40, 6), (1500, 4), (600, 5)]
    requests = [(_prompt(n, seed), out) for seed, (n, out) in enumerate(lengths)]
    decoded_while_long_prefills = []

    def watch(seqs):
        if seqs[2].num_computed < 1500:
            decoded_while_long_prefills.append(len(seqs[0].output_ids))

    llm = moetide.LLM(path, device="cpu")
    try:
        got = _run_checking_blocks(llm.engine, requests, watch)
    finally:
        llm.close()
    assert len(decoded_while_long_prefills) >= 3  # its prefill took three steps or more
    assert decoded_while_long_prefills[-1] >= 3  # ... and the 3-token prompt decoded meanwhile
    assert got == [_reference(reference, prompt, n) for prompt, n in requests]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_preempted_sequences_recompute_and_give_the_same_tokens(long_checkpoints, family):
    """A pool of 8 blocks of 16 tokens for four sequences that need 4-5 blocks each: the youngest
    are preempted and recomputed, and every output is what it is alone."""
    path, reference = long_checkpoints[family]
    requests = [(_prompt(10 + 5 * i, 50 + i), 50 - 5 * i) for i in range(4)]
    llm = moetide.LLM(path, device="cpu", kv_cache_tokens=8 * 16)
    try:
        assert llm.engine.blocks.num_blocks == 8
        got = _run_checking_blocks(llm.engine, requests)
        assert llm.engine.scheduler.preemptions >= 1
    finally:
        llm.close()
    assert got == [_reference(reference, prompt, n) for prompt, n in requests]


def test_preemption_leaves_seeded_sampling_unchanged(long_checkpoints):
    """Sampled (temperature 0.9, a seed per request): each sequence's own generator carries on
    where it was, so a small pool that preempts gives the tokens of a pool that never does."""
    path, _ = long_checkpoints["qwen3_moe"]
    prompts = [_prompt(12 + 3 * i, 80 + i) for i in range(4)]
    runs = {}
    for pool in (None, 8 * 16):
        llm = moetide.LLM(path, device="cpu", **({"kv_cache_tokens": pool} if pool else {}))
        try:
            params = [
                moetide.SamplingParams(max_tokens=40, temperature=0.9, seed=i, ignore_eos=True) for i in range(4)
            ]
            seqs = [llm.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
            while llm.engine.has_unfinished():
                llm.engine.step()
            runs[pool] = ([s.output_ids for s in seqs], llm.engine.scheduler.preemptions)
        finally:
            llm.close()
    assert runs[None][1] == 0 and runs[8 * 16][1] >= 1
    assert runs[8 * 16][0] == runs[None][0]


def test_demo_model_mixed_lengths_with_preemption_give_transformers_greedy_tokens():
    """The demo model (float32): a 520-token prompt prefilled in two chunks beside shorter ones,
    in a pool too small for all of them: preemptions, and every output is transformers' alone."""
    from transformers import AutoModelForCausalLM

    from moetide.engine.llm import demo_model_path

    reference = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    # the 520-token prompt takes 33 of the pool's 38 blocks first; the others then grow into the rest
    lengths = [(520, 20), (60, 24), (20, 8), (3, 8)]
    requests = [([t + 100 for t in _prompt(n, 7 + n)], out) for n, out in lengths]
    llm = moetide.LLM(device="cpu", policy="no-offload", dtype="float32", kv_cache_tokens=38 * 16)
    try:
        got = _run_checking_blocks(llm.engine, requests)
        assert llm.engine.scheduler.preemptions >= 1
    finally:
        llm.close()
    assert got == [_reference(reference, prompt, n) for prompt, n in requests]


def test_prefix_cache_hits_and_outputs_equal_without_it(long_checkpoints):
    path, _ = long_checkpoints["qwen3_moe"]
    system = _prompt(70, 3)  # 4 full blocks shared
    requests = [(system + _prompt(5 + i, 10 + i), 6) for i in range(3)]
    outputs = {}
    for caching in (False, True):
        llm = moetide.LLM(path, device="cpu", prefix_caching=caching)
        try:
            first = _run_checking_blocks(llm.engine, requests[:1])  # alone: its blocks are cached after
            rest = _run_checking_blocks(llm.engine, requests[1:])
            outputs[caching] = first + rest
            stats = llm.engine.kv_stats()
        finally:
            llm.close()
        assert stats["prefix_cache_hits"] == (2 * 64 if caching else 0)
        assert stats["prefix_cache_queries"] == (sum(len(p) for p, _ in requests) if caching else 0)
    assert outputs[True] == outputs[False]


def test_a_prompt_beyond_the_kv_pool_is_refused_in_one_line(long_checkpoints):
    path, _ = long_checkpoints["qwen3_moe"]
    llm = moetide.LLM(path, device="cpu", kv_cache_tokens=64)
    try:
        with pytest.raises(ConfigError) as info:
            llm.generate([_prompt(100, 1)], _greedy(4))
        message = str(info.value)
        assert "\n" not in message and "needs 7 KV blocks" in message and "holds 4" in message
        assert llm.generate([_prompt(50, 1)], _greedy(14))[0].finish_reason == "length"  # 64 tokens fit
    finally:
        llm.close()


@pytest.mark.parametrize(
    "family,overrides",
    [
        ("mixtral", {"sliding_window": 8}),  # every layer slides
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),  # mixed
    ],
)
def test_sliding_window_layers_see_the_window_only(tmp_path, family, overrides):
    """The engine's own 4D mask applies the config's window (one mask, or one per layer kind) as
    transformers' mask functions would: greedy tokens equal `generate` past the window."""
    reference = save_tiny_model(family, tmp_path, **overrides)
    if family == "qwen2_moe":
        assert set(reference.config.layer_types) == {"full_attention", "sliding_attention"}
    requests = [(_prompt(30, 5), 12), (_prompt(4, 6), 12)]
    llm = moetide.LLM(tmp_path, device="cpu")
    try:
        got = _run_checking_blocks(llm.engine, requests)
    finally:
        llm.close()
    assert got == [_reference(reference, prompt, n) for prompt, n in requests]


def test_mask_sizes_are_those_of_the_gathered_rows():
    from moetide.engine.paged_cache import PagedKVCache

    cache = PagedKVCache(8, 16, torch.device("cpu"), grow=True)
    assert cache.get_mask_sizes(5, 0) == (5, 0)  # no step laid out yet: the query alone
    cache.set_step(torch.arange(16, 21), torch.tensor([[1, 2, 0]]))
    assert cache.get_mask_sizes(5, 0) == (3 * 16, 0)  # three blocks of 16 gathered per row
