"""Decode from fixed buffers over the paged KV cache (engine/graphed_decode.py): the fixed-buffer
step computes what the eager step computes, through rows joining and leaving and the block tables
outgrowing their bucket; on CUDA the same step captured as a CUDA graph and replayed does too. A
batch runs padded to its row bucket: the pad rows stay finite and out of every record, observation
and counter the policies and metrics read."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import moetide
from moetide import SamplingParams
from moetide.engine.graphed_decode import MAX_STATES, ROW_BUCKETS, GraphedDecoder, row_bucket, width_bucket
from moetide.engine.paged_cache import PagedKVCache
from moetide.engine.runner import ENGINE_SDPA_BACKENDS, DecodeBatch

PROMPTS = ["def add(a, b):", "Tell me a story about a cat who", "Bonjour"]


def _decoder(
    llm, *, capture: bool, column_bucket: int, compile_step: bool = False, row_buckets=ROW_BUCKETS
) -> GraphedDecoder:
    """The decoder the engine builds on CUDA (`engine.llm.graphed_decoder`); `row_buckets=None`: a
    shape per exact row count, no pad rows."""
    return GraphedDecoder(
        llm.loaded.model,
        llm.engine.runner.kv,
        llm.loaded.runtime.decode_is_sync_free,
        ENGINE_SDPA_BACKENDS,
        capture=capture,
        column_bucket=column_bucket,
        compile_step=compile_step,
        max_rows=llm.config.max_num_seqs,
        row_buckets=row_buckets,
    )


def _teacher_forced_logits(llm, graphs, steps: int) -> list[torch.Tensor]:
    """Prefill PROMPTS together, then decode `steps` steps feeding fixed tokens; logits per step."""
    engine, runner = llm.engine, llm.engine.runner
    runner.graphs = graphs
    params = moetide.SamplingParams(max_tokens=64)
    seqs = [engine.add_request(llm.tokenizer.encode(p), params) for p in PROMPTS]
    scheduled = engine.scheduler.schedule()  # admits all three: one packed prefill
    assert [s for s, _ in scheduled.prefill] == seqs
    runner.kv.reserve(engine.blocks.high_water)
    logits = runner.prefill(scheduled.prefill)
    for seq, n in scheduled.prefill:
        engine.scheduler.computed(seq, n)
    tokens = logits.argmax(-1).tolist()
    out = []
    for i in range(steps):
        for seq, token in zip(seqs, tokens, strict=True):
            seq.output_ids.append((token + 7 * i) % logits.shape[-1])
            assert engine.blocks.append_slot(seq.block_table, seq.num_tokens)
        runner.kv.reserve(engine.blocks.high_water)
        logits = runner.decode(seqs)
        for seq in seqs:
            engine.scheduler.computed(seq, 1)
        out.append(logits.float().cpu())
    for seq in seqs:
        seq.finish("abort")
    engine.scheduler.drop_finished()
    assert engine.blocks.num_used == 0
    runner.graphs = None
    return out


def _assert_steps_close(got, want, *, atol: float, rtol: float, label: str = "") -> None:
    """Per-step logits `(B, V)` of two runs agree; a failure names the step."""
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        message = lambda m, step=step: f"{label}step {step}: {m}"  # a callable keeps torch's report
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=message)


CPU_TOL = {"atol": 2e-4, "rtol": 1e-4}  # float32 on the CPU: fixed-buffer and eager steps agree this closely


def test_the_fixed_buffer_step_computes_the_eager_steps_logits_through_table_growth():
    llm = moetide.LLM(device="cpu", policy="no-offload")
    try:
        want = _teacher_forced_logits(llm, None, 12)
        graphs = _decoder(llm, capture=False, column_bucket=8)
        got = _teacher_forced_logits(llm, graphs, 12)
    finally:
        llm.close()
    assert graphs.entries == 12
    assert graphs.allocations >= 2  # the tables outgrew their bucket: buffers of the next width
    _assert_steps_close(got, want, **CPU_TOL)


def test_a_later_batch_of_the_same_shape_reuses_the_buffers_and_computes_the_same():
    llm = moetide.LLM(device="cpu", policy="no-offload")
    try:
        want = _teacher_forced_logits(llm, None, 6)
        graphs = _decoder(llm, capture=False, column_bucket=64)
        first = _teacher_forced_logits(llm, graphs, 6)
        again = _teacher_forced_logits(llm, graphs, 6)
    finally:
        llm.close()
    assert graphs.entries == 12 and graphs.allocations == 1
    _assert_steps_close(first, want, **CPU_TOL)
    _assert_steps_close(again, want, **CPU_TOL, label="reused, ")


def _generate(llm, graphs):
    llm.engine.runner.graphs = graphs
    llm.engine.runner.fold_prefill_tokens = 0  # decode rows only (prefill rows: see the folding test)
    params = [moetide.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (5, 19, 11)]
    outs = [llm.engine.add_request(llm.tokenizer.encode(p), sp) for p, sp in zip(PROMPTS, params, strict=True)]
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.runner.graphs = None
    return [s.output_ids for s in outs]


def test_continuous_batching_from_fixed_buffers_gives_the_same_tokens():
    """Rows leave at different steps (max_tokens 5/19/11): each row bucket (3 rows run as 4) gets
    buffers of its own, and the rows' block tables are rewritten into them every step."""
    llm = moetide.LLM(device="cpu", policy="no-offload")
    try:
        want = _generate(llm, None)
        graphs = _decoder(llm, capture=False, column_bucket=16)
        got = _generate(llm, graphs)
    finally:
        llm.close()
    assert got == want
    assert set(graphs.rows_entered) == {3, 2, 1}


