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
"""

from __future__ import annotations

import gc
import platform
import time
from pathlib import Path

import torch

from ..config import EngineConfig
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
        if warmup_requests:
            drive_engine(engine, warmup_requests, closed_loop=trace is not None)
        else:
            if replay is not None:
                replay.enabled = False
            # a full batch of short requests: the batch's shapes are compiled before measuring
            batch = requests[: config.max_num_seqs]
            drive_engine(engine, [BenchRequest(r.prompt_ids[:16], 2) for r in batch])
            if replay is not None:
                replay.enabled = True
        _sync()
        peak_with_load = _peak_bytes()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        metrics = loaded.runtime.metrics
        metrics.reset()
        records, duration = drive_engine(engine, requests, online=online, closed_loop=trace is not None)
        _sync()
        residency = loaded.runtime.residency
        plan = getattr(residency, "plan", None)
        snapshot = metrics.snapshot(
            residency.resident_counts() if hasattr(residency, "resident_counts") else None
        )
        result = {
            "engine": "moetide",
            "policy": config.policy,
            "budget_bytes": config.gpu_memory_bytes,
            "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "load_s": load_s,
            "engine_options": {
                "on_miss": config.on_miss,
                "prefetch_distance": config.prefetch_distance,
                "hi_precision": config.hi_precision,
                "host_versions": list(config.host_versions) if config.host_versions is not None else None,
                "lo_kernel": config.lo_kernel,
                "cuda_graphs": config.cuda_graphs,
                "searcher": config.searcher,
                # the largest decode batch the fused lo kernel computes (0: dequant everywhere)
                "lo_kernel_max_tokens": loaded.runtime.lowbit_max_tokens
                if loaded.runtime.lowbit_kernel
                else 0,
            },
            "cuda_graph_stats": engine.runner.graph_stats(),
            "plan": plan.describe() if plan is not None else None,
            "hi_slots": plan.hi_slots if plan is not None else None,
            "lo_slots": plan.lo_slots if plan is not None else None,
            "fixed_bytes": plan.fixed.total if plan is not None else None,
            "summary": summarize(records, duration),
            "metrics": snapshot,
            "policy_stats": loaded.policy.stats()
            if loaded.policy is not None and hasattr(loaded.policy, "stats")
            else {},
            "peak_gpu_bytes": _peak_bytes(),
            "peak_gpu_bytes_with_load": peak_with_load,
            "requests": records,
        }
        if replay is not None:
            result["replay"] = replay.stats()
        return result
    finally:
        if replay is not None:
            replay.remove()
        close_engine(loaded)
        del loaded, engine
        free_device()


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
    from transformers import AutoModelForCausalLM

    from ..models.checkpoint import load_config
    from ..models.loader import resolve_device, resolve_dtype

    dev = resolve_device(device)
    if offload_budget_bytes is not None and dev.type != "cuda":
        raise ConfigError("hf-offload needs CUDA (accelerate offloads from the host to a GPU)")
    cfg = load_config(Path(path))
    dtype = resolve_dtype("auto", cfg, dev)
    kwargs: dict = {"dtype": dtype}
    if offload_budget_bytes is not None:
        kwargs.update(device_map="auto", max_memory={dev.index or 0: offload_budget_bytes, "cpu": 200 << 30})
    elif dev.type == "cuda":
        kwargs["device_map"] = str(dev)
    free_device()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()
    load_s = time.perf_counter() - t0
    if offload_budget_bytes is None and dev.type == "cpu":
        model.to(dev)
    pad = cfg.pad_token_id if isinstance(cfg.pad_token_id, int) else 0
    in_dev = torch.device("cuda", dev.index or 0) if dev.type == "cuda" else dev

    def generate(chunk: list[BenchRequest], streamer=None):
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

    try:
        # warm-up. transformers' attention may be cuDNN's, which builds a graph per (batch, query, KV)
        # shape on first use, so on the GPU the first batch runs whole, untimed: the measured run then
        # reuses those shapes (a steady state, the baseline's best case). hf-offload (~1 s per token)
        # and the CPU get the short warm-up.
        full = offload_budget_bytes is None and torch.cuda.is_available()
        warm = (
            requests[:batch_size]
            if full
            else [BenchRequest(r.prompt_ids[:16], 2) for r in requests[:batch_size]]
        )
        generate(warm)
        _sync()
        peak_with_load = _peak_bytes()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        records = []
        start = time.perf_counter()
        for b in range(0, len(requests), batch_size):
            chunk = requests[b : b + batch_size]
            streamer = _TokenTimes()
            generate(chunk, streamer)
            _sync()
            t = streamer.times
            for r in chunk:  # offline: every request of the run arrived at `start`
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
        duration = time.perf_counter() - start
        return {
            "engine": "hf-offload" if offload_budget_bytes is not None else "hf",
            "policy": "hf-offload" if offload_budget_bytes is not None else "hf",
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
        model = None  # the closure above holds the name; dropping the module frees the device
        free_device()
