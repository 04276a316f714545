"""Invariants of the residency core on the CPU backend (separate arena, copies on a worker thread,
simulated bandwidth, poisoned slots), under random interleavings of forward passes, prefetches,
promotions, demotions and evictions."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moetide
from moetide.compute.expert_compute import expert_mlp
from moetide.config import EngineConfig, parse_bytes
from moetide.errors import BudgetError
from moetide.residency.budget import BudgetTracker, FixedCosts, plan_memory
from moetide.residency.core import ResidencyManager, ResidencyOptions
from moetide.residency.handles import HandleState
from moetide.residency.metrics import ExpertMetrics
from moetide.residency.slot_table import UNUSED
from moetide.residency.transfer import CpuTransfer
from moetide.store import quant
from moetide.store.host_store import ExpertShape, HostExpertStore

LAYERS, EXPERTS, HIDDEN, INTER = 3, 8, 32, 32
ACT = torch.nn.functional.silu


def make_store(lo: str = "int4") -> HostExpertStore:
    torch.manual_seed(0)
    store = HostExpertStore(LAYERS, EXPERTS, ExpertShape(HIDDEN, INTER, torch.float32))
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            store.put_projection(layer, e, "gate", torch.randn(INTER, HIDDEN) * 0.1)
            store.put_projection(layer, e, "up", torch.randn(INTER, HIDDEN) * 0.1)
            store.put_projection(layer, e, "down", torch.randn(HIDDEN, INTER) * 0.1)
    store.check_complete()
    store.add_precision(lo)
    return store


STORE = make_store()


def make_manager(
    mode: str,
    hi_slots: int,
    lo_slots: int,
    on_miss: str = "stall",
    bandwidth: float | None = 2e8,
    wait_for_copies: bool = False,
):
    hi_bytes, lo_bytes = STORE.bytes_per_expert("hi"), STORE.bytes_per_expert("int4")
    fixed = FixedCosts(1000, 0, 0, 0)
    budget = fixed.total + hi_slots * hi_bytes + lo_slots * lo_bytes
    plan = plan_memory(
        budget,
        fixed,
        num_experts_total=LAYERS * EXPERTS,
        hi_slot_bytes=hi_bytes,
        lo_slot_bytes=lo_bytes,
        min_hi_slots=2 if mode != "all-lo" else 0,
        mode=mode,
    )
    tracker = BudgetTracker(budget)
    tracker.reserve(fixed.total, "fixed", "fixed")
    transfer = CpuTransfer(bandwidth_bytes_per_s=bandwidth, poison=True)
    manager = ResidencyManager(
        STORE,
        ExpertMetrics(LAYERS),
        plan,
        tracker,
        transfer,
        torch.device("cpu"),
        ResidencyOptions(mode=mode, lo_precision="int4", on_miss=on_miss, wait_for_copies=wait_for_copies),
    )
    if mode in ("lo+hi", "all-lo"):
        manager.preload("lo")
    return manager


def reference_output(x, layer, e, precision):
    """The expert computed from the host store's version of `precision` (what the handle resolved to)."""
    if precision == "hi":
        v = STORE.views(layer, e, "hi")
        return expert_mlp(x, v["gate_up"], v["down"], ACT)
    gate_up, down = quant.dequantize(STORE.views(layer, e, precision), STORE.meta[precision], x.dtype)
    return expert_mlp(x, gate_up, down, ACT)


def run_forward(manager, layer, experts, x):
    """Acquire in waves, compute each expert, compare with the reference, release."""
    pending = sorted(set(experts))
    while pending:
        resolved, pending = manager.acquire(layer, pending, torch.device("cpu"))
        for e, version in resolved.items():
            assert version.published and version.ready.query()
            if version.precision == "hi":
                got = expert_mlp(x, version.views["gate_up"], version.views["down"], ACT)
            else:
                got = expert_mlp(x, *quant.dequantize(version.views, version.meta, x.dtype), ACT)
            assert torch.isfinite(got).all(), "read a poisoned (partially written) slot"
            torch.testing.assert_close(got, reference_output(x, layer, e, version.precision), rtol=0, atol=0)
        manager.release(layer, list(resolved))