def test_dynamic_policies_decode_from_fixed_buffers():
    """Every policy reads the device table: its steps are sync-free and run from fixed buffers (the
    observers write device buffers, read a step later), with the same tokens as the dynamic path
    (hi-cache experts are the checkpoint's weights, wherever they are read from)."""
    llm = moetide.LLM(device="cpu", policy="finemoe", gpu_memory="25%", searcher="thread")
    try:
        assert llm.loaded.runtime.decode_is_sync_free(1)
        want = _generate(llm, None)
        graphs = _decoder(llm, capture=False, column_bucket=16)
        got = _generate(llm, graphs)
        assert got == want
        assert graphs.entries >= 1
        assert llm.metrics.host_syncs == 0
    finally:
        llm.close()
    llm = moetide.LLM(device="cpu", policy="no-offload")
    try:
        graphs = _decoder(llm, capture=False, column_bucket=16)
        assert llm.loaded.runtime.decode_is_sync_free(4)
        handle = llm.loaded.model.get_input_embeddings().register_forward_hook(lambda *a: None)
        try:
            _generate(llm, graphs)
        finally:
            handle.remove()
        assert graphs.entries == 0  # a hook added after start-up would be skipped by a replay
    finally:
        llm.close()


def _row_diffs(got, want) -> torch.Tensor:
    """(steps, rows): max |logit difference| of each row at each step."""
    return torch.stack([(g - w).abs().amax(-1) for g, w in zip(got, want, strict=True)])


def _argmax_agreement(got, want) -> int:
    return sum(int((g.argmax(-1) == w.argmax(-1)).sum()) for g, w in zip(got, want, strict=True))


def _assert_within_run_to_run_noise(got, want, control, label: str) -> None:
    """bf16 on the H200 is not bit-reproducible from run to run (run 15: the same eager path twice
    differs by up to 1.2 in a logit, median 0.125 per row), so a replay is held to the noise of
    `control` (a second eager run against `want`): a typical row no further off than twice the noise,
    and the greedy tokens no less often equal. A stale position, mask column or KV write moves every
    row by several units."""
    noise, diff = _row_diffs(control, want), _row_diffs(got, want)
    assert float(diff.median()) <= 2 * float(noise.median()) + 0.05, (label, diff, noise)
    assert _argmax_agreement(got, want) >= _argmax_agreement(control, want) - 2, (label, diff, noise)


