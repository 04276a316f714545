"""`moetide eval`: held-out loss per workload against stored bits per expert weight, for every static
precision of the registry and for dynamic ladders (hot experts in one format over a resident cold one).

Configurations (all run through moetide's own loader and managed experts):

    bf16        every expert in hi precision (`no-offload`; on the CPU the hi version is fp32 computed
                from the bf16 checkpoint, i.e. the same weights without rounding)
    int4, int2  every expert in that format (`static-int4`, `static-int2`)
    int2+4, ... any other low-bit format of `store.formats.FORMATS`: every expert runs its resident
                version of that format (`dynaexq` with the scheduler never updating, so nothing is
                promoted; `lo_share` = 1 in the record shows it)
    HOT>COLD    a dynamic ladder, e.g. bf16>int2, int4>int2+4: DynaExq (`dynaexq`, hi = HOT,
                lo = COLD) at expert-memory budgets; every expert keeps its COLD version resident and
                `n_hi` experts also hold a HOT copy, chosen at run time from router statistics.
                `dynamic` and `dynamic-int4` are the names of bf16>int2 and int4>int2.
    A>B>...>Z   a deeper ladder, e.g. int4>int2+4>int2: every expert keeps Z resident; the memory
                above it is split over the tiers A..Y as the engine's budget plan splits it
                (`residency.budget.split_ladder`: equal bytes per tier, counted here in the bf16
                layout), the hottest experts in A, the next in B, ...

Expert memory and bits per expert weight are counted from the bytes the store keeps in the bf16
layout a GPU holds (`models.info.expert_bytes`: scales, offsets and alignment padding included),
whatever the device the evaluation runs on, so a budget means the same number of hot experts on the
CPU and on the GPU. A dynamic budget M gives `n_hi = (M - N * cold_bytes) // hot_bytes` hot experts
(N = layers x experts; a deeper ladder: `split_ladder` of M - N * cold_bytes), split over the layers
as evenly as they go (`dynaexq.per_layer_hi_slots`); the device budget is then exactly the fixed part
+ N cold slots + those hot slots in the device's own layout (and the engine is given the tiers'
sizes), so the memory plan holds what was asked.

Budgets (`--budgets`): `mid` = halfway between static int2 and static int4 (the quality target's
point), `int4` = the same memory as static int4, or a fraction f in (0, 1) = cold + f x (bf16 - cold).

Data: the shipped held-out ShareGPT conversations, never trained on. Two splits:
  * `first` = N (the issue protocol, `--first 128`): the first N held-out conversations (file order,
    every workload) are measured; the next `calib_convs` calibrate the dynamic ladders.
  * otherwise: the first `calib_convs` calibrate, and the next `max_convs` of each workload (code,
    non-english, chat) are measured.
Calibration conversations are fed through the model so the DynaExq scheduler counts router
selections, then one update is forced and its promotions applied (`ResidencyManager.settle()`); they
are never measured. Each workload is scored on its own (`data.heldout_loss`: chat-templated, first
`max_len` tokens, token-weighted nats/token); "all" is the token-weighted mean over the measured
conversations. `loss_increase` is each loss minus the bf16 configuration's (the checkpoint's
precision). With `adapt` (default), the scheduler keeps running during measurement (time-based
updates, promotions copied in the background), as in serving; without it, the hot set stays as
calibrated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..store.formats import FORMATS, parse_ladder, precision_names, user_name
from .report import (  # noqa: F401 - re-exported: the report is part of `moetide eval`'s API
    LADDER_ALIASES,
    SUMMARY_KEYS,
    WORKLOADS,
    add_loss_increase,
    gap_recovered,
    summarize,
    write_plot,
    write_table,
)

STATIC = precision_names()  # "bf16", then every low-bit format, most bytes first
STATIC_POLICY = {"bf16": "no-offload", "int4": "static-int4", "int2": "static-int2"}
# calibrated formats ("-gptq") only when asked: their first use runs a calibration pass (cached)
UNCALIBRATED = tuple(c for c in STATIC if c == "bf16" or not FORMATS[c].calibration)
DEFAULT_CONFIGS = (*UNCALIBRATED, "bf16>int2", "int4>int2", "bf16>int2+4", "int4>int2+4")
CONFIGS = (*STATIC, *LADDER_ALIASES)  # names accepted besides any HOT>COLD ladder


def ladder_of(name: str) -> tuple[str, ...] | None:
    """The tiers of a dynamic ladder name, hottest first ("int4>int2+4", "bf16>int4>int2" or an
    alias; "hi" is shown as "bf16"), None for a static one. ConfigError when a part is not a format
    or a tier does not take fewer bytes than the one above it (`store.formats.parse_ladder`)."""
    name = LADDER_ALIASES.get(name, name)
    if ">" not in name:
        return None
    try:
        return tuple(user_name(p) for p in parse_ladder(name))
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass
class EvalSpec:
    model: str | None = None
    device: str | None = None
    dtype: str = "auto"
    configs: list[str] = field(default_factory=lambda: list(DEFAULT_CONFIGS))
    budgets: list[str] = field(default_factory=lambda: ["mid", "int4", "0.25", "0.5"])
    max_convs: int | None = 64  # measured conversations per workload (None = all)
    first: int | None = None  # measure the first N held-out conversations instead (the issue protocol)
    calib_convs: int = 16
    max_len: int = 512
    batch_size: int = 8
    adapt: bool = True
    cache_dir: str | None = None
    out: str = "eval-out"
    command: str = ""

    def __post_init__(self) -> None:
        for c in self.configs:
            if c not in CONFIGS and ">" not in c:
                raise ConfigError(
                    f"unknown config {c!r}; choose from {', '.join(CONFIGS)} or a ladder HOT>COLD"
                )
            ladder_of(c)
        if not self.configs:
            raise ConfigError("--configs is empty")
        for b in self.budgets:
            if b not in ("mid", "int4"):
                try:
                    f = float(b)
                except ValueError:
                    raise ConfigError(f"budget {b!r}: use mid, int4 or a fraction in (0, 1)") from None
                if not 0 < f < 1:
                    raise ConfigError(
                        f"budget {b!r}: a fraction of the way from the cold format to bf16 must be in (0, 1)"
                    )
        if self.calib_convs < 1 and any(ladder_of(c) for c in self.configs):
            raise ConfigError("--calib-convs must be >= 1 for the dynamic configurations")
        if self.max_convs is not None and self.max_convs < 1:
            raise ConfigError("--max-convs must be >= 1")
        if self.first is not None and self.first < 1:
            raise ConfigError("--first must be >= 1")


@dataclass(frozen=True)
class ExpertGeometry:
    """Expert counts and sizes (bytes per expert in the bf16 reference layout, per format)."""

    layers: int
    experts: int
    top_k: int
    intermediate: int
    hidden: int
    ref_bytes: dict  # {"bf16", "int4", "int2+4", "int2", ...}

    @property
    def total(self) -> int:
        return self.layers * self.experts

    def static_bytes(self, precision: str) -> int:
        return self.total * self.ref_bytes[precision]

    def bits_per_weight(self, expert_bytes: float) -> float:
        """Stored bits per expert weight of `expert_bytes` over all experts."""
        return 8 * expert_bytes / (self.total * 3 * self.intermediate * self.hidden)


def expert_geometry(model_path: Path) -> ExpertGeometry:
    """Geometry and reference expert sizes from the checkpoint's config and shard headers."""
    from ..models.info import checkpoint_summary, expert_bytes

    s = checkpoint_summary(model_path)
    return ExpertGeometry(
        s["moe_layers"],
        s["experts"],
        s["top_k"],
        s["expert_intermediate"],
        s["hidden"],
        expert_bytes(s["expert_intermediate"], s["hidden"]),
    )


