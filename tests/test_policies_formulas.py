"""The policy formulas, each pinned by a test that fails if the formula changes.

FineMoE: delta selection, delta = clip(1 - score), RDY dedup weights, semantic / trajectory cosine.
DynaExq: EMA, per-layer top-n_hi, hysteresis margin, rate limit ordered by gap, n_hi from budget.
Baselines: LRU speculative prefetch, MoE-Infinity request matching.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moetide.analysis.ablations import HitCountPolicy
from moetide.policies.baselines import LRUSpeculativePolicy, MoEInfinityPolicy
from moetide.policies.dynaexq import DynaExqScheduler, n_hi_from_budget
from moetide.policies.expert_map import ExpertMapStore, delta_from_score, select_by_cumulative_probability
from moetide.policies.finemoe import FineMoEPolicy


class RecordingSink:
    capacity_experts = 16

    def __init__(self):
        self.prefetches = []
        self.protects = []
        self.precisions = []

    def prefetch(self, layer, experts, *, iteration, priorities=None, protect=False):
        if protect:
            self.protects.append((iteration, layer, list(experts)))
        self.prefetches.append((iteration, layer, list(experts)))

    def protect(self, layer, experts, *, iteration):
        self.protects.append((iteration, layer, list(experts)))

    def set_precision(self, layer, expert, precision):
        self.precisions.append((layer, expert, precision))


# -- delta selection ----------------------------------------------------------------------------------
def test_delta_is_clipped_one_minus_score():
    assert delta_from_score(0.7) == pytest.approx(0.3)
    assert delta_from_score(1.3) == 0.0
    assert delta_from_score(-0.5) == 1.0


@pytest.mark.parametrize(
    ("delta", "top_k", "expected"),
    [
        (0.0, 1, [0]),  # confident: just the top one
        (0.5, 1, [0, 1]),  # 0.5 does not *exceed* 0.5: one more
        (0.6, 1, [0, 1]),  # 0.8 > 0.6
        (0.85, 1, [0, 1, 3]),  # 0.5 + 0.3 + 0.12 = 0.92 > 0.85
        (1.0, 1, [0, 1, 3, 2]),  # never exceeds 1: every expert
        (0.0, 3, [0, 1, 3]),  # never fewer than top-k
    ],
)
def test_select_by_cumulative_probability(delta, top_k, expected):
    probs = torch.tensor([0.5, 0.3, 0.08, 0.12])
    assert select_by_cumulative_probability(probs, delta, top_k) == expected


def test_select_ties_prefer_lower_ids():
    assert select_by_cumulative_probability(torch.full((4,), 0.25), 0.3, 1) == [0, 1]


# -- cosine searches ----------------------------------------------------------------------------------
def _store(capacity=4, L=2, J=4, H=3, d=1):
    return ExpertMapStore(capacity, L, J, H, d)


def test_semantic_search_picks_highest_cosine_and_reports_it():
    s = _store()
    s.add(torch.tensor([1.0, 0.0, 0.0]), torch.full((2, 4), 0.25))
    s.add(torch.tensor([1.0, 1.0, 0.0]), torch.full((2, 4), 0.25))
    score, row = s.semantic_search(torch.tensor([2.0, 1.9, 0.0]))  # scale does not matter
    assert row == 1
    assert score == pytest.approx((2.0 + 1.9) / (math.hypot(2.0, 1.9) * math.sqrt(2)), rel=1e-6)


def test_trajectory_search_compares_only_the_observed_prefix():
    s = _store()
    e = torch.ones(3)
    a = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.0, 0.0, 0.0, 1.0]])  # same layer 0 as the query
    b = torch.tensor([[0.1, 0.7, 0.1, 0.1], [0.0, 0.0, 1.0, 0.0]])  # same layer 1 as the query
    s.add(e, a)
    s.add(e, b)
    query = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.0, 0.0, 1.0, 0.0]])
    score, row = s.trajectory_search(query[:1])
    assert row == 0 and score == pytest.approx(1.0, abs=1e-6)
    # full prefix: cos(query, a) = 0.49+0.01+0.01+0.01 / (|q| |a|) vs cos(query, b) = 0.07+0.07+0.01+0.01+1
    _, row = s.trajectory_search(query)
    assert row == 1
    full = s.trajectory_scores(query)
    qa = float((query * a).sum() / (query.norm() * a.norm()))
    assert float(full[0]) == pytest.approx(qa, rel=1e-6)


# -- RDY dedup ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("d", "replaced"), [(1, 1), (3, 0)])
def test_rdy_weights_semantic_by_d_over_L(d, replaced):
    """A: same embedding as the newcomer, different map. B: different embedding, same map.
    RDY = d/L sem + (L-d)/L traj: with d=1 of L=4 the map dominates (B replaced), with d=3 the
    embedding does (A replaced)."""
    L, J = 4, 2
    s = ExpertMapStore(2, L, J, 2, d)
    m_new = torch.tensor([[1.0, 0.0]] * L)
    m_other = torch.tensor([[0.0, 1.0]] * L)
    s.add(torch.tensor([1.0, 0.0]), m_other)  # A
    s.add(torch.tensor([0.0, 1.0]), m_new)  # B
    rdy = s.redundancy(torch.tensor([1.0, 0.0]), m_new)
    assert rdy.tolist() == pytest.approx([d / L * 1.0 + (L - d) / L * 0.0, d / L * 0.0 + (L - d) / L * 1.0])
    assert s.add(torch.tensor([1.0, 0.0]), m_new) == replaced
    assert len(s) == 2


def test_store_save_load_round_trip(tmp_path):
    s = _store(capacity=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        s.add(torch.randn(3, generator=g), torch.softmax(torch.randn(2, 4, generator=g), -1))
    path = s.save(tmp_path / "maps.safetensors")
    t = ExpertMapStore.load(path)
    assert len(t) == 3 and t.capacity == 3 and t.prefetch_distance == 1
    for row in range(3):
        assert torch.equal(t.map(row), s.map(row))
        assert torch.equal(t.embedding(row), s.embedding(row))


def test_store_save_keeps_the_later_maps(tmp_path):
    """The step-ahead maps (what the step-late FineMoE matches against) survive save and load, row by
    row, and a row without one stays without one."""
    s = _store(capacity=4)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        s.add(torch.randn(3, generator=g), torch.softmax(torch.randn(2, 4, generator=g), -1))
    later = {
        0: torch.softmax(torch.randn(2, 4, generator=g), -1),
        2: torch.softmax(torch.randn(2, 4, generator=g), -1),
    }
    for row, m in later.items():
        s.set_ahead(row, m)
    t = ExpertMapStore.load(s.save(tmp_path / "maps.safetensors"))
    assert t.state()["has_ahead"].tolist() == [True, False, True, False]
    for row, m in later.items():
        assert np.array_equal(t.ahead_np(row), m.numpy())
    full = np.zeros((2, 4), dtype=np.float32)
    assert t.lookahead_search_np(np.ones(3, dtype=np.float32), full) is not None
    # a smaller store: rows replaced while loading lose their later map with their entry
    u = ExpertMapStore.load(tmp_path / "maps.safetensors", capacity=2)
    assert len(u) == 2 and u.state()["has_ahead"].sum() <= 1


# -- FineMoE issues what the formulas say ------------------------------------------------------------
def test_finemoe_semantic_then_trajectory_prefetch_with_protection():
    L, J, H = 4, 4, 3
    store = ExpertMapStore(8, L, J, H, 2)
    m = torch.tensor([[0.9, 0.05, 0.03, 0.02]] * L)
    store.add(torch.tensor([1.0, 0.0, 0.0]), m)
    p = FineMoEPolicy(store=store, prefetch_distance=2, synchronous=True)
    sink = RecordingSink()
    p.attach(sink, L, J, 1)
    p.begin_iteration(0, torch.tensor([1.0, 0.0, 0.0]), 1)
    assert sink.prefetches == [(0, 0, [0]), (0, 1, [0])]  # layers 0..d-1, score 1 -> delta 0 -> top-1
    p.observe_layer(0, 0, m[0], torch.tensor([[0]]))
    assert sink.prefetches[-1] == (0, 2, [0])  # l + d
    assert sink.protects == sink.prefetches
    p.observe_layer(0, 1, m[1], torch.tensor([[0]]))
    p.observe_layer(0, 2, m[2], torch.tensor([[0]]))  # 2 + 2 >= L: nothing
    assert len(sink.prefetches) == 4
    p.observe_layer(0, 3, m[3], torch.tensor([[0]]))
    p.end_iteration(0)
    assert len(store) == 2  # online update


def test_finemoe_fixed_top_k_when_delta_is_off():
    L, J = 2, 4
    store = ExpertMapStore(8, L, J, 2, 1)
    store.add(torch.tensor([1.0, 0.0]), torch.tensor([[0.4, 0.3, 0.2, 0.1]] * L))
    for adaptive in (True, False):
        sink = RecordingSink()
        p = FineMoEPolicy(
            store=store, prefetch_distance=1, synchronous=True, adaptive_delta=adaptive, online_updates=False
        )
        p.attach(sink, L, J, 2)
        # score 0.25 -> delta 0.75 -> 0.4 + 0.3 + 0.2 = 0.9 is the first mass above it
        p.begin_iteration(0, torch.tensor([0.25, math.sqrt(1 - 0.25**2)]), 1)
        assert sink.prefetches[-1][2] == ([0, 1, 2] if adaptive else [0, 1])
        # score 0 -> delta 1 -> every expert
        p.begin_iteration(1, torch.tensor([0.0, 1.0]), 1)
        assert sink.prefetches[-1][2] == ([0, 1, 2, 3] if adaptive else [0, 1])


# -- DynaExq ------------------------------------------------------------------------------------------
def _sched(n_hi=1, L=1, J=4, **kw) -> tuple[DynaExqScheduler, RecordingSink]:
    s = DynaExqScheduler(n_hi, clock=None, **kw)
    sink = RecordingSink()
    s.attach(sink, L, J, 1)
    return s, sink


def _observe(s, layer, counts):
    ids = torch.tensor([e for e, c in enumerate(counts) for _ in range(c)], dtype=torch.int64).view(-1, 1)
    s.observe_layer(0, layer, None, ids)


def test_ema_arithmetic():
    s, _ = _sched(alpha=0.9)
    _observe(s, 0, [10, 0, 0, 0])
    s.update()
    assert s.scores[0].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])  # 0.9*0 + 0.1*10
    _observe(s, 0, [0, 20, 0, 0])
    s.update()
    assert s.scores[0].tolist() == pytest.approx([0.9, 2.0, 0.0, 0.0])  # 0.9*1 + 0.1*0, 0.1*20
    s.update()  # no counts: pure decay
    assert s.scores[0].tolist() == pytest.approx([0.81, 1.8, 0.0, 0.0])


def test_a_whole_step_counts_what_its_layers_count_one_by_one():
    """`observe_step` (the engine's step-late publication): one bincount over every layer."""
    ids = torch.randint(0, 4, (3, 5, 2), generator=torch.Generator().manual_seed(0))
    by_layer, whole = _sched(L=3)[0], _sched(L=3)[0]
    for layer in range(3):
        by_layer.observe_layer(0, layer, None, ids[layer])
    whole.observe_step(0, torch.zeros(3, 4), ids)
    assert by_layer.counts.sum() == 30 and torch.equal(whole.counts, by_layer.counts)


def test_tick_is_time_based():
    s, _ = _sched(update_interval_s=2.0)
    assert s.tick(10.0) == [] and s.updates == 0  # starts the clock
    _observe(s, 0, [3, 0, 0, 0])
    assert s.tick(11.9) == [] and s.updates == 0
    assert s.tick(12.0) == [(0, 0, "hi")] and s.updates == 1


def test_top_n_hi_per_layer_fills_free_slots_with_hot_experts():
    s, sink = _sched(n_hi=2, L=2, J=4, alpha=0.0)
    _observe(s, 0, [1, 5, 3, 0])
    _observe(s, 1, [0, 0, 2, 0])  # only one expert with traffic: one slot stays free
    s.update()
    assert s.hi_set(0) == [1, 2] and s.hi_set(1) == [2]
    assert sorted(sink.precisions) == [(0, 1, "hi"), (0, 2, "hi"), (1, 2, "hi")]


@pytest.mark.parametrize(
    ("margin", "challenger", "swapped"), [(0.0, 1.1, True), (0.25, 1.1, False), (0.25, 1.2, True)]
)
def test_hysteresis_margin(margin, challenger, swapped):
    """Insider S=1.0, outsider S=challenger, two idle experts; margin unit = mean score."""
    s, sink = _sched(n_hi=1, alpha=0.0, hysteresis_margin=margin)
    s.scores[0] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    s.hi[0, 0] = True
    # alpha = 0: the scores become exactly this interval's counts (x10 to stay integral)
    _observe(s, 0, [10, round(challenger * 10), 0, 0])
    s.update()
    # mean = (1.0 + c) / 4 after /10; compare with the rule: c > 1.0 + margin * mean
    assert s.scores[0].tolist()[:2] == pytest.approx([10.0, challenger * 10])
    assert (s.hi_set(0) == [1]) is swapped
    if swapped:
        assert sink.precisions == [(0, 0, "lo"), (0, 1, "hi")]  # demotion first
    else:
        assert sink.precisions == []


def test_hysteresis_reduces_transitions_on_near_ties():
    def run(margin):
        s, sink = _sched(n_hi=1, alpha=0.5, hysteresis_margin=margin)
        for t in range(40):  # two experts trading places by a hair every interval
            _observe(s, 0, [10, 11, 0, 0] if t % 2 else [11, 10, 0, 0])
            s.update()
        return len(sink.precisions)

    plain, with_margin = run(0.0), run(0.25)
    assert with_margin == 1  # one fill, never a swap
    assert plain > 10 * with_margin


def test_rate_limit_orders_by_gap_and_defers_the_rest():
    s, sink = _sched(n_hi=2, L=2, J=4, alpha=0.0, max_transitions_per_update=3)
    _observe(s, 0, [9, 1, 0, 0])
    _observe(s, 1, [0, 0, 5, 7])
    s.update()
    assert sink.precisions == [(0, 0, "hi"), (1, 3, "hi"), (1, 2, "hi")]  # gaps 9, 7, 5; 1 deferred
    assert s.deferred_moves == 1
    sink.precisions.clear()
    s.update()  # scores now 0 (alpha = 0, no counts): the deferred fill has no heat left
    assert sink.precisions == []


def test_rate_limit_counts_a_swap_as_two():
    s, sink = _sched(n_hi=1, L=2, J=2, alpha=0.0, hysteresis_margin=0.0, max_transitions_per_update=2)
    s.hi[0, 0] = True
    s.hi[1, 0] = True
    _observe(s, 0, [0, 5])
    _observe(s, 1, [1, 9])
    s.update()
    assert sink.precisions == [(1, 0, "lo"), (1, 1, "hi")]  # gap 8 beats gap 5; one swap fits


def test_n_hi_from_budget():
    # 2 layers x 4 experts, hi 100 B, lo 25 B: all-lo needs 200 B; each hi adds 75 B per layer
    assert n_hi_from_budget(200, 2, 4, 100, 25) == 0
    assert n_hi_from_budget(200 + 2 * 75 * 3, 2, 4, 100, 25) == 3
    assert n_hi_from_budget(10_000, 2, 4, 100, 25) == 4
    with pytest.raises(ValueError):
        n_hi_from_budget(100, 2, 4, 100, 25)


# -- baselines ----------------------------------------------------------------------------------------
def test_lru_speculative_prefetches_next_layers_guess_ranked():
    p = LRUSpeculativePolicy(prefetch_distance=2)
    sink = RecordingSink()
    p.attach(sink, 4, 8, 2)
    assert p.speculative_distances == (2,)
    p.observe_speculative(5, 1, 2, torch.tensor([[3, 1], [1, 7]]))
    assert sink.prefetches == [(5, 3, [1, 3, 7])]
    p.observe_speculative(5, 2, 2, torch.tensor([[3, 1]]))  # 2 + 2 >= 4: nothing
    assert len(sink.prefetches) == 1


def test_moe_infinity_matches_nearest_request_and_ranks_by_frequency():
    L, J = 2, 4
    p = MoEInfinityPolicy(prefetch_distance=1, per_layer=2)
    sink = RecordingSink()
    p.attach(sink, L, J, 1)
    p.add_request_matrix(torch.tensor([[5.0, 0, 0, 0], [0, 0, 1, 9]]))
    p.add_request_matrix(torch.tensor([[0.0, 5, 0, 0], [4, 6, 0, 0]]))
    p.begin_iteration(0, torch.zeros(2), 3, request_ids=(7,))
    # empty request matrix: global popularity (sum of both) for layer 0: experts 0 and 1 tie at 5
    assert sink.prefetches == [(0, 0, [0, 1])]
    p.observe_layer(0, 0, None, torch.tensor([[1], [1], [1]]))
    assert sink.prefetches[-1] == (0, 1, [1, 0])  # nearest = second request; its layer 1 ranked
    hc = HitCountPolicy(prefetch_distance=1)
    hc.attach(sink, L, J, 1)
    assert hc._share() == 1


def test_make_policy_covers_every_cli_policy():
    from moetide.config import POLICIES
    from moetide.policies import make_policy

    for name in POLICIES:
        p = make_policy(name, n_hi=2, synchronous=True)
        assert p.name == name
        sink = RecordingSink()
        p.attach(sink, 2, 4, 1)
        p.close()
    with pytest.raises(ValueError, match="needs n_hi"):
        make_policy("dynaexq")


def test_expected_distinct_experts_of_a_multi_token_step():
    from moetide.policies.finemoe import expected_distinct

    p = torch.tensor([0.5, 0.25, 0.125, 0.125])
    assert expected_distinct(p, 1, 2) == 2  # one token: top-k
    # f = min(1, 2p) = [1, 0.5, 0.25, 0.25]; T=2: 1 + 0.75 + 0.4375 + 0.4375 = 2.625 -> 3
    assert expected_distinct(p, 2, 2) == 3
    assert expected_distinct(p, 100, 2) == 4


def test_finemoe_prefetches_what_a_prefill_step_needs():
    """A multi-token step's floor is the distinct experts its last observed layer used."""
    L, J = 3, 8
    store = ExpertMapStore(4, L, J, 2, 1)
    store.add(torch.tensor([1.0, 0.0]), torch.softmax(torch.arange(J, dtype=torch.float32), 0).repeat(L, 1))
    sink = RecordingSink()
    p = FineMoEPolicy(store=store, prefetch_distance=1, synchronous=True, online_updates=False)
    p.attach(sink, L, J, 2)
    p.begin_iteration(0, torch.tensor([1.0, 0.0]), 5)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [0, 2], [1, 3]])  # 6 distinct experts
    p.observe_layer(0, 0, torch.full((J,), 1 / J), ids)
    assert len(sink.prefetches[-1][2]) >= 6 and sink.prefetches[-1][1] == 1
