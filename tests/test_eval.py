"""`moetide eval` on the demo model with a tiny subset (CPU): table, JSON, plot, and the orderings
that must hold whatever the subset (int2 is worse than bf16; the dynamic budget buys what it says)."""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
from test_bad_input import run_cli

from moetide.engine.llm import demo_model_path
from moetide.errors import ConfigError
from moetide.eval.quality import (
    EvalSpec,
    dynamic_hi_experts,
    expert_geometry,
    ladder_of,
    run_eval,
    split_conversations,
)
from moetide.eval.report import write_plot


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    spec = EvalSpec(
        device="cpu",
        configs=["bf16", "int4", "int2+4", "int2", "dynamic", "int4>int2+4"],
        budgets=["mid"],
        max_convs=2,
        calib_convs=2,
        max_len=128,
        out=str(out),
    )
    return run_eval(spec, progress=False), out


def test_eval_writes_table_json_and_plot(report):
    rep, out = report
    names = [r["name"] for r in rep["results"]]
    assert names == ["bf16", "int4", "int2+4", "int2", "dynamic@mid", "int4>int2+4@mid"]
    assert all("error" not in r for r in rep["results"]), [r.get("error") for r in rep["results"]]
    saved = json.loads((out / "eval.json").read_text())
    assert [r["name"] for r in saved["results"]] == names
    table = (out / "eval.md").read_text()
    for name in names:
        assert f"| {name} |" in table
    assert "Gap recovered" in table
    assert (out / "quality_vs_bits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for r in rep["results"]:
        assert set(r["ppl"]) == {"all", "code", "non-english", "chat"}
        assert r["conversations"]["all"] == 6 and all(p > 1 for p in r["ppl"].values())
        assert r["ppl"]["all"] == pytest.approx(math.exp(r["loss"]["all"]))


def test_int2_is_worse_than_bf16_and_memory_is_ordered(report):
    by = {r["name"]: r for r in report[0]["results"]}
    assert by["int2"]["ppl"]["all"] > by["bf16"]["ppl"]["all"]
    assert by["int2"]["expert_bytes"] < by["dynamic@mid"]["expert_bytes"] < by["int4"]["expert_bytes"]
    assert by["int4"]["expert_bytes"] < by["bf16"]["expert_bytes"]
    gap = report[0]["gap_recovered"]
    assert gap is not None and set(gap) >= {"all"}


def test_dynamic_perplexity_lies_between_bf16_and_int2(report):
    """Hot experts in bf16, the rest int2: better than all-int2 (its hot set buys something), and not
    better than bf16 beyond noise (a dynamic config that scored like bf16 would be measuring bf16)."""
    by = {r["name"]: r["ppl"]["all"] for r in report[0]["results"]}
    assert by["bf16"] * 0.99 <= by["dynamic@mid"] < by["int2"], by
    assert 0 < report[0]["gap_recovered"]["all"], report[0]["gap_recovered"]


def test_dynamic_budget_calibrates_its_hot_set(report):
    dyn = next(r for r in report[0]["results"] if r["name"] == "dynamic@mid")
    geo = expert_geometry(demo_model_path())
    # (3.375 - 2.25) / 16 x 256 = 18 bf16 experts: 2 or 3 per layer
    assert dyn["hi_experts"] == dynamic_hi_experts("mid", geo) == 18
    assert sorted(dyn["calibration"]["n_hi_per_layer"]) == [2] * 6 + [3] * 2
    assert dyn["calibration"]["resident"]["hi"] == 18  # promotions applied before measuring
    assert dyn["calibration"]["resident"]["lo"] == geo.total
    assert "hi slots" in dyn["plan"] and dyn["lo_share"] is not None and 0 < dyn["lo_share"] < 1


def test_calibration_and_measured_conversations_are_disjoint():
    calib, measured = split_conversations(5, 3)
    calib_ids = {c["id"] for c in calib}
    for workload, convs in measured.items():
        assert len(convs) == 3 and all(c["workload"] == workload for c in convs)
        assert not calib_ids & {c["id"] for c in convs}


def test_spec_rejects_bad_budgets():
    with pytest.raises(ConfigError, match="fraction"):
        EvalSpec(budgets=["1.5"])
    with pytest.raises(ConfigError, match="unknown config"):
        EvalSpec(configs=["fp8"])


def test_the_plot_warns_of_nothing_when_a_workload_has_no_conversation(report, tmp_path):
    """`--first N` can leave a workload unmeasured: its panel has no line, and matplotlib is not
    asked for a legend of nothing (a UserWarning on the user's terminal)."""
    rep = copy.deepcopy(report[0])
    assert any(r.get("dynamic") for r in rep["results"])
    for r in rep["results"]:
        r["loss_increase"].pop("code")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_plot(rep, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_cli(tmp_path):
    proc = run_cli(
        "eval",
        "--device",
        "cpu",
        "--configs",
        "int2",
        "--max-convs",
        "1",
        "--max-len",
        "64",
        "--out",
        str(tmp_path),
        "--quiet",
    )
    assert proc.returncode == 0, proc.stderr
    assert "| int2 |" in proc.stdout and (tmp_path / "eval.json").is_file()


def test_bits_per_weight_come_from_stored_bytes_and_losses_from_bf16(report):
    by = {r["name"]: r for r in report[0]["results"]}
    bits = {name: by[name]["bits_per_weight"] for name in ("bf16", "int4", "int2+4", "int2")}
    assert bits == {"bf16": 16.0, "int4": 4.5, "int2+4": 3.0, "int2": 2.25}
    geo = expert_geometry(demo_model_path())
    ladder = by["int4>int2+4@mid"]
    # (3.375 - 3.0) / 4.5 x 256 = 21.3: 21 hot experts, 2 or 3 per layer
    assert ladder["hi_experts"] == dynamic_hi_experts("mid", geo, "int4", "int2+4") == 21
    assert ladder["bits_per_weight"] == pytest.approx(3.0 + 21 / 256 * 4.5)
    assert sorted(ladder["calibration"]["n_hi_per_layer"]) == [2, 2, 2, 3, 3, 3, 3, 3]
    assert ladder["calibration"]["resident"]["hi"] == 21
    assert by["bf16"]["loss_increase"] == {w: 0.0 for w in by["bf16"]["loss"]}
    for r in by.values():
        assert r["loss_increase"]["all"] == pytest.approx(r["loss"]["all"] - by["bf16"]["loss"]["all"])
    assert by["int2+4"]["lo_share"] == 1.0  # a static format: every expert ran its int2+4 version
    assert by["int2"]["loss_increase"]["all"] > by["int2+4"]["loss_increase"]["all"] > 0
    summary = report[0]["summary"]
    assert summary["int2_down4_bits_per_weight"] == 3.0 and summary["int2_bits_per_weight"] == 2.25
    assert summary["int2_loss_increase"] == by["int2"]["loss_increase"]["all"]
    assert set(summary["gap_recovered_at_mid"]) == {"dynamic", "int4>int2+4"}
    assert summary["dynamic_halfway_gap_recovered"] == max(summary["gap_recovered_at_mid"].values())


def test_ladder_names_are_checked_against_the_registry():
    assert ladder_of("int4>int2+4") == ("int4", "int2+4")
    assert ladder_of("dynamic") == ("bf16", "int2") and ladder_of("hi>int2") == ("bf16", "int2")
    assert ladder_of("int2+4") is None
    assert ladder_of("int4>int2+4-gptq") == ("int4", "int2+4-gptq")  # a calibrated cold tier
    from moetide.eval.quality import DEFAULT_CONFIGS

    assert not any("gptq" in c for c in DEFAULT_CONFIGS)  # calibration runs only when asked
    with pytest.raises(ConfigError, match="fewer bytes than the one before it"):
        EvalSpec(configs=["int2>int4"])
    with pytest.raises(ConfigError, match="unknown format 'int3'"):
        EvalSpec(configs=["int3>int2"])
    assert ladder_of("bf16>int4>int2+4>int2") == ("bf16", "int4", "int2+4", "int2")
    with pytest.raises(ConfigError, match="int2 .* is not smaller than int2"):
        EvalSpec(configs=["int4>int2>int2"])


def test_a_deeper_ladder_is_planned_at_the_same_budget_as_the_engine_would_split_it():
    """int4 > int2+4 > int2 at the halfway memory (3.375 bits/weight): the 3.375 MiB above all-int2
    split in equal bytes, 32 int4 + 48 int2+4 experts; the device budget it names gives the engine's
    plan exactly those tiers (checked without loading the weights)."""
    import dataclasses

    from moetide.engine.memory import model_bytes, plan_for
    from moetide.eval.quality import _engine_config, config_plan, ladder_experts

    geo = expert_geometry(demo_model_path())
    assert ladder_experts("mid", geo, ("int4", "int2+4", "int2")) == [32, 48]
    assert ladder_experts("mid", geo, ("int4", "int2+4")) == [21]  # the two-tier rule, unchanged
    spec = EvalSpec(device="cpu", configs=["int4>int2+4>int2"], budgets=["mid"])
    plan = config_plan(spec, demo_model_path(), "int4>int2+4>int2", geo, "mid")
    assert plan["tier_experts"] == [32, 48] and plan["hi_experts"] == 32 and plan["dynamic"]
    assert plan["bits_per_weight"] == pytest.approx(3.375)
    ladder, budget = ("int4", "int2+4", "int2"), plan["budget_bytes"]
    config = _engine_config(spec, demo_model_path(), "dynaexq", budget, ladder, plan["tier_experts"])
    memory = plan_for(config, model_bytes(config), budget)
    assert (memory.hi_slots, memory.mid_slots, memory.lo_slots) == (32, (48,), geo.total)
    unsplit = plan_for(dataclasses.replace(config, ladder_slots=None), model_bytes(config), budget)
    assert unsplit.upper_slots == (32, 48)  # on the CPU too the engine's own split agrees (no bf16 tier)


def test_first_split_measures_the_first_conversations_and_calibrates_on_the_next():
    from moetide.data.sharegpt import heldout_conversations

    calib, measured = split_conversations(4, None, first=10)
    first_ids = [c["id"] for c in heldout_conversations()[:14]]
    assert sorted(c["id"] for cs in measured.values() for c in cs) == sorted(first_ids[:10])
    assert [c["id"] for c in calib] == first_ids[10:]
