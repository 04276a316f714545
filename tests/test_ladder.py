"""DynaExq's precision ladder of more than two tiers (e.g. bf16 > int4 > int2): the scheduler's tier
assignment (hysteresis, rate limit), the budget's split into tier capacities, the residency's
moves between tiers, greedy outputs through the engine against a dequantized reference, the memory
cap, and the one-line errors of a bad ladder."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from test_bad_input import assert_one_line_error, run_cli
from test_device_table import DeviceTableMachine, LaggingTransfer
from test_policies_formulas import RecordingSink, _observe, _sched
from residency_setup import EXPERTS, LAYERS, make_store

import moetide
from moetide.config import EngineConfig, parse_bytes
from moetide.errors import BudgetError, ConfigError
from moetide.policies.base import tier_names
from moetide.policies.dynaexq import DynaExqScheduler
from moetide.residency.budget import BudgetTracker, FixedCosts, plan_memory, split_ladder
from moetide.residency.core import ResidencyManager, ResidencyOptions
from moetide.residency.handles import HandleState
from moetide.residency.metrics import ExpertMetrics
from moetide.residency.transfer import CpuTransfer
from moetide.store import quant

KiB = 1024
LADDER = ("hi", "int4", "int2")  # the residency tests' ladder: pools hi, mid1 (int4), lo (int2)


# -- the scheduler --------------------------------------------------------------------------------------
def _ladder(n_hi, n_mid, J, L=1, **kw) -> tuple[DynaExqScheduler, RecordingSink]:
    return _sched(n_hi, L=L, J=J, n_mid=n_mid, **kw)


def test_the_hottest_go_to_the_top_tier_the_next_to_the_middle_one():
    s, sink = _ladder(1, (2,), J=6, alpha=0.0, hysteresis_margin=0.0)
    _observe(s, 0, [1, 9, 4, 0, 7, 2])
    sent = s.update()
    assert s.tier_set(0, 0) == [1] and s.tier_set(0, 1) == [2, 4] and s.tier_set(0, 2) == [0, 3, 5]
    assert sent == sink.precisions == [(0, 1, "hi"), (0, 4, "mid1"), (0, 2, "mid1")]  # largest gap first
    assert s.stats()["tier_experts"] == {"hi": 1, "mid1": 2}


def _climb(s):
    """hi = {0}, mid1 = {1}; then expert 2 turns hottest: 2 -> hi, 0 -> mid1, 1 -> lo."""
    s.hi[0, 0] = True
    s.members[1, 0, 1] = True
    _observe(s, 0, [5, 3, 9, 0])


def test_a_hot_expert_climbs_every_tier_in_one_update_and_the_displaced_step_down_one():
    s, sink = _ladder(1, (1,), J=4, alpha=0.0, hysteresis_margin=0.0)
    _climb(s)
    s.update()
    assert sink.precisions == [(0, 1, "lo"), (0, 0, "mid1"), (0, 2, "hi")]  # demotions first
    assert (s.promotions, s.demotions) == (1, 2)


def test_the_rate_limit_counts_experts_that_change_tier():
    """Two swaps (2 with 1, then 2 with 0) change three experts: with a limit of 2 the second waits
    for the next update, which finishes the climb."""
    s, sink = _ladder(1, (1,), J=4, alpha=0.0, hysteresis_margin=0.0, max_transitions_per_update=2)
    _climb(s)
    s.update()
    assert sink.precisions == [(0, 1, "lo"), (0, 2, "mid1")] and s.deferred_moves == 1
    sink.precisions.clear()
    _observe(s, 0, [5, 3, 9, 0])  # alpha = 0: the same scores again
    s.update()
    assert sink.precisions == [(0, 0, "mid1"), (0, 2, "hi")]
    s3, sink3 = _ladder(1, (1,), J=4, alpha=0.0, hysteresis_margin=0.0, max_transitions_per_update=3)
    _climb(s3)
    s3.update()
    assert len(sink3.precisions) == 3 and s3.deferred_moves == 0


@pytest.mark.parametrize(("challenger", "swapped"), [(11, False), (13, True)])
def test_hysteresis_guards_the_middle_tier(challenger, swapped):
    """hi = {0} (S 20), mid1 = {1} (S 10); a cold expert must beat mid1's weakest by the margin,
    0.25 x the layer's mean score: (30 + c) / 16 = 2.56 for c = 11, 2.69 for c = 13."""
    s, sink = _ladder(1, (1,), J=4, alpha=0.0, hysteresis_margin=0.25)
    s.hi[0, 0] = True
    s.members[1, 0, 1] = True
    _observe(s, 0, [20, 10, challenger, 0])
    s.update()
    assert sink.precisions == ([(0, 1, "lo"), (0, 2, "mid1")] if swapped else [])
    assert s.hi_set(0) == [0]


