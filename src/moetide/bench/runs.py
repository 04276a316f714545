"""One benchmark run: load an engine (moetide or a transformers baseline), send requests, measure.

moetide runs go through `LLMEngine` (continuous batching, `max_num_seqs` = the batch size):

    offline   every request is submitted at t = 0; the engine batches them
    online    requests are added at their arrival times by the one thread that steps the engine;
              a request's arrival is its *scheduled* time, so queueing behind a running step counts
              in its TTFT

Per request: TTFT (arrival -> first token), TPOT (mean gap between later tokens), E2E (arrival ->
last token, so E2E = TTFT + (n - 1) x TPOT). Tokens are generated greedily with EOS ignored, so every request produces exactly its
output length. The engine warms up on a batch of short requests before measuring (CUDA kernels,
Triton compilation); residency metrics and the CUDA peak-memory counter are reset after the warm-up.

Batch-1 decode (`bench_moetide`, `bench_hf`, used by scripts/bench_offload.py): one policy or one
transformers baseline, one warm-up request as long as the timed one, then decode tok/s of the timed
request (first token excluded), TPOT, TTFT, peak device memory and, for moetide, the residency
metrics and a third pass with every step timed between device syncs.
"""

from __future__ import annotations

import gc
import platform
import time
from pathlib import Path

import torch

from ..config import EngineConfig, parse_bytes
from ..errors import ConfigError, MoetideError
from .stats import summarize
from .workload import BenchRequest


def machine_info() -> dict:
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return info


def one_line_error(e: BaseException) -> str:
    """A failure as one line: the message of a moetide error, `Type: message` for anything else."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if isinstance(e, MoetideError) else f"{type(e).__name__}: {text}"


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_bytes() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def _params(req: BenchRequest):
    from ..engine.sampling import SamplingParams

    return SamplingParams(max_tokens=req.output_len, temperature=0.0, ignore_eos=True)


def drive_engine(
    engine, requests: list[BenchRequest], *, online: bool = False, closed_loop: bool = False
) -> tuple[list[dict], float]:
    """Send `requests` through `engine` until all finish. Returns (per-request records, duration_s).

    Offline: all submitted at once. Online: each added when the clock reaches its `arrival_s`.
    Closed loop: one at a time, each submitted when the previous one finished (trace replay).
    Duration runs from the start to the last finish.
    """
    start = time.perf_counter()
    seqs = [None] * len(requests)
    if closed_loop:
        for i, r in enumerate(requests):
            seqs[i] = engine.add_request(list(r.prompt_ids), _params(r))
            while engine.has_unfinished():
                engine.step()
    elif not online:
        for i, r in enumerate(requests):
            seqs[i] = engine.add_request(list(r.prompt_ids), _params(r))
            seqs[i].arrival_s = start
        while engine.has_unfinished():
            engine.step()
    else:
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        nxt = 0
        while nxt < len(order) or engine.has_unfinished():
            now = time.perf_counter() - start
            while nxt < len(order) and requests[order[nxt]].arrival_s <= now:
                i = order[nxt]
                seqs[i] = engine.add_request(list(requests[i].prompt_ids), _params(requests[i]))
                seqs[i].arrival_s = start + requests[i].arrival_s
                nxt += 1
            if engine.has_unfinished():
                engine.step()
            elif nxt < len(order):
                time.sleep(max(0.0, requests[order[nxt]].arrival_s - (time.perf_counter() - start)))

    def last_token_s(s):  # E2E ends at the last token, as TTFT and TPOT are measured from token times
        return s.token_times_s[-1] if s.token_times_s else s.finish_s

    end = max((last_token_s(s) for s in seqs if last_token_s(s) is not None), default=time.perf_counter())
    records = []
    for r, s in zip(requests, seqs, strict=True):
        records.append(
            {
                "arrival_s": s.arrival_s - start,
                "prompt_len": len(s.prompt_ids),
                "output_len": len(s.output_ids),
                "requested_output_len": r.output_len,
                "finish_reason": s.finish_reason,
                "ttft_s": s.ttft_s,
                "tpot_s": s.tpot_s,
                "e2e_s": (last_token_s(s) - s.arrival_s) if last_token_s(s) is not None else None,
            }
        )
    return records, end - start


def close_engine(loaded) -> None:
    if loaded.policy is not None:
        loaded.policy.close()
        loaded.policy_hooks.remove()
    loaded.runtime.residency.close()


def run_moetide(
    config: EngineConfig,
    requests: list[BenchRequest],
    *,
    online: bool = False,
    trace=None,
    warmup_requests: list[BenchRequest] | None = None,
) -> dict:
    """Measure one moetide configuration on `requests`.

    `trace`: replay its routing (`replay.TraceReplay`) from its first step, one request at a time
    (closed loop); then `warmup_requests` must be the trace's first requests (they consume the first
    steps) and `requests` the rest.
    """
    from ..engine.llm import build_engine
    from .replay import TraceReplay

    free_device()
    t0 = time.perf_counter()
    loaded, engine, _ = build_engine(config, progress=False)
    load_s = time.perf_counter() - t0
    replay = None
    try:
        if trace is not None:
            replay = TraceReplay(loaded.model, loaded.adapter, trace)
        _warm_up(engine, replay, requests[: config.max_num_seqs], warmup_requests)
        _sync()
        peak_with_load = _peak_bytes()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        loaded.runtime.metrics.reset()
        records, duration = drive_engine(engine, requests, online=online, closed_loop=trace is not None)
        _sync()
        result = _moetide_result(config, loaded, engine, load_s)
        result.update(
            summary=summarize(records, duration),
            peak_gpu_bytes=_peak_bytes(),
            peak_gpu_bytes_with_load=peak_with_load,
            requests=records,
        )
        if replay is not None:
            result["replay"] = replay.stats()
        return result
    finally:
        if replay is not None:
            replay.remove()
        close_engine(loaded)
        del loaded, engine
        free_device()


def _warm_up(engine, replay, batch: list[BenchRequest], warmup_requests) -> None:
    """A trace replay's warm-up requests (they consume the trace's first steps), else a full batch of
    short requests with the replay off: the batch's shapes are compiled before measuring."""
    if warmup_requests:
        drive_engine(engine, warmup_requests, closed_loop=replay is not None)
        return
    if replay is not None:
        replay.enabled = False
    drive_engine(engine, [BenchRequest(r.prompt_ids[:16], 2) for r in batch])
    if replay is not None:
        replay.enabled = True