def check_invariants(manager):
    assert manager.budget.used_bytes <= manager.budget.total_bytes
    for name, pool in manager.pools.items():
        resident = sum(1 for row in manager.handles for h in row if name in h.versions)
        pending = sum(1 for p, *_ in manager._pending_free if p == name)
        assert resident + pending + pool.free_slots == pool.num_slots
    for row in manager.handles:
        for h in row:
            assert h.in_use == 0
            v = h.resolve()
            if v is not None:
                assert v.ready.query()
            assert isinstance(h.state, HandleState)


op = st.one_of(
    st.tuples(
        st.just("forward"),
        st.integers(0, LAYERS - 1),
        st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=6),
    ),
    st.tuples(
        st.just("prefetch"),
        st.integers(0, LAYERS - 1),
        st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=4),
    ),
    st.tuples(st.just("promote"), st.integers(0, LAYERS - 1), st.integers(0, EXPERTS - 1)),
    st.tuples(st.just("demote"), st.integers(0, LAYERS - 1), st.integers(0, EXPERTS - 1)),
    st.tuples(
        st.just("protect"), st.integers(0, LAYERS - 1), st.lists(st.integers(0, EXPERTS - 1), max_size=3)
    ),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["hi-cache", "lo+hi", "all-lo"]),
    hi_slots=st.integers(2, 10),
    on_miss=st.sampled_from(["stall", "lo"]),
    ops=st.lists(op, min_size=1, max_size=25),
)
def test_random_interleavings_keep_every_invariant(mode, hi_slots, on_miss, ops):
    manager = make_manager(
        mode, hi_slots if mode != "all-lo" else 0, LAYERS * EXPERTS if mode != "hi-cache" else 0, on_miss
    )
    x = torch.randn(3, HIDDEN)
    iteration = 0
    try:
        for kind, layer, arg in ops:
            if kind == "forward":
                iteration += 1
                manager.begin_iteration(iteration)
                run_forward(manager, layer, arg, x)
            elif kind == "prefetch":
                manager.prefetch(layer, arg, iteration=iteration)
            elif kind == "protect":
                manager.protect(layer, arg, iteration=iteration)
            else:
                manager.set_precision(layer, arg, "hi" if kind == "promote" else "lo")
            check_invariants(manager)
        # drain whatever is still queued through one more forward pass per layer
        for layer in range(LAYERS):
            run_forward(manager, layer, [0, 1], x)
        check_invariants(manager)
    finally:
        manager.close()


def test_each_use_is_a_hit_a_lo_run_or_a_miss():
    """lo+hi with lo on miss: an expert with only its lo version runs lo (a lo run, not a hit); once
    its hi version is resident it is a hit; hi-cache without lo: a miss. used = hits + lo_runs + misses."""
    manager = make_manager("lo+hi", 4, LAYERS * EXPERTS, on_miss="lo")
    x = torch.randn(2, HIDDEN)
    manager.begin_iteration(1)
    run_forward(manager, 0, [1, 2], x)
    c = manager.metrics.layers[0]
    assert (c.hits, c.lo_runs, c.misses) == (0, 2, 0)
    manager.set_precision(0, 1, "hi")
    manager.settle()
    manager.begin_iteration(2)
    run_forward(manager, 0, [1, 2], x)
    assert (c.hits, c.lo_runs, c.misses) == (1, 3, 0)
    assert manager.metrics.hit_rate == 0.25 and c.used == c.hits + c.lo_runs + c.misses
    manager.close()
    manager = make_manager("hi-cache", 4, 0)
    manager.begin_iteration(1)
    run_forward(manager, 0, [1], x)
    run_forward(manager, 0, [1], x)
    c = manager.metrics.layers[0]
    assert (c.hits, c.lo_runs, c.misses) == (1, 0, 1)
    manager.close()


