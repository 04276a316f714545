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
import traceback
from dataclasses import dataclass, field
from pathlib import Path


from ..config import POLICIES, EngineConfig, format_bytes
from ..errors import ConfigError
from ..progress import bar as progress_bar
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


TEMPLATE_MODEL = "(the swept model)"  # the template's model; each run gets the resolved checkpoint
_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


@dataclass(init=False)
class BenchSpec:
    """Everything one `moetide bench` invocation runs: an `EngineConfig` template, the axes swept
    over it (a cross product), the workload and where results go.

    Each moetide run is `engine` with its `policy` (a `policy:lo` / `policy:zero-copy` name also
    sets `on_miss`), `gpu_memory_bytes` (from the `gpu_memory` axis), `max_num_seqs` (the batch size),
    `max_model_len` and `kv_cache_tokens` (what the batch needs) and `model` (the checkpoint the plan
    resolved) replaced. Keyword arguments that name an `EngineConfig` field (`device`, `dtype`,
    `prefetch_distance`, `seed`, `lo_kernel`, ...) set that field of the template.
    """

    engine: EngineConfig
    # the axes
    policies: list[str] = field(default_factory=lambda: ["on-demand"])
    gpu_memory: list[str | None] = field(default_factory=lambda: [None])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    # the model and the workload
    model: str | None = None  # checkpoint directory; None = the demo model (unless `synthetic`)
    synthetic: str | None = None  # a shape of `bench.synthetic.SHAPES`
    synthetic_dir: str = "/tmp/moetide-synthetic"
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
    out: str = "bench-out"
    command: str = ""

    def __init__(self, engine: EngineConfig | None = None, **kwargs) -> None:
        template = {k: kwargs.pop(k) for k in list(kwargs) if k in _ENGINE_FIELDS and k != "model"}
        own = {f.name: f for f in dataclasses.fields(self) if f.name != "engine"}
        unknown = sorted(set(kwargs) - set(own))
        if unknown:
            raise TypeError(f"BenchSpec got unknown field(s): {', '.join(unknown)}")
        self.engine = dataclasses.replace(engine or EngineConfig(model=TEMPLATE_MODEL), **template)
        for name, f in own.items():
            if name in kwargs:
                value = kwargs[name]
            else:
                value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            setattr(self, name, value)
        self.__post_init__()

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
            if policy not in POLICIES or on_miss not in (None, "lo", "zero-copy"):
                raise ConfigError(
                    f"unknown policy {name!r}; choose from {', '.join(POLICIES)}, optionally with"
                    " ':lo' or ':zero-copy' (its --on-miss), e.g. combined:zero-copy"
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
    path = synthetic_path(shape, root, overrides)
    if not synthetic_written(path):
        write_synthetic_checkpoint(shape, path, progress=progress, **(overrides or {}))
    return path


def synthetic_path(shape: str, root: str | Path, overrides: dict | None = None) -> Path:
    name = shape + "".join(f"-{_slug(k)}{v}" for k, v in sorted((overrides or {}).items()))
    return Path(root).expanduser() / name


def synthetic_written(path: Path) -> bool:
    """The tokenizer is written last: its presence means the checkpoint is complete."""
    return (path / "model.safetensors.index.json").is_file() and (path / "tokenizer.json").is_file()


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
            demo_prompt_lengths(count, spec.max_input_len, spec.prompts_file), vocab, spec.engine.seed
        )
    from ..models.checkpoint import load_tokenizer

    return text_prompts(load_tokenizer(model_path), count, spec.max_input_len, spec.prompts_file)


def plan_sweep(spec: BenchSpec, progress: bool = True) -> Plan:
    """Resolve the model, build the requests per batch size and list the runs."""
    from ..models.checkpoint import load_config

    notes: list[str] = []
    trace = _load_trace(spec, notes)
    model_path = _resolve_model(spec, trace, notes, progress)
    vocab = load_config(model_path).vocab_size
    warmup = None
    if trace is not None:
        requests, warmup, trace = _trace_requests(spec, trace, vocab, notes)
    else:
        requests = _workload_requests(spec, model_path, vocab)
    run_list = _run_list(spec, baselines=trace is None and spec.mode == "offline")
    if spec.baselines and (trace is not None or spec.mode == "online"):
        notes.append("transformers baselines run offline without trace replay only; skipped")
    return Plan(model_path, vocab, run_list, requests, warmup, trace, notes)


def _load_trace(spec: BenchSpec, notes: list[str]):
    if spec.trace is None:
        return None
    from ..analysis.trace import Trace

    if not Path(spec.trace).is_file():
        raise ConfigError(f"--trace {spec.trace}: no such file (record one with --record-trace)")
    notes.append(TRACE_NOTE)
    return Trace.load(spec.trace)


def _resolve_model(spec: BenchSpec, trace, notes: list[str], progress: bool) -> Path:
    """The checkpoint to run: --model, the demo model, or a synthetic shape written on first use
    (with a trace, in the trace's routing geometry)."""
    from ..models.loader import resolve_device
    from .host_memory import check_fits

    device = str(resolve_device(spec.engine.device))
    if spec.synthetic is None:
        from ..engine.llm import demo_model_path
        from ..models.checkpoint import load_config

        path = Path(spec.model).expanduser() if spec.model else demo_model_path()
        check_fits(load_config(path), device, spec.engine.dtype, f"moetide bench on {path.name}")
        return path
    from .replay import trace_geometry_overrides
    from .synthetic import SHAPES, synthetic_config

    if spec.synthetic not in SHAPES:
        raise ConfigError(f"unknown synthetic shape {spec.synthetic!r}; choose one of {', '.join(SHAPES)}")
    overrides = {}
    if trace is not None:
        overrides = trace_geometry_overrides(SHAPES[spec.synthetic]["model_type"], trace)
    what = f"moetide bench --synthetic {spec.synthetic}"
    path = synthetic_path(spec.synthetic, spec.synthetic_dir, overrides)
    write_to = None if synthetic_written(path) else path
    check_fits(synthetic_config(spec.synthetic, **overrides), device, spec.engine.dtype, what, write_to)
    notes.append(SYNTHETIC_NOTE if trace is None else TRACE_SYNTHETIC_NOTE)
    return ensure_synthetic(spec.synthetic, spec.synthetic_dir, overrides, progress)