def dynamic_hi_experts(budget: str, geo: ExpertGeometry, hi: str = "bf16", cold: str = "int2") -> int:
    """Hot experts (all layers) that a dynamic budget buys (each costs a `hi` copy beside its resident
    `cold` one); the engine splits them over the layers (`dynaexq.per_layer_hi_slots`)."""
    return ladder_experts(budget, geo, (hi, cold))[0]


def ladder_experts(budget: str, geo: ExpertGeometry, ladder: tuple[str, ...]) -> list[int]:
    """Experts (all layers) of each tier above the coldest that a dynamic budget buys, hottest first,
    every expert keeping its coldest version: the memory above all-cold split as the engine's plan
    splits it (`split_ladder`, in the bf16 layout's bytes). Two tiers: `(M - N * cold) // hot`."""
    lo2, lo4, all_bf16, all_cold = (geo.static_bytes(p) for p in ("int2", "int4", "bf16", ladder[-1]))
    if budget == "mid":
        memory = (lo2 + lo4) / 2
    elif budget == "int4":
        memory = lo4
    else:
        memory = all_cold + float(budget) * (all_bf16 - all_cold)
    room = max(0, int(memory - all_cold))
    from ..residency.budget import split_ladder

    min_top = geo.top_k if len(ladder) > 2 else 0  # as the engine's plan (two tiers: the whole room)
    return split_ladder(room, tuple(geo.ref_bytes[p] for p in ladder[:-1]), geo.total, min_top)


