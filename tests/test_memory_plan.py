"""The memory plan under `--gpu-memory`: `M_fixed` and the expert pools, the smallest budget each
policy names, the KV reservation, host versions, prepared caches, and every allocation against the cap."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import moetide
from moetide.config import EngineConfig, parse_bytes
from moetide.engine.memory import minimum_budget, model_bytes
from moetide.errors import BudgetError
from moetide.residency.budget import FixedCosts, plan_memory


def test_budget_too_small_names_its_parts():
    fixed = FixedCosts(10_000, 5_000, 5_000, 0)
    with pytest.raises(BudgetError, match=r"fixed part .* 19.53 KiB \+ at least 2 experts 1.95 KiB"):
        plan_memory(
            15_000,
            fixed,
            num_experts_total=10,
            hi_slot_bytes=1000,
            lo_slot_bytes=250,
            min_hi_slots=2,
            mode="hi-cache",
        )
    with pytest.raises(BudgetError, match=r"no-offload .* \+ 20 experts 19.53 KiB = 39.06 KiB, more than"):
        plan_memory(
            30_000,
            fixed,
            num_experts_total=20,
            hi_slot_bytes=1000,
            lo_slot_bytes=250,
            min_hi_slots=2,
            mode="all-hi",
        )


def test_impossible_budget_is_a_clear_error(qwen3_checkpoint):
    with pytest.raises(BudgetError, match="too small"):
        moetide.LLM(qwen3_checkpoint, device="cpu", policy="on-demand", gpu_memory="1MiB")
    roomy = moetide.LLM(qwen3_checkpoint, device="cpu", policy="on-demand", gpu_memory="64MiB")
    plan = roomy.loaded.runtime.residency.plan
    roomy.close()
    just_above_fixed = plan.fixed.total + 4 * plan.hi_slot_bytes  # room for 4 of the 16 experts
    with pytest.raises(BudgetError, match=r"no-offload keeps every expert .* smallest budget for no-offload"):
        moetide.LLM(qwen3_checkpoint, device="cpu", policy="no-offload", gpu_memory=just_above_fixed)
    tight = moetide.LLM(qwen3_checkpoint, device="cpu", policy="on-demand", gpu_memory=just_above_fixed)
    assert tight.loaded.runtime.residency.plan.hi_slots == 4
    out = tight.generate([[5, 6, 7]], moetide.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and tight.metrics.evictions > 0
    tight.close()


def test_prepare_writes_a_cache_that_later_loads_reuse_and_a_changed_checkpoint_invalidates(
    tiny_checkpoints, tmp_path
):
    import shutil

    from moetide.models.prepare import prepare
    from moetide.store.prepare import cache_file

    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["olmoe"][0], path)
    cache = tmp_path / "cache"
    written = prepare(str(path), ["int4", "int2"], cache_dir=str(cache), dtype="float32", progress=False)
    assert [p.name.split("-")[0] for p in written] == ["int4", "int2"] and all(p.is_file() for p in written)
    llm = moetide.LLM(path, device="cpu", policy="static-int2", gpu_memory="64MiB")
    assert "int2" in llm.loaded.store.versions
    llm.close()
    # reuse: the prepared file is what a load with the same settings looks for
    assert cache_file(path, "int2", torch.float32, cache) == written[1]
    shard = next(path.glob("*.safetensors"))
    shard.touch()  # a changed checkpoint (new mtime) gets a new cache key
    assert cache_file(path, "int2", torch.float32, cache) != written[1]


def test_host_versions_can_be_dropped_only_where_the_device_holds_them(qwen3_checkpoint):
    llm = moetide.LLM(
        qwen3_checkpoint, device="cpu", policy="static-int4", gpu_memory="64MiB", host_versions=()
    )
    assert llm.loaded.store.versions == {}  # every expert lives in the device's lo pool
    out = llm.generate([[5, 6, 7]], moetide.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6
    llm.close()
    # (at 64MiB every expert fits in hi, and on-demand runs as no-offload: the host copies may go)
    config = EngineConfig(model=str(qwen3_checkpoint), device="cpu", policy="on-demand")
    tight = minimum_budget(config, model_bytes(config))  # a hi cache of a few experts
    with pytest.raises(BudgetError, match="cannot drop the host hi versions"):
        moetide.LLM(
            qwen3_checkpoint, device="cpu", policy="on-demand", gpu_memory=tight, host_versions=("lo",)
        )


def _plan(**kw):
    fixed = FixedCosts(1000, 64 * 10, 100, 50, kv_cache_tokens=64)  # 10 bytes per KV token
    return plan_memory(
        kw.pop("budget"),
        fixed,
        num_experts_total=8,
        hi_slot_bytes=400,
        lo_slot_bytes=100,
        min_hi_slots=2,
        **kw,
    )


def test_spare_budget_goes_to_the_kv_reservation_and_never_to_more_than_the_budget():
    # fixed 1,790 B; every expert version has its slot (8 lo + 8 hi = 4,000 B); 4,210 B left: +421 tokens
    roomy = _plan(budget=10_000, mode="lo+hi")
    assert (roomy.lo_slots, roomy.hi_slots) == (8, 8)
    grown = roomy.with_spare_kv(10, max_kv_tokens=10_000)
    # the KV pool grows by whole blocks of 16 tokens: 421 -> 416
    assert grown.fixed.kv_cache_tokens == 64 + 416 and grown.fixed.kv_cache == 640 + 4160
    assert grown.fixed.total + grown.expert_bytes <= grown.budget_bytes
    assert (grown.hi_slots, grown.lo_slots) == (roomy.hi_slots, roomy.lo_slots)  # the pools keep theirs
    assert roomy.with_spare_kv(10, max_kv_tokens=100).fixed.kv_cache_tokens == 100  # capped
    # pools not capped: only what is left beside whole slots (< one hi slot) can go to the KV cache
    tight = _plan(budget=4_000, mode="hi-cache")
    assert tight.with_spare_kv(10, max_kv_tokens=10_000).fixed.kv_cache_tokens - 64 < 400 // 10


def test_the_engine_reserves_spare_budget_for_kv_unless_told_a_size():
    llm = moetide.LLM(device="cpu", policy="on-demand", gpu_memory="1GiB")
    try:
        plan = llm.loaded.runtime.residency.plan
        assert plan.fixed.kv_cache_tokens == llm.engine.kv_cache_tokens == 32 * 2048  # max_num_seqs full rows
        assert plan.fixed.total + plan.expert_bytes <= plan.budget_bytes
    finally:
        llm.close()
    llm = moetide.LLM(device="cpu", policy="on-demand", gpu_memory="1GiB", kv_cache_tokens=4096)
    try:
        assert llm.loaded.runtime.residency.plan.fixed.kv_cache_tokens == llm.engine.kv_cache_tokens == 4096
    finally:
        llm.close()


def _suggested(error: BudgetError) -> str:
    match = re.search(r"the smallest budget for \S+ is --gpu-memory (\S+)$", str(error))
    assert match, str(error)
    return match.group(1)


def test_the_smallest_budget_named_is_stable_and_works():
    """no-offload on the demo model: the KV reservation grows with the budget, so "fixed part at this
    budget + experts" moved when the user retried with it (140 MiB -> "needs 186.77", 187 MiB ->
    "needs 189.47"). The minimum named is the same from any budget below it, it fits, and 1 MiB
    less does not; the engine loads at it."""
    import dataclasses

    import moetide
    from moetide.engine.llm import demo_model_path
    from moetide.engine.memory import check_budget, model_bytes

    config = EngineConfig(model=str(demo_model_path()), device="cpu", policy="no-offload")
    mb = model_bytes(config)
    at = {}
    for budget in ("140MiB", "187MiB", "1MiB"):
        with pytest.raises(BudgetError) as e:
            check_budget(dataclasses.replace(config, gpu_memory_bytes=parse_bytes(budget)), mb)
        at[budget] = _suggested(e.value)
    assert len(set(at.values())) == 1, at
    minimum = parse_bytes(at["140MiB"])
    check_budget(dataclasses.replace(config, gpu_memory_bytes=minimum), mb)
    with pytest.raises(BudgetError):
        check_budget(dataclasses.replace(config, gpu_memory_bytes=minimum - (1 << 20)), mb)
    llm = moetide.LLM(device="cpu", policy="no-offload", gpu_memory=at["140MiB"])
    assert llm.loaded.runtime.residency.plan.hi_slots == mb.num_experts_total
    llm.close()


def test_static_budget_messages_say_what_to_type():
    """The all-lo message says the fixed part is included; static-int4 may suggest static-int2,
    static-int2 never suggests int2 again."""
    from moetide.engine.llm import demo_model_path
    from moetide.engine.memory import check_budget

    for policy, suggests_int2 in (("static-int4", True), ("static-int2", False)):
        config = EngineConfig(
            model=str(demo_model_path()), device="cpu", policy=policy, gpu_memory_bytes=100 << 20
        )
        with pytest.raises(BudgetError) as e:
            check_budget(config)
        text = str(e.value)
        parts = r"the fixed part \(.*\) [\d.]+ MiB \+ 256 experts [\d.]+ MiB = [\d.]+ MiB"
        assert re.search(parts, text), text
        assert ("use static-int2" in text) is suggests_int2 and "use int2" not in text
        check_budget(dataclasses.replace(config, gpu_memory_bytes=parse_bytes(_suggested(e.value))))


def test_relative_gpu_memory_works_wherever_gpu_memory_does(qwen3_checkpoint):
    """`--gpu-memory 50%` (room for half of all experts in hi beside the fixed part) in generate's engine
    options and in `moetide.LLM`, not only in bench."""
    import moetide
    from moetide.cli import build_parser, engine_config_from_args
    from moetide.engine.memory import model_bytes, resolve_budget

    base = EngineConfig(model=str(qwen3_checkpoint), device="cpu", policy="on-demand")
    want = resolve_budget("50%", base)
    mb = model_bytes(base)
    assert want - mb.fixed_at(want).total >= mb.all_experts_hi_bytes // 2  # the room holds half the experts
    from moetide.config import SERVE_KV_TOKENS_PER_SEQ
    from moetide.serve.cli import serve_engine_config

    serve_base = dataclasses.replace(base, kv_tokens_per_seq=SERVE_KV_TOKENS_PER_SEQ)  # serve's KV floor
    for command, to_config, expected in (
        (["generate", "hi"], engine_config_from_args, want),
        (["serve"], serve_engine_config, resolve_budget("50%", serve_base)),
    ):
        args = build_parser().parse_args(
            [command[0], "--model", str(qwen3_checkpoint), "--device", "cpu", "--policy", "on-demand",
             "--gpu-memory", "50%", *command[1:]]
        )  # fmt: skip
        assert to_config(args).gpu_memory_bytes == expected
    llm = moetide.LLM(qwen3_checkpoint, device="cpu", policy="on-demand", gpu_memory="50%")
    assert llm.config.gpu_memory_bytes == want and llm.loaded.runtime.residency.plan.budget_bytes == want
    llm.close()


def _kv_bytes(engine) -> int:
    """Bytes of the K/V pools the paged cache holds now."""
    return engine.runner.kv.nbytes


def test_every_allocation_of_a_budgeted_run_fits_the_cap():
    """The demo model under a --gpu-memory cap on the CPU (the CPU stands in for the device): the
    weights, the slot pools and every tensor allocated while a 900-token prompt is prefilled and
    decoded (seen by the profiler's allocator records: KV cache growth, activations, logits, expert
    scratch) are accounted against the plan, category by category, and in all against the cap."""
    from torch.profiler import ProfilerActivity, profile

    llm = moetide.LLM(device="cpu", policy="on-demand", gpu_memory="60%", max_num_seqs=2)
    residency = llm.loaded.runtime.residency
    plan, fixed = residency.plan, residency.plan.fixed
    model = llm.loaded.model
    tensors = [*model.parameters(), *model.buffers()]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    pools = sum(p.arena.numel() * p.arena.element_size() for p in residency.pools.values())
    assert weights == fixed.non_expert_weights  # no expert weight left on the device, nothing missed
    assert pools == plan.expert_bytes and fixed.total + plan.expert_bytes <= plan.budget_bytes
    prompt = [(i * 7919) % 8000 + 100 for i in range(900)]
    kv_peak = 0
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        llm.engine.add_request(prompt, moetide.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while llm.engine.has_unfinished():
            llm.engine.step()
            kv_peak = max(kv_peak, _kv_bytes(llm.engine))
    records = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = transient_peak = 0
    for _, nbytes in records:  # allocations (+) and frees (-) in time order
        live += nbytes
        transient_peak = max(transient_peak, live)
    assert llm.metrics.misses > 0  # experts were copied into slots under the cap
    assert 0 < kv_peak <= fixed.kv_cache
    assert 0 < transient_peak <= fixed.kv_cache + fixed.activations + fixed.dequant_scratch
    assert weights + pools + transient_peak <= plan.budget_bytes
    assert residency.budget.peak_bytes <= plan.budget_bytes
    llm.close()


def test_the_servers_kv_floor_holds_a_chat_turn_per_sequence_up_to_a_quarter_of_the_budget():
    """`kv_tokens_per_seq` (what `moetide serve` asks for) raises the derived KV reservation to that
    many tokens per sequence of max_num_seqs, but never past a quarter of the budget; without it the
    reservation is a tenth of the budget or one full-length sequence, whichever is more."""
    from moetide.engine.llm import demo_model_path
    from moetide.engine.memory import model_bytes
    from moetide.residency import kv_bytes_per_token

    def kv_tokens(budget, seqs, per_seq):
        config = EngineConfig(model=str(demo_model_path()), device="cpu", gpu_memory_bytes=budget,
                              max_num_seqs=seqs, kv_tokens_per_seq=per_seq)  # fmt: skip
        return model_bytes(config).fixed.kv_cache_tokens

    from transformers import AutoConfig

    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(demo_model_path()), torch.float32)
    budget = 128 << 20
    tenth, quarter = budget // 10 // per_token, budget // 4 // per_token
    assert tenth < 2048 < 24 * 128 < quarter < 64 * 128  # the cases below are distinct
    assert kv_tokens(budget, 24, 0) == 2048  # one full-length sequence of the demo model
    assert kv_tokens(budget, 8, 128) == 2048  # 8 x 128 is less than that
    assert kv_tokens(budget, 24, 128) == 24 * 128
    assert kv_tokens(budget, 64, 128) == quarter
