"""CUDA paths: real streams and events, pinned host store, grouped bf16 matmuls, the memory cap.

Skipped without CUDA; run on the GPU machine with `python -m pytest -q -m gpu`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from triton_interpreter import run_both_kernels

import moetide

pytestmark = pytest.mark.gpu


def _bf16_logits(reference, ids):
    ref = copy.deepcopy(reference).to("cuda", torch.bfloat16)
    with torch.no_grad():
        return ref(ids).logits.float()


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(
    "policy,budget,tol",
    [
        ("no-offload", None, 1e-2),
        ("on-demand", "tight", 1e-2),
        ("combined", "50%", 1e-2),
        ("static-int4", "64MiB", 0.15),
        ("static-int2", "64MiB", 0.6),
    ],
)
def test_policies_on_cuda_match_transformers_bf16(tiny_checkpoints, policy, budget, tol):
    """bf16 tolerance: relative Frobenius error of the logits < 1e-2 for hi paths; lo paths are
    bounded by their quantization error (int4 < 0.15, int2 < 0.6 on random tiny experts)."""
    path, reference = tiny_checkpoints["qwen2_moe"]
    if budget == "tight":
        roomy = moetide.LLM(path, device="cuda", dtype="bfloat16", policy="on-demand", gpu_memory="64MiB")
        plan = roomy.loaded.runtime.residency.plan
        roomy.close()
        budget = plan.fixed.total + 5 * plan.hi_slot_bytes  # 5 of 16 experts fit: evictions happen
    llm = moetide.LLM(path, device="cuda", dtype="bfloat16", policy=policy, gpu_memory=budget)
    ids = torch.randint(5, 90, (2, 13), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        got = llm.loaded.model(ids).logits.float()
    assert _rel(got, _bf16_logits(reference, ids)) < tol
    if policy == "on-demand":
        assert llm.metrics.evictions > 0 and llm.metrics.bytes_h2d > 0
    out = llm.generate([[5, 6, 7, 8]], moetide.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[
        0
    ]
    assert len(out.token_ids) == 16
    llm.close()


@pytest.mark.parametrize("policy", ["on-demand", "lru", "finemoe", "moe-infinity", "combined", "dynaexq"])
def test_sync_free_policies_on_cuda_replay_graphs_and_match_the_eager_steps(tiny_checkpoints, policy):
    """Every dynamic policy on CUDA with its default --on-miss (zero-copy reads of pinned host memory
    for the hi caches, lo for combined/dynaexq): no host sync in the whole generate, decode steps
    replayed as CUDA graphs, and for the hi caches the same greedy tokens as eager steps (both read
    the checkpoint's bf16 weights, from host memory or from a device slot)."""
    path, _ = tiny_checkpoints["qwen2_moe"]
    keeps_lo = policy in ("combined", "dynaexq")
    roomy = moetide.LLM(path, device="cuda", dtype="bfloat16", policy=policy if keeps_lo else "on-demand",
                        gpu_memory="50%" if keeps_lo else "64MiB")  # fmt: skip
    plan = roomy.loaded.runtime.residency.plan
    roomy.close()
    tight = plan.fixed.total + 5 * plan.hi_slot_bytes  # 5 of 16 hi experts fit: misses and evictions
    if keeps_lo:
        tight = plan.fixed.total + plan.lo_slots * plan.lo_slot_bytes + 4 * plan.hi_slot_bytes
    params = moetide.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for graphs in ("auto", "off"):
        llm = moetide.LLM(path, device="cuda", dtype="bfloat16", policy=policy, gpu_memory=tight,
                          cuda_graphs=graphs, searcher="thread")  # fmt: skip
        tokens = [o.token_ids for o in llm.generate([[5, 6, 7, 8], [9, 10, 11]], params)]
        runs[graphs] = (tokens, llm.metrics.host_syncs, llm.engine.runner.graph_stats(), llm.metrics.misses)
        if graphs == "auto":  # a replayed graph runs no Python, yet every step's routing is read
            assert llm.metrics.steps_observed == llm.metrics.steps > 0
            feed = llm.loaded.policy_hooks.feed if llm.loaded.policy_hooks is not None else None
            if feed is not None:  # and the in-step policies saw the replayed steps' layers as they ran
                assert feed.idle(10)
                stats = feed.stats()
                assert stats["errors"] == 0 and stats["steps_seen"] > 0, stats
                assert stats["steps_seen"] + stats["steps_cut"] == llm.metrics.steps, stats
        llm.close()
    tokens, syncs, graphs, misses = runs["auto"]
    assert syncs == 0 and graphs["replays"] > 0 and graphs["failed"] is None, graphs
    assert runs["off"][1] == 0 and not (runs["off"][2] or {}).get("replays")
    if not keeps_lo:
        assert misses > 0  # some experts were read zero-copy
        assert tokens == runs["off"][0]


def test_no_offload_greedy_equals_transformers_generate_bf16(tiny_checkpoints):
    path, reference = tiny_checkpoints["qwen3_moe"]
    ref = copy.deepcopy(reference).to("cuda", torch.bfloat16)
    llm = moetide.LLM(path, device="cuda", dtype="bfloat16", policy="no-offload")
    prompt = [7, 8, 9, 10, 11]
    expected = ref.generate(
        torch.tensor([prompt], device="cuda"),
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=2,
    )[0, len(prompt) :].tolist()
    got = llm.generate([prompt], moetide.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[
        0
    ].token_ids
    # bf16: a different but valid summation order may flip a near-tie late in the sequence
    agree = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), len(got))
    assert agree >= 8, (got, expected)
    llm.close()