def split_conversations(
    calib: int, per_workload: int | None, first: int | None = None
) -> tuple[list[dict], dict[str, list[dict]]]:
    """(calibration conversations, {workload: measured conversations}), disjoint, in file order.

    first=N: the first N are measured (grouped by workload) and the next `calib` calibrate;
    otherwise the first `calib` calibrate and the next `per_workload` of each workload are measured."""
    from ..data.sharegpt import heldout_conversations

    convs = heldout_conversations()
    if first is not None:
        calibration, rest = convs[first : first + calib], convs[:first]
        return calibration, {w: [c for c in rest if c["workload"] == w] for w in WORKLOADS}
    calibration, rest = convs[:calib], convs[calib:]
    measured = {w: [c for c in rest if c["workload"] == w] for w in WORKLOADS}
    if per_workload is not None:
        measured = {w: cs[:per_workload] for w, cs in measured.items()}
    return calibration, measured


def _device_budget(
    spec: EvalSpec, model_path: Path, geo: ExpertGeometry, upper: list[int], ladder: tuple[str, ...]
) -> int:
    """Device bytes for a dynaexq run: fixed part + every cold slot + `upper[t]` slots of each tier
    above it (hottest first), in the device's layout."""
    from ..bench.budget import model_bytes
    from ..models.checkpoint import load_config
    from ..models.loader import resolve_device, resolve_dtype
    from ..store import quant

    config = _engine_config(spec, model_path, "dynaexq", None, ladder)
    mb = model_bytes(config)
    dtype = resolve_dtype(config.dtype, load_config(model_path), resolve_device(config.device))

    def nbytes(p: str) -> int:
        return mb.hi_expert_bytes if p == "bf16" else quant.nbytes_for(p, geo.intermediate, geo.hidden, dtype)

    return mb.fixed.total + geo.total * nbytes(ladder[-1]) + sum(n * nbytes(p) for n, p in zip(upper, ladder))


def _engine_config(
    spec: EvalSpec,
    model_path: Path,
    policy: str,
    budget_bytes: int | None,
    ladder: tuple[str, ...] = ("bf16", "int2"),
    upper: list[int] | None = None,
):
    """The engine for one configuration: `ladder` (hottest first), and with `upper` the sizes of its
    tiers above the coldest (the eval's, counted in the bf16 layout)."""
    from ..config import EngineConfig

    return EngineConfig(
        model=str(model_path),
        device=spec.device,
        dtype=spec.dtype,
        policy=policy,
        ladder=ladder,
        ladder_slots=tuple(upper) if upper is not None else None,
        gpu_memory_bytes=budget_bytes,
        max_num_seqs=spec.batch_size,
        max_model_len=spec.max_len,
        kv_cache_tokens=spec.max_len,  # the loss forward uses no engine KV cache; keep the fixed part small
        cache_dir=spec.cache_dir,
    )


def _score(loaded, tokenizer, spec: EvalSpec, measured: dict[str, list[dict]]) -> dict:
    """Loss, perplexity and token count per workload and over all measured conversations."""
    from ..data.sharegpt import heldout_loss

    out = {"loss": {}, "ppl": {}, "tokens": {}, "conversations": {}}
    tot_nll = tot_n = 0.0
    for w in WORKLOADS:
        convs = measured.get(w) or []
        if not convs:
            continue
        _, per = heldout_loss(
            loaded.model,
            tokenizer,
            convs,
            max_len=spec.max_len,
            device=loaded.device,
            per_conversation=True,
            batch_size=spec.batch_size,
        )
        nll, n = sum(s for s, _ in per), sum(k for _, k in per)
        tot_nll += nll
        tot_n += n
        out["loss"][w] = nll / n if n else math.nan
        out["ppl"][w] = math.exp(out["loss"][w]) if n else math.nan
        out["tokens"][w] = n
        out["conversations"][w] = len(convs)
    out["loss"]["all"] = tot_nll / tot_n if tot_n else math.nan
    out["ppl"]["all"] = math.exp(out["loss"]["all"]) if tot_n else math.nan
    out["tokens"]["all"] = int(tot_n)
    out["conversations"]["all"] = sum(out["conversations"].values())
    return out


