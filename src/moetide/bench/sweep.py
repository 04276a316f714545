"""`moetide bench`: a sweep over policies x memory budgets x batch sizes (+ transformers baselines).

Every run writes `runs/<name>.json` (config, machine, per-request records, summary, residency
metrics, peak GPU memory) as soon as it ends; `summary.json`, `summary.md` and the plots are
rewritten after each run, so an interrupted sweep keeps what it measured. A configuration that
fails (a budget too small, out of memory) is recorded with its one-line error and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..config import POLICIES, EngineConfig, format_bytes
from ..errors import ConfigError
from . import runs
from ..engine.memory import resolve_budget
from .workload import (
    BenchRequest,
    build_requests,
    demo_prompt_lengths,
    poisson_arrivals,
    random_prompts,
    read_arrivals_csv,
    requests_from_arrivals,
    text_prompts,
)

SYNTHETIC_NOTE = (
    "random-weight model: its routers route near-uniformly, the hardest case for any expert predictor;"
    " these runs measure residency, transfer and compute costs, not prediction quality"
)
TRACE_NOTE = (
    "trace-driven: routing recorded on a real model replayed onto a model of the same routing geometry"
    " (layers, experts, top-k)"
)
TRACE_SYNTHETIC_NOTE = (
    "the replay target is a random-weight model with the named shape's expert sizes: prediction is"
    " measured on real routing at real transfer costs"
)
BASELINES = ("hf", "hf-offload")


@dataclass
class BenchSpec:
    """Everything one `moetide bench` invocation sweeps. Lists are swept as a cross product."""

    model: str | None = None  # checkpoint directory; None = the demo model (unless `synthetic`)
    synthetic: str | None = None  # a shape of `bench.synthetic.SHAPES`
    synthetic_dir: str = "/tmp/moetide-synthetic"
    policies: list[str] = field(default_factory=lambda: ["on-demand"])
    gpu_memory: list[str | None] = field(default_factory=lambda: [None])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    output_len: int = 32
    num_prompts: int | None = None  # None: one batch per run (offline) / 32 requests (online)
    max_input_len: int = 256
    mode: str = "offline"
    rate: float | None = None
    arrivals: str | None = None
    prompts_file: str | None = None
    baselines: list[str] = field(default_factory=list)
    hf_offload_output_len: int | None = 8
    trace: str | None = None
    trace_warmup: int | None = None
    device: str | None = None
    dtype: str = "auto"
    lo_precision: str = "auto"
    on_miss: str = "lo"
    prefetch_distance: int = 2
    precision_options: dict = field(
        default_factory=dict
    )  # EngineConfig's hi_precision, host_versions, lo_kernel
    seed: int = 0
    out: str = "bench-out"
    command: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("offline", "online"):
            raise ConfigError(f"--mode must be offline or online, got {self.mode!r}")
        if self.mode == "online" and (self.rate is None) == (self.arrivals is None):
            raise ConfigError("online mode needs exactly one of --rate R (Poisson) or --arrivals CSV")
        if self.mode == "offline" and (self.rate is not None or self.arrivals is not None):
            raise ConfigError("--rate and --arrivals belong to --mode online")
        if any(b < 1 for b in self.batch_sizes) or not self.batch_sizes:
            raise ConfigError("--batch-size needs positive integers, e.g. 1,8,32")
        if self.output_len < 1 or self.max_input_len < 1:
            raise ConfigError("--output-len and --max-input-len must be >= 1")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError("--num-prompts must be >= 1")
        if not self.policies and not self.baselines:
            raise ConfigError("nothing to run: give --policy and/or --baselines")
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise ConfigError(f"unknown baseline {unknown[0]!r}; choose from {', '.join(BASELINES)}")
        if self.trace is not None:
            if self.batch_sizes != [1]:
                raise ConfigError(
                    "trace replay runs at batch 1 (one traced request at a time); use --batch-size 1"
                )
            if self.mode != "offline":
                raise ConfigError("trace replay runs offline (the trace fixes the requests)")
        if self.model is not None and self.synthetic is not None:
            raise ConfigError("give --model or --synthetic, not both")
        for name in self.policies:
            policy, on_miss = split_policy(name)
            if policy not in POLICIES or on_miss not in (None, "lo", "stall"):
                raise ConfigError(
                    f"unknown policy {name!r}; choose from {', '.join(POLICIES)}, optionally with"
                    " ':lo' or ':stall' (its --on-miss), e.g. combined:lo"
                )


def _slug(text: str) -> str:
    text = text.replace("%", "pct").replace(":", "-")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "x"


def split_policy(name: str) -> tuple[str, str | None]:
    """`"combined:lo"` -> ("combined", "lo"): a policy with its own --on-miss; plain names -> (name, None)."""
    policy, _, on_miss = name.partition(":")
    return policy, on_miss or None


def ensure_synthetic(
    shape: str, root: str | Path, overrides: dict | None = None, progress: bool = True
) -> Path:
    """The synthetic checkpoint of `shape` (+ overrides) under `root`, written on first use only."""
    from .synthetic import SHAPES, write_synthetic_checkpoint

    if shape not in SHAPES:
        raise ConfigError(f"unknown synthetic shape {shape!r}; choose one of {', '.join(SHAPES)}")
    name = shape + "".join(f"-{_slug(k)}{v}" for k, v in sorted((overrides or {}).items()))
    path = Path(root).expanduser() / name
    # the tokenizer is written last: its presence means the checkpoint is complete
    if not ((path / "model.safetensors.index.json").is_file() and (path / "tokenizer.json").is_file()):
        write_synthetic_checkpoint(shape, path, progress=progress, **(overrides or {}))
    return path


@dataclass
class Plan:
    """The sweep resolved: model path, requests per batch size, the list of runs."""

    model_path: Path
    vocab_size: int
    runs: list[dict]
    requests: dict[int, list[BenchRequest]]
    warmup_requests: list[BenchRequest] | None = None
    trace: object = None
    notes: list[str] = field(default_factory=list)


def _prompts(spec: BenchSpec, model_path: Path, count: int, synthetic: bool, vocab: int) -> list[list[int]]:
    if synthetic:
        return random_prompts(
            demo_prompt_lengths(count, spec.max_input_len, spec.prompts_file), vocab, spec.seed
        )
    from ..models.checkpoint import load_tokenizer

    return text_prompts(load_tokenizer(model_path), count, spec.max_input_len, spec.prompts_file)


def plan_sweep(spec: BenchSpec, progress: bool = True) -> Plan:
    from ..engine.llm import demo_model_path
    from ..models.checkpoint import load_config

    notes: list[str] = []
    trace = None
    if spec.trace is not None:
        from ..policies.trace import Trace

        if not Path(spec.trace).is_file():
            raise ConfigError(f"--trace {spec.trace}: no such file (record one with --record-trace)")
        trace = Trace.load(spec.trace)
        notes.append(TRACE_NOTE)
    if spec.synthetic is not None:
        from .replay import trace_geometry_overrides
        from .synthetic import SHAPES

        overrides = {}
        if trace is not None and spec.synthetic in SHAPES:
            overrides = trace_geometry_overrides(SHAPES[spec.synthetic]["model_type"], trace)
        model_path = ensure_synthetic(spec.synthetic, spec.synthetic_dir, overrides, progress)
        notes.append(SYNTHETIC_NOTE if trace is None else TRACE_SYNTHETIC_NOTE)
    else:
        model_path = Path(spec.model).expanduser() if spec.model else demo_model_path()
    cfg = load_config(model_path)
    vocab = cfg.vocab_size
    requests: dict[int, list[BenchRequest]] = {}
    warmup = None
    if trace is not None:
        from .replay import trace_requests

        all_requests, trace = trace_requests(trace, vocab, seed=spec.seed)
        n_warm = spec.trace_warmup if spec.trace_warmup is not None else max(1, len(all_requests) // 4)
        n_warm = min(n_warm, len(all_requests) - 1)
        measured = all_requests[n_warm:]
        if spec.num_prompts is not None:
            measured = measured[: spec.num_prompts]
        warmup = all_requests[:n_warm] or None
        requests[1] = measured
        notes.append(
            f"trace: {len(all_requests)} requests, the first {n_warm} replayed as warm-up (not measured);"
            " requests run one at a time (closed loop)"
        )
    elif spec.mode == "online":
        if spec.arrivals is not None:
            rows = read_arrivals_csv(spec.arrivals)
            rows = rows[: spec.num_prompts] if spec.num_prompts else rows
            prompts = _prompts(spec, model_path, len(rows), spec.synthetic is not None, vocab)
            reqs = requests_from_arrivals(prompts, rows)
        else:
            n = spec.num_prompts or 32
            prompts = _prompts(spec, model_path, n, spec.synthetic is not None, vocab)
            reqs = build_requests(prompts, spec.output_len, poisson_arrivals(n, spec.rate, spec.seed))
        for bs in spec.batch_sizes:
            requests[bs] = reqs
    else:
        n_max = max(spec.num_prompts or bs for bs in spec.batch_sizes)
        prompts = _prompts(spec, model_path, n_max, spec.synthetic is not None, vocab)
        for bs in spec.batch_sizes:
            requests[bs] = build_requests(prompts[: spec.num_prompts or bs], spec.output_len)

    run_list = []
    for bs in spec.batch_sizes:
        for budget in spec.gpu_memory:
            for policy in spec.policies:
                run_list.append(
                    {"engine": "moetide", "policy": policy, "gpu_memory": budget, "batch_size": bs}
                )
        if trace is None and spec.mode == "offline":
            if "hf" in spec.baselines:
                run_list.append({"engine": "hf", "policy": "hf", "gpu_memory": None, "batch_size": bs})
            if "hf-offload" in spec.baselines:
                for budget in spec.gpu_memory:
                    if budget is not None:
                        run_list.append(
                            {
                                "engine": "hf-offload",
                                "policy": "hf-offload",
                                "gpu_memory": budget,
                                "batch_size": bs,
                            }
                        )
    if spec.baselines and (trace is not None or spec.mode == "online"):
        notes.append("transformers baselines run offline without trace replay only; skipped")
    return Plan(model_path, vocab, run_list, requests, warmup, trace, notes)


def run_name(run: dict) -> str:
    budget = run["gpu_memory"] or "nocap"
    return _slug(f"bs{run['batch_size']:03d}_{budget}_{run['policy']}")


def _engine_config(spec: BenchSpec, plan: Plan, run: dict) -> EngineConfig:
    reqs = plan.requests[run["batch_size"]]
    max_len = max(len(r.prompt_ids) + r.output_len for r in reqs) + 1
    if plan.warmup_requests:
        max_len = max(max_len, *(len(r.prompt_ids) + r.output_len + 1 for r in plan.warmup_requests))
    bs = run["batch_size"]
    policy, on_miss = split_policy(run["policy"]) if run["engine"] == "moetide" else ("on-demand", None)
    base = EngineConfig(
        model=str(plan.model_path),
        device=spec.device,
        dtype=spec.dtype,
        policy=policy,
        lo_precision=spec.lo_precision,
        on_miss=on_miss or spec.on_miss,
        prefetch_distance=spec.prefetch_distance,
        max_num_seqs=bs,
        max_model_len=max_len,
        kv_cache_tokens=bs * max_len,  # what this batch needs, reserved inside the budget
        seed=spec.seed,
        **spec.precision_options,
    )
    return dataclasses.replace(base, gpu_memory_bytes=resolve_budget(run["gpu_memory"], base))


def execute(spec: BenchSpec, plan: Plan, run: dict) -> dict:
    """Run one configuration of the plan; never raises for a failing configuration."""
    result = {"name": run_name(run), **run, "mode": spec.mode}
    try:
        config = _engine_config(spec, plan, run)
        result["budget_bytes"] = config.gpu_memory_bytes
        reqs = plan.requests[run["batch_size"]]
        if run["engine"] == "moetide":
            out = runs.run_moetide(
                config,
                reqs,
                online=spec.mode == "online",
                trace=plan.trace,
                warmup_requests=plan.warmup_requests,
            )
        else:
            if run["engine"] == "hf-offload" and spec.hf_offload_output_len:
                reqs = [
                    dataclasses.replace(r, output_len=min(r.output_len, spec.hf_offload_output_len))
                    for r in reqs
                ]
            out = runs.run_hf(
                plan.model_path,
                reqs,
                run["batch_size"],
                device=spec.device,
                offload_budget_bytes=config.gpu_memory_bytes if run["engine"] == "hf-offload" else None,
            )
        result.update({k: v for k, v in out.items() if k not in ("engine", "policy")})
    except KeyboardInterrupt:
        raise
    except Exception as e:  # one failing configuration must not lose the sweep
        result["error"] = runs.one_line_error(e)
        runs.free_device()
    return result


def summary_row(result: dict) -> dict:
    """The flat numbers of one run (what `summary.json`, `summary.md` and the plots use)."""
    s = result.get("summary") or {}
    m = result.get("metrics") or {}

    def dist(key, stat):
        d = s.get(key) or {}
        return d.get(stat)

    return {
        "name": result["name"],
        "engine": result["engine"],
        "policy": result["policy"],
        "gpu_memory": result["gpu_memory"],
        "budget_bytes": result.get("budget_bytes"),
        "batch_size": result["batch_size"],
        "mode": result["mode"],
        "requests": s.get("requests"),
        "output_tokens": s.get("output_tokens"),
        "throughput_tok_s": s.get("throughput_tok_s"),
        "ttft_mean_s": dist("ttft_s", "mean"),
        "ttft_p50_s": dist("ttft_s", "p50"),
        "ttft_p90_s": dist("ttft_s", "p90"),
        "ttft_p99_s": dist("ttft_s", "p99"),
        "tpot_mean_s": dist("tpot_s", "mean"),
        "tpot_p50_s": dist("tpot_s", "p50"),
        "tpot_p90_s": dist("tpot_s", "p90"),
        "tpot_p99_s": dist("tpot_s", "p99"),
        "e2e_mean_s": dist("e2e_s", "mean"),
        "e2e_p50_s": dist("e2e_s", "p50"),
        "e2e_p90_s": dist("e2e_s", "p90"),
        "e2e_p99_s": dist("e2e_s", "p99"),
        "hit_rate": m.get("hit_rate"),
        "stall_s": m.get("stall_s"),
        "bytes_h2d": m.get("bytes_h2d"),
        "promotions": m.get("promotions"),
        "demotions": m.get("demotions"),
        "lo_runs": m.get("lo_runs"),
        "prefetches_issued": m.get("prefetches_issued"),
        "prefetches_used": m.get("prefetches_used"),
        "peak_gpu_bytes": result.get("peak_gpu_bytes"),
        "peak_device_bytes_residency": m.get("peak_device_bytes"),
        "error": result.get("error"),
    }


def run_sweep(spec: BenchSpec, *, progress: bool = True) -> dict:
    """Plan and run the whole sweep; returns the summary (also written under `spec.out`).

    `progress`: bars on a terminal, one plain line otherwise; each run's result line either way."""
    from ..engine.llm import progress_bars
    from .report import write_markdown, write_plots

    out = Path(spec.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    progress = progress_bars(progress, f"bench: writing to {out}")
    plan = plan_sweep(spec, progress=progress)
    machine = runs.machine_info()
    header = {
        "command": spec.command,
        "spec": dataclasses.asdict(spec),
        "model_path": str(plan.model_path),
        "machine": machine,
        "notes": plan.notes,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    rows: list[dict] = []
    bar = tqdm(plan.runs, desc="bench", unit="run", disable=not progress, file=sys.stderr)
    for run in bar:
        bar.set_postfix_str(run_name(run))
        result = execute(spec, plan, run)
        result["config"] = {"spec": header["spec"], "model_path": header["model_path"]}
        result["machine"] = machine
        result["notes"] = plan.notes
        (out / "runs" / f"{result['name']}.json").write_text(json.dumps(result, indent=2, default=str))
        row = summary_row(result)
        rows.append(row)
        bar.write(_describe(row), file=sys.stderr)
        summary = {**header, "runs": rows}
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        write_markdown(summary, out / "summary.md")
        write_plots(rows, out)
    bar.close()
    return {**header, "runs": rows}


def _describe(row: dict) -> str:
    if row.get("error"):
        return f"{row['name']}: error: {row['error']}"
    tput = row["throughput_tok_s"] or 0.0
    tpot = (row["tpot_mean_s"] or 0.0) * 1000
    ttft = (row["ttft_mean_s"] or 0.0) * 1000
    hit = f" hit {row['hit_rate']:.1%}" if row.get("hit_rate") is not None else ""
    moved = f" moved {format_bytes(row['bytes_h2d'])}" if row.get("bytes_h2d") is not None else ""
    return (
        f"{row['name']}: {tput:.1f} tok/s | TTFT {ttft:.1f} ms | TPOT {tpot:.1f} ms |"
        f" {row['output_tokens']} tok{hit}{moved}"
    )