def test_prefetch_turns_a_miss_into_a_hit():
    manager = make_manager("hi-cache", 4, 0)
    x = torch.randn(2, HIDDEN)
    manager.begin_iteration(1)
    manager.prefetch(1, [3, 5], iteration=1)
    run_forward(manager, 0, [0], x)  # the prefetch is issued at this layer's start
    run_forward(manager, 1, [3, 5], x)
    m = manager.metrics
    assert m.layers[1].hits == 2 and m.layers[1].misses == 0
    assert m.prefetches_used == 2
    manager.close()


def _resident(manager, layer):
    return {e for e in range(EXPERTS) if "hi" in manager.handles[layer][e].versions}


def test_protected_experts_are_not_evicted_until_their_layer_has_run():
    manager = make_manager("hi-cache", 3, 0)
    x = torch.randn(2, HIDDEN)
    manager.begin_iteration(1)
    run_forward(manager, 0, [0, 1, 2], x)  # pool full, LRU order 0, 1, 2
    manager.begin_iteration(2)
    manager.protect(0, [0], iteration=2)
    run_forward(manager, 0, [7], x)  # needs a slot: 0 is oldest but protected, 1 goes
    assert _resident(manager, 0) == {0, 2, 7}
    # layer 0 has run in iteration 2: its protection has served, so 0 (least recent) goes next
    run_forward(manager, 0, [5], x)
    assert _resident(manager, 0) == {2, 5, 7}
    # a protection that arrives after its layer ran in this iteration is ignored
    manager.protect(0, [2], iteration=2)
    run_forward(manager, 0, [6], x)
    assert _resident(manager, 0) == {5, 6, 7}
    manager.close()


def test_a_landed_prefetch_that_was_never_used_can_be_evicted_by_the_next_prefetch():
    """Wrong predictions must not pin the cache: an unused prefetched version whose copy has landed
    is as evictable as any other (before the fix it stayed unpublished, so later prefetches were
    deferred instead)."""
    manager = make_manager("hi-cache", 3, 0, bandwidth=None)
    x = torch.randn(2, HIDDEN)
    manager.begin_iteration(1)
    manager.prefetch(1, [3, 5], iteration=1)
    run_forward(manager, 0, [0], x)  # demand 0, then the prefetches of layer 1 are issued
    for e in (3, 5):
        manager.handles[1][e].versions["hi"].ready.synchronize()
    manager.begin_iteration(2)
    manager.protect(0, [0], iteration=2)  # so the only candidates are the two unused prefetches
    manager.prefetch(1, [6], iteration=2)  # the next prediction: 3 and 5 were wrong
    run_forward(manager, 0, [0], x)
    assert manager.metrics.deferred == 0
    assert 6 in _resident(manager, 1) and len(_resident(manager, 1)) == 2
    manager.close()


def test_prefetches_for_later_layers_never_evict_the_running_layers_experts():
    manager = make_manager("hi-cache", 3, 0, bandwidth=None)
    x = torch.randn(2, HIDDEN)
    manager.begin_iteration(1)
    run_forward(manager, 0, [0, 1], x)
    run_forward(manager, 1, [4], x)  # LRU order: (0,0), (0,1), (1,4)
    manager.begin_iteration(2)
    manager.prefetch(1, [6, 7], iteration=2)
    misses = manager.metrics.layers[0].misses
    run_forward(manager, 0, [0, 1], x)  # both hits: the prefetches wait until after this layer's demand
    assert manager.metrics.layers[0].misses == misses
    assert _resident(manager, 0) == {0, 1}
    manager.close()


def test_prefetches_are_not_rate_limited():
    manager = make_manager("hi-cache", 12, 0, bandwidth=None)
    manager.options = dataclasses.replace(manager.options, max_background_copies=2, max_inflight_prefetches=64)
    x = torch.randn(2, HIDDEN)
    manager.begin_iteration(1)
    manager.prefetch(1, list(range(EXPERTS)), iteration=1)  # more than max_background_copies
    run_forward(manager, 0, [0], x)
    assert manager.metrics.copies == 1 + EXPERTS  # the demand load and every prefetch
    manager.close()


