"""The residency core on the CPU backend (a separate arena, copies on a worker thread at a simulated
bandwidth, each destination poisoned first): what each step reads through the device table, the
accounting of its uses, prefetches, protection, precision changes, and the eviction rules. The
device-table state machine (`test_device_table.py`) adds steps that lag the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from residency_setup import EXPERTS, LAYERS, land_all, make_manager, read_entry, resident, run_step

import moetide
from moetide.errors import BudgetError
from moetide.residency.budget import BudgetTracker
from moetide.residency.eviction import RULES, ExpertStats, eviction_order, eviction_rule
from moetide.residency.handles import HandleState


def check_invariants(manager):
    assert manager.budget.used_bytes <= manager.budget.total_bytes
    for name, pool in manager.pools.items():
        held = sum(1 for row in manager.handles for h in row if name in h.versions)
        assert held + pool.pending + pool.free_slots == pool.num_slots
        reserved = manager.budget.reserved.get(f"expert_{name}", 0)
        assert reserved == (held + pool.pending) * pool.slot_bytes  # a slot's bytes until it is free
    for row in manager.handles:
        for h in row:
            v = h.resolve()
            if v is not None:
                assert v.ready.query()
            assert isinstance(h.state, HandleState)


op = st.one_of(
    st.tuples(st.just("step"), st.integers(0, LAYERS - 1), st.lists(st.integers(0, EXPERTS - 1), max_size=6)),
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
    st.tuples(st.just("land"), st.just(0), st.just(0)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["hi-cache", "lo+hi", "all-lo"]), hi_slots=st.integers(2, 10),
       ops=st.lists(op, min_size=1, max_size=25))  # fmt: skip
def test_random_interleavings_keep_every_invariant(mode, hi_slots, ops):
    """Steps read only complete versions of the experts the table names; slots and bytes add up."""
    lo_slots = LAYERS * EXPERTS if mode != "hi-cache" else 0
    manager = make_manager(mode, hi_slots if mode != "all-lo" else 0, lo_slots)
    iteration = 0
    try:
        for kind, layer, arg in ops:
            if kind == "step":
                iteration += 1
                run_step(manager, iteration, {layer: arg})
            elif kind == "prefetch":
                manager.prefetch(layer, arg, iteration=iteration)
            elif kind == "protect":
                manager.protect(layer, arg, iteration=iteration)
            elif kind == "land":
                land_all(manager)
            else:
                manager.set_precision(layer, arg, "hi" if kind == "promote" else "lo")
            check_invariants(manager)
        land_all(manager)
        run_step(manager, iteration + 1, {layer: list(range(EXPERTS)) for layer in range(LAYERS)})
        check_invariants(manager)
    finally:
        manager.close()


def test_each_use_is_a_hit_a_lo_run_or_a_miss():
    """lo+hi: an expert with only its lo version runs lo (a lo run, not a hit); once its hi version is
    resident it is a hit. hi-cache: a use read from host memory is a miss, cached for later steps
    (a miss fill, not a prefetch). used = hits + lo_runs + misses."""
    manager = make_manager("lo+hi", 4, LAYERS * EXPERTS)
    run_step(manager, 1, {0: [1, 2]})
    c = manager.metrics.layers[0]
    assert (c.hits, c.lo_runs, c.misses) == (0, 2, 0)
    manager.set_precision(0, 1, "hi")
    manager.settle()
    run_step(manager, 2, {0: [1, 2]})
    assert (c.hits, c.lo_runs, c.misses) == (1, 3, 0)
    assert manager.metrics.hit_rate == 0.25 and c.used == c.hits + c.lo_runs + c.misses
    manager.close()
    manager = make_manager("hi-cache", 4, 0)
    run_step(manager, 1, {0: [1]})
    run_step(manager, 2, {})  # the fill goes out
    land_all(manager)
    run_step(manager, 3, {0: [1]})
    m, c = manager.metrics, manager.metrics.layers[0]
    assert (c.hits, c.lo_runs, c.misses) == (1, 0, 1)
    assert (m.miss_fills, m.prefetches_issued, m.prefetches_used) == (1, 0, 0)
    manager.close()


def test_prefetch_turns_a_miss_into_a_hit_and_counts_only_copies_started():
    manager = make_manager("hi-cache", 4, 0, bandwidth=None)
    manager.prefetch(1, [3, 5], iteration=1)
    run_step(manager, 1, {})  # the prefetches are issued at the step boundary
    land_all(manager)
    manager.prefetch(1, [3, 5], iteration=2)  # already resident: no copy, not counted
    run_step(manager, 2, {1: [3, 5]})
    m = manager.metrics
    assert m.layers[1].hits == 2 and m.layers[1].misses == 0
    assert (m.prefetches_issued, m.prefetches_used, m.copies) == (2, 2, 2)
    run_step(manager, 3, {1: [3, 5]})  # a prefetch is used once
    assert m.prefetches_used == 2
    manager.close()


def test_protected_experts_are_not_evicted_while_their_protection_holds():
    manager = make_manager("hi-cache", 3, 0, bandwidth=None)
    manager.prefetch(0, [0, 1, 2], iteration=1)
    run_step(manager, 1, {})
    land_all(manager)
    run_step(manager, 2, {0: [0, 1, 2]})  # pool full, LRU order 0, 1, 2
    manager.protect(0, [0], iteration=3)
    manager.prefetch(0, [7], iteration=3)  # needs a slot: 0 is oldest but protected, 1 goes
    run_step(manager, 3, {})
    land_all(manager)
    assert resident(manager, 0) == {0, 2, 7}
    manager.prefetch(0, [5], iteration=4)  # step 3 has run: its protection has served, 0 goes
    run_step(manager, 4, {})
    assert resident(manager, 0) == {2, 5, 7}
    manager.close()


def test_a_landed_prefetch_that_was_never_used_can_be_evicted_by_the_next_prefetch():
    """Wrong predictions must not pin the cache: an unused prefetched version whose copy has landed
    is as evictable as any other."""
    manager = make_manager("hi-cache", 3, 0, bandwidth=None)
    manager.prefetch(0, [0], iteration=1)
    manager.prefetch(1, [3, 5], iteration=1)
    run_step(manager, 1, {})
    land_all(manager)
    manager.protect(0, [0], iteration=2)  # so the only candidates are the two unused prefetches
    manager.prefetch(1, [6], iteration=2)  # the next prediction: 3 and 5 were wrong
    run_step(manager, 2, {})
    assert manager.metrics.deferred == 0
    assert 6 in resident(manager, 1) and len(resident(manager, 1)) == 2
    manager.close()


def test_in_step_prefetches_evict_only_versions_of_layers_already_run():
    """Within a step, routed at layer 1: a prefetch for layer 2 may take the slot of a layer-0
    version (its readers are done), never one of layer 1 (running) or 2 (still to read)."""
    manager = make_manager("hi-cache", 3, 0, bandwidth=None)
    for layer, e in ((0, 0), (1, 4), (2, 5)):
        manager.prefetch(layer, [e], iteration=1)
    run_step(manager, 1, {})
    land_all(manager)
    manager.begin_step(2)
    manager.prefetch(2, [6], iteration=2)
    assert manager.in_step(2, 0) == 0  # routed at layer 0: nothing has run before it
    manager.prefetch(2, [6], iteration=2)
    assert manager.in_step(2, 1) == 1
    land_all(manager)
    assert (resident(manager, 0), resident(manager, 1), resident(manager, 2)) == (set(), {4}, {5, 6})
    assert read_entry(manager, 2, 6) == manager.pool_ids["hi"]  # the copy published its own entry
    manager.end_step()
    manager.close()


def test_prefetches_are_not_rate_limited():
    manager = make_manager(
        "hi-cache", 12, 0, bandwidth=None, max_background_copies=2, max_inflight_prefetches=64
    )
    manager.prefetch(1, list(range(EXPERTS)), iteration=1)  # more than max_background_copies x layers
    run_step(manager, 1, {})
    assert manager.metrics.copies == EXPERTS
    manager.close()


def test_precision_changes_are_rate_limited_per_step_and_the_rest_wait():
    manager = make_manager("lo+hi", 12, LAYERS * EXPERTS, bandwidth=None, max_background_copies=1)
    for e in range(EXPERTS):
        manager.set_precision(0, e, "hi")
    run_step(manager, 1, {})
    assert manager.metrics.promotions == LAYERS  # one per layer and step
    run_step(manager, 2, {})
    assert manager.metrics.promotions == 2 * LAYERS
    manager.close()


def test_predictions_past_the_links_capacity_are_dropped_but_cache_fills_are_not():
    """Copies slowed down: at most `max_inflight_prefetches` predicted copies in flight; a miss being
    cached is not a prediction and is always copied."""
    manager = make_manager("hi-cache", 2 * EXPERTS, 0, bandwidth=2e5, max_inflight_prefetches=2)
    manager.prefetch(1, list(range(EXPERTS)), iteration=1)
    run_step(manager, 1, {})  # the predictions go out: two copies, the rest dropped
    assert manager.metrics.copies == 2 and manager.metrics.deferred == EXPERTS - 2
    run_step(manager, 2, {0: [0, 1, 2]})  # three misses of layer 0, read from host memory
    run_step(manager, 3, {})  # the link is still busy, yet every miss is cached
    assert manager.metrics.copies == 2 + 3 and manager.metrics.miss_fills == 3
    manager.close()


def test_a_miss_fill_survives_the_layer_feed_of_a_later_layer():
    """A miss is cached for the next steps, not for a layer of the running step: the layer feed's
    in-step pass, at a layer past the missed one, leaves its fill queued; the fill is a miss fill,
    and a later prediction of the same expert is a prefetch, not a fill."""
    manager = make_manager("hi-cache", 4, 0, bandwidth=None)
    manager.in_step_fed = True
    run_step(manager, 1, {0: [1]})  # a miss: its fill is queued
    assert manager.in_step(1, 2) == 0  # the feed, still on step 1, past layer 0
    run_step(manager, 2, {})  # the fill goes out
    m = manager.metrics
    assert "hi" in manager.handles[0][1].versions and (m.miss_fills, m.prefetches_issued) == (1, 0)
    manager.prefetch(1, [2], iteration=2)
    run_step(manager, 3, {})
    assert (m.miss_fills, m.prefetches_issued) == (1, 1) and manager.handles[1][2].versions["hi"].prefetched
    manager.close()


def test_in_the_lo_plus_hi_mode_a_prefetch_brings_the_precision_the_precision_policy_chose():
    """combined: FineMoE says when, DynaExq says in which precision. A prefetch of an expert whose
    target is hi copies its hi version back; one whose target is lo is brought into hi beside the hot
    set, in the slots the hot set leaves (free ones, then other predictions'), and never evicts a
    version of the hot set: with none left it runs lo."""
    manager = make_manager("lo+hi", 4, LAYERS * EXPERTS, bandwidth=None)
    hi = manager.pool_ids["hi"]
    manager.set_precision(1, 5, "hi")
    run_step(manager, 1, {})  # applies the precision change (a promotion: one hi copy)
    assert manager.metrics.copies == 1 and manager.metrics.promotions == 1
    manager.prefetch(1, [2, 3], iteration=1)  # target lo: into the three free hi slots
    manager.prefetch(2, [1], iteration=1)
    run_step(manager, 2, {})
    assert manager.metrics.copies == 4 and manager.metrics.prefetches_issued == 3
    land_all(manager)
    ran = run_step(manager, 3, {1: [2, 5]})
    assert ran[1, 2] == ran[1, 5] == hi and manager.metrics.prefetches_used == 1
    manager.prefetch(0, [0, 1, 2], iteration=3)  # the pool is full: predictions replace predictions
    run_step(manager, 4, {})
    land_all(manager)
    run_step(manager, 5, {})
    assert "hi" in manager.handles[1][5].versions  # the hot set's version stays
    assert manager.metrics.copies == 7 and resident(manager, 0) == {0, 1, 2}
    manager.cache.evict(manager.handles[1][5], "hi", None)  # the hot expert's hi version was evicted
    manager.prefetch(1, [5], iteration=5)  # target hi: the prefetch brings it back in hi
    run_step(manager, 6, {})
    assert manager.metrics.copies == 8 and "hi" in manager.handles[1][5].versions
    manager.close()


def test_in_the_lo_plus_hi_mode_a_prediction_never_evicts_the_hot_set():
    manager = make_manager("lo+hi", 2, LAYERS * EXPERTS, bandwidth=None)
    lo = manager.pool_ids["lo"]
    for e in (0, 1):
        manager.set_precision(0, e, "hi")
    run_step(manager, 1, {})
    land_all(manager)
    copies = manager.metrics.copies
    manager.prefetch(2, [3], iteration=1)  # target lo, every hi slot the hot set's
    ran = run_step(manager, 2, {2: [3]})
    assert manager.metrics.copies == copies and manager.metrics.deferred == 1
    assert resident(manager, 0) == {0, 1} and ran[2, 3] == lo
    manager.close()


def test_promotion_is_published_only_after_its_copy_and_the_step_never_waits():
    manager = make_manager("lo+hi", 4, LAYERS * EXPERTS, bandwidth=2e4)  # a very slow copy engine
    lo, hi = manager.pool_ids["lo"], manager.pool_ids["hi"]
    manager.set_precision(0, 4, "hi")
    ran = run_step(manager, 1, {0: [4]})
    h = manager.handles[0][4]
    assert ran[0, 4] == lo and h.state is HandleState.PROMOTING  # still lo: the copy is under way
    h.versions["hi"].ready.synchronize()
    assert read_entry(manager, 0, 4) == hi  # the landed copy published its entry itself
    ran = run_step(manager, 2, {0: [4]})
    assert ran[0, 4] == hi and h.state is HandleState.RESIDENT_HI
    assert manager.metrics.promotions == 1
    manager.close()


def test_promotion_is_deferred_when_no_slot_can_be_reserved():
    manager = make_manager("lo+hi", 2, LAYERS * EXPERTS)
    for e in range(4):
        manager.set_precision(0, e, "hi")
    manager.protect(0, [0, 1], iteration=1)
    run_step(manager, 1, {0: [0, 1]})
    assert manager.budget.used_bytes <= manager.budget.total_bytes
    assert manager.metrics.promotions == 2 and manager.metrics.deferred >= 2
    manager.close()


def test_demotion_frees_the_hi_slot():
    manager = make_manager("lo+hi", 2, LAYERS * EXPERTS, bandwidth=None)
    manager.set_precision(1, 6, "hi")
    run_step(manager, 1, {})
    land_all(manager)
    manager.set_precision(1, 6, "lo")
    run_step(manager, 2, {})
    assert "hi" not in manager.handles[1][6].versions
    assert manager.handles[1][6].state is HandleState.RESIDENT_LO
    assert manager.metrics.demotions == 1
    run_step(manager, 3, {})  # the last step that could read the slot has run: it is free again
    assert manager.pools["hi"].free_slots == 2
    manager.close()


@pytest.mark.parametrize("policy", ["no-offload", "on-demand", "combined", "dynaexq"])
def test_hi_resident_outputs_equal_the_foundation(tiny_checkpoints, policy):
    """With every expert hi-resident, or read in hi from host memory, logits equal the reference."""
    path, reference = tiny_checkpoints["qwen2_moe"]
    llm = moetide.LLM(path, device="cpu", policy=policy, gpu_memory="64MiB")
    if policy in ("combined", "dynaexq"):
        res = llm.loaded.runtime.residency
        for layer in range(len(llm.loaded.moe_layers)):
            for e in range(res.store.num_experts):
                res.set_precision(layer, e, "hi")
        res.settle()
        llm.metrics.reset()
    ids = torch.randint(5, 90, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(llm.loaded.model(ids).logits, reference(ids).logits, atol=1e-5, rtol=0)
    if policy in ("combined", "dynaexq"):
        llm.loaded.runtime.flush_observations()
        assert llm.metrics.snapshot()["lo_runs"] == 0 and llm.metrics.hits > 0
    llm.close()


# -- eviction rules ---------------------------------------------------------------------------------


def test_eviction_order_puts_first_then_lowest_score_then_least_recent():
    prob = np.array([0.5, 0.1, 0.1, 0.9])
    visits = np.array([1, 2, 2, 1])
    recency = np.array([3, 1, 0, 2])
    assert eviction_order(eviction_rule("lru"), recency, prob, visits).tolist() == [2, 1, 3, 0]
    assert eviction_order(eviction_rule("prob-freq"), recency, prob, visits).tolist() == [2, 1, 0, 3]
    first = np.array([False, False, False, True])
    assert eviction_order(eviction_rule("prob-freq"), recency, prob, visits, first).tolist() == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="eviction"):
        eviction_rule("random")


def test_prob_freq_eviction_ranks_by_probability_times_visits_then_lru():
    """FineMoE's rule: the resident expert with the lowest probability x visit count goes first
    (ties: least recently used); plain LRU would evict the oldest."""
    manager = make_manager("hi-cache", 3, 0, bandwidth=None, eviction="prob-freq")
    manager.prefetch(0, [0, 1, 2], iteration=1)
    run_step(manager, 1, {})
    land_all(manager)
    run_step(manager, 2, {0: [0, 1, 2]})  # LRU order 0, 1, 2; one visit each
    run_step(manager, 3, {0: [0]})  # expert 0: two visits, now the most recent
    manager.observe_gate_probs(0, torch.tensor([0.3, 0.4, 0.1, 0, 0, 0, 0, 0.2]))
    manager.prefetch(0, [7], iteration=4)
    run_step(manager, 4, {})  # scores 0: 0.6, 1: 0.4, 2: 0.1 -> 2 goes (LRU would evict 1)
    land_all(manager)
    assert resident(manager, 0) == {0, 1, 7}
    manager.observe_gate_probs(0, torch.tensor([0.05, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.9]))
    manager.prefetch(0, [1], iteration=5, priorities=[0.01])  # a newer prediction lowers 1's estimate
    run_step(manager, 5, {0: [7]})
    manager.prefetch(0, [3], iteration=6)
    run_step(manager, 6, {})  # scores 0: 0.1, 1: 0.01, 7: 0.9 -> 1 goes (0 would by observation)
    assert resident(manager, 0) == {0, 3, 7}
    manager.close()


@pytest.mark.parametrize("eviction", sorted(RULES))
def test_a_burst_of_prefetches_evicts_in_the_order_single_evictions_would(eviction):
    """`victim_queue` ranks once what `victim` picks one scan at a time, and skips a version touched
    after the ranking (an expert just predicted again must not go)."""
    manager = make_manager("hi-cache", 4, 0, bandwidth=None, eviction=eviction)
    manager.prefetch(0, [0, 1, 2, 3], iteration=1)
    run_step(manager, 1, {})
    land_all(manager)
    run_step(manager, 2, {0: [0, 1, 2, 3]})
    run_step(manager, 3, {0: [2]})  # LRU order 0, 1, 3, 2; visits 1, 1, 2, 1
    manager.observe_gate_probs(0, torch.tensor([0.4, 0.1, 0.3, 0.2, 0, 0, 0, 0]))
    run_step(manager, 4, {})
    cache, stats = manager.cache, manager.stats
    singles = []
    for _ in range(4):
        h = cache.victim("hi")
        assert h is cache.candidates("hi")[0][0]
        singles.append(h.expert)
        cache.lru["hi"].move_to_end((h.layer, h.expert))  # so the next scan finds the next one
        stats.visits[h.layer, h.expert] += 100  # and prob-freq ranks it last
    stats.visits[0, :4] = [1, 1, 2, 1]
    for e in (0, 1, 3, 2):
        cache.touch(manager.handles[0][e], "hi")
    next_victim = cache.victim_queue("hi")
    want = [0, 1, 3, 2] if eviction == "lru" else [1, 3, 0, 2]  # scores 0.4, 0.1, 0.6, 0.2
    assert [next_victim().expert for _ in range(4)] == want
    assert singles == want
    next_victim = cache.victim_queue("hi")
    cache.touch(manager.handles[0][want[0]], "hi")  # predicted again after the ranking
    assert next_victim().expert == want[1]
    manager.close()


def test_protection_ends_with_the_iterations_it_was_asked_for():
    stats = ExpertStats.zeros(2, 4)
    stats.protect(0, [1, 2], iteration=5)
    stats.protect(1, [3], iteration=7)
    stats.unprotect(5, layers=slice(1, 2))  # another layer's: nothing ends
    assert stats.is_protected(0, 1) and stats.is_protected(1, 3)
    stats.unprotect(5)
    assert not stats.is_protected(0, 1) and not stats.is_protected(0, 2) and stats.is_protected(1, 3)
    assert not stats.is_protected(0, 0)


def test_a_copy_still_in_flight_is_never_a_victim():
    manager = make_manager("hi-cache", 2, 0, bandwidth=1e3)  # a copy takes seconds
    manager.prefetch(0, [0, 1], iteration=1)
    run_step(manager, 1, {})
    assert manager.cache.victim("hi") is None and manager.cache.candidates("hi") == []
    manager.prefetch(0, [2], iteration=2)
    run_step(manager, 2, {})
    assert resident(manager, 0) == {0, 1} and manager.metrics.deferred == 1
    manager.close()


@pytest.mark.parametrize("eviction", sorted(RULES))
def test_no_rule_offers_a_protected_version(eviction):
    """Every way to a victim (one pick, a full ranking, a burst's queue) spares protected experts."""
    manager = make_manager("hi-cache", 3, 0, bandwidth=None, eviction=eviction)
    manager.prefetch(0, [0, 1, 2], iteration=1)
    run_step(manager, 1, {})
    land_all(manager)
    run_step(manager, 2, {0: [0, 1, 2]})
    manager.stats.protect(0, [0, 1], iteration=9)
    cache = manager.cache
    assert cache.victim("hi").expert == 2
    assert [h.expert for h, _cold in cache.candidates("hi")] == [2]
    next_victim = cache.victim_queue("hi")
    assert next_victim().expert == 2 and next_victim() is None
    manager.close()


def test_a_protection_for_a_later_step_holds_until_that_step_has_run():
    """A prediction made from step i's observations is for step i + 2 (`TABLE_LAG`): its protection
    spares the expert through that step's copies and ends with it."""
    manager = make_manager("hi-cache", 3, 0, bandwidth=None)
    manager.prefetch(0, [0, 1, 2], iteration=1)
    run_step(manager, 1, {})
    land_all(manager)
    run_step(manager, 2, {0: [0, 1, 2]})  # LRU order 0, 1, 2
    manager.protect(0, [0], iteration=4)
    run_step(manager, 3, {})
    manager.prefetch(0, [7], iteration=3)
    run_step(manager, 4, {})  # 0 is the oldest but spared for step 4: 1 goes
    land_all(manager)
    assert resident(manager, 0) == {0, 2, 7}
    manager.prefetch(0, [5], iteration=4)
    run_step(manager, 5, {})  # step 4 has run: 0 goes
    assert resident(manager, 0) == {2, 5, 7}
    manager.close()


def test_the_budget_refuses_the_reservation_that_would_exceed_it():
    """The new reservation is what tips the budget over: 200 of 250 bytes used, 100 more refused,
    50 more (exactly what is left) accepted."""
    tracker = BudgetTracker(250)
    assert tracker.try_reserve(200, "a")
    assert not tracker.try_reserve(100, "b") and tracker.used_bytes == 200
    assert tracker.try_reserve(50, "b") and tracker.used_bytes == tracker.peak_bytes == 250
    with pytest.raises(BudgetError, match="needs 1 B"):
        tracker.reserve(1, "c", "one more byte")


def test_a_budget_smaller_than_the_free_slots_binds_the_residency():
    """Four free hi slots, but the budget holds only two of them once another reservation takes
    its share: prefetching four experts copies two, and the budget is never exceeded."""
    m = make_manager("hi-cache", 4, 0, bandwidth=None)
    try:
        hi = m.pools["hi"]
        m.budget.reserve(2 * hi.slot_bytes, "other", "another reservation")
        m.prefetch(1, [0, 1, 2, 3], iteration=1)
        run_step(m, 1, {})
        land_all(m)
        assert hi.free_slots == 2 and len(resident(m, 1)) == 2
        assert m.budget.used_bytes == m.budget.total_bytes
        check_invariants(m)
    finally:
        m.close()


def test_both_residencies_have_every_member_of_the_protocol():
    """The engine codes against `Residency`: each implementation answers every attribute and method
    of it (a planned one with its plan and options, the static one with None for both)."""
    from residency_setup import STORE

    from moetide.residency.metrics import ExpertMetrics
    from moetide.residency.protocol import Residency, StaticResidency

    members = set(Residency.__annotations__) | {n for n in vars(Residency) if not n.startswith("_")}
    static = StaticResidency(STORE, ExpertMetrics(LAYERS), torch.device("cpu"))
    planned = make_manager("hi-cache", 4, 0)
    try:
        for residency in (static, planned):
            missing = sorted(n for n in members if not hasattr(residency, n))
            assert not missing, f"{type(residency).__name__} lacks {missing}"
        assert static.plan is None and static.options is None
        assert planned.plan is not None and planned.options.mode == "hi-cache"
        assert planned.resident_counts() and static.resident_counts()["hi"] == LAYERS * EXPERTS
    finally:
        planned.close()
