"""`--gpu-memory NN%` has one meaning in every command: after the fixed part that command's engine
reserves at the budget, the room left holds NN % of all experts in hi precision."""

from __future__ import annotations

import dataclasses

import pytest

from moetide.cli import build_parser, engine_config_from_args
from moetide.config import EngineConfig, format_bytes
from moetide.engine.llm import demo_model_path
from moetide.engine.memory import check_budget, model_bytes, resolve_budget
from moetide.errors import BudgetError
from moetide.serve.cli import SERVE_KV_TOKENS_PER_SEQ

MIB = 1 << 20


@pytest.fixture(scope="module")
def demo() -> EngineConfig:
    return EngineConfig(model=str(demo_model_path()), device="cpu")


def _room(config: EngineConfig, budget: int) -> int:
    """What the expert pools get at `budget`: the budget less the fixed part reserved at it."""
    return budget - model_bytes(config).fixed_at(budget).total


def _configs(demo: EngineConfig) -> dict[str, EngineConfig]:
    """The configurations generate, serve and bench build (a bench run reserves its batch's KV)."""
    args = build_parser().parse_args(["generate", "hi", "--device", "cpu", "--gpu-memory", "none"])
    generate = engine_config_from_args(args)
    return {
        "generate": generate,
        "serve": dataclasses.replace(generate, kv_tokens_per_seq=SERVE_KV_TOKENS_PER_SEQ),
        "bench": dataclasses.replace(demo, max_num_seqs=8, max_model_len=300, kv_cache_tokens=8 * 300),
        "dynaexq": dataclasses.replace(demo, policy="dynaexq"),
    }


@pytest.mark.parametrize("share", ["10%", "25%", "100%", "300%"])
def test_every_command_gives_the_experts_that_share_of_their_hi_bytes(demo, share):
    want = int(float(share[:-1]) / 100 * model_bytes(demo).all_experts_hi_bytes)
    for name, config in _configs(demo).items():
        budget = resolve_budget(share, config)
        assert _room(config, budget) >= want > _room(config, budget - 1), name  # the smallest such budget


def test_the_generate_command_resolves_a_share_without_a_cap_to_reserve_for(demo):
    """`generate --gpu-memory 25%` builds its config from the command line; the share gives about a
    quarter of the demo's 96 MiB of float32 experts beside a fixed part of about 96 MiB, not the KV
    reservation of an uncapped run (512 MiB)."""
    args = build_parser().parse_args(["generate", "hi", "--device", "cpu", "--gpu-memory", "25%"])
    config = engine_config_from_args(args)
    mb = model_bytes(demo)
    assert config.gpu_memory_bytes == resolve_budget("25%", demo)
    assert config.gpu_memory_bytes < mb.fixed_at(1).total + mb.all_experts_hi_bytes // 4 + MIB


def test_the_too_small_error_reports_the_fixed_part_a_share_is_added_to(demo):
    """no-offload at 50%: refused, and the fixed part in the error is the one the 50 % sits beside."""
    config = dataclasses.replace(demo, policy="no-offload")
    budget = resolve_budget("50%", config)
    with pytest.raises(BudgetError) as e:
        check_budget(dataclasses.replace(config, gpu_memory_bytes=budget))
    fixed = model_bytes(config).fixed_at(budget).total
    assert f"the fixed part (non-expert weights, KV cache, activations) {format_bytes(fixed)}" in str(e.value)