def test_predictions_past_the_links_capacity_are_dropped_but_cache_fills_are_not():
    """Table mode, copies slowed down: at most `max_inflight_prefetches` predicted copies in flight;
    a miss being cached is not a prediction and is always copied."""
    manager = make_manager("hi-cache", 2 * EXPERTS, 0, on_miss="zero-copy", bandwidth=2e5)
    manager.options = dataclasses.replace(manager.options, max_inflight_prefetches=2)
    manager.begin_step(1)
    manager.prefetch(1, list(range(EXPERTS)), iteration=1)
    manager.end_step()
    manager.begin_step(2)  # the predictions go out: two copies, the rest dropped
    assert manager.metrics.copies == 2 and manager.metrics.deferred == EXPERTS - 2
    ran = np.full((LAYERS, EXPERTS), UNUSED, dtype=np.int32)
    ran[0, :3] = manager.pool_ids["host"]  # three misses of layer 0, read from host memory
    manager.observe_step(ran, 2)
    manager.end_step()
    manager.begin_step(3)  # the link is still busy, yet every miss is cached
    assert manager.metrics.copies == 2 + 3
    manager.close()


def test_in_the_lo_plus_hi_mode_a_prefetch_brings_the_precision_the_precision_policy_chose():
    """combined: FineMoE says when, DynaExq says in which precision. A prefetch of an expert whose
    target is lo (resident in the lo pool) copies nothing; one whose target is hi copies its hi
    version. Run 10 (OLMoE shape, batch 1, 4 GiB): prefetching hi for every predicted expert into 50 hi
    slots moved 178 GB in 64 tokens and ran at 20.6 tok/s, against 56.2 for static-int2."""
    manager = make_manager("lo+hi", 4, LAYERS * EXPERTS, on_miss="lo", bandwidth=None)
    x = torch.randn(2, HIDDEN)
    manager.begin_iteration(1)
    manager.set_precision(1, 5, "hi")
    run_forward(manager, 0, [0], x)  # applies the precision change (a promotion: one hi copy)
    copies = manager.metrics.copies
    assert copies == 1 and manager.metrics.promotions == 1
    manager.prefetch(1, [2, 3], iteration=1)  # target lo, lo resident: nothing to move
    manager.prefetch(2, [1], iteration=1)
    manager._drain_requests()
    assert not manager._prefetch_queue  # (not even queued: most of a busy step's requests)
    run_forward(manager, 0, [0], x)
    assert manager.metrics.copies == copies
    assert all("hi" not in manager.handles[l][e].versions for l, e in ((1, 2), (1, 3), (2, 1)))
    manager.handles[1][5].versions["hi"].ready.synchronize()
    manager._evict(manager.handles[1][5], "hi")  # the hot expert's hi version was evicted
    manager.prefetch(1, [5], iteration=1)  # target hi: the prefetch brings it back in hi
    run_forward(manager, 0, [0], x)
    assert manager.metrics.copies == copies + 1 and "hi" in manager.handles[1][5].versions
    manager.close()


def test_promotion_is_published_only_after_its_copy_and_the_forward_pass_never_waits():
    # a very slow copy engine: the promotion cannot finish while the forward pass runs
    manager = make_manager("lo+hi", 4, LAYERS * EXPERTS, on_miss="lo", bandwidth=2e4)
    manager.begin_iteration(1)
    manager.set_precision(0, 4, "hi")
    resolved, _ = manager.acquire(0, [4], torch.device("cpu"))
    h = manager.handles[0][4]
    assert resolved[4].pool == "lo"  # still lo: the hi copy has not completed
    assert h.state is HandleState.PROMOTING
    manager.release(0, [4])
    h.versions["hi"].ready.synchronize()
    resolved, _ = manager.acquire(0, [4], torch.device("cpu"))
    assert resolved[4].pool == "hi" and h.state is HandleState.RESIDENT_HI
    manager.release(0, [4])
    assert manager.metrics.promotions == 1 and manager.metrics.layers[0].stall_s < 0.05
    manager.close()


