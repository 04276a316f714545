#!/usr/bin/env python3
"""Training-step speed of the demo model per experts implementation.

Builds the demo model's Qwen3-MoE config (as `train_demo_model.py` does), feeds random token batches and
times whole optimizer steps (bf16 autocast forward + backward + fused AdamW), per implementation:

    python scripts/bench_train_step.py --out train_step.json [--impls grouped_mm_bf16,grouped_mm] [--batch-sizes 128,256]

Random tokens route differently from real text, so read the numbers as kernel speed, not training speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_demo_model as train  # noqa: E402


def time_steps(impl: str, batch_size: int, seq_len: int, steps: int, warmup: int, dropout: float) -> dict:
    """Mean wall seconds of one optimizer step on `batch_size` x `seq_len` random tokens."""
    import torch
    import torch.nn.functional as F
    from transformers import Qwen3MoeForCausalLM

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = train.make_config()
    cfg.attention_dropout = dropout
    model = Qwen3MoeForCausalLM(cfg).to(dev)
    if dropout:
        train.add_residual_dropout(model, dropout)
    model.set_experts_implementation(impl)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=dev.type == "cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1), device=dev)
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
            out = model(input_ids=x[:, :-1], output_router_logits=True)
            ce = F.cross_entropy(out.logits.float().view(-1, cfg.vocab_size), x[:, 1:].reshape(-1))
            loss = ce + cfg.router_aux_loss_coef * out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    step_s = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    del model, opt
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {
        "impl": impl,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "step_s": round(step_s, 4),
        "tokens_per_s": round(batch_size * seq_len / step_s),
        "peak_gib": None if peak is None else round(peak, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="grouped_mm_bf16,grouped_mm")
    ap.add_argument("--batch-sizes", default="128")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.05)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    train.register_training_experts()
    results = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "runs": [],
    }
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        for impl in args.impls.split(","):
            try:
                r = time_steps(impl, bs, args.seq_len, args.steps, args.warmup, args.dropout)
            except Exception as e:  # noqa: BLE001 - one implementation failing must not lose the others
                r = {"impl": impl, "batch_size": bs, "error": f"{type(e).__name__}: {e}"}
            results["runs"].append(r)
            print(json.dumps(r), flush=True)
            Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