@st.composite
def ladder_runs(draw):
    L, J = draw(st.integers(1, 3)), draw(st.integers(3, 9))
    tiers = draw(st.integers(1, 3))  # tiers above lo
    caps = []
    for _ in range(tiers):
        caps.append([draw(st.integers(0, max(0, J // tiers))) for _ in range(L)])
    counts = draw(st.lists(st.lists(st.lists(st.integers(0, 6), min_size=J, max_size=J), min_size=L,
                                    max_size=L), min_size=1, max_size=5))  # fmt: skip
    margin = draw(st.sampled_from([0.0, 0.25, 1.0]))
    limit = draw(st.one_of(st.none(), st.integers(1, 4)))
    return L, J, caps, counts, margin, limit


@settings(max_examples=60, deadline=None)
@given(run=ladder_runs())
def test_every_update_keeps_capacities_the_rate_limit_and_hysteresis(run):
    L, J, caps, counts, margin, limit = run
    s, sink = _ladder(caps[0], tuple(caps[1:]), J, L, alpha=0.5, hysteresis_margin=margin,
                      max_transitions_per_update=limit)  # fmt: skip
    T = len(caps)
    for interval in counts:
        before = [s.tier_of(layer).copy() for layer in range(L)]
        for layer, c in enumerate(interval):
            _observe(s, layer, c)
        sent = s.update()
        after = [s.tier_of(layer) for layer in range(L)]
        names = tier_names(T + 1)
        changed = {
            (l, e): names[after[l][e]] for l in range(L) for e in range(J) if after[l][e] != before[l][e]
        }
        assert len(sent) == len(changed) and {(l, e): p for l, e, p in sent} == changed  # once each, its tier
        assert sink.precisions[-len(sent) or len(sink.precisions) :] == sent
        ranks = [after[l][e] - before[l][e] for l, e, _ in sent]
        assert ranks == sorted(ranks, key=lambda r: r < 0)  # demotions before promotions
        assert not s.members.sum(0).gt(1).any()  # one tier per expert
        for t in range(T):
            assert (s.members[t].sum(1).numpy() <= np.array(caps[t])).all()
        if limit is not None:
            assert len(sent) <= limit
            continue
        S = s.scores.numpy()
        for l in range(L):
            m = margin * S[l].mean()
            for t in range(T):
                inside, below = after[l] == t, after[l] > t
                if not below.any():
                    continue
                if inside.sum() < caps[t][l]:
                    assert S[l][below].max() <= 0  # a free slot is left only when no one below is hot
                elif inside.any():
                    assert S[l][below].max() <= S[l][inside].min() + m  # no swap the margin allows
    if limit is None:  # no new traffic: the scores decay alike and nothing moves
        assert s.update() == []


# -- the budget's split ---------------------------------------------------------------------------------
def test_the_split_gives_each_tier_an_equal_share_of_the_bytes():
    # the demo model at the int2/int4 halfway memory: int4 > int2+4 above int2 (54 and 36 KiB)
    assert split_ladder(3456 * KiB, (54 * KiB, 36 * KiB), 256) == [32, 48]
    assert split_ladder(1152 * KiB, (54 * KiB,), 256) == [21]  # one tier: room // bytes
    assert split_ladder(1152 * KiB, (192 * KiB, 54 * KiB), 256, min_top=4) == [4, 7]  # top gets top_k
    assert split_ladder(256 * 192 * KiB, (192 * KiB, 54 * KiB), 256) == [256, 0]  # the model fits in bf16
    assert split_ladder(100 * 54 * KiB, (54 * KiB, 36 * KiB), 64) == [64, 0]  # more room than experts


@settings(max_examples=80, deadline=None)
@given(
    room=st.integers(0, 400_000),
    tier_bytes=st.lists(st.integers(50, 5_000), min_size=1, max_size=4, unique=True),
    total=st.integers(1, 120),
    min_top=st.integers(0, 5),
)
def test_the_split_fits_and_leaves_nothing_it_could_use(room, tier_bytes, total, min_top):
    tier_bytes = tuple(sorted(tier_bytes, reverse=True))
    slots = split_ladder(room, tier_bytes, total, min_top)
    used = sum(n * b for n, b in zip(slots, tier_bytes))
    left = room - used
    assert used <= room and sum(slots) <= total and min(slots) >= 0
    assert slots[0] >= min(min_top, total, room // tier_bytes[0])
    if sum(slots) < total:
        assert left < min(tier_bytes)  # not one more expert in any tier
    for t in range(len(tier_bytes)):
        for j in range(t + 1, len(tier_bytes)):
            if slots[j]:
                assert left < tier_bytes[t] - tier_bytes[j]  # no expert could move up


def test_the_plan_holds_a_pool_per_tier_and_refuses_tier_sizes_that_do_not_fit():
    fixed = FixedCosts(10_000, 0, 0, 0)
    kw = {"num_experts_total": 20, "hi_slot_bytes": 1000, "lo_slot_bytes": 100, "min_hi_slots": 2,
          "mode": "lo+hi", "mid_slot_bytes": (400,)}  # fmt: skip
    plan = plan_memory(10_000 + 20 * 100 + 6_000, fixed, **kw)
    assert (plan.hi_slots, plan.mid_slots, plan.lo_slots) == (3, (7,), 20)  # 3,000 + 2,800 of 6,000
    assert plan.expert_bytes == 3 * 1000 + 7 * 400 + 20 * 100 and plan.upper_slots == (3, 7)
    assert "3 hi slots" in plan.describe() and "7 mid1 slots" in plan.describe()
    given_ = plan_memory(10_000 + 20 * 100 + 6_000, fixed, upper_slots=(2, 10), **kw)
    assert (given_.hi_slots, given_.mid_slots) == (2, (10,))
    with pytest.raises(BudgetError, match=r"the ladder's 2\+11 upper-tier experts") as e:
        plan_memory(10_000 + 20 * 100 + 6_000, fixed, upper_slots=(2, 11), **kw)
    assert "\n" not in str(e.value)


# -- bad ladders: one line each ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ladder", "fragment"),
    [
        ("bf16>int3>int2", "unknown format 'int3'"),
        ("int2>int4", "int4 (4.5 bits/weight) is not smaller than int2"),
        ("int2+4>int2+4-gptq", "not smaller than int2+4"),  # same bytes: calibrated codes, same layout
        ("int4", "two or more formats"),
    ],
)
def test_a_bad_ladder_is_one_line(ladder, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)) as e:
        EngineConfig(model="m", policy="dynaexq", ladder=ladder)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="disagrees with --ladder bf16>int4>int2"):
        EngineConfig(model="m", policy="dynaexq", ladder="bf16>int4>int2", lo_precision="int2+4")
    with pytest.raises(ConfigError, match="ladder_slots needs 2 counts"):
        EngineConfig(model="m", policy="dynaexq", ladder="bf16>int4>int2", ladder_slots=(3,))


def test_the_cli_takes_a_ladder_and_refuses_a_bad_one_or_a_budget_too_small():
    from moetide.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "--policy", "dynaexq", "--ladder", "bf16>int4>int2+4", "x"])
    config = engine_config_from_args(args)
    assert config.ladder == ("hi", "int4", "int2+4") and config.mid_precisions == ("int4",)
    assert (config.hi_precision, config.lo_precision) == ("hi", "int2+4")
    assert_one_line_error(run_cli("generate", "--policy", "dynaexq", "--ladder", "bf16>fp8>int2", "x"),
                          "unknown format 'fp8'")  # fmt: skip
    proc = run_cli("generate", "--device", "cpu", "--policy", "dynaexq", "--ladder", "bf16>int4>int2",
                   "--gpu-memory", "40MiB", "x")  # fmt: skip
    assert_one_line_error(proc, "too small", "the smallest budget for dynaexq is --gpu-memory")


def test_the_smallest_ladder_budget_named_loads():
    from moetide.engine.llm import demo_model_path
    from moetide.engine.memory import check_budget

    config = EngineConfig(
        model=str(demo_model_path()), device="cpu", policy="dynaexq", ladder="bf16>int4>int2",
        gpu_memory_bytes=40 << 20,
    )  # fmt: skip
    with pytest.raises(BudgetError) as e:
        check_budget(config)
    minimum = str(e.value).rsplit("--gpu-memory ", 1)[1]
    llm = moetide.LLM(device="cpu", policy="dynaexq", ladder="bf16>int4>int2", gpu_memory=minimum)
    plan = llm.loaded.runtime.residency.plan
    assert plan.budget_bytes == parse_bytes(minimum) and plan.hi_slots >= 4  # top_k hot slots at least
    llm.close()


# -- the residency: moves between tiers ------------------------------------------------------------------
def make_ladder_store():
    store = make_store("int4")
    store.add_precision("int2")
    return store


LADDER_STORE = make_ladder_store()


def make_ladder_manager(hi_slots: int, mid_slots: int, bandwidth: float | None = None, transfer=None):
    """lo+hi mode over hi > int4 (pool mid1) > int2 (lo, every expert), the device table on."""
    b = {p: LADDER_STORE.bytes_per_expert(p) for p in LADDER}
    fixed = FixedCosts(1000, 0, 0, 0)
    total = LAYERS * EXPERTS
    budget = fixed.total + hi_slots * b["hi"] + mid_slots * b["int4"] + total * b["int2"]
    plan = plan_memory(budget, fixed, num_experts_total=total, hi_slot_bytes=b["hi"], lo_slot_bytes=b["int2"],
                       min_hi_slots=min(2, hi_slots), mode="lo+hi", mid_slot_bytes=(b["int4"],),
                       upper_slots=(hi_slots, mid_slots))  # fmt: skip
    tracker = BudgetTracker(budget)
    tracker.reserve(fixed.total, "fixed", "fixed")
    transfer = transfer or CpuTransfer(bandwidth_bytes_per_s=bandwidth, poison=True)
    options = ResidencyOptions(mode="lo+hi", lo_precision="int2", mid_precisions=("int4",), on_miss="lo")
    manager = ResidencyManager(LADDER_STORE, ExpertMetrics(LAYERS), plan, tracker, transfer,
                               torch.device("cpu"), options)  # fmt: skip
    manager.preload("lo")
    return manager


def _pool(manager, layer, expert) -> str:
    pool_of, _ = manager.step_table(layer)
    names = {v: k for k, v in manager.pool_ids.items()}
    return names[int(pool_of[expert])]


def _land(manager, layer, expert):
    for v in manager.handles[layer][expert].versions.values():
        v.ready.synchronize()


def test_a_demotion_to_the_middle_tier_drops_hi_at_once_and_copies_the_middle_version():
    m = make_ladder_manager(2, 2)
    m.set_precision(0, 3, "hi")
    m.begin_step(1)
    _land(m, 0, 3)
    m.begin_step(2)
    assert _pool(m, 0, 3) == "hi" and m.metrics.promotions == 1
    m.transfer.close()
    m.transfer = CpuTransfer(bandwidth_bytes_per_s=1e4, poison=True)  # the mid1 copy takes 0.2 s
    m.set_precision(0, 3, "mid1")
    m.begin_step(3)
    h = m.handles[0][3]
    assert "hi" not in h.versions and "mid1" in h.versions and m.metrics.demotions == 1
    assert _pool(m, 0, 3) == "lo"  # meanwhile its resident lo version runs, never a partial copy
    assert h.state is HandleState.PROMOTING  # (a version hotter than the published one is on its way)
    _land(m, 0, 3)
    m.begin_step(4)
    assert _pool(m, 0, 3) == "mid1" and h.state is HandleState.RESIDENT_MID
    m.close()


def test_a_promotion_keeps_the_middle_version_until_hi_lands_and_then_gives_its_slot_up_first():
    m = make_ladder_manager(2, 1)
    m.set_precision(1, 5, "mid1")
    m.begin_step(1)
    _land(m, 1, 5)
    m.begin_step(2)
    assert _pool(m, 1, 5) == "mid1"
    m.transfer.close()
    m.transfer = CpuTransfer(bandwidth_bytes_per_s=4e4, poison=True)  # the hi copy takes 0.3 s
    m.set_precision(1, 5, "hi")
    m.begin_step(3)
    assert _pool(m, 1, 5) == "mid1"  # the int4 version serves while the hi copy is on its way
    _land(m, 1, 5)
    m.begin_step(4)
    assert _pool(m, 1, 5) == "hi" and m.metrics.promotions == 2
    m.transfer.close()
    m.transfer = CpuTransfer(poison=True)
    m.set_precision(2, 0, "mid1")  # the one mid1 slot still holds expert (1, 5)'s int4 version: unwanted
    m.begin_step(5)
    assert "mid1" not in m.handles[1][5].versions and "mid1" in m.handles[2][0].versions
    m.close()


def test_a_full_tier_defers_a_move_without_undoing_another_and_asks_again():
    m = make_ladder_manager(2, 1)
    m.set_precision(0, 1, "mid1")
    m.begin_step(1)
    _land(m, 0, 1)
    m.set_precision(0, 2, "mid1")  # the tier's one slot is wanted by (0, 1)
    m.begin_step(2)
    assert "mid1" in m.handles[0][1].versions and "mid1" not in m.handles[0][2].versions
    assert m.metrics.deferred == 1
    m.set_precision(0, 1, "lo")
    m.begin_step(3)  # (0, 1) leaves; the deferred move is asked again, with no new request
    m.begin_step(4)
    assert "mid1" not in m.handles[0][1].versions and "mid1" in m.handles[0][2].versions
    m.close()


class LadderTableMachine(DeviceTableMachine):
    """test_device_table's state machine over a three-tier ladder: copies into hi and mid1, moves
    between the three tiers, in-step prefetches and steps that complete late never read a partial
    or reused slot, and every read finds the version of the pool the table named."""

    @rule(hi_slots=st.integers(2, 4), mid_slots=st.integers(1, 6))
    @precondition(lambda self: self.manager is None)
    def start(self, hi_slots, mid_slots):
        manager = make_ladder_manager(hi_slots, mid_slots, bandwidth=5e7)
        manager.transfer.close()
        manager.transfer = LaggingTransfer(bandwidth_bytes_per_s=5e7, poison=True)
        manager.in_step_fed = True
        self.manager = manager

    @rule(
        layer=st.integers(0, LAYERS - 1),
        expert=st.integers(0, EXPERTS - 1),
        tier=st.sampled_from(list(tier_names(3))),
    )
    @precondition(lambda self: self.manager is not None)
    def set_precision(self, layer, expert, tier):
        self.manager.set_precision(layer, expert, tier)


LadderTableMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_no_step_of_a_ladder_reads_a_partial_or_reused_slot = LadderTableMachine.TestCase


# -- the engine ---------------------------------------------------------------------------------------------
def _calibrated_ladder_llm(**kw):
    """The demo model under dynaexq with bf16 > int4 > int2 at 110 MiB (9 hi, 66 mid1 slots), its
    tiers set from two rounds of traffic (the second moves experts between tiers), then frozen."""
    llm = moetide.LLM(device="cpu", policy="dynaexq", ladder="bf16>int4>int2", gpu_memory="110MiB", **kw)
    scheduler, residency = llm.loaded.policy, llm.loaded.runtime.residency
    scheduler.clock = None
    params = moetide.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    rounds = (["How do I reverse a list in Python?"], ["Écris un poème sur la mer.", "What is 2 + 2?"])
    for prompts in rounds:
        llm.generate(prompts, params)
        llm.loaded.runtime.flush_observations()
        scheduler.update()
        residency.settle()
    return llm


def _table(residency, layers: int) -> list[list[str]]:
    """Each expert's pool name as the device table holds it, per layer."""
    names = {v: k for k, v in residency.pool_ids.items()}
    return [[names[int(p)] for p in residency.step_table(layer)[0]] for layer in range(layers)]


def test_ladder_greedy_tokens_equal_a_reference_of_each_experts_dequantized_tier():
    """The engine with three pools against transformers' own model whose experts hold, dequantized
    from the host store, the version the device table sends each expert to: the same logits and
    greedy tokens, and every tier was read."""
    from transformers import AutoModelForCausalLM

    from moetide.engine.llm import demo_model_path

    llm = _calibrated_ladder_llm()
    residency, store = llm.loaded.runtime.residency, llm.loaded.store
    layers = len(llm.loaded.moe_layers)
    llm.loaded.runtime.begin_step(), llm.loaded.runtime.end_step()  # the table after the last settle
    table = _table(residency, layers)
    assert {pool for row in table for pool in row} == {"hi", "mid1", "lo"}
    ref = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    for moe_layer, (layer, row) in enumerate(zip(llm.loaded.moe_layers, table, strict=True)):
        experts = ref.model.layers[layer].mlp.experts
        for e, pool in enumerate(row):
            precision = residency.precision_of(pool)
            views = store.views(moe_layer, e, precision)
            if precision == "hi":
                gate_up, down = views["gate_up"], views["down"]
            else:
                gate_up, down = quant.dequantize(views, store.meta[precision], torch.float32)
            experts.gate_up_proj.data[e] = gate_up
            experts.down_proj.data[e] = down
    prompt = [5, 6, 7, 8, 9, 10]
    llm.metrics.reset()
    params = moetide.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = llm.generate([prompt], params)[0].token_ids
    ids = torch.tensor([prompt])
    with torch.inference_mode():  # (as the engine runs: its step buffers are inference tensors)
        for _ in range(8):
            ids = torch.cat([ids, ref(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        want_logits = ref(torch.tensor([prompt])).logits
        logits = llm.loaded.model(torch.tensor([prompt])).logits
    assert got == ids[0, len(prompt) :].tolist()
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)
    assert _table(residency, layers) == table  # frozen: the reference stayed what the engine read
    m = llm.metrics.snapshot()
    assert m["hits"] > 0 and m["mid_runs"] > 0 and m["lo_runs"] > m["mid_runs"] and m["host_syncs"] == 0
    llm.close()


def test_a_ladder_run_with_moves_between_tiers_stays_within_the_cap():
    """Under --deterministic the scheduler updates every 8 steps while 17 tokens decode: experts move
    between the three tiers, and the weights, the three pools and every tensor the run allocates
    (the profiler's allocator records) fit the plan and the cap."""
    from torch.profiler import ProfilerActivity, profile

    llm = moetide.LLM(device="cpu", policy="dynaexq", ladder="bf16>int4>int2", gpu_memory="110MiB",
                      deterministic=True, max_num_seqs=2)  # fmt: skip
    residency = llm.loaded.runtime.residency
    plan, fixed = residency.plan, residency.plan.fixed
    weights = sum(
        t.numel() * t.element_size() for t in [*llm.loaded.model.parameters(), *llm.loaded.model.buffers()]
    )
    pools = sum(p.arena.numel() for p in residency.pools.values())
    assert set(residency.pools) == {"hi", "mid1", "lo"} and plan.mid_slots[0] > 0
    assert pools == plan.expert_bytes and fixed.total + plan.expert_bytes <= plan.budget_bytes
    prompts = [[(i * 7919 + j) % 8000 + 100 for i in range(64)] for j in range(2)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for prompt in prompts:
            llm.engine.add_request(
                prompt, moetide.SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)
            )
        while llm.engine.has_unfinished():
            llm.engine.step()
    live = transient_peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):  # fmt: skip
        live += nbytes
        transient_peak = max(transient_peak, live)
    stats = llm.loaded.policy.stats()
    assert stats["updates"] >= 2 and stats["promotions"] > 0
    m = llm.metrics.snapshot()
    assert m["mid_runs"] > 0 and m["host_syncs"] == 0
    assert weights + pools + transient_peak <= plan.budget_bytes
    assert residency.budget.peak_bytes <= plan.budget_bytes
    assert residency.budget.used_bytes <= plan.budget_bytes
    llm.close()


@pytest.mark.gpu
def test_a_ladder_on_cuda_decodes_the_cpu_tokens_while_experts_move_between_tiers():
    """float32, --deterministic (tables depend on the request stream alone), the same tier sizes on
    both devices: the three pools on CUDA (real copy streams, the fused kernel, CUDA graphs) give the
    CPU's greedy tokens while the scheduler moves experts, with no host sync and within the cap."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts = [[(i * 7919 + j) % 8000 + 100 for i in range(40)] for j in range(2)]
    params = moetide.SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)
    runs = {}
    for device in ("cpu", "cuda"):
        llm = moetide.LLM(device=device, policy="dynaexq", ladder="bf16>int4>int2", gpu_memory="110MiB",
                          ladder_slots=(9, 66), deterministic=True, max_num_seqs=2, dtype="float32")  # fmt: skip
        try:
            tokens = [o.token_ids for o in llm.generate(prompts, params)]
            runs[device] = (tokens, llm.metrics.snapshot(), llm.loaded.policy.stats())
            residency = llm.loaded.runtime.residency
            assert residency.budget.peak_bytes <= residency.plan.budget_bytes
        finally:
            llm.close()
    (cpu_tokens, _, _), (tokens, m, stats) = runs["cpu"], runs["cuda"]
    assert stats["updates"] >= 2 and stats["promotions"] > 0
    assert m["mid_runs"] > 0 and m["host_syncs"] == 0
    assert tokens == cpu_tokens