def _moetide_result(config: EngineConfig, loaded, engine, load_s: float) -> dict:
    """What a moetide run records besides its requests: options, memory plan, metrics, policy stats."""
    residency = loaded.runtime.residency
    plan = residency.plan
    snapshot = loaded.runtime.metrics.snapshot(residency.resident_counts())
    return {
        "engine": "moetide",
        "policy": config.policy,
        "budget_bytes": config.gpu_memory_bytes,
        "cpu_memory_bytes": config.cpu_memory_bytes,  # the host cap asked for (None: the machine's spare)
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "load_s": load_s,
        "engine_options": {
            "on_miss": config.on_miss,
            "prefetch_distance": config.prefetch_distance,
            "hi_precision": config.hi_precision,
            "ladder": list(config.ladder) if config.ladder else None,
            "host_versions": list(config.host_versions) if config.host_versions is not None else None,
            "lo_kernel": config.lo_kernel,
            "cuda_graphs": config.cuda_graphs,
            "searcher": config.searcher,
            # the largest decode batch the fused lo kernel computes (0: dequant everywhere)
            "moe_kernel": "fused" if loaded.runtime.fused is not None else "reference",
        },
        "cuda_graph_stats": engine.runner.graph_stats(),
        "kv_cache": engine.kv_stats(),  # blocks, prefix-cache tokens queried/hit, preemptions
        "plan": plan.describe() if plan is not None else None,
        "hi_slots": plan.hi_slots if plan is not None else None,
        "lo_slots": plan.lo_slots if plan is not None else None,
        "mid_slots": list(plan.mid_slots) if plan is not None else None,
        "fixed_bytes": plan.fixed.total if plan is not None else None,
        "metrics": snapshot,
        "policy_stats": loaded.policy.stats()
        if loaded.policy is not None and hasattr(loaded.policy, "stats")
        else {},
        # the layer feed (policies that decide within a step): steps followed whole or in part
        "layer_feed": loaded.policy_hooks.feed.stats()
        if loaded.policy_hooks is not None and loaded.policy_hooks.feed is not None
        else None,
    }