def _trace_requests(spec: BenchSpec, trace, vocab: int, notes: list[str]):
    """({1: measured requests}, warm-up requests, the trace) for a trace replay."""
    from .replay import trace_requests

    all_requests, trace = trace_requests(trace, vocab, seed=spec.engine.seed)
    n_warm = spec.trace_warmup if spec.trace_warmup is not None else max(1, len(all_requests) // 4)
    n_warm = min(n_warm, len(all_requests) - 1)
    measured = all_requests[n_warm:]
    if spec.num_prompts is not None:
        measured = measured[: spec.num_prompts]
    notes.append(
        f"trace: {len(all_requests)} requests, the first {n_warm} replayed as warm-up (not measured);"
        " requests run one at a time (closed loop)"
    )
    return {1: measured}, all_requests[:n_warm] or None, trace


def _workload_requests(spec: BenchSpec, model_path: Path, vocab: int) -> dict[int, list[BenchRequest]]:
    """The requests of each batch size: one batch (offline), or the same arrivals for every size (online)."""
    synthetic, seed = spec.synthetic is not None, spec.engine.seed
    if spec.mode == "online":
        if spec.arrivals is not None:
            rows = read_arrivals_csv(spec.arrivals)
            rows = rows[: spec.num_prompts] if spec.num_prompts else rows
            reqs = requests_from_arrivals(_prompts(spec, model_path, len(rows), synthetic, vocab), rows)
        else:
            n = spec.num_prompts or 32
            prompts = _prompts(spec, model_path, n, synthetic, vocab)
            reqs = build_requests(prompts, spec.output_len, poisson_arrivals(n, spec.rate, seed))
        return dict.fromkeys(spec.batch_sizes, reqs)
    n_max = max(spec.num_prompts or bs for bs in spec.batch_sizes)
    prompts = _prompts(spec, model_path, n_max, synthetic, vocab)
    return {bs: build_requests(prompts[: spec.num_prompts or bs], spec.output_len) for bs in spec.batch_sizes}


def _run_list(spec: BenchSpec, baselines: bool) -> list[dict]:
    """The cross product batch size x budget x policy, each batch size's baselines after it."""
    run_list = []
    for bs in spec.batch_sizes:
        for budget in spec.gpu_memory:
            for policy in spec.policies:
                run = {"engine": "moetide", "policy": policy, "gpu_memory": budget, "batch_size": bs}
                run_list.append(run)
        if not baselines:
            continue
        if "hf" in spec.baselines:
            run_list.append({"engine": "hf", "policy": "hf", "gpu_memory": None, "batch_size": bs})
        if "hf-offload" in spec.baselines:
            for budget in (b for b in spec.gpu_memory if b is not None):
                run_list.append(
                    {"engine": "hf-offload", "policy": "hf-offload", "gpu_memory": budget, "batch_size": bs}
                )
    return run_list


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
    base = dataclasses.replace(
        spec.engine,
        model=str(plan.model_path),
        policy=policy,
        on_miss=on_miss or spec.engine.on_miss,
        max_num_seqs=bs,
        max_model_len=max_len,
        kv_cache_tokens=bs * max_len,  # what this batch needs, reserved inside the budget
        # a replayed prompt prefills whole: the trace's step has all its tokens, a cached prefix less
        prefix_caching=spec.engine.prefix_caching and plan.trace is None,
    )
    return dataclasses.replace(base, gpu_memory_bytes=resolve_budget(run["gpu_memory"], base))


def execute(spec: BenchSpec, plan: Plan, run: dict) -> dict:
    """Run one configuration of the plan; never raises for a failing configuration."""
    result = {"name": run_name(run), **run, "mode": spec.mode}
    try:
        config = _engine_config(spec, plan, run)
        result["budget_bytes"] = config.gpu_memory_bytes
        if run["engine"] == "moetide":  # the spec as this run ran it: its policy, on-miss rule, budget
            result["config"] = {"spec": {**dataclasses.asdict(spec), "engine": dataclasses.asdict(config)}}
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
                device=spec.engine.device,
                offload_budget_bytes=config.gpu_memory_bytes if run["engine"] == "hf-offload" else None,
            )
        result.update({k: v for k, v in out.items() if k not in ("engine", "policy")})
    except KeyboardInterrupt:
        raise
    except Exception as e:  # one failing configuration must not lose the sweep
        result["error"] = runs.one_line_error(e)
        result["traceback"] = traceback.format_exc(limit=-12)  # the run file keeps where it failed
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
        "lo_run_rate": m.get("lo_runs", 0) / max(1, m.get("experts_used", 0)),
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
    bar = progress_bar(plan.runs, desc="bench", unit="run", enabled=progress)
    for run in bar:
        bar.set_postfix_str(run_name(run))
        result = execute(spec, plan, run)
        result["config"] = {
            "spec": header["spec"],
            **result.get("config", {}),
            "model_path": header["model_path"],
        }
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