def config_plan(spec: EvalSpec, model_path: Path, name: str, geo: ExpertGeometry, budget: str | None) -> dict:
    """What one configuration runs: policy, device budget, hot/cold formats, hot experts, expert bytes
    (bf16 layout) and bits per expert weight."""
    ladder = ladder_of(name)
    upper = None
    if ladder is not None:
        upper = ladder_experts(budget, geo, ladder)
        if sum(upper) < geo.layers:
            raise ConfigError(
                f"budget {budget!r} buys {sum(upper)} hot experts, fewer than one per layer; raise it"
            )
        budget_bytes, policy = _device_budget(spec, model_path, geo, upper, ladder), "dynaexq"
        expert_bytes = geo.static_bytes(ladder[-1]) + sum(n * geo.ref_bytes[p] for n, p in zip(upper, ladder))
        tiers, n_hot = ladder, upper[0]
    elif name in STATIC_POLICY:
        tiers, n_hot = (("bf16", "int2"), geo.total) if name == "bf16" else (("bf16", name), 0)
        budget_bytes, policy, expert_bytes = None, STATIC_POLICY[name], geo.static_bytes(name)
    else:  # a format without a static policy: dynaexq that never promotes (every expert runs `name`)
        tiers, n_hot = ("bf16", name), 0
        budget_bytes = _device_budget(spec, model_path, geo, [geo.top_k], tiers)
        policy, expert_bytes = "dynaexq", geo.static_bytes(name)
    return {
        "policy": policy,
        "budget_bytes": budget_bytes,
        "dynamic": ladder is not None,
        "ladder": list(tiers),
        "hot": tiers[0],
        "cold": tiers[-1],
        "hi_experts": n_hot,
        "tier_experts": upper,  # each tier above the coldest, hottest first (dynamic only)
        "hi_precision": tiers[0],
        "expert_bytes": expert_bytes,
        "bits_per_weight": geo.bits_per_weight(expert_bytes),
    }


def _calibrate(loaded, tokenizer, spec: EvalSpec, calibration, residency) -> dict:
    """Count router selections over the calibration conversations, force one scheduler update and
    apply its promotions. Returns the calibration record."""
    from ..data.sharegpt import heldout_loss

    scheduler = loaded.policy
    scheduler.clock = None  # updates only when asked, during calibration
    calib_loss = heldout_loss(
        loaded.model,
        tokenizer,
        calibration,
        max_len=spec.max_len,
        device=loaded.device,
        batch_size=spec.batch_size,
    )
    loaded.runtime.flush_observations()  # steps reach the policy one step late: the last one too
    scheduler.update()
    residency.settle()
    if spec.adapt:
        scheduler.clock = time.monotonic
    return {
        "conversations": len(calibration),
        "loss": calib_loss,
        "resident": residency.resident_counts(),
        "n_hi_per_layer": list(scheduler.n_hi),
        "n_per_layer": {name: row.tolist() for name, row in zip(scheduler.tiers, scheduler.capacity)},
    }