@pytest.mark.parametrize("policy", ["static-int2", "static-int4", "combined"])
def test_fused_kernel_matches_reference_bf16(tiny_checkpoints, policy, monkeypatch):
    """The fused MoE kernel against the per-expert reference (dequantize + matmul), end to end on
    qwen2_moe (shared experts too): close logits and the same greedy tokens at least 8 of 16 deep."""
    kernel = pytest.importorskip("moetide.compute.fused_moe")
    path, _ = tiny_checkpoints["qwen2_moe"]
    budget = "64MiB"
    if policy == "combined":  # every expert lo-resident, room for 4 hi versions: lo versions run
        roomy = moetide.LLM(path, device="cuda", dtype="bfloat16", policy="combined", gpu_memory="50%")
        plan = roomy.loaded.runtime.residency.plan
        roomy.close()
        budget = plan.fixed.total + plan.lo_slots * plan.lo_slot_bytes + 4 * plan.hi_slot_bytes
    ids = torch.randint(5, 90, (1, 11), generator=torch.Generator().manual_seed(4)).cuda()
    got, calls = run_both_kernels(kernel, monkeypatch, path, ids, 16, device="cuda", dtype="bfloat16",
                                     policy=policy, gpu_memory=budget, on_miss="lo")  # fmt: skip
    assert calls, "the fused kernel never ran"
    (ref_logits, ref_tokens, lo_runs), (logits, tokens, _) = got["dequant"], got["fused"]
    assert policy != "combined" or lo_runs > 0
    assert _rel(logits, ref_logits) < 3e-2
    agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
    assert agree >= 8, (tokens, ref_tokens)


def test_peak_gpu_memory_stays_under_the_budget(tmp_path):
    from moetide.bench.synthetic import write_synthetic_checkpoint

    path = write_synthetic_checkpoint(
        "olmoe-1b-7b",
        tmp_path / "m",
        num_hidden_layers=4,
        num_experts=16,
        hidden_size=512,
        intermediate_size=1024,
        vocab_size=4096,
        num_attention_heads=8,
        num_key_value_heads=8,
        progress=False,
    )
    budget = (
        192 << 20
    )  # fixed part ~146 MiB (incl. top_k experts of scratch); 64 experts x 3 MiB do not all fit
    for policy in ("on-demand", "static-int2", "combined"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        llm = moetide.LLM(path, device="cuda", policy=policy, gpu_memory=budget)
        llm.generate(
            [list(range(3, 200))], moetide.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        )
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= budget, (policy, peak)
        llm.close()
        del llm


def test_cuda_residency_random_interleavings():
    """The CPU-backend property test, on real CUDA streams and events with a pinned store: every
    step reads through the table only complete versions of the experts it names."""
    import residency_setup as rs
    import test_residency as tr
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from moetide.residency.budget import BudgetTracker, FixedCosts, plan_memory
    from moetide.residency.core import ResidencyManager, ResidencyOptions
    from moetide.residency.metrics import ExpertMetrics
    from moetide.residency.transfer import CudaTransfer

    store = rs.STORE
    pinned = {p: a.pin_memory() for p, a in store.versions.items()}
    store.versions.update(pinned)

    @settings(max_examples=10, deadline=None)
    @given(mode=st.sampled_from(["hi-cache", "lo+hi"]), hi_slots=st.integers(2, 6),
           ops=st.lists(tr.op, min_size=1, max_size=20))  # fmt: skip
    def run(mode, hi_slots, ops):
        hi_b, lo_b = store.bytes_per_expert("hi"), store.bytes_per_expert("int4")
        fixed = FixedCosts(1000, 0, 0, 0)
        lo_slots = rs.LAYERS * rs.EXPERTS if mode == "lo+hi" else 0
        budget = fixed.total + hi_slots * hi_b + lo_slots * lo_b
        plan = plan_memory(budget, fixed, num_experts_total=rs.LAYERS * rs.EXPERTS, hi_slot_bytes=hi_b,
                           lo_slot_bytes=lo_b, min_hi_slots=2, mode=mode)  # fmt: skip
        tracker = BudgetTracker(budget)
        tracker.reserve(fixed.total, "fixed", "fixed")
        on_miss = "lo" if mode == "lo+hi" else "zero-copy"
        m = ResidencyManager(store, ExpertMetrics(rs.LAYERS), plan, tracker, CudaTransfer(torch.device("cuda")),
                             torch.device("cuda"), ResidencyOptions(mode=mode, lo_precision="int4", on_miss=on_miss))  # fmt: skip
        if mode == "lo+hi":
            m.preload("lo")
        iteration = 0
        for kind, layer, arg in ops:
            if kind == "step":
                iteration += 1
                rs.run_step(m, iteration, {layer: arg})
            elif kind == "prefetch":
                m.prefetch(layer, arg, iteration=iteration)
            elif kind == "protect":
                m.protect(layer, arg, iteration=iteration)
            elif kind == "land":
                rs.land_all(m)
            else:
                m.set_precision(layer, arg, "hi" if kind == "promote" else "lo")
            tr.check_invariants(m)
        m.close()

    run()