class _TokenTimes:
    """A transformers streamer that timestamps every generated step (the first `put` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(
    path,
    requests: list[BenchRequest],
    batch_size: int,
    *,
    device: str | None = None,
    offload_budget_bytes: int | None = None,
) -> dict:
    """transformers' own `generate` on `requests`, `batch_size` at a time (left-padded, greedy).

    `offload_budget_bytes`: accelerate's `device_map="auto"` with `max_memory` = this cap on GPU 0
    (the rest on the CPU, copied every forward): the slow baseline. None: fully on the device.
    Per request TTFT/TPOT/E2E come from a streamer's timestamps of each generated step.
    """
    from ..models.loader import resolve_device

    dev = resolve_device(device)
    if offload_budget_bytes is not None and dev.type != "cuda":
        raise ConfigError("hf-offload needs CUDA (accelerate offloads from the host to a GPU)")
    free_device()
    model, cfg, dtype, load_s = _load_hf(path, dev, offload_budget_bytes)
    pad = cfg.pad_token_id if isinstance(cfg.pad_token_id, int) else 0
    in_dev = torch.device("cuda", dev.index or 0) if dev.type == "cuda" else dev
    try:
        # warm-up. transformers' attention may be cuDNN's, which builds a graph per (batch, query, KV)
        # shape on first use, so on the GPU the first batch runs whole, untimed: the measured run then
        # reuses those shapes (a steady state, the baseline's best case). hf-offload (~1 s per token)
        # and the CPU get the short warm-up.
        full = offload_budget_bytes is None and torch.cuda.is_available()
        first = requests[:batch_size]
        warm = first if full else [BenchRequest(r.prompt_ids[:16], 2) for r in first]
        _hf_generate(model, warm, pad, in_dev)
        _sync()
        peak_with_load = _peak_bytes()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        records = []
        start = time.perf_counter()
        for b in range(0, len(requests), batch_size):
            chunk = requests[b : b + batch_size]
            streamer = _TokenTimes()
            _hf_generate(model, chunk, pad, in_dev, streamer)
            _sync()
            records += _hf_records(chunk, streamer.times, start)
        duration = time.perf_counter() - start
        name = "hf-offload" if offload_budget_bytes is not None else "hf"
        return {
            "engine": name,
            "policy": name,
            "budget_bytes": offload_budget_bytes,
            "device": str(dev),
            "dtype": str(dtype).removeprefix("torch."),
            "load_s": load_s,
            "summary": summarize(records, duration),
            "peak_gpu_bytes": _peak_bytes(),
            "peak_gpu_bytes_with_load": peak_with_load,
            "requests": records,
        }
    finally:
        model = None  # dropping the module frees the device
        free_device()


def _load_hf(path, dev: torch.device, offload_budget_bytes: int | None):
    """transformers' model on `dev` (or offloaded by accelerate under the cap): (model, config, dtype,
    load seconds)."""
    from transformers import AutoModelForCausalLM

    from ..models.checkpoint import load_config
    from ..models.loader import resolve_dtype

    cfg = load_config(Path(path))
    dtype = resolve_dtype("auto", cfg, dev)
    kwargs: dict = {"dtype": dtype}
    if offload_budget_bytes is not None:
        kwargs.update(device_map="auto", max_memory={dev.index or 0: offload_budget_bytes, "cpu": 200 << 30})
    elif dev.type == "cuda":
        kwargs["device_map"] = str(dev)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
    load_s = time.perf_counter() - t0
    if offload_budget_bytes is None and dev.type == "cpu":
        model.to(dev)
    return model, cfg, dtype, load_s


def _hf_generate(model, chunk: list[BenchRequest], pad: int, in_dev: torch.device, streamer=None) -> None:
    """Greedy `generate` of one left-padded batch, exactly the longest output length for every row."""
    width = max(len(r.prompt_ids) for r in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros((len(chunk), width), dtype=torch.long)
    for i, r in enumerate(chunk):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids) :] = 1
    n = max(r.output_len for r in chunk)
    with torch.inference_mode():
        model.generate(
            input_ids=ids.to(in_dev),
            attention_mask=mask.to(in_dev),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
            streamer=streamer,
        )


def _hf_records(chunk: list[BenchRequest], t: list[float], start: float) -> list[dict]:
    """Per-request records from the step timestamps `t` of one batch (offline: all arrived at `start`)."""
    records = []
    for r in chunk:
        n = min(r.output_len, len(t))
        records.append(
            {
                "arrival_s": 0.0,
                "prompt_len": len(r.prompt_ids),
                "output_len": n,
                "requested_output_len": r.output_len,
                "finish_reason": "length",
                "ttft_s": t[0] - start if t else None,
                "tpot_s": (t[n - 1] - t[0]) / (n - 1) if n > 1 else None,
                "e2e_s": t[n - 1] - start if n else None,
            }
        )
    return records


# -- batch-1 decode ----------------------------------------------------------------------------------------
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
    KV size, first launches) fall outside the measurement: a shorter warm-up left the first
    configuration of a process 3x slower than the same configuration run again."""
    import moetide

    free_device()
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
        "peak_gpu_bytes": _peak_bytes() or 0,
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
        "kv_cache": llm.engine.kv_stats(),
    }
    llm.close()
    del llm
    free_device()
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

    free_device()
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
    # warm-up as long as the timed run (see bench_moetide); hf-offload (~1 s/token) keeps it short
    ttft, total = timed_hf_generate(
        model, ids, new_tokens, warmup_tokens=(2 if offload_budget else new_tokens,)
    )
    tpot = (total - ttft) / (new_tokens - 1)
    result = {
        "engine": "hf-offload" if offload_budget else "hf",
        "gpu_memory": offload_budget,
        "experts_implementation": experts_implementation or "default",
        "load_s": round(load_s, 2),
        "ttft_s": ttft,
        "tpot_s": tpot,
        "decode_tok_s": 1.0 / tpot if tpot > 0 else None,
        "new_tokens": new_tokens,
        "peak_gpu_bytes": _peak_bytes() or 0,
    }
    del model
    free_device()
    return result


def timed_hf_generate(
    model, ids: torch.Tensor, new_tokens: int, *, warmup_tokens=(), **gen
) -> tuple[float, float]:
    """transformers' `generate` on `ids (B, S)` (CUDA), after untimed runs of `warmup_tokens` new
    tokens each: (seconds of a one-token run, i.e. TTFT; seconds of a `new_tokens` run)."""
    gen = {"do_sample": False, "eos_token_id": None, "pad_token_id": 2, **gen}
    with torch.inference_mode():
        for n in warmup_tokens:
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **gen)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **gen)
        torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t1