@pytest.mark.gpu
@pytest.mark.parametrize("policy,budget", [("no-offload", None), ("static-int2", "1GiB")])
def test_cuda_graph_replays_compute_what_the_same_step_computes_eagerly(policy, budget):
    """bf16, three rows: the captured step against the same static-KV step run eagerly (same kernels,
    same shapes: only the capture differs), through a re-entry (bucket 8); then a later batch of
    the same shape replays the graph it left behind."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = moetide.LLM(device="cuda", policy=policy, gpu_memory=budget, dtype="bfloat16", cuda_graphs="off")
    try:
        want = _teacher_forced_logits(llm, _decoder(llm, capture=False, column_bucket=8), 10)
        control = _teacher_forced_logits(llm, _decoder(llm, capture=False, column_bucket=8), 10)
        graphs = _decoder(llm, capture=True, column_bucket=8)
        got = _teacher_forced_logits(llm, graphs, 10)
        assert graphs.failed is None, graphs.failed
        assert graphs.captures >= 2 and graphs.replays == 10, (graphs.captures, graphs.replays)
        _assert_within_run_to_run_noise(got, want, control, "captured")
        graphs = _decoder(llm, capture=True, column_bucket=64)  # one shape covers all 10 steps
        first = _teacher_forced_logits(llm, graphs, 10)
        again = _teacher_forced_logits(llm, graphs, 10)
        assert graphs.captures == 1 and graphs.allocations == 1 and graphs.replays == 20
        _assert_within_run_to_run_noise(again, want, control, "reused")
        _assert_within_run_to_run_noise(first, want, control, "first of bucket 64")
    finally:
        llm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("policy,budget", [("no-offload", None), ("static-int2", "1GiB")])
def test_compiled_step_computes_what_the_eager_step_computes(policy, budget):
    """bf16, three rows: the torch.compile'd captured step against the eager captured step, within
    bf16 accuracy; greedy tokens of a whole generation agree with the eager ones too, at least 8 deep."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = moetide.LLM(device="cuda", policy=policy, gpu_memory=budget, dtype="bfloat16", cuda_graphs="off")
    try:
        want = _teacher_forced_logits(llm, _decoder(llm, capture=True, column_bucket=64), 10)
        control = _teacher_forced_logits(llm, _decoder(llm, capture=True, column_bucket=64), 10)
        compiled = _decoder(llm, capture=True, column_bucket=64, compile_step=True)
        got = _teacher_forced_logits(llm, compiled, 10)
        assert compiled.failed is None, compiled.failed
        # Inductor fuses and reorders bf16 arithmetic, so the compiled step is held to bf16 accuracy
        # (not to the eager step's run-to-run noise): relative error and greedy agreement
        # (H200, 2026-12-01: median 0.006, one step of ten at 0.036 after nine teacher-forced steps;
        # over the paged cache's gathered blocks and 4D mask, median 0.016, max 0.040)
        diff = torch.stack([(g - w).norm() / w.norm() for g, w in zip(got, want, strict=True)])
        assert float(diff.median()) < 2.5e-2 and float(diff.max()) < 6e-2, diff
        assert _argmax_agreement(got, want) >= 0.9 * _argmax_agreement(control, want), diff
        params = moetide.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        llm.engine.runner.graphs = _decoder(llm, capture=True, column_bucket=64)
        eager_tokens = llm.generate([PROMPTS[0]], params)[0].token_ids
        llm.engine.runner.graphs = compiled
        compiled_tokens = llm.generate([PROMPTS[0]], params)[0].token_ids
        agree = next((i for i, (a, b) in enumerate(zip(compiled_tokens, eager_tokens)) if a != b), 32)
        assert agree >= 8, (compiled_tokens, eager_tokens)
    finally:
        llm.close()


@pytest.mark.gpu
def test_float32_captures_every_row_count():
    """float32: the fused kernel takes any number of rows without a host sync, so one, two and three
    rows are captured and match the dynamic path."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = moetide.LLM(device="cuda", policy="no-offload", dtype="float32", cuda_graphs="off")
    try:
        assert llm.loaded.runtime.decode_is_sync_free(1)
        assert llm.loaded.runtime.decode_is_sync_free(3)
        graphs = _decoder(llm, capture=True, column_bucket=8)
        params = moetide.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        want = llm.generate([PROMPTS[1]], params)[0].token_ids
        llm.engine.runner.graphs = graphs
        got = llm.generate([PROMPTS[1]], params)[0].token_ids
        assert got == want and graphs.failed is None and graphs.captures >= 1
        graphs.rows_entered.clear()
        assert _generate(llm, graphs) == _generate(llm, None)
        assert 3 in graphs.rows_entered, graphs.rows_entered
    finally:
        llm.close()


def _staggered(llm, graphs) -> list[list[int]]:
    """Three greedy requests of equal length, each joining two steps after the one before, and a
    fourth once the first has left: batches of 1, 2, 3 rows, then 3 rows of other sequences."""
    engine = llm.engine
    engine.runner.graphs = graphs
    engine.runner.fold_prefill_tokens = 0  # decode rows only (prefill rows: see the folding test)
    params = [moetide.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 12, 12, 8)]
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(4)]
    seqs = []
    for step in range(40):
        if step in (0, 2, 4) or (step > 4 and len(seqs) == 3 and seqs[0].finished):
            seqs.append(engine.add_request(prompts[len(seqs)], params[len(seqs)]))
        if not engine.has_unfinished():
            break
        engine.step()
    while engine.has_unfinished():
        engine.step()
    engine.runner.graphs = None
    return [s.output_ids for s in seqs]


@pytest.mark.gpu
def test_rows_joining_and_leaving_replay_the_graph_of_their_batch_shape():
    """float32 on CUDA: rows join and leave; the KV never moves, so a batch of the same row bucket
    and table width (other sequences, other blocks) replays the graph captured for that shape, with
    the tokens of the eager path."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = moetide.LLM(device="cuda", policy="no-offload", dtype="float32", cuda_graphs="off")
    try:
        want = _staggered(llm, None)
        graphs = _decoder(llm, capture=True, column_bucket=64)  # every table here fits 4 blocks
        got = _staggered(llm, graphs)
        assert got == want and graphs.failed is None
        assert len(want) == 4 and set(graphs.rows_entered) == {1, 2, 3}
        assert graphs.captures == 3 and graphs.replays == graphs.entries  # one per row bucket: 1, 2, 4
    finally:
        llm.close()


