#!/usr/bin/env python3
"""Decode tok/s at batch 1 and 32 and 2k-token prefill TTFT of moetide's policies, against
transformers' `generate` with the whole model on the GPU (its default cache, and a static cache:
a compiled step), all in one process on one checkpoint (a model shape with random weights, written
as a real safetensors checkpoint).

    python scripts/bench_decode_step.py --out out/decode_step.json [--batch-sizes 1,32] \
        [--policies no-offload,static-int4,static-int2,combined,lru] [--budget 4GiB] [--hf default,static] \
        [--compile off,auto] [--decode-ahead auto,off] [--lo-kernel auto,triton]

Decode tok/s of a batch = generated tokens after each sequence's first / wall time of the steps
after the prefill (a warm-up of the same shape runs first, untimed). Each moetide run also reports
`metrics.host_syncs` over its whole `generate` (prefill included).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

import moetide
from moetide.bench.runs import free_device, timed_hf_generate
from moetide.bench.synthetic import write_synthetic_checkpoint
from moetide.policies.registry import policy_spec


def prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def timed_generate(llm, batch: list[list[int]], new_tokens: int) -> dict:
    """One engine run of `batch`, stepping it by hand: (prefill seconds, decode tok/s). The decode
    clock starts after the first decode step (where a CUDA graph is captured when the KV
    reservation cannot keep the last one beside a new batch): steady-state steps only."""
    engine = llm.engine
    params = moetide.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(ids, params) for ids in batch]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    decode_start, tokens_at_start, prefill_s = None, 0, None
    while engine.has_unfinished():
        engine.step()
        if prefill_s is None and all(s.output_ids for s in seqs):
            torch.cuda.synchronize()
            prefill_s = time.perf_counter() - t0
            continue
        if decode_start is None and prefill_s is not None:
            torch.cuda.synchronize()
            decode_start = time.perf_counter()
            tokens_at_start = sum(len(s.output_ids) for s in seqs)
    torch.cuda.synchronize()
    end = time.perf_counter()
    decoded = sum(len(s.output_ids) for s in seqs) - tokens_at_start
    return {"prefill_s": prefill_s, "decode_tok_s": decoded / (end - decode_start)}


def bench_moetide(path, policy, budget, batch_sizes, new_tokens, prefill_len, compile_mode="off",
                  cache_dir=None, in_step=True, decode_attention="auto", decode_ahead="auto", lo_kernel="auto") -> list[dict]:  # fmt: skip
    free_device()
    t0 = time.perf_counter()
    extra = {} if in_step else {"layer_feed": False}
    llm = moetide.LLM(str(path), policy=policy, gpu_memory=budget, max_num_seqs=max(batch_sizes),
                      max_model_len=max(prefill_len + 8, 256), compile=compile_mode, cache_dir=cache_dir,
                      decode_attention=decode_attention, decode_ahead=decode_ahead, lo_kernel=lo_kernel,
                      **extra)  # fmt: skip
    load_s = time.perf_counter() - t0
    vocab = llm.loaded.config.vocab_size
    rows = []
    for b in batch_sizes:
        timed_generate(llm, prompts(vocab, b, 32, seed=b), new_tokens)  # warm-up: captures, compiles
        llm.metrics.reset()
        r = timed_generate(llm, prompts(vocab, b, 32, seed=100 + b), new_tokens)
        graphs = llm.engine.runner.graph_stats()
        snap = llm.metrics.snapshot()
        residency = {k: snap[k] for k in ("hit_rate", "hits", "lo_runs", "misses", "copies", "bytes_h2d",
                                          "promotions", "steps", "step_host_s", "deferred", "prefetches_late",
                                          "parked_misses")}  # fmt: skip
        options = getattr(llm.loaded.runtime.residency, "options", None)
        residency["lo"] = getattr(options, "lo_precision", None)
        feed = llm.loaded.policy_hooks.feed if llm.loaded.policy_hooks is not None else None
        rows.append({"engine": "moetide", "policy": policy, "gpu_memory": budget, "batch": b, "load_s": load_s,
                     "compile": compile_mode, "decode_attention": decode_attention,
                     "decode_ahead": decode_ahead, "ahead_steps": llm.engine.ahead_steps,
                     "decode_kernel": llm.engine.runner.kv.decode_kernel, "fused_routers": llm.loaded.fused_routers,
                     "fused_qkv": llm.loaded.fused_qkv,
                     "lo_kernel": lo_kernel, "in_step": feed is not None, "host_syncs": llm.metrics.host_syncs,
                     **r, **residency, "graphs": graphs, "layer_feed": feed.stats() if feed else None})  # fmt: skip
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "graphs"}),
              "graph failure:" if graphs and graphs.get("failed") else "", (graphs or {}).get("failed") or "",
              flush=True)  # fmt: skip
    if prefill_len:
        long = prompts(vocab, 1, prefill_len, seed=7)
        timed_generate(llm, long, 2)
        best = min(timed_generate(llm, long, 2)["prefill_s"] for _ in range(3))
        rows.append({"engine": "moetide", "policy": policy, "gpu_memory": budget, "prefill_tokens": prefill_len,
                     "ttft_s": best})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    rows[0]["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    llm.close()
    del llm
    return rows


def bench_hf(path, batch_sizes, new_tokens, modes=("static",)) -> list[dict]:
    """transformers' generate, whole model on the GPU: its default cache ("default": engine "hf")
    and `cache_implementation="static"` ("static": engine "hf-static", a compiled step)."""
    from transformers import AutoModelForCausalLM

    free_device()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, device_map="cuda").eval()
    rows = []
    for mode in modes:
        engine = "hf-static" if mode == "static" else "hf"
        extra = {"cache_implementation": "static"} if mode == "static" else {}
        for b in batch_sizes:
            ids = torch.tensor(prompts(model.config.vocab_size, b, 32, seed=100 + b), device="cuda")
            try:  # warm-up twice: compile, then the steady state
                ttft, total = timed_hf_generate(model, ids, new_tokens, warmup_tokens=(new_tokens, new_tokens),
                                                **extra)  # fmt: skip
            except Exception as e:  # one baseline failing must not lose the rest
                rows.append({"engine": engine, "batch": b, "error": f"{type(e).__name__}: {e}"[:300]})
                print(rows[-1], flush=True)
                continue
            decode_s = total - ttft
            rows.append({"engine": engine, "batch": b, "decode_tok_s": b * (new_tokens - 1) / decode_s,
                         "peak_gpu_bytes": torch.cuda.max_memory_allocated()})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    del model
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="olmoe-1b-7b")
    ap.add_argument("--checkpoint", default="/tmp/moetide-synthetic")
    ap.add_argument("--policies", default="no-offload,static-int4@6GiB,static-int2",
                    help="POLICY[@BUDGET][:step-late],... (:step-late: the policies decide a step late, no layer feed)")
    ap.add_argument("--budget", default="4GiB", help="for every policy but no-offload")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the TTFT run (0: none)")
    ap.add_argument("--compile", default="off", help="comma-separated of auto,off: each policy once per setting")
    ap.add_argument("--decode-attention", default="auto",
                    help="comma-separated of auto,gather,kernel: each policy once per setting")  # fmt: skip
    ap.add_argument("--decode-ahead", default="auto", help="comma-separated of auto,off: each policy once per setting")
    ap.add_argument("--hf", default="static", help="comma-separated transformers baselines: default,static")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cache-dir", default=None, help="where lo versions are cached between loads (prepare's)")
    ap.add_argument("--lo-kernel", default="auto",
                    help="comma-separated of auto,cuda,triton,dequant: each policy once per setting")  # fmt: skip
    args = ap.parse_args()
    ckpt = Path(args.checkpoint) / args.shape
    if not (ckpt / "model.safetensors.index.json").is_file():
        write_synthetic_checkpoint(args.shape, ckpt)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    report = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": args.shape, "runs": []}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.policies.split(","):
        spec, late, _ = spec.partition(":step-late")  # combined:step-late: without the layer feed
        policy, _, own_budget = spec.partition("@")  # static-int4@6GiB: this policy's own budget
        # a policy that offloads nothing runs uncapped (the whole model on the GPU)
        budget = None if policy_spec(policy).memory_mode == "all-hi" else own_budget or args.budget
        axes = itertools.product(args.lo_kernel.split(","), args.compile.split(","), args.decode_attention.split(","),
                                 args.decode_ahead.split(","))  # fmt: skip
        for lo_kernel, compile_mode, attention, ahead in axes:
            try:
                rows = bench_moetide(ckpt, policy, budget, batch_sizes, args.new_tokens, args.prefill,
                                     compile_mode, args.cache_dir, in_step=not late,
                                     decode_attention=attention, decode_ahead=ahead, lo_kernel=lo_kernel)  # fmt: skip
                report["runs"] += rows
            except Exception as e:
                report["runs"].append({"engine": "moetide", "policy": policy, "compile": compile_mode,
                                       "decode_attention": attention, "decode_ahead": ahead, "lo_kernel": lo_kernel,
                                       "error": f"{type(e).__name__}: {e}"[:500]})  # fmt: skip
                print(report["runs"][-1], flush=True)
            out.write_text(json.dumps(report, indent=1))
    if not args.skip_hf:
        report["runs"] += bench_hf(ckpt, batch_sizes, args.new_tokens, args.hf.split(","))
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
