#!/usr/bin/env python
"""Expert hit rate vs prefetch distance for every policy (FineMoE's figure), and the paper's ablation.

One command, three sources of traces:

    python scripts/simulate_hit_rate.py --model src/moetide/demo_model --out runs/hit_rate
        records a warm-up trace from training-split ShareGPT prompts and a test trace from the held-out
        prompts (first exchange each; decode steps feed the reference reply unless --decode greedy)
    python scripts/simulate_hit_rate.py --warm-trace warm.safetensors --test-trace test.safetensors --out DIR
    python scripts/simulate_hit_rate.py --synthetic --out DIR        (no model needed)

Warm-up: FineMoE's map store and MoE-Infinity's activation-matrix collection see only the warm trace;
everything is measured on the test trace (online updates during the test run are part of both
algorithms). Writes results.json, results.md (tables), hit_rate_vs_distance.png, ablation.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moetide.analysis.ablations import ABLATIONS, HitCountPolicy
from moetide.analysis.simulator import simulate
from moetide.analysis.trace import Trace
from moetide.policies.baselines import LRUSpeculativePolicy, MoEInfinityPolicy, OnDemandPolicy
from moetide.policies.finemoe import FineMoEPolicy

MAIN_POLICIES = ("on-demand", "lru", "moe-infinity", "finemoe")
ABLATION_STEPS = ("speculate", "hit-count", "map-t", "map-ts", "map-ts-delta")
ABLATION_LABELS = {
    "speculate": "Speculate",
    "hit-count": "Hit-count",
    "map-t": "Map(T)",
    "map-ts": "Map(T+S)",
    "map-ts-delta": "Map(T+S+δ)",
}
EXTRA_POLICIES = ("finemoe-lru-evict",)  # FineMoE's prediction with plain LRU eviction

_WARM: Trace | None = None
_TEST: Trace | None = None


SAME_RUN = {"speculate": "lru", "map-ts-delta": "finemoe"}  # ablation steps that are a main policy's run


def make_policy(name: str, d: int, args):
    """The simulated policy of a main, extra or ablation name (a table: one builder per name)."""
    cap = args.map_store_capacity

    def finemoe(**kw):
        return FineMoEPolicy(prefetch_distance=d, map_store_capacity=cap, synchronous=True, **kw)

    builders = {
        "on-demand": OnDemandPolicy,
        "lru": lambda: LRUSpeculativePolicy(d),
        "moe-infinity": lambda: MoEInfinityPolicy(d, eamc_capacity=cap),
        "hit-count": lambda: HitCountPolicy(d, eamc_capacity=cap),
        "finemoe": finemoe,
        "finemoe-lru-evict": lambda: finemoe(preferred_eviction="lru"),
        **{step: (lambda kw=kw: finemoe(**kw)) for step, kw in ABLATIONS.items()},
    }
    return builders[SAME_RUN.get(name, name)]()


def run_job(job: dict) -> dict:
    """One simulation (runs in a worker process; the traces are module globals inherited by fork)."""
    import torch

    torch.set_num_threads(1)
    args = argparse.Namespace(**job["args"])
    policy = make_policy(job["policy"], job["d"], args)
    t0 = time.perf_counter()
    if hasattr(policy, "warm_up") and not isinstance(policy, OnDemandPolicy):
        policy.warm_up(_WARM)
    res = simulate(
        _TEST,
        policy,
        job["capacity"],
        scope=args.scope,
        prefetch_distance=job["d"],
        bytes_per_expert=args.bytes_per_expert,
    )
    out = res.to_dict()
    out.update(
        name=job["policy"], d=job["d"], cache_fraction=job["fraction"], seconds=time.perf_counter() - t0
    )
    return out


def record_traces(args) -> tuple[Trace, Trace]:
    from moetide.analysis.workload import (
        heldout_conversations,
        load_hf_model,
        record_conversations,
        training_conversations,
    )

    model, tok, adapter = load_hf_model(args.model)
    t0 = time.time()
    warm_convs = training_conversations(args.warm_requests, seed=args.seed)
    test_convs = heldout_conversations(args.test_requests)
    kw = {"prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens, "decode": args.decode}
    warm = record_conversations(model, tok, adapter, warm_convs, source=f"{args.model}:train", **kw)
    print(f"[record] warm {warm} in {time.time() - t0:.0f} s", flush=True)
    t0 = time.time()
    test = record_conversations(
        model, tok, adapter, test_convs, source=f"{args.model}:heldout", request_id_start=1_000_000, **kw
    )
    print(f"[record] test {test} in {time.time() - t0:.0f} s", flush=True)
    return warm, test


def expert_bytes_from_model(model_dir: str) -> int:
    """bf16 bytes of one routed expert: gate, up (I x H each) and down (H x I)."""
    from transformers import AutoConfig

    from moetide.models.registry import get_adapter

    cfg = AutoConfig.from_pretrained(model_dir)
    return 3 * cfg.hidden_size * get_adapter(cfg.model_type).expert_intermediate(cfg) * 2


def fmt(x: float) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def write_markdown(path: Path, rows: list[dict], static_rows: list[dict], meta: dict, args) -> None:
    lines = [f"# Expert hit rate vs prefetch distance ({meta['source']})", ""]
    lines.append(
        f"Warm-up: {meta['warm']}. Test: {meta['test']}. Cache scope: {args.scope}; "
        f"{meta['num_layers']} layers x {meta['num_experts']} experts = {meta['total_experts']} experts. "
        "Hit = the expert was resident when its layer ran (distinct experts per step and layer). "
        "No timing model: a prefetch issued after layer l is resident before layer l+d runs, within "
        "the cache's capacity. The cache starts empty (cold misses count), so no-offload is just below 1."
    )
    lines.append("")
    by = {(r["name"], r["d"], r["cache_fraction"]): r for r in rows}
    for frac in args.cache_fractions:
        cap = max(1, round(frac * meta["total_experts"]))
        lines += [f"## Cache {frac:.0%} of the experts ({cap} experts)", ""]
        lines.append("| policy | " + " | ".join(f"d={d}" for d in args.distances) + " |")
        lines.append("|---|" + "---|" * len(args.distances))
        for name in MAIN_POLICIES + EXTRA_POLICIES:
            cells = [fmt(by[(name, d, frac)]["hit_rate"]) for d in args.distances]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        for r in static_rows:
            if r["cache_fraction"] == frac:
                lines.append(
                    f"| {r['name']} (capacity {r['capacity_experts']} lo experts; any d) | "
                    + " | ".join(fmt(r["hit_rate"]) for _ in args.distances)
                    + " |"
                )
        lines.append("")
        lines.append("FineMoE / baseline hit-rate ratio:")
        lines.append("")
        lines.append("| ratio | " + " | ".join(f"d={d}" for d in args.distances) + " |")
        lines.append("|---|" + "---|" * len(args.distances))
        for base in ("moe-infinity", "lru"):
            cells = [
                fmt(by[("finemoe", d, frac)]["hit_rate"] / by[(base, d, frac)]["hit_rate"])
                for d in args.distances
            ]
            lines.append(f"| finemoe / {base} | " + " | ".join(cells) + " |")
        lines.append("")
        unit = "GB" if args.bytes_per_expert > 1 else "expert loads"
        scale = 1e9 if args.bytes_per_expert > 1 else 1
        lines.append(f"Prefetch precision / recall / moved ({unit}):")
        lines.append("")
        lines.append("| policy | " + " | ".join(f"d={d}" for d in args.distances) + " |")
        lines.append("|---|" + "---|" * len(args.distances))
        for name in MAIN_POLICIES[1:]:
            cells = []
            for d in args.distances:
                r = by[(name, d, frac)]
                cells.append(f"{fmt(r['precision'])} / {fmt(r['recall'])} / {r['bytes_moved'] / scale:.4g}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        r0 = by[("on-demand", args.distances[0], frac)]
        lines.append(
            f"| on-demand | moved {r0['bytes_moved'] / scale:.4g} {unit} at every d |"
            + " |" * (len(args.distances) - 1)
        )
        lines.append("")
        lines += [f"### Ablation (cache {frac:.0%})", ""]
        lines.append("| step | " + " | ".join(f"d={d}" for d in args.distances) + " |")
        lines.append("|---|" + "---|" * len(args.distances))
        for name in ABLATION_STEPS:
            cells = [fmt(by[(name, d, frac)]["hit_rate"]) for d in args.distances]
            lines.append(f"| {ABLATION_LABELS[name]} | " + " | ".join(cells) + " |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def plot(out: Path, rows: list[dict], static_rows: list[dict], args, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["name"], r["d"], r["cache_fraction"]): r for r in rows}
    fig, axes = plt.subplots(
        1, len(args.cache_fractions), figsize=(5.5 * len(args.cache_fractions), 4.2), squeeze=False
    )
    markers = {"on-demand": "x", "lru": "s", "moe-infinity": "^", "finemoe": "o"}
    for ax, frac in zip(axes[0], args.cache_fractions, strict=True):
        for name in MAIN_POLICIES:
            ax.plot(
                args.distances,
                [by[(name, d, frac)]["hit_rate"] for d in args.distances],
                marker=markers[name],
                label=name,
            )
        ax.set_title(f"cache {frac:.0%} of experts")
        ax.set_xlabel("prefetch distance d (layers)")
        ax.set_ylabel("expert hit rate")
        ax.set_xticks(args.distances)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "hit_rate_vs_distance.png", dpi=130)
    plt.close(fig)

    fig, axes = plt.subplots(
        1, len(args.cache_fractions), figsize=(5.5 * len(args.cache_fractions), 4.2), squeeze=False
    )
    width = 0.8 / len(ABLATION_STEPS)
    for ax, frac in zip(axes[0], args.cache_fractions, strict=True):
        for i, name in enumerate(ABLATION_STEPS):
            xs = [d + (i - (len(ABLATION_STEPS) - 1) / 2) * width for d in args.distances]
            ax.bar(
                xs,
                [by[(name, d, frac)]["hit_rate"] for d in args.distances],
                width,
                label=ABLATION_LABELS[name],
            )
        ax.set_title(f"ablation, cache {frac:.0%} of experts")
        ax.set_xlabel("prefetch distance d (layers)")
        ax.set_ylabel("expert hit rate")
        ax.set_xticks(args.distances)
        ax.set_ylim(0, 1.15)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, ncol=3, loc="upper center")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=130)
    plt.close(fig)


def ratios(rows: list[dict], args) -> dict:
    """FineMoE's hit rate over MoE-Infinity's and LRU's, per cache fraction and distance."""
    by = {(r["name"], r["d"], r["cache_fraction"]): r for r in rows}
    targets = {}
    for frac in args.cache_fractions:
        for d in args.distances:
            f = by[("finemoe", d, frac)]["hit_rate"]
            targets[f"cache={frac},d={d}"] = {
                "finemoe_over_moe_infinity": f / by[("moe-infinity", d, frac)]["hit_rate"],
                "finemoe_over_lru": f / by[("lru", d, frac)]["hit_rate"],
            }
    return targets


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="transformers MoE checkpoint dir (records both traces)")
    src.add_argument("--warm-trace", help="recorded warm-up trace (with --test-trace)")
    src.add_argument("--synthetic", action="store_true", help="synthetic routing (no model)")
    src.add_argument("--replot", action="store_true", help="redraw tables and plots from OUT/results.json")
    ap.add_argument("--test-trace")
    ap.add_argument("--out", required=True)
    ap.add_argument("--distances", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--cache-fractions", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--scope", choices=("global", "layer"), default="global")
    ap.add_argument("--map-store-capacity", type=int, default=1000)
    ap.add_argument("--warm-requests", type=int, default=300)
    ap.add_argument("--test-requests", type=int, default=100)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--decode", choices=("forced", "greedy"), default="forced")
    ap.add_argument(
        "--bytes-per-expert", type=int, default=None, help="default: bf16 size from the model config"
    )
    ap.add_argument(
        "--int4-ratio", type=float, default=4.25 / 16, help="int4 (group 128, bf16 scale+zero) / bf16 bytes"
    )
    ap.add_argument("--int2-ratio", type=float, default=2.5 / 16, help="int2 (group 64) / bf16 bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2)))
    return ap.parse_args(argv), ap


def load_traces(args, ap, out: Path) -> str:
    """Set the warm-up and test traces (module globals, inherited by the workers); their source."""
    global _WARM, _TEST
    if args.model:
        _WARM, _TEST = record_traces(args)
        _WARM.save(out / "warm.trace.safetensors")
        _TEST.save(out / "test.trace.safetensors")
        source = f"model {args.model}, decode={args.decode}"
        if args.bytes_per_expert is None:
            args.bytes_per_expert = expert_bytes_from_model(args.model)
    elif args.synthetic:
        from moetide.analysis.synthetic import synthetic_trace

        _WARM = synthetic_trace(
            [i % 4 for i in range(args.warm_requests)], seed=1, decode_steps=args.max_new_tokens - 1
        )
        _TEST = synthetic_trace(
            [i % 4 for i in range(args.test_requests)], seed=2, decode_steps=args.max_new_tokens - 1
        )
        source = "synthetic routing"
    else:
        if not args.test_trace:
            ap.error("--warm-trace needs --test-trace")
        _WARM, _TEST = Trace.load(args.warm_trace), Trace.load(args.test_trace)
        source = f"traces: {_TEST.meta.source or args.test_trace}"
    if args.bytes_per_expert is None:
        args.bytes_per_expert = 1
    return source


def build_jobs(args, total: int) -> list[dict]:
    """Every (cache fraction, d, policy) simulation, and the static baselines per cache fraction."""
    names = MAIN_POLICIES + EXTRA_POLICIES + tuple(n for n in ABLATION_STEPS if n not in MAIN_POLICIES)
    jobs = []
    job_args = {k: v for k, v in vars(args).items()}
    for frac in args.cache_fractions:
        cap = max(1, round(frac * total))
        for d in args.distances:
            for name in names:
                if name in SAME_RUN:
                    continue  # same runs as lru / finemoe
                jobs.append({"policy": name, "d": d, "fraction": frac, "capacity": cap, "args": job_args})
        for name, ratio in (
            ("no-offload", None),
            ("static-int4", args.int4_ratio),
            ("static-int2", args.int2_ratio),
        ):
            lo_cap = total if ratio is None else min(total, int(cap / ratio))
            jobs.append(
                {
                    "policy": "on-demand",
                    "d": args.distances[0],
                    "fraction": frac,
                    "capacity": lo_cap,
                    "args": job_args,
                    "static": name,
                }
            )
    return jobs


def run_jobs(jobs: list[dict], processes: int) -> list[dict]:
    t0 = time.time()
    print(f"[simulate] {len(jobs)} runs on {_TEST} with {processes} processes", flush=True)
    if processes > 1:
        import multiprocessing as mp

        with ProcessPoolExecutor(processes, mp_context=mp.get_context("fork")) as ex:
            results = list(ex.map(run_job, jobs))
    else:
        results = [run_job(j) for j in jobs]
    print(f"[simulate] done in {time.time() - t0:.0f} s", flush=True)
    return results


def main(argv=None) -> int:
    args, ap = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        saved = json.loads((out / "results.json").read_text())
        old = argparse.Namespace(**saved["args"])
        meta = saved["meta"]
        write_markdown(out / "results.md", saved["results"], saved["static"], meta, old)
        plot(out, saved["results"], saved["static"], old, f"{meta['source']}\ntest: {meta['test']}")
        return 0
    source = load_traces(args, ap, out)
    m = _TEST.meta
    total = m.num_layers * m.num_experts
    if max(args.distances) >= m.num_layers:
        ap.error(f"distances must be < {m.num_layers} layers")
    jobs = build_jobs(args, total)
    results = run_jobs(jobs, args.jobs)
    rows, static_rows = [], []
    for job, r in zip(jobs, results, strict=True):
        if "static" in job:
            r["name"] = job["static"]
            static_rows.append(r)
        else:
            rows.append(r)
    for r in list(rows):  # the shared runs under their ablation names
        rows.extend(dict(r, name=step) for step, main in SAME_RUN.items() if r["name"] == main)

    meta = {
        "source": source,
        "warm": repr(_WARM),
        "test": repr(_TEST),
        "num_layers": m.num_layers,
        "num_experts": m.num_experts,
        "top_k": m.top_k,
        "total_experts": total,
        "scope": args.scope,
        "bytes_per_expert": args.bytes_per_expert,
    }
    targets = ratios(rows, args)
    (out / "results.json").write_text(
        json.dumps(
            {"meta": meta, "args": vars(args), "results": rows, "static": static_rows, "ratios": targets},
            indent=1,
        )
    )
    write_markdown(out / "results.md", rows, static_rows, meta, args)
    plot(
        out, rows, static_rows, args, f"{source}\ntest: {len(_TEST.requests())} requests, {len(_TEST)} steps"
    )
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
