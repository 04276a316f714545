"""`moetide info`: what a checkpoint is and how big its experts are, from shard headers alone."""

from __future__ import annotations

import math

from ..config import format_bytes
from .checkpoint import inspect_checkpoint

_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def expert_bytes(intermediate: int, hidden: int) -> dict[str, int]:
    """Bytes of one expert (gate, up, down) per precision of the registry, in the store's layouts
    ("bf16" first, then every low-bit format, most bytes first)."""
    import torch

    from ..store import quant

    return {p: quant.nbytes_for(p, intermediate, hidden, torch.bfloat16) for p in quant.precision_names()}


def checkpoint_summary(path) -> dict:
    """Family, layer/expert geometry and parameter counts of a checkpoint (no weights loaded)."""
    info = inspect_checkpoint(path)
    cfg, adapter = info.config, info.adapter
    total = expert_params = 0
    expert_layers = set()
    for shard in info.shards:
        for name, (_dtype, shape) in shard.tensors.items():
            n = math.prod(shape)
            total += n
            key = adapter.match_expert_key(name)
            if key is not None:
                expert_params += n
                expert_layers.add(key[0])
    num_experts, top_k = adapter.num_experts(cfg), adapter.top_k(cfg)
    inter = adapter.expert_intermediate(cfg)
    per_expert = 3 * inter * cfg.hidden_size
    active = total - expert_params + len(expert_layers) * top_k * per_expert
    return {
        "path": str(info.path),
        "family": adapter.display_name,
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "moe_layers": len(expert_layers),
        "experts": num_experts,
        "top_k": top_k,
        "hidden": cfg.hidden_size,
        "expert_intermediate": inter,
        "params_total": total,
        "params_experts": expert_params,
        "params_non_expert": total - expert_params,
        "params_active_per_token": active,
        "params_per_expert": per_expert,
        "bytes_per_expert": expert_bytes(inter, cfg.hidden_size),
        "shards": len(info.shards),
    }


def describe_checkpoint(path) -> str:
    s = checkpoint_summary(path)
    per = s["bytes_per_expert"]
    n_exp = s["moe_layers"] * s["experts"]
    lines = [
        f"model         {s['path']}",
        f"family        {s['family']} ({s['model_type']})",
        f"layers        {s['layers']} ({s['moe_layers']} with experts)",
        f"experts       {s['experts']} per layer, top-{s['top_k']}  (hidden {s['hidden']}, expert intermediate"
        f" {s['expert_intermediate']})",
        f"parameters    {s['params_total'] / 1e6:,.1f} M total, {s['params_experts'] / 1e6:,.1f} M in experts,"
        f" {s['params_non_expert'] / 1e6:,.1f} M other, {s['params_active_per_token'] / 1e6:,.1f} M active per token",
        "bytes/expert  " + ", ".join(f"{p} {format_bytes(b)}" for p, b in per.items()),
        ("bits/weight   ")
        + ", ".join(f"{p} {8 * b / s['params_per_expert']:.2f}" for p, b in per.items())
        + "  (stored bytes: scales, offsets, padding)",
        "all experts   " + ", ".join(f"{p} {format_bytes(b * n_exp)}" for p, b in per.items()),
        f"shards        {s['shards']}",
    ]
    return "\n".join(lines)