def evaluate_config(
    spec: EvalSpec,
    model_path: Path,
    name: str,
    geo: ExpertGeometry,
    calibration,
    measured,
    *,
    budget: str | None = None,
) -> dict:
    """Load one configuration, calibrate it if dynamic, score it. Returns its JSON record."""
    from ..bench.runs import close_engine, free_device
    from ..engine.llm import build_engine
    from ..policies.dynaexq import DynaExqScheduler

    record: dict = {"name": name if budget is None else f"{name}@{budget}", "config": name, "budget": budget}
    plan = config_plan(spec, model_path, name, geo, budget)
    record.update(plan)
    upper = plan["tier_experts"] if len(plan["ladder"]) > 2 else None  # (two tiers: the plan's own split)
    ladder = tuple(plan["ladder"])
    config = _engine_config(spec, model_path, plan["policy"], plan["budget_bytes"], ladder, upper)
    free_device()
    t0 = time.perf_counter()
    loaded, _, tokenizer = build_engine(config, progress=False)
    try:
        residency = loaded.runtime.residency
        memory_plan = getattr(residency, "plan", None)
        record["plan"] = memory_plan.describe() if memory_plan is not None else None
        record["device"] = str(loaded.device)
        if plan["dynamic"]:
            record["calibration"] = _calibrate(loaded, tokenizer, spec, calibration, residency)
        elif isinstance(loaded.policy, DynaExqScheduler):
            loaded.policy.clock = None  # a static format: nothing is ever promoted
        loaded.runtime.metrics.reset()
        record.update(_score(loaded, tokenizer, spec, measured))
        if isinstance(loaded.policy, DynaExqScheduler):
            record["scheduler"] = loaded.policy.stats()
            record["resident_after"] = residency.resident_counts()
            m = loaded.runtime.metrics.snapshot()
            record["lo_share"] = m["lo_runs"] / m["experts_used"] if m["experts_used"] else None
        record["seconds"] = time.perf_counter() - t0
        return record
    finally:
        close_engine(loaded)
        del loaded
        free_device()


def eval_jobs(spec: EvalSpec) -> list[tuple[str, str | None]]:
    """(config, budget) pairs in run order: static formats first (bf16 is every loss's baseline)."""
    jobs = [(c, None) for c in STATIC if c in spec.configs]
    jobs += [(c, None) for c in spec.configs if c not in STATIC and ladder_of(c) is None]
    for config in spec.configs:
        if ladder_of(config) is not None:
            # dynamic-int4 (int4>int2) was only ever run at the halfway point; kept as it was
            budgets = ["mid"] if config == "dynamic-int4" else spec.budgets
            jobs += [(config, b) for b in budgets]
    return jobs


def _run_one(spec, model_path, name, budget, geo, calibration, measured, bar) -> dict:
    try:
        r = evaluate_config(spec, model_path, name, geo, calibration, measured, budget=budget)
        bar.write(
            f"{r['name']}: loss {r['loss']['all']:.4f} ("
            + ", ".join(f"{w} {r['loss'][w]:.4f}" for w in WORKLOADS if w in r["loss"])
            + f") at {r['bits_per_weight']:.3f} bits/weight",
            file=sys.stderr,
        )
    except KeyboardInterrupt:
        raise
    except Exception as e:  # a failing configuration is recorded; the others still run
        from ..bench.runs import one_line_error

        r = {
            "name": name if budget is None else f"{name}@{budget}",
            "config": name,
            "budget": budget,
            "error": one_line_error(e),
        }
        bar.write(f"{r['name']}: error: {r['error']}", file=sys.stderr)
    return r


def run_eval(spec: EvalSpec, *, progress: bool = True) -> dict:
    from ..bench.runs import machine_info
    from ..engine.llm import demo_model_path
    from ..progress import bar as progress_bar

    model_path = Path(spec.model).expanduser() if spec.model else demo_model_path()
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    geo = expert_geometry(model_path)
    calibration, measured = split_conversations(spec.calib_convs, spec.max_convs, spec.first)
    report = {
        "command": spec.command,
        "spec": dataclasses.asdict(spec),
        "model_path": str(model_path),
        "machine": machine_info(),
        "geometry": dataclasses.asdict(geo),
        "calibration_conversations": len(calibration),
        "measured_conversations": {w: len(c) for w, c in measured.items()},
        "results": [],
    }
    jobs = eval_jobs(spec)
    bar = progress_bar(jobs, desc="eval", unit="config", enabled=progress)
    for name, budget in bar:
        bar.set_postfix_str(name if budget is None else f"{name}@{budget}")
        report["results"].append(_run_one(spec, model_path, name, budget, geo, calibration, measured, bar))
        add_loss_increase(report["results"])
        report["summary"] = summarize(report["results"])
        report["gap_recovered"] = gap_recovered(report["results"])
        report["gap_recovered_int4"] = gap_recovered(report["results"], config="dynamic-int4")
        (out / "eval.json").write_text(json.dumps(report, indent=2, default=str))
        write_table(report, out / "eval.md")
        write_plot(report, out / "quality_vs_bits.png")
    bar.close()
    return report
