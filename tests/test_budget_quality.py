"""Every budget the engine accepts gives text within the policy's quality (demo model, CPU).

Quality measure: the held-out loss (nats/token, `data.sharegpt.heldout_loss`, teacher-forced over the
first held-out conversations) of the engine at the budget, measured after it has generated greedy
text for a few prompts (so the residency is in the state decoding left it in). The bound is the
loss of the policy's coldest version run everywhere, with no cap, plus `TOLERANCE`:

    hi-cache policies (on-demand, lru, finemoe, moe-infinity) and no-offload   the hi model's loss
    static-int4                                                             static-int4's loss
    static-int2, and the lo+hi policies (combined, dynaexq: every expert runs   static-int2's loss
    in hi or in a resident int2 version, or a miss reads hi from host memory)

An expert that runs nowhere adds 0 to its tokens' outputs: that is garbage text, 4 nats/token or
more above these bounds on the demo model, where hi and int2 lie about 0.1 nats apart (int4 is
within 1e-3 of hi).

Budgets: the smallest the engine accepts for the policy (`engine.memory.minimum_budget`), 1 MiB and
8 MiB above it, where the lo pool goes from part of the experts to all of them and the hi pool from
the top-k minimum to a few dozen slots.
"""

from __future__ import annotations

import pytest
import torch

import moetide
from moetide.config import EngineConfig
from moetide.data.sharegpt import heldout_conversations, heldout_loss
from moetide.engine.llm import demo_model_path
from moetide.engine.memory import minimum_budget, model_bytes
from moetide.policies.registry import POLICY_NAMES, policy_spec

TOLERANCE = 0.01  # nats/token: the reduction-order noise of float32 runs is below 1e-3
CONVERSATIONS, MAX_LEN = 3, 192
PROMPTS = ("How do I reverse a list in Python?", "What is the capital of France?")
MIB = 1 << 20


def _loss(policy: str, budget: int | None) -> float:
    """The engine's held-out loss after greedy decoding of `PROMPTS` (see the module docstring)."""
    llm = moetide.LLM(device="cpu", policy=policy, gpu_memory=budget)
    try:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        llm.generate(prompts, moetide.SamplingParams(max_tokens=16, temperature=0))
        with torch.no_grad():
            return heldout_loss(
                llm.loaded.model,
                llm.tokenizer,
                heldout_conversations()[:CONVERSATIONS],
                max_len=MAX_LEN,
                batch_size=1,
            )
    finally:
        llm.close()


@pytest.fixture(scope="module")
def floors() -> dict[str, float]:
    """The loss with every expert in hi, in int4 and in int2 (no cap)."""
    return {
        "hi": _loss("no-offload", None),
        "int4": _loss("static-int4", None),
        "int2": _loss("static-int2", None),
    }


def _floor_of(policy: str) -> str:
    spec = policy_spec(policy)
    if spec.memory_mode in ("hi-cache", "all-hi"):
        return "hi"
    return spec.lo_precision or "int2"  # lo+hi: at worst the int2 version (what "auto" picks when tight)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_accepted_budget_keeps_the_policys_quality(policy, floors):
    config = EngineConfig(model=str(demo_model_path()), device="cpu", policy=policy)
    smallest = minimum_budget(config, model_bytes(config))
    bound = floors[_floor_of(policy)] + TOLERANCE
    assert max(floors["hi"], floors["int4"]) + 5 * TOLERANCE < floors["int2"]  # the measure tells int2 apart
    for budget in (smallest, smallest + MIB, smallest + 8 * MIB):
        loss = _loss(policy, budget)
        assert loss <= bound, (
            f"{policy} at {budget / MIB:.2f} MiB: held-out loss {loss:.3f} above the bound {bound:.3f}"
            f" ({_floor_of(policy)} {floors[_floor_of(policy)]:.3f} + {TOLERANCE})"
        )
