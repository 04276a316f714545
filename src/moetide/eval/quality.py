"""`moetide eval`: held-out perplexity per workload against expert memory, static and dynamic precision.

Configurations (all run through moetide's own loader and managed experts):

    bf16      every expert in hi precision (`no-offload`; on the CPU the hi version is fp32 computed
              from the bf16 checkpoint, i.e. the same weights without rounding)
    int4      every expert int4 (`static-int4`)
    int2      every expert int2 (`static-int2`)
    dynamic   DynaExq (`dynaexq`, hi = bf16, lo = int2) at expert-memory budgets between all-int2
              and all-bf16: every expert keeps its int2 version resident, and `n_hi` experts per layer
              also hold a bf16 copy, chosen at run time from router statistics

Expert memory is counted in the bf16 layout a GPU holds (`models.info.expert_bytes`), whatever the
device the evaluation runs on, so a budget means the same number of hi experts on the CPU and on
the GPU. A dynamic budget M gives `n_hi = (M - N * int2_bytes) // bf16_bytes` hi experts in total
(N = layers x experts), rounded down to a multiple of the layer count (the scheduler gives each
layer the same share); the device budget is then set to exactly the fixed part + N int2 slots +
n_hi hi slots in the device's own layout, so the memory plan holds what was asked.

Budgets (`--budgets`): `mid` = halfway between static int2 and static int4 (the quality target's
point), `int4` = the same memory as static int4, or a fraction f in (0, 1) = int2 + f x (bf16 - int2).

Data: the shipped held-out ShareGPT conversations, never trained on. The first `calib_convs` (file
order, all workloads mixed) calibrate the dynamic configurations: they are fed through the model so
the DynaExq scheduler counts router selections, then one update is forced and its promotions
applied (`ResidencyManager.settle()`); they are never measured. Measured: the next `max_convs`
conversations of each workload (code, non-english, chat). Each workload is scored on its own
(`data.heldout_loss`: chat-templated, first `max_len` tokens, token-weighted nats/token); "all" is
the token-weighted mean over the measured conversations. With `adapt` (default), the scheduler keeps
running during measurement (time-based updates, promotions copied in the background), as in
serving; without it, the hot set stays as calibrated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import format_bytes
from ..errors import ConfigError

CONFIGS = ("bf16", "int4", "int2", "dynamic", "dynamic-int4")
DYNAMIC = {"dynamic": "bf16", "dynamic-int4": "int4"}  # dynamic config -> precision of its hot experts
STATIC_POLICY = {"bf16": "no-offload", "int4": "static-int4", "int2": "static-int2"}
WORKLOADS = ("code", "non-english", "chat")


@dataclass
class EvalSpec:
    model: str | None = None
    device: str | None = None
    dtype: str = "auto"
    configs: list[str] = field(default_factory=lambda: list(CONFIGS))
    budgets: list[str] = field(default_factory=lambda: ["mid", "int4", "0.25", "0.5"])
    max_convs: int | None = 64  # measured conversations per workload (None = all)
    calib_convs: int = 16
    max_len: int = 512
    batch_size: int = 8
    adapt: bool = True
    out: str = "eval-out"
    command: str = ""

    def __post_init__(self) -> None:
        bad = [c for c in self.configs if c not in CONFIGS]
        if bad or not self.configs:
            raise ConfigError(f"unknown config {bad[0] if bad else ''!r}; choose from {', '.join(CONFIGS)}")
        for b in self.budgets:
            if b not in ("mid", "int4"):
                try:
                    f = float(b)
                except ValueError:
                    raise ConfigError(f"budget {b!r}: use mid, int4 or a fraction in (0, 1)") from None
                if not 0 < f < 1:
                    raise ConfigError(
                        f"budget {b!r}: a fraction of the way from int2 to bf16 must be in (0, 1)"
                    )
        if self.calib_convs < 1 and any(c in DYNAMIC for c in self.configs):
            raise ConfigError("--calib-convs must be >= 1 for the dynamic configurations")
        if self.max_convs is not None and self.max_convs < 1:
            raise ConfigError("--max-convs must be >= 1")


@dataclass(frozen=True)
class ExpertGeometry:
    """Expert counts and sizes (bytes per expert in the bf16 reference layout)."""

    layers: int
    experts: int
    top_k: int
    intermediate: int
    hidden: int
    ref_bytes: dict  # {"bf16", "int4", "int2"}

    @property
    def total(self) -> int:
        return self.layers * self.experts

    def static_bytes(self, precision: str) -> int:
        return self.total * self.ref_bytes[precision]


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


def dynamic_hi_experts(budget: str, geo: ExpertGeometry, hi: str = "bf16") -> int:
    """hi experts (all layers) that a dynamic budget buys (each costs a `hi` copy beside its resident
    int2 one), a multiple of the layer count."""
    lo2, lo4, all_bf16 = (geo.static_bytes(p) for p in ("int2", "int4", "bf16"))
    if budget == "mid":
        memory = (lo2 + lo4) / 2
    elif budget == "int4":
        memory = lo4
    else:
        memory = lo2 + float(budget) * (all_bf16 - lo2)
    n = int((memory - lo2) // geo.ref_bytes[hi])
    return min(geo.total, (n // geo.layers) * geo.layers)


def split_conversations(calib: int, per_workload: int | None) -> tuple[list[dict], dict[str, list[dict]]]:
    """(calibration conversations, {workload: measured conversations}), disjoint, in file order."""
    from ..data.sharegpt import heldout_conversations

    convs = heldout_conversations()
    calibration, rest = convs[:calib], convs[calib:]
    measured = {w: [c for c in rest if c["workload"] == w] for w in WORKLOADS}
    if per_workload is not None:
        measured = {w: cs[:per_workload] for w, cs in measured.items()}
    return calibration, measured


def _device_budget(spec: EvalSpec, model_path: Path, geo: ExpertGeometry, n_hi: int, hi: str = "bf16") -> int:
    """Device bytes for a dynamic config: fixed part + every int2 slot + `n_hi` hi slots, device layout."""
    from ..bench.budget import model_bytes
    from ..models.checkpoint import load_config
    from ..models.loader import resolve_device, resolve_dtype
    from ..store import quant

    config = _engine_config(spec, model_path, "dynaexq", None)
    mb = model_bytes(config)
    dtype = resolve_dtype(config.dtype, load_config(model_path), resolve_device(config.device))
    lo_bytes = quant.nbytes_for("int2", geo.intermediate, geo.hidden, dtype)
    hi_bytes = (
        mb.hi_expert_bytes if hi == "bf16" else quant.nbytes_for(hi, geo.intermediate, geo.hidden, dtype)
    )
    return mb.fixed.total + geo.total * lo_bytes + n_hi * hi_bytes


def _engine_config(spec: EvalSpec, model_path: Path, policy: str, budget_bytes: int | None, hi: str = "bf16"):
    from ..config import EngineConfig

    return EngineConfig(
        model=str(model_path),
        device=spec.device,
        dtype=spec.dtype,
        policy=policy,
        lo_precision="int2",
        hi_precision="hi" if hi == "bf16" else hi,
        gpu_memory_bytes=budget_bytes,
        max_num_seqs=spec.batch_size,
        max_model_len=spec.max_len,
        kv_cache_tokens=spec.max_len,  # the loss forward uses no engine KV cache; keep the fixed part small
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
    from ..data.sharegpt import heldout_loss
    from ..engine.llm import build_engine

    record: dict = {"name": name if budget is None else f"{name}@{budget}", "config": name, "budget": budget}
    hi = DYNAMIC.get(name, "bf16")
    if name in DYNAMIC:
        n_hi = dynamic_hi_experts(budget, geo, hi)
        if n_hi < geo.layers:
            raise ConfigError(f"budget {budget!r} buys {n_hi} hi experts, fewer than one per layer; raise it")
        budget_bytes = _device_budget(spec, model_path, geo, n_hi, hi)
        policy = "dynaexq"
        record.update(
            hi_experts=n_hi, hi_precision=hi, expert_bytes=geo.static_bytes("int2") + n_hi * geo.ref_bytes[hi]
        )
    else:
        budget_bytes, policy = None, STATIC_POLICY[name]
        precision = {"bf16": "bf16", "int4": "int4", "int2": "int2"}[name]
        record.update(hi_experts=geo.total if name == "bf16" else 0, expert_bytes=geo.static_bytes(precision))
    record.update(policy=policy, budget_bytes=budget_bytes)
    config = _engine_config(spec, model_path, policy, budget_bytes, hi)
    free_device()
    t0 = time.perf_counter()
    loaded, _, tokenizer = build_engine(config, progress=False)
    try:
        residency = loaded.runtime.residency
        plan = getattr(residency, "plan", None)
        record["plan"] = plan.describe() if plan is not None else None
        record["device"] = str(loaded.device)
        if name in DYNAMIC:
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
            scheduler.update()
            residency.settle()
            record["calibration"] = {
                "conversations": len(calibration),
                "loss": calib_loss,
                "resident": residency.resident_counts(),
                "n_hi_per_layer": scheduler.n_hi[0],
            }
            if spec.adapt:
                scheduler.clock = time.monotonic
        loaded.runtime.metrics.reset()
        record.update(_score(loaded, tokenizer, spec, measured))
        if name in DYNAMIC:
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


def gap_recovered(results: list[dict], budget: str = "mid", config: str = "dynamic") -> dict | None:
    """(ppl_int2 - ppl_dyn) / (ppl_int2 - ppl_int4) per workload at `budget`; None if a part is missing."""
    by = {r["name"]: r for r in results if "ppl" in r}
    dyn, lo2, lo4 = by.get(f"{config}@{budget}"), by.get("int2"), by.get("int4")
    if not (dyn and lo2 and lo4):
        return None
    out = {}
    for w in ("all", *WORKLOADS):
        if w not in lo2["ppl"] or w not in lo4["ppl"] or w not in dyn["ppl"]:
            continue
        gap = lo2["ppl"][w] - lo4["ppl"][w]
        out[w] = (lo2["ppl"][w] - dyn["ppl"][w]) / gap if gap > 0 else None
    return out


def write_table(report: dict, path: Path) -> str:
    cols = ["all", *WORKLOADS]
    lines = [
        f"# moetide eval: {report['model_path']}",
        "",
        (
            f"machine: {report['machine'].get('gpu') or 'CPU'}; measured conversations per workload:"
            f" {report['measured_conversations']}; calibration (dynamic only): first"
            f" {report['calibration_conversations']} held-out conversations, never measured"
        ),
    ]
    if report.get("command"):
        lines.append(f"command: `{report['command']}`")
    lines += [
        "",
        "Perplexity (exp of nats/token) on held-out ShareGPT; expert memory in the bf16 layout.",
        "",
        "| config | expert memory | hi experts | " + " | ".join(f"ppl {c}" for c in cols) + " | loss all |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in cols) + " | ---: |",
    ]
    for r in report["results"]:
        if r.get("error"):
            lines.append(f"| {r['name']} | error: {r['error']} |" + " |" * (len(cols) + 2))
            continue
        ppl = " | ".join(f"{r['ppl'].get(c, math.nan):.3f}" for c in cols)
        lines.append(
            f"| {r['name']} | {format_bytes(r['expert_bytes'])} | {r['hi_experts']} | {ppl}"
            f" | {r['loss']['all']:.4f} |"
        )
    lines.append("")
    for config, gap in (
        ("dynamic", report.get("gap_recovered")),
        ("dynamic-int4", report.get("gap_recovered_int4")),
    ):
        if gap:
            parts = ", ".join(f"{w} {v:.1%}" if v is not None else f"{w} n/a" for w, v in gap.items())
            lines.append(
                f"Gap recovered by {config} at the memory halfway between static int2 and int4"
                f" ((ppl_int2 - ppl_dyn) / (ppl_int2 - ppl_int4)): {parts}. Target: >= 50%."
            )
        else:
            lines.append(f"Gap recovered by {config}: not computed (needs int2, int4 and {config} at `mid`).")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["results"] if "ppl" in r]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, w in zip(axes.flat, ("all", *WORKLOADS), strict=True):
        dyn = []
        for config, label in (
            ("dynamic", "dynamic (bf16 + int2)"),
            ("dynamic-int4", "dynamic (int4 + int2)"),
        ):
            points = sorted(
                (r["expert_bytes"], r["ppl"][w]) for r in ok if r["config"] == config and w in r["ppl"]
            )
            if points:
                dyn += points
                ax.plot([m / 2**20 for m, _ in points], [p for _, p in points], marker="o", label=label)
        for r in ok:
            if r["config"] not in DYNAMIC and w in r["ppl"]:
                ax.scatter([r["expert_bytes"] / 2**20], [r["ppl"][w]], marker="s", s=50, zorder=3)
                ax.annotate(
                    f"static {r['name']}",
                    (r["expert_bytes"] / 2**20, r["ppl"][w]),
                    textcoords="offset points",
                    xytext=(5, 5),
                    fontsize=8,
                )
        ax.set_title(w)
        ax.set_xlabel("expert memory (MiB, bf16 layout)")
        ax.set_ylabel("perplexity")
        ax.grid(alpha=0.3)
        if dyn:
            ax.legend(fontsize=8)
    fig.suptitle(f"held-out perplexity vs expert memory: {Path(report['model_path']).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_eval(spec: EvalSpec, *, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    from ..bench.runs import machine_info
    from ..engine.llm import demo_model_path

    model_path = Path(spec.model).expanduser() if spec.model else demo_model_path()
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    geo = expert_geometry(model_path)
    calibration, measured = split_conversations(spec.calib_convs, spec.max_convs)
    jobs = [(c, None) for c in ("bf16", "int4", "int2") if c in spec.configs]
    for config in DYNAMIC:
        if config in spec.configs:
            jobs += [(config, b) for b in spec.budgets if not (config == "dynamic-int4" and b != "mid")]
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
    bar = tqdm(jobs, desc="eval", unit="config", disable=not progress, file=sys.stderr)
    for name, budget in bar:
        bar.set_postfix_str(name if budget is None else f"{name}@{budget}")
        try:
            r = evaluate_config(spec, model_path, name, geo, calibration, measured, budget=budget)
            bar.write(
                f"{r['name']}: ppl {r['ppl']['all']:.3f} ("
                + ", ".join(f"{w} {r['ppl'][w]:.3f}" for w in WORKLOADS if w in r["ppl"])
                + f") at {format_bytes(r['expert_bytes'])}",
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
        report["results"].append(r)
        report["gap_recovered"] = gap_recovered(report["results"])
        report["gap_recovered_int4"] = gap_recovered(report["results"], config="dynamic-int4")
        (out / "eval.json").write_text(json.dumps(report, indent=2, default=str))
        write_table(report, out / "eval.md")
        write_plot(report, out / "quality_vs_memory.png")
    bar.close()
    return report
