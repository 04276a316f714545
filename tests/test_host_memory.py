"""The `--cpu-memory` cap: policies that read hi from the mapped checkpoint run below the demo model's
bf16 experts with every host allocation of expert versions inside the cap and the uncapped tokens;
a cap too small is refused before the load naming the smallest that works; `moetide info` prints
each policy's needs."""

from __future__ import annotations

import re

import pytest
import torch

import moetide
from moetide.engine.host_memory import host_needs
from moetide.engine.memory import model_bytes
from moetide.errors import BudgetError
from moetide.residency.budget import BudgetTracker

CAP = (
    30 << 20
)  # below the demo model's experts in bf16 (48 MiB) and as the CPU store holds them (float32, 96 MiB)
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300]]
GREEDY = moetide.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture
def host_samples(monkeypatch):
    """Bytes reserved by the host tracker (total == CAP) after every reservation, in order."""
    samples = []
    original = BudgetTracker.try_reserve

    def recording(self, nbytes, category):
        ok = original(self, nbytes, category)
        if self.total_bytes == CAP:
            samples.append((category, nbytes, ok, self.used_bytes))
        return ok

    monkeypatch.setattr(BudgetTracker, "try_reserve", recording)
    return samples


def _run(policy, cpu_memory, **kw):
    kw.setdefault("gpu_memory", "40%")
    llm = moetide.LLM(
        device="cpu", policy=policy, cpu_memory=cpu_memory, deterministic=True, max_num_seqs=2, **kw
    )
    tokens = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return llm, tokens


@pytest.mark.parametrize(
    ("policy", "extra"),
    [
        ("combined", {}),
        ("dynaexq", {}),
        ("static-int4", {}),
        ("no-offload", {"gpu_memory": "100%"}),
        ("combined", {"hi_precision": "int4"}),
    ],
)
def test_capped_runs_keep_host_allocations_inside_the_cap_and_give_the_uncapped_tokens(
    policy, extra, host_samples
):
    uncapped, expected = _run(policy, None, **extra)
    assert not uncapped.loaded.store.hi_mapped
    served = {k: uncapped.metrics.snapshot()[k] for k in ("hits", "lo_runs", "misses", "promotions")}
    needs = host_needs(uncapped.config, model_bytes(uncapped.config), "cpu")
    assert uncapped.loaded.store.budget.peak_bytes == needs.full  # what `info` prints as the whole layout
    uncapped.close()
    llm, tokens = _run(policy, CAP, **extra)
    store = llm.loaded.store
    assert tokens == expected
    assert {k: llm.metrics.snapshot()[k] for k in served} == served  # the same residency, step by step
    assert "moetide-stager" not in store.mapped.reads_by_thread  # deterministic: staged at step boundaries
    assert store.hi_mapped and "hi" not in store.versions  # no copy of the checkpoint's hi versions
    assert host_samples and all(used <= CAP for *_, used in host_samples)
    held = sum(a.numel() for a in store.versions.values()) + (store.staged.nbytes if store.staged else 0)
    assert held == store.budget.used_bytes <= CAP  # what is held is what was accounted
    snap = llm.metrics.snapshot()
    assert snap["host_cap_bytes"] == CAP and snap["host_peak_bytes"] <= CAP and snap["rss_bytes"] > 0
    copies_hi = policy in ("combined", "dynaexq", "no-offload") and "hi_precision" not in extra
    if copies_hi:  # hi versions were read from the map into staged slots, and copied from there
        assert snap["disk_reads"] > 0 and snap["disk_read_bytes"] > 0 and snap["host_cache_hits"] > 0
        assert snap["host_staged_bytes"] == store.staged.nbytes > 0
    else:  # hi is not copied: no staged slot
        assert store.staged is None
    llm.close()