def test_rows_joining_and_leaving_decode_from_fixed_buffers_as_eagerly():
    """The same schedule on the CPU, without capture: the buffers of a shape are reused by other
    sequences (one allocation per row bucket: 1, 2, 4) and give the eager tokens."""
    llm = moetide.LLM(device="cpu", policy="no-offload", dtype="float32")
    try:
        want = _staggered(llm, None)
        graphs = _decoder(llm, capture=False, column_bucket=64)
        got = _staggered(llm, graphs)
    finally:
        llm.close()
    assert got == want and len(want) == 4
    assert set(graphs.rows_entered) == {1, 2, 3} and graphs.allocations == 3


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "phimoe", "deepseek_v2"])
def test_every_family_decodes_from_fixed_buffers_as_eagerly(tiny_checkpoints, family):
    """Each supported family's attention (GQA, shared experts, MLA with its compressed latent)
    reads and writes the paged pool from fixed buffers as it does eagerly: same greedy tokens, rows
    leaving at different steps and the tables outgrowing their bucket on the way."""
    path, _ = tiny_checkpoints[family]
    llm = moetide.LLM(str(path), device="cpu", policy="no-offload", dtype="float32")
    try:
        graphs = _decoder(llm, capture=False, column_bucket=8)
        prompts = [[3, 5, 7, 9, 11], [4, 6], [8, 10, 12, 14, 16, 18, 20]]
        runs = {}
        for name, decoder in (("eager", None), ("fixed", graphs)):
            llm.engine.runner.graphs = decoder
            params = [moetide.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (4, 13, 9)]
            seqs = [llm.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
            while llm.engine.has_unfinished():
                llm.engine.step()
            runs[name] = [s.output_ids for s in seqs]
        llm.engine.runner.graphs = None
    finally:
        llm.close()
    assert runs["fixed"] == runs["eager"]
    assert graphs.entries >= 3


def test_a_predictive_policy_with_nothing_to_offload_is_not_attached_and_observers_keep_capture():
    """No cap and every expert in hi ("all-hi", what an uncapped GPU run of a model that fits gets):
    FineMoE/DynaExq have nothing to decide, so no hooks are attached. An observer (PolicyHooks with
    the runtime) writes device buffers only, so the steps stay capturable, and it still sees every
    step, one step late: each iteration once, in order, every layer with its (T, k) ids."""
    from dataclasses import replace

    from moetide.engine.llm import attach_policy
    from moetide.policies.base import PolicyBase
    from moetide.policies.hooks import PolicyHooks

    class Recorder(PolicyBase):
        def __init__(self):
            self.seen = []

        def begin_iteration(self, iteration, embedding, num_tokens, request_ids=()):
            self.seen.append([iteration, num_tokens, 0])

        def observe_layer(self, iteration, layer, gate_probs, topk_ids):
            assert self.seen[-1][0] == iteration and topk_ids.shape == (self.seen[-1][1], self.top_k)
            assert abs(float(gate_probs.sum()) - 1.0) < 1e-4
            self.seen[-1][2] += 1

    llm = moetide.LLM(device="cpu", policy="no-offload", gpu_memory="1GiB")
    try:
        loaded = llm.loaded
        assert loaded.runtime.residency.options.mode == "all-hi"
        attach_policy(replace(llm.config, policy="combined"), loaded)
        assert loaded.policy is None and loaded.policy_hooks is None
        assert loaded.runtime.decode_is_sync_free(1)
        recorder = Recorder()
        hooks = PolicyHooks(loaded.model, loaded.adapter, [recorder], runtime=loaded.runtime)
        try:
            assert loaded.runtime.decode_is_sync_free(1)
            first = loaded.runtime.iteration + 1
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        finally:
            hooks.remove()
        layers = len(loaded.moe_layers)
        assert recorder.seen == [[first, 3, layers]] + [[first + i, 1, layers] for i in range(1, 6)]
        assert loaded.runtime.decode_is_sync_free(1)
    finally:
        llm.close()



# -- row buckets: a step of B rows runs in the buffers of the smallest bucket >= B -----------------------


def test_every_row_count_and_width_up_to_4096_tokens_has_a_kept_shape():
    """Up to 128 rows and 4096 tokens (256 blocks of 16), the (row bucket, width) shapes are few
    enough that none is evicted; each bucket holds its rows and none exceeds the engine's maximum."""
    shapes = {(row_bucket(r, 128), width_bucket(b, 16)) for r in range(1, 129) for b in range(1, 257)}
    assert len(shapes) <= MAX_STATES, len(shapes)
    assert {w for _, w in shapes} == {16, 32, 64, 128, 256}  # 256 * 2^k tokens
    assert {row_bucket(r, 64) for r in range(1, 65)} == {1, 2, 4, 8, 16, 24, 32, 48, 64}
    for r in range(1, 300):
        assert r <= row_bucket(r) and (r > ROW_BUCKETS[-1] or row_bucket(r) in ROW_BUCKETS)
        assert r <= row_bucket(r, 40) <= max(r, 40)
    assert row_bucket(129) == 160 and row_bucket(7, None, None) == 7


class _BufferReader(torch.nn.Module):
    """Stands in for the model: records what each step reads from the fixed buffers and returns each
    row's input token as its logits `(R, 1, 2)`."""

    config = SimpleNamespace(use_sliding_window=False)

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep):
        kv = past_key_values
        self.seen.append(
            [t.clone() for t in (input_ids, position_ids, kv.slot_mapping, kv.block_tables, attention_mask)]
        )
        return SimpleNamespace(logits=input_ids.float().unsqueeze(-1).expand(-1, 1, 2))