def test_promotion_is_deferred_when_no_slot_can_be_reserved():
    manager = make_manager("lo+hi", 2, LAYERS * EXPERTS, on_miss="lo")
    x = torch.randn(2, HIDDEN)
    manager.begin_iteration(1)
    for e in range(4):
        manager.set_precision(0, e, "hi")
    manager.protect(0, [0, 1], iteration=1)
    run_forward(manager, 0, [0, 1], x)
    used = manager.budget.used_bytes
    assert used <= manager.budget.total_bytes
    assert manager.metrics.promotions == 2 and manager.metrics.deferred >= 2
    manager.close()


def test_demotion_frees_the_hi_slot():
    manager = make_manager("lo+hi", 2, LAYERS * EXPERTS, on_miss="lo", bandwidth=None)
    x = torch.randn(2, HIDDEN)
    manager.begin_iteration(1)
    manager.set_precision(1, 6, "hi")
    run_forward(manager, 0, [0], x)
    manager.handles[1][6].versions["hi"].ready.synchronize()
    manager.set_precision(1, 6, "lo")
    run_forward(manager, 0, [0], x)
    assert "hi" not in manager.handles[1][6].versions
    assert manager.handles[1][6].state is HandleState.RESIDENT_LO
    assert manager.metrics.demotions == 1
    manager.close()


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


