"""Tiny random checkpoints of every supported family, written with `save_pretrained` (fp32)."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

FAMILY_KWARGS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8),
    "qwen2_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    "deepseek_v2": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        num_hidden_layers=3,
        num_key_value_heads=4,  # MLA: one KV head per query head
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    ),
}
FAMILIES = tuple(FAMILY_KWARGS)


def make_config(model_type: str, **overrides):
    from transformers import AutoConfig

    kw = {**BASE, **FAMILY_KWARGS[model_type], **overrides}
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.eos_token_id = 1
    cfg.bos_token_id = 0
    cfg.pad_token_id = 2
    return cfg


def save_tiny_model(
    model_type: str,
    path: Path,
    *,
    seed: int = 0,
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    **overrides,
):
    """Random `model_type` model saved at `path` (`overrides`: config fields); returns the
    transformers model (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(model_type, **overrides), dtype=torch.float32).eval()
    # Routers init to zeros in some families: give them real, skewed weights so routing matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")) and p.dim() == 2:
                p.normal_(0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                p.zero_()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if with_tokenizer:
        save_char_tokenizer(path, model.config.vocab_size)
    return model


def save_char_tokenizer(path: Path, vocab_size: int) -> None:
    """A tiny character-level fast tokenizer with a chat template, built with `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>"]
    chars = [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(specials + chars[: vocab_size - len(specials)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}"
    )
    fast.save_pretrained(path)