def test_lo_versions_quantized_from_the_map_in_batches_inside_the_cap_equal_those_from_the_hi_arena(
    host_samples, tmp_path
):
    uncapped = moetide.LLM(
        device="cpu", policy="static-int4", gpu_memory="40%", cache_dir=str(tmp_path / "a")
    )
    expected = uncapped.loaded.store.versions["int4"].clone()
    uncapped.close()
    llm = moetide.LLM(device="cpu", policy="static-int4", gpu_memory="40%", cpu_memory=CAP,
                      cache_dir=str(tmp_path / "b"))  # fmt: skip
    store = llm.loaded.store
    assert store.hi_mapped and store.versions["int4"].equal(expected)
    batches = [(nbytes, used) for cat, nbytes, ok, used in host_samples if cat == "batch"]
    # one buffer, reused by every batch, holding fewer experts than there are
    ((batch, used),), every = batches, store.num_layers * store.num_experts
    assert used <= CAP and batch < every * store.shape.hi_nbytes
    assert store.mapped.reads == every  # each expert read from the map once
    assert store.budget.reserved["batch"] == 0  # released once quantized
    llm.close()


def test_without_deterministic_a_hi_version_only_on_disk_is_staged_in_the_background():
    import threading

    llm = moetide.LLM(device="cpu", policy="combined", cpu_memory=CAP, gpu_memory="40%", max_num_seqs=2)
    at_start = dict(llm.loaded.store.mapped.reads_by_thread)
    out = llm.generate(PROMPTS * 3, moetide.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    snap = llm.metrics.snapshot()
    assert all(len(o.token_ids) == 24 for o in out)
    assert snap["host_cache_requests"] > 0 and snap["disk_reads"] > 0  # the stager read them
    assert snap["host_cache_hits"] > 0 and snap["host_peak_bytes"] <= CAP
    reads = llm.loaded.store.mapped.reads_by_thread
    forward = threading.current_thread().name
    assert reads.get(forward, 0) == at_start.get(forward, 0)  # no disk read on the forward thread
    assert reads["moetide-stager"] > at_start.get("moetide-stager", 0)
    llm.close()


def test_a_cap_too_small_is_refused_before_the_load_naming_the_smallest_that_works():
    with pytest.raises(BudgetError, match=r"smallest host budget for combined is --cpu-memory (\S+)") as e:
        moetide.LLM(device="cpu", policy="combined", cpu_memory="4MiB", gpu_memory="40%")
    smallest = re.search(r"--cpu-memory (\S+)$", str(e.value)).group(1)
    llm = moetide.LLM(device="cpu", policy="combined", cpu_memory=smallest, gpu_memory="40%", max_num_seqs=2)
    assert len(llm.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    config = llm.config
    llm.close()
    needs = host_needs(config, model_bytes(config), "cpu")  # exact: the typed value above is rounded up
    with pytest.raises(BudgetError, match="smallest host budget for combined"):
        moetide.LLM(device="cpu", policy="combined", cpu_memory=needs.minimum - 1, gpu_memory="40%")
    exact = moetide.LLM(
        device="cpu", policy="combined", cpu_memory=needs.minimum, gpu_memory="40%", max_num_seqs=2
    )
    assert exact.loaded.store.staged.num_slots == needs.staged_slots == 4  # the demo model's top-k
    assert len(exact.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    exact.close()
    with pytest.raises(BudgetError, match=r"smallest host budget for lru is --cpu-memory 96MiB"):
        moetide.LLM(device="cpu", policy="lru", cpu_memory=CAP, gpu_memory="40%")  # misses read host hi


def test_info_prints_what_each_policy_needs_at_the_given_budgets(capsys):
    from moetide.cli import main
    from moetide.config import EngineConfig
    from moetide.engine.llm import demo_model_path
    from moetide.engine.memory import resolve_budget, typed_size

    assert main(["info", "--device", "cpu", "--gpu-memory", "40%", "--cpu-memory", "30MiB"]) == 0
    out = capsys.readouterr().out
    assert "host cap 30.00 MiB" in out
    config = EngineConfig(model=str(demo_model_path()), device="cpu")
    config = EngineConfig(model=config.model, device="cpu", gpu_memory_bytes=resolve_budget("40%", config))
    rows = {line.split()[0]: line for line in out.splitlines()[-9:]}
    for policy in ("combined", "lru", "static-int4", "no-offload"):
        c = EngineConfig(
            model=config.model, device="cpu", gpu_memory_bytes=config.gpu_memory_bytes, policy=policy
        )
        needs = host_needs(c, model_bytes(c), "cpu")
        assert (
            typed_size(needs.minimum) in rows[policy].split()
            and typed_size(needs.full) in rows[policy].split()
        )
    assert "staged" in rows["combined"] and "every hi version" in rows["lru"]


def test_prepare_under_a_cap_streams_the_experts_from_the_map_without_their_hi_copy(tmp_path):
    """The peak RSS of `prepare` under a cap stays below the uncapped run's by most of the hi arena
    (the experts are read from the map in batches; each batch's pages leave the resident set), and
    both write the same cache."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from moetide.config import EngineConfig
    from moetide.engine.llm import demo_model_path

    def run(folder, *cap):
        env = dict(os.environ, PYTHONPATH=str(Path(moetide.__file__).parents[1]))
        script = Path(__file__).with_name("prepare_rss.py")
        out = subprocess.run([sys.executable, str(script), str(tmp_path / folder), *map(str, cap)],
                             capture_output=True, text=True, env=env, check=True)  # fmt: skip
        return json.loads(out.stdout.splitlines()[-1])

    uncapped, capped = run("a"), run("b", CAP)
    hi_all = model_bytes(EngineConfig(model=str(demo_model_path()), device="cpu")).all_experts_hi_bytes
    # a third of the hi arena: the allocator keeps some freed quantizer temporaries (46-99 MB seen)
    assert capped["peak"] - capped["base"] <= uncapped["peak"] - uncapped["base"] - hi_all // 3
    (a,), (b,) = (list((tmp_path / f).iterdir()) for f in "ab")
    from safetensors import safe_open

    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        assert a.name == b.name and fa.metadata() == fb.metadata()  # the same arena hash and layout
        assert fa.get_tensor("arena").equal(fb.get_tensor("arena"))


def test_staged_slots_hold_the_checkpoints_values_and_are_not_reused_while_a_copy_reads_them():
    """`StagedHi` over the mapped demo checkpoint, one slot: a staged version equals the checkpoint's
    tensors; while the slot is held (handed out, copy not started) or fenced (copy in flight) no
    other expert takes it; once released, the next request is staged into it."""
    import time

    from safetensors import safe_open

    from moetide.engine.llm import demo_model_path
    from moetide.models.checkpoint import inspect_checkpoint
    from moetide.residency.transfer import ThreadEvent
    from moetide.store.host_store import ExpertShape, hi_views
    from moetide.store.mapped import MappedExperts
    from moetide.store.staging import StagedHi

    info = inspect_checkpoint(demo_model_path())
    layers = info.config.num_hidden_layers
    mapped = MappedExperts(info, {i: i for i in range(layers)})
    shape = ExpertShape(info.config.hidden_size, info.adapter.expert_intermediate(info.config), torch.float32)
    budget = BudgetTracker(shape.hi_nbytes)
    staged = StagedHi(mapped, shape, layers, 32, 1, pin_memory=False, budget=budget)
    assert budget.used_bytes == shape.hi_nbytes and not budget.try_reserve(
        1, "more"
    )  # the slot fills the cap

    def staged_soon(layer, expert):
        staged.wait_idle()
        return staged.get(layer, expert)

    assert staged.get(1, 2) is None  # only on disk: queued
    buffer = staged_soon(1, 2)  # now staged, and held for a copy
    views = hi_views(buffer, shape)
    name = info.adapter.expert_checkpoint_key(1, 2, "gate")
    shard = next(s.path for s in info.shards if name in s.tensors)
    with safe_open(str(shard), "pt") as f:
        assert views["gate_up"][: shape.intermediate].equal(f.get_tensor(name).float())
    assert staged.get(3, 4) is None
    time.sleep(0.05)
    assert staged.staged_rows() == [1 * 32 + 2]  # held: (3, 4) cannot take the slot
    copy_done = ThreadEvent()
    staged.fence(buffer, copy_done)
    time.sleep(0.05)
    assert staged.staged_rows() == [1 * 32 + 2]  # fenced by a copy in flight
    copy_done.set()
    assert staged_soon(3, 4) is not None and staged.staged_rows() == [3 * 32 + 4]
    staged.unhold(staged.arena[0])
    staged.close()
    mapped.close()
