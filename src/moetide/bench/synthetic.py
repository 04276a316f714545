"""Random-weight models of real MoE shapes, written as real checkpoints (safetensors + config +
tokenizer), so that benchmarks measure real transfer and compute costs without downloads.

Random routers route near-uniformly: the hardest case for any expert predictor. Say so next to
every number measured on these models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHAPES: dict[str, dict] = {
    "olmoe-1b-7b": dict(
        model_type="olmoe",
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        norm_topk_prob=False,
    ),
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5632,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=60,
        num_experts_per_tok=4,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        norm_topk_prob=True,
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
}


def synthetic_config(name: str, **overrides):
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"unknown synthetic shape {name!r}; choose one of {', '.join(SHAPES)}")
    kw = {**SHAPES[name], **overrides}
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 0, 1, 2
    return cfg


def _random(shape, name: str, generator: torch.Generator, device: str) -> torch.Tensor:
    import torch

    if name.endswith("norm.weight") or "layernorm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=generator)
    return t.to(torch.bfloat16).cpu()


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id ("<123>"), for models with random weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    vocab.update({f"<{i}>": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    ).save_pretrained(path)


def write_synthetic_checkpoint(
    name: str,
    path: str | Path,
    *,
    seed: int = 0,
    shard_bytes: int = 2 << 30,
    progress: bool = True,
    **overrides,
) -> Path:
    """Write a random bf16 model of shape `name` to `path` (config, shards, index, tokenizer)."""
    import torch
    from safetensors.torch import save_file

    from ..models.loader import build_empty_model, moe_blocks
    from ..models.registry import get_adapter
    from ..progress import bar as progress_bar

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = synthetic_config(name, **overrides)
    adapter = get_adapter(cfg.model_type)
    model = build_empty_model(cfg, torch.bfloat16)
    blocks = {idx for idx, _ in moe_blocks(model, adapter)}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    entries: list[tuple[str, tuple[int, ...]]] = []
    for pname, p in model.named_parameters():
        if ".experts." in pname:
            continue
        entries.append((adapter.checkpoint_key(pname), tuple(p.shape)))
    inter, hidden = adapter.expert_intermediate(cfg), cfg.hidden_size
    for layer in sorted(blocks):
        for e in range(adapter.num_experts(cfg)):
            for role, shape in (
                ("gate", (inter, hidden)),
                ("up", (inter, hidden)),
                ("down", (hidden, inter)),
            ):
                entries.append((adapter.expert_checkpoint_key(layer, e, role), shape))
    weight_map, shard, shard_size, index = {}, {}, 0, 0
    total = sum(torch.Size(s).numel() * 2 for _, s in entries)

    def flush():
        nonlocal shard, shard_size, index
        if not shard:
            return
        index += 1
        fname = f"model-{index:05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        shard, shard_size = {}, 0

    with progress_bar(total=total, unit="B", unit_scale=True, desc=f"writing {name}", enabled=progress) as bar:
        for key, shape in entries:
            t = _random(shape, key, gen, device)
            shard[key] = t
            shard_size += t.numel() * 2
            bar.update(t.numel() * 2)
            if shard_size >= shard_bytes:
                flush()
        flush()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(path)
    write_word_tokenizer(path, cfg.vocab_size)
    return path