@pytest.mark.parametrize("policy", ["no-offload", "on-demand", "combined", "dynaexq"])
def test_hi_resident_outputs_equal_the_foundation(tiny_checkpoints, policy):
    """With every expert hi-resident (or reached through hi copies), logits equal the reference."""
    path, reference = tiny_checkpoints["qwen2_moe"]
    llm = moetide.LLM(path, device="cpu", policy=policy, gpu_memory="64MiB", on_miss="stall")
    if policy in ("combined", "dynaexq"):
        res = llm.loaded.runtime.residency
        for layer in range(len(llm.loaded.moe_layers)):
            for e in range(res.store.num_experts):
                res.set_precision(layer, e, "hi")
        res.options = type(res.options)(**{**res.options.__dict__, "max_background_copies": 10_000})
        res.acquire(0, [0], torch.device("cpu"))  # issues the promotions (after its own demand)
        res.release(0, [0])
        for row in res.handles:
            for h in row:
                h.versions["hi"].ready.synchronize()
        llm.metrics.reset()
    ids = torch.randint(5, 90, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(llm.loaded.model(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)
    if policy in ("combined", "dynaexq"):
        assert llm.metrics.snapshot()["lo_runs"] == 0
    llm.close()


def test_direct_residency_off_the_cpu_stages_each_steps_experts_as_the_kernels_pool(tiny_checkpoints):
    """Direct residency on a device that is not the host (the foundation reference on a GPU) copies
    the step's experts into one staged arena, which is the kernel's pool for that step. Exercised on
    the CPU by naming another device type: the logits still equal transformers' own."""
    from moetide.residency.direct import DirectResidency

    path, reference = tiny_checkpoints["qwen2_moe"]
    llm = moetide.LLM(path, device="cpu", policy="no-offload")
    runtime = llm.loaded.runtime
    assert isinstance(runtime.residency, DirectResidency)
    runtime.residency = DirectResidency(runtime.residency.store, runtime.metrics, device_type="cuda")
    ids = torch.randint(5, 90, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(llm.loaded.model(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)
    assert runtime.metrics.host_syncs > 0  # it went through acquire, not the static table
    llm.close()


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
    with pytest.raises(BudgetError, match="cannot drop the host hi versions"):
        moetide.LLM(
            qwen3_checkpoint, device="cpu", policy="on-demand", gpu_memory="64MiB", host_versions=("lo",)
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


def test_prob_freq_eviction_ranks_by_probability_times_visits_then_lru():
    """FineMoE's rule: the resident expert with the lowest probability x visit count goes first
    (ties: least recently used); plain LRU would evict the oldest."""
    from dataclasses import replace

    manager = make_manager("hi-cache", 3, 0, bandwidth=None)
    manager.options = replace(manager.options, eviction="prob-freq")
    x = torch.randn(2, HIDDEN)
    manager.begin_iteration(1)
    run_forward(manager, 0, [0, 1, 2], x)  # LRU order 0, 1, 2; one visit each
    manager.begin_iteration(2)
    run_forward(manager, 0, [0], x)  # expert 0: two visits, now the most recent
    manager.observe_gate_probs(0, torch.tensor([0.3, 0.4, 0.1, 0, 0, 0, 0, 0.2]))
    manager.begin_iteration(3)
    run_forward(manager, 0, [7], x)  # scores 0: 0.6, 1: 0.4, 2: 0.1 -> 2 goes (LRU would evict 1)
    assert _resident(manager, 0) == {0, 1, 7}
    manager.observe_gate_probs(0, torch.tensor([0.05, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9]))
    manager.prefetch(0, [1], iteration=3, priorities=[0.01])  # a newer prediction lowers 1's estimate
    manager.begin_iteration(4)
    run_forward(manager, 0, [3], x)  # scores 0: 0.1, 1: 0.01, 7: 0.9 -> 1 goes (0 would by observation)
    assert _resident(manager, 0) == {0, 3, 7}
    with pytest.raises(ValueError, match="eviction"):
        replace(manager.options, eviction="random")
    manager.close()


@pytest.mark.parametrize("eviction", ["lru", "prob-freq"])
def test_a_burst_of_prefetches_evicts_in_the_order_single_evictions_would(eviction):
    """`_victim_queue` ranks once what `_victim` would pick one scan at a time, and skips a version
    touched after the ranking (an expert just predicted again must not go)."""
    from dataclasses import replace

    manager = make_manager("hi-cache", 4, 0, bandwidth=None)
    manager.options = replace(manager.options, eviction=eviction)
    x = torch.randn(2, HIDDEN)
    manager.begin_iteration(1)
    run_forward(manager, 0, [0, 1, 2, 3], x)
    manager.begin_iteration(2)
    run_forward(manager, 0, [2], x)  # LRU order 0, 1, 3, 2
    manager.observe_gate_probs(0, torch.tensor([0.4, 0.1, 0.3, 0.2, 0, 0, 0, 0]))
    manager._drain_requests()
    singles = []
    for _ in range(4):
        h = manager._victim("hi", protect_all=True)
        singles.append(h.expert)
        manager._lru["hi"].move_to_end((h.layer, h.expert))  # so the next scan finds the next one
        manager._visits[h.layer, h.expert] += 100  # and prob-freq ranks it last
    manager.begin_iteration(3)
    run_forward(manager, 0, [0, 1, 2, 3], x)  # back to the state before the single picks
    manager._visits[0, :4] = [1, 1, 2, 1]
    for e in (0, 1, 3, 2):
        manager._touch(manager.handles[0][e], "hi")
    next_victim = manager._victim_queue("hi")
    want = [0, 1, 3, 2] if eviction == "lru" else [1, 3, 0, 2]  # scores 0.4, 0.1, 0.6, 0.2
    assert [next_victim().expert for _ in range(4)] == want
    assert singles == want
    next_victim = manager._victim_queue("hi")
    manager._touch(manager.handles[0][want[0]], "hi")  # predicted again after the ranking
    assert next_victim().expert == want[1]
    manager.close()


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
    """`--gpu-memory 50%` (the fixed part + half of all experts in hi) in generate/serve's engine
    options and in `moetide.LLM`, not only in bench."""
    import moetide
    from moetide.cli import build_parser, engine_config_from_args
    from moetide.engine.memory import model_bytes, resolve_budget

    base = EngineConfig(model=str(qwen3_checkpoint), device="cpu", policy="on-demand")
    want = resolve_budget("50%", base)
    mb = model_bytes(base)
    assert want == mb.fixed.total + mb.all_experts_hi_bytes // 2
    for command in (["generate", "hi"], ["serve"]):
        args = build_parser().parse_args(
            [command[0], "--model", str(qwen3_checkpoint), "--device", "cpu", "--policy", "on-demand",
             "--gpu-memory", "50%", *command[1:]]
        )  # fmt: skip
        assert engine_config_from_args(args).gpu_memory_bytes == want
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
