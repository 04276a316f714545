"""Batch-1 decode measurements of moetide policies and of transformers' own baselines, in one process.

Every function returns a JSON-able dict: tokens/s of the decode phase (first token excluded), TPOT,
TTFT, peak device memory (torch's allocator peak, i.e. everything this process allocated on the
GPU) and, for moetide, the residency metrics.
"""

from __future__ import annotations

import gc
import time

import torch

from ..config import parse_bytes


def _free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_bytes() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def prompt_ids(vocab_size: int, length: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=g).tolist()


def bench_moetide(
    path,
    policy: str,
    gpu_memory: str | None,
    *,
    prompt_len: int = 32,
    new_tokens: int = 64,
    device: str | None = None,
    warmup_tokens: int | None = None,
    **engine_kwargs,
) -> dict:
    """Decode speed of one moetide policy at batch 1.

    The timed request is preceded by an untimed one of `warmup_tokens` new tokens (default: as many
    as the timed one), so costs paid once per sequence length (the allocator's first blocks of each
    KV size, first launches) fall outside the measurement: on the H200 a shorter warm-up left the
    first configuration of a process 3x slower than the same configuration run again (run 7)."""
    import moetide

    _free_device()
    start = time.perf_counter()
    llm = moetide.LLM(path, device=device, policy=policy, gpu_memory=gpu_memory, **engine_kwargs)
    load_s = time.perf_counter() - start
    vocab = llm.loaded.config.vocab_size
    ids = prompt_ids(vocab, prompt_len)
    warmup = new_tokens if warmup_tokens is None else warmup_tokens
    llm.generate([ids], moetide.SamplingParams(max_tokens=warmup, temperature=0, ignore_eos=True))
    llm.metrics.reset()
    out = llm.generate(
        [prompt_ids(vocab, prompt_len, seed=1)],
        moetide.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
    )[0]
    steps_ms = _decode_step_times_ms(llm, prompt_ids(vocab, prompt_len, seed=2), new_tokens)
    result = {
        "engine": "moetide",
        "policy": policy,
        "gpu_memory": gpu_memory,
        "budget_bytes": parse_bytes(gpu_memory),
        "load_s": round(load_s, 2),
        "ttft_s": out.ttft_s,
        "tpot_s": out.tpot_s,
        "decode_tok_s": 1.0 / out.tpot_s if out.tpot_s else None,
        "new_tokens": len(out.token_ids),
        "peak_gpu_bytes": _peak_bytes(),
        # a diagnostic third pass, each engine step timed with a device sync on both sides: are slow
        # decodes uniformly slow, or a few steps very slow (first-use costs, collection pauses)?
        "decode_step_ms": {
            "min": round(min(steps_ms), 3),
            "p50": round(sorted(steps_ms)[len(steps_ms) // 2], 3),
            "max": round(max(steps_ms), 3),
            "all": [round(t, 3) for t in steps_ms],
        }
        if steps_ms
        else None,
        "metrics": {k: v for k, v in llm.metrics.snapshot().items() if k != "per_layer"},
        "resident": llm.loaded.runtime.residency.resident_counts(),
        "plan": getattr(getattr(llm.loaded.runtime.residency, "plan", None), "describe", lambda: None)(),
        "cuda_graphs": llm.engine.runner.graph_stats(),
    }
    llm.close()
    del llm
    _free_device()
    return result


def _decode_step_times_ms(llm, ids: list[int], new_tokens: int) -> list[float]:
    """Wall time of every decode step of one batch-1 request (the prefill step excluded), in ms."""
    import moetide

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    engine = llm.engine
    engine.add_request(ids, moetide.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    times = []
    while engine.has_unfinished():
        sync()
        t0 = time.perf_counter()
        engine.step()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return times[1:]


def bench_hf(
    path,
    *,
    offload_budget: str | None = None,
    prompt_len: int = 32,
    new_tokens: int = 64,
    experts_implementation: str | None = None,
) -> dict:
    """transformers' own `generate`: fully on the GPU, or with accelerate offloading under a cap."""
    from transformers import AutoModelForCausalLM

    _free_device()
    kwargs = {"dtype": torch.bfloat16}
    if offload_budget is None:
        kwargs["device_map"] = "cuda"
    else:
        kwargs["device_map"] = "auto"
        kwargs["max_memory"] = {0: parse_bytes(offload_budget), "cpu": 200 << 30}
    if experts_implementation:
        kwargs["experts_implementation"] = experts_implementation
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
    load_s = time.perf_counter() - start
    vocab = model.config.vocab_size
    ids = torch.tensor([prompt_ids(vocab, prompt_len, seed=1)], device="cuda")
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=2)
    with torch.inference_mode():
        # warm-up as long as the timed run (see bench_moetide); hf-offload (~1 s/token) keeps it short
        model.generate(ids, max_new_tokens=2 if offload_budget else new_tokens, **gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **gen)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **gen)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    ttft = t1 - t0
    tpot = ((t2 - t1) - ttft) / (new_tokens - 1)
    result = {
        "engine": "hf-offload" if offload_budget else "hf",
        "gpu_memory": offload_budget,
        "experts_implementation": experts_implementation or "default",
        "load_s": round(load_s, 2),
        "ttft_s": ttft,
        "tpot_s": tpot,
        "decode_tok_s": 1.0 / tpot if tpot > 0 else None,
        "new_tokens": new_tokens,
        "peak_gpu_bytes": _peak_bytes(),
    }
    del model
    _free_device()
    return result