def _batch(rows: int, blocks: int) -> DecodeBatch:
    """`rows` rows, the first with a table of `blocks` blocks (the others shorter), ids 100 + row."""
    tables = torch.zeros(rows, blocks, dtype=torch.long)
    for r in range(rows):
        used = max(1, blocks - r % 3)
        tables[r, :used] = 1 + r * blocks + torch.arange(used)
    positions = (tables > 0).sum(1) * 16 - 1
    slots = tables.gather(1, (positions // 16).view(-1, 1)).view(-1) * 16 + positions % 16
    return DecodeBatch(100 + torch.arange(rows), positions, slots, tables)


def test_rows_varying_from_1_to_40_run_in_the_buffers_of_eight_buckets_padded_with_harmless_rows():
    """Batches of every size 1..40 and tables of 1..64 blocks: one buffer per (bucket, width), never
    evicted; the real rows are the batch's, each pad row reads token 0 at position 0 over a table of
    the pad block, writes slot 0 of it and sees exactly its column 0 (never a fully masked row)."""
    model = _BufferReader()
    kv = PagedKVCache(4096, 16, torch.device("cpu"), grow=True)
    graphs = GraphedDecoder(model, kv, lambda rows: True, ENGINE_SDPA_BACKENDS, capture=False, max_rows=64)
    sizes = list(range(1, 41)) + list(range(40, 0, -3))
    for step, rows in enumerate(sizes):
        batch = _batch(rows, blocks=1 + (step * 7) % 64)
        logits = graphs.decode(batch)
        assert logits.shape == (rows, 2) and logits[:, 0].tolist() == batch.input_ids.tolist()
        ids, positions, slots, tables, mask = model.seen[-1]
        bucket = row_bucket(rows, 64)
        assert ids.shape == (bucket, 1) and tables.shape[1] == width_bucket(batch.width, 16)
        assert torch.equal(ids[:rows, 0], batch.input_ids) and torch.equal(slots[:rows], batch.slot_mapping)
        assert torch.equal(positions[:rows, 0], batch.positions)
        assert torch.equal(tables[:rows, : batch.width], batch.block_tables)
        assert not tables[:rows, batch.width :].any()
        assert not (ids[rows:].any() or positions[rows:].any() or slots[rows:].any() or tables[rows:].any())
        assert mask[rows:, 0, 0].sum(-1).tolist() == [1] * (bucket - rows) and mask[rows:, 0, 0, 0].all()
    stats = graphs.stats()
    assert {r for r, _ in graphs.states} == {1, 2, 4, 8, 16, 24, 32, 48}
    assert stats["allocations"] == len(graphs.states) <= 8 * 3 and stats["evictions"] == 0
    assert stats["rows_entered"] == {r: sizes.count(r) for r in set(sizes)}  # keyed by real rows
    assert stats["padded_rows"] == sum(row_bucket(r, 64) - r for r in sizes) > 0
    exact = GraphedDecoder(
        _BufferReader(), kv, lambda rows: True, ENGINE_SDPA_BACKENDS, capture=False, row_buckets=None
    )
    for rows in range(1, 41):
        exact.decode(_batch(rows, blocks=3))
    assert exact.allocations == 40 and exact.padded_rows == 0


def _strict_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention as softmax over the masked scores: a row that sees no column is NaN (as it is on
    some GPU backends; the CPU's give 0), and so is any row with a NaN value in a masked column."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(2, 3)) * scaling
    weights = scores.masked_fill(~attention_mask, float("-inf")).softmax(-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def test_padded_rows_leave_the_real_rows_logits_and_the_pad_block_finite():
    """Three rows run as a bucket of four, float32, under attention that turns a fully masked row
    into NaN: the real rows' logits are those of the exact three-row step (to float32 GEMM noise:
    the CPU's kernels round by batch size) and the pad block holds finite values only. A pad row
    that saw no column would be NaN, and its NaN K/V, written into the pad block, would reach every
    real row through its masked pad-block columns (0 * NaN)."""
    from transformers import AttentionInterface

    AttentionInterface.register("moetide_strict", _strict_attention)
    llm = moetide.LLM(device="cpu", policy="no-offload", dtype="float32")
    try:
        llm.loaded.model.config._attn_implementation = "moetide_strict"
        exact_rows = _decoder(llm, capture=False, column_bucket=64, row_buckets=None)
        exact = _teacher_forced_logits(llm, exact_rows, 8)
        graphs = _decoder(llm, capture=False, column_bucket=64)
        padded = _teacher_forced_logits(llm, graphs, 8)
        kv = llm.engine.runner.kv
        pad_block = [pool[layer][: kv.block_size] for pool in (kv.keys, kv.values) for layer in pool]
    finally:
        llm.close()
    assert graphs.stats()["rows_entered"] == {3: 8} and graphs.padded_rows == 8
    assert all(torch.isfinite(step).all() for step in exact + padded)
    assert all(torch.isfinite(block).all() and block[0].abs().sum() > 0 for block in pad_block)
    _assert_steps_close(padded, exact, atol=1e-4, rtol=1e-5)


def _ramp(llm, graphs, rows: int) -> list[list[int]]:
    """Greedy requests joining one per step until `rows` run together, all asking the same number of
    tokens: decode batches of every size 1..rows on the way up and again on the way down."""
    engine = llm.engine
    engine.runner.graphs = graphs
    engine.runner.fold_prefill_tokens = 0  # decode rows only (prefill rows: see the folding test)
    params = moetide.SamplingParams(max_tokens=rows + 2, temperature=0, ignore_eos=True)
    seqs = []
    while len(seqs) < rows or engine.has_unfinished():
        if len(seqs) < rows:
            seqs.append(engine.add_request([3 + len(seqs), 6 + len(seqs) % 7, 7, 8, 9], params))
        engine.step()
    engine.runner.graphs = None
    return [s.output_ids for s in seqs]


def _layer_counts(metrics) -> list[tuple[int, int, int, int]]:
    return [(c.used, c.hits, c.lo_runs, c.misses) for c in metrics.layers]


def test_batches_padded_to_their_row_bucket_give_the_tokens_and_counts_of_exact_rows():
    """Batches of 1..6 rows (3, 5 and 6 padded to 4 and 8): the greedy tokens of exact rows and of
    the eager path; the static table's use counts (read from the ids on the CPU) leave pad rows out."""
    counts = {}
    for name, buckets in (("exact", None), ("padded", ROW_BUCKETS)):
        llm = moetide.LLM(device="cpu", policy="no-offload", dtype="float32")
        try:
            graphs = _decoder(llm, capture=False, column_bucket=64, row_buckets=buckets)
            got = _ramp(llm, graphs, 6)
            counts[name] = _layer_counts(llm.metrics)
            if name == "padded":
                want = _ramp(llm, None, 6)
        finally:
            llm.close()
    assert got == want
    assert set(graphs.rows_entered) == set(range(1, 7)) and graphs.padded_rows > 0
    assert {r for r, _ in graphs.states} == {1, 2, 4, 8}
    assert counts["padded"] == counts["exact"]


class _Seen:
    """A policy that keeps what it is shown: per step `[iteration, num_tokens, embedding, layers]`,
    each layer `(layer, gate_probs, topk_ids)`."""

    def __init__(self):
        self.steps = []

    def begin_iteration(self, iteration, embedding, num_tokens, request_ids=()):
        self.steps.append([iteration, num_tokens, None if embedding is None else embedding.clone(), []])

    def observe_layer(self, iteration, layer, gate_probs, topk_ids):
        assert self.steps[-1][0] == iteration and topk_ids.shape[0] == self.steps[-1][1]
        self.steps[-1][3].append((layer, gate_probs.clone(), topk_ids.clone()))

    def end_iteration(self, iteration):
        pass


def _copy(record) -> dict:
    """A `StepRecord`'s fields, copied out of its pinned slot."""
    arrays = {n: getattr(record, n) for n in ("ids", "pools", "logits", "spec", "embed")}
    out = {n: None if a is None else np.array(a) for n, a in arrays.items()}
    return {"iteration": record.iteration, "num_tokens": record.num_tokens, **out}


def _observed_run(policy: str, buckets, rows: int):
    """A fresh deterministic engine at 128MiB: its StepRecords, what its policy was shown, the
    residency's counters and the tokens of a ramp of `rows` rows from fixed buffers."""
    llm = moetide.LLM(device="cpu", policy=policy, gpu_memory="128MiB", deterministic=True, searcher="thread")
    try:
        records, seen = [], _Seen()
        llm.loaded.runtime.step_observers.append(lambda record: records.append(_copy(record)))
        llm.loaded.policy_hooks.policies.append(seen)
        graphs = _decoder(llm, capture=False, column_bucket=64, row_buckets=buckets)
        tokens = _ramp(llm, graphs, rows)
        m = llm.metrics
        counters = (_layer_counts(m), m.steps_observed, m.prefetches_issued, m.prefetches_used, m.evictions)
    finally:
        llm.close()
    return records, seen.steps, counters, tokens, graphs


@pytest.mark.parametrize("policy", ["combined", "finemoe"])
def test_padded_steps_show_the_policies_and_counters_what_exact_steps_show(policy):
    """Every record, every observation a policy gets and every residency counter of a run whose
    batches are padded to their row bucket are those of the same run with exact rows: ids and pools
    equal, router logits and the mean embedding (over the real rows, counted on the device) to
    float32 GEMM noise, token counts the real rows'."""
    exact = _observed_run(policy, None, 5)
    padded = _observed_run(policy, ROW_BUCKETS, 5)
    assert padded[4].padded_rows > 0 and exact[4].padded_rows == 0
    assert padded[3] == exact[3]  # the tokens
    assert padded[2] == exact[2]  # hits, lo runs, misses per layer; prefetches; evictions
    records, want = padded[0], exact[0]
    steps = lambda rs: [(r["iteration"], r["num_tokens"]) for r in rs]  # noqa: E731
    assert steps(records) == steps(want)
    assert {r["num_tokens"] for r in records} >= {1, 2, 3, 4, 5}
    for got, ref in zip(records, want, strict=True):
        for name in ("ids", "pools", "spec"):
            assert (got[name] is None) == (ref[name] is None), name
            if got[name] is not None:
                message = f"{name} of step {got['iteration']}"
                np.testing.assert_array_equal(got[name], ref[name], err_msg=message)
        np.testing.assert_allclose(got["logits"], ref["logits"], atol=1e-4, rtol=1e-5)
        np.testing.assert_allclose(got["embed"], ref["embed"], atol=1e-6, rtol=1e-6)
    seen, seen_exact = padded[1], exact[1]
    assert [s[:2] for s in seen] == [s[:2] for s in seen_exact] and len(seen) == len(records)
    for got, ref in zip(seen, seen_exact, strict=True):
        torch.testing.assert_close(got[2], ref[2], atol=1e-6, rtol=1e-6)
        layers = lambda step: [(layer, ids.tolist()) for layer, _, ids in step[3]]  # noqa: E731
        assert layers(got) == layers(ref)


def test_the_layer_feed_publishes_only_the_real_rows_of_a_padded_step():
    """FineMoE deciding within the step (the layer feed): every step it is shown holds exactly the
    rows the runner decoded, however many pad rows its bucket added."""
    llm = moetide.LLM(device="cpu", policy="finemoe", gpu_memory="128MiB", searcher="thread")
    try:
        runner, runtime = llm.engine.runner, llm.loaded.runtime
        real = {}  # iteration -> rows decoded
        decode = runner.decode

        def counted(seqs, chunks=(), **kwargs):
            real[runtime.iteration + 1] = len(seqs)
            return decode(seqs, chunks, **kwargs)

        runner.decode = counted
        seen = _Seen()
        llm.loaded.policy_hooks.policies.append(seen)
        graphs = _decoder(llm, capture=False, column_bucket=64)
        _ramp(llm, graphs, 5)
        feed = llm.loaded.policy_hooks.feed
        assert feed is not None and feed.idle(10) and not feed.errors
    finally:
        llm.close()
    assert graphs.padded_rows > 0
    decoded = [s for s in seen.steps if s[0] in real]
    # the feed may drop a step it fell behind on (a busy machine), never publish one with pad rows
    assert len(decoded) >= len(real) // 2, (len(decoded), len(real))
    for iteration, num_tokens, embedding, layers in decoded:
        assert num_tokens == real[iteration] and embedding is not None
        assert all(ids.shape[0] == num_tokens for _, _, ids in layers)


def _shared_prefix_joins(llm, graphs, system: str) -> list[list[int]]:
    """A long prompt decodes alone for two steps; then a request sharing its first blocks and a
    short one join: greedy tokens of all three."""
    engine = llm.engine
    engine.runner.graphs = graphs
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = engine.add_request(llm.tokenizer.encode(system + " Name one of them."), params)
    for _ in range(3):
        engine.step()
    later = [engine.add_request(llm.tokenizer.encode(p), params) for p in (system + " Why?", PROMPTS[2])]
    while engine.has_unfinished():
        engine.step()
    engine.runner.graphs = None
    return [s.output_ids for s in (first, *later)]


def test_short_prefill_chunks_ride_in_the_decode_step_and_give_the_same_tokens():
    """float32: a prefix-cache hit's new tokens and a short prompt are computed as rows of the running
    decode step (their K/V written before any row attends, each row masked to its own positions):
    the same greedy tokens as their own packed prefill forward."""
    system = "The cat sat on the mat while the dog slept by the door and the bird sang in the tree. " * 3
    llm = moetide.LLM(device="cpu", policy="no-offload", dtype="float32")
    try:
        want = _shared_prefix_joins(llm, None, system)
        assert llm.engine.kv_stats()["prefix_cache_hits"] >= 48
        graphs = _decoder(llm, capture=False, column_bucket=16)
        got = _shared_prefix_joins(llm, graphs, system)
        folded = llm.engine.runner.folded_tokens
        llm.engine.runner.fold_prefill_tokens = 0  # off: the same decoder, prefills as their own forward
        unfolded = _shared_prefix_joins(llm, _decoder(llm, capture=False, column_bucket=16), system)
    finally:
        llm.close()
    assert got == want == unfolded
    # the shared request's tail and the short prompt rode along: rows beyond one per sequence
    assert folded >= 2 and max(graphs.rows_entered) > 3, (folded, graphs.rows_entered)


def test_the_warm_up_decodes_once_at_every_row_bucket_and_leaves_the_engine_idle():
    """`LLMEngine.warm_up` (what `moetide serve` runs before its first client): a decode step at each
    row bucket up to max_num_seqs, from the decoder's buffers; nothing left running or cached."""
    llm = moetide.LLM(device="cpu", policy="no-offload", dtype="float32", max_num_seqs=6)
    try:
        assert llm.engine.warm_up(progress=False) == 0  # no graph decoder (the CPU): nothing to warm
        graphs = _decoder(llm, capture=False, column_bucket=64)
        llm.engine.runner.graphs = graphs
        steps = llm.engine.warm_up(progress=False)
        assert steps > 0 and not llm.engine.has_unfinished()
        assert {r for r, _ in graphs.states} == {1, 2, 4, 6}  # buckets 1, 2, 4, then max_num_seqs
        stats = llm.engine.kv_stats()
        assert stats["kv_blocks_used"] == 0 and stats["prefix_cache_queries"] == 0
    finally:
        llm.close()


def _compiled_fused_kernels() -> int:
    """Compiled variants of the fused MoE kernels, over every device (Triton's per-device caches)."""
    from moetide.compute import fused_moe

    kernels = (fused_moe._gate_up_kernel, fused_moe._down_kernel)
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


@pytest.mark.gpu
def test_after_the_warm_up_no_prompt_length_compiles_a_kernel():
    """The warm-up prefills once per tile bucket of the fused MoE kernel, and the kernels do not
    specialise on the number of pairs: prompts of any length up to the prefill chunk, alone or
    joining a decode, then compile nothing (a compile stalled every client of a wave once)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = moetide.LLM(device="cuda", policy="combined", gpu_memory="25%", dtype="bfloat16", max_num_seqs=8)
    try:
        assert llm.engine.warm_up(progress=False) > 0 and not llm.engine.has_unfinished()
        warmed = _compiled_fused_kernels()
        assert warmed > 0
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        engine = llm.engine
        for length in (33, 40, 77, 129, 200, 301, 511):
            engine.add_request([5 + (length + j) % 200 for j in range(length)], params)
            engine.add_request([9, 8, 7], params)
            while engine.has_unfinished():
                engine.step()
        assert _compiled_fused_kernels() == warmed
    finally:
        llm.close()
