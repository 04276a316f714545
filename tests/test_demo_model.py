"""The shipped demo model is the one MODEL.md describes, loaded through moetide's own loader."""

from __future__ import annotations

import re

import pytest
import torch

import moetide
from moetide.data.sharegpt import heldout_conversations, heldout_loss
from moetide.engine.assemble import load_model
from moetide.models.checkpoint import load_tokenizer

DEMO = moetide.demo_model_path()


def documented_subset_loss() -> float:
    text = (DEMO / "MODEL.md").read_text()
    m = re.search(r"Test subset \(first (\d+) held-out conversations[^)]*\): \*\*([0-9.]+)\*\*", text)
    assert m, "MODEL.md must state the test-subset loss"
    return int(m.group(1)), float(m.group(2))


def test_shipped_weights_reproduce_the_documented_heldout_loss():
    count, documented = documented_subset_loss()
    loaded = load_model(DEMO, device="cpu", progress=False)
    tokenizer = load_tokenizer(DEMO)
    with torch.no_grad():
        loss = heldout_loss(loaded.model, tokenizer, heldout_conversations()[:count], max_len=512)
    assert abs(loss - documented) <= 0.05, (loss, documented)
    # and it is a trained model, far below the uniform-guess loss ln(8192) = 9.0
    assert loss < 3.0


def test_shipped_model_fits_the_size_limits():
    shards = sorted(DEMO.glob("*.safetensors"))
    assert shards and sum(s.stat().st_size for s in shards) <= 60e6
    assert all(s.stat().st_size <= 15e6 for s in shards)


@pytest.mark.parametrize("policy,budget", [("on-demand", None), ("combined", "200MiB")])
def test_generate_without_model_uses_the_demo_and_stops_at_end_of_turn(policy, budget):
    llm = moetide.LLM(device="cpu", policy=policy, gpu_memory=budget)
    out = llm.chat(
        [{"role": "user", "content": "Thank you!"}], moetide.SamplingParams(max_tokens=120, temperature=0)
    )[0]
    assert out.finish_reason == "stop" and 0 < len(out.token_ids) < 120  # stopped at <|end|>, not the limit
    assert "welcome" in out.text
    llm.close()
