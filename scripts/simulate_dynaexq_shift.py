#!/usr/bin/env python
"""DynaExq on a workload shift: does the hi set follow the new hot experts, and what does hysteresis save?

    python scripts/simulate_dynaexq_shift.py --model src/moetide/demo_model --out runs/dynaexq_shift
        records held-out code conversations, then held-out non-code (chat) ones, as one trace
    python scripts/simulate_dynaexq_shift.py --trace shift.safetensors --shift-step N --out DIR
    python scripts/simulate_dynaexq_shift.py --synthetic --out DIR          (topic 0, then topic 1)

The trace is replayed on a simulated clock (a decode step costs --decode-step-s, a prefill
--prefill-token-s per token). Runs, all with the same n_hi, EMA and rate limit:
    hysteresis   DynaExq with --margin
    plain top-n  margin 0
    frozen       hysteresis until the shift, then no more updates (what a static map would give)
    oracle       per phase, the phase's own top-n_hi experts by total count (an upper bound)
Reports the share of token selections that hit a hi expert over time (per phase, and in the second
half of phase 2, against the frozen set and the oracle), the overlap of the hi set with the phase-2
hot set over time and how many update intervals after the shift it takes to reach 75% / 90%, and the
precision transitions with and without hysteresis.
Writes results.json and dynaexq_shift.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np
import torch

from moetide.analysis.simulator import TraceSimulator, VirtualClock, default_step_time
from moetide.analysis.trace import Trace
from moetide.policies.dynaexq import DynaExqScheduler


def phase_counts(trace: Trace, start: int, end: int) -> torch.Tensor:
    """(L, J) selection counts of steps [start, end)."""
    a, b = int(trace.token_offsets[start]), int(trace.token_offsets[end])
    ids = trace.topk_ids[a:b].long()
    m = trace.meta
    return torch.stack(
        [torch.bincount(ids[:, l].reshape(-1), minlength=m.num_experts) for l in range(m.num_layers)]
    ).double()


def top_sets(counts: torch.Tensor, n_hi: int) -> torch.Tensor:
    """(L, J) bool: each layer's n_hi most selected experts."""
    hot = torch.zeros_like(counts, dtype=torch.bool)
    idx = torch.topk(counts, n_hi, dim=1).indices
    hot.scatter_(1, idx, True)
    return hot


def share(counts: torch.Tensor, hot: torch.Tensor) -> float:
    return float((counts * hot).sum() / counts.sum())


def run(trace: Trace, args, margin: float, freeze_at: int | None, phase2_hot: torch.Tensor) -> dict:
    clock = VirtualClock()
    sched = DynaExqScheduler(
        args.n_hi,
        update_interval_s=args.update_interval_s,
        alpha=args.alpha,
        hysteresis_margin=margin,
        max_transitions_per_update=args.max_transitions,
        clock=clock,
    )
    overlap: list[tuple[float, float]] = []
    transitions: list[tuple[float, int]] = []

    def on_step(s: int, sim: TraceSimulator) -> None:
        if freeze_at is not None and s == freeze_at - 1:
            sched.clock = None  # no more updates from the shift on
        hi = torch.from_numpy(sim.hi)
        overlap.append((clock.now, float((hi & phase2_hot).sum() / phase2_hot.sum())))
        transitions.append((clock.now, sim.result.promotions + sim.result.demotions))

    step_time = lambda step: default_step_time(step, args.decode_step_s, args.prefill_token_s)
    sim = TraceSimulator(trace, sched, 0, clock=clock, step_time=step_time, on_step=on_step)
    r = sim.run()
    return {
        "times_s": sim.step_times,
        "selections": sim.step_selections,
        "hi_selections": sim.step_hi_selections,
        "overlap_with_phase2_hot": [o for _, o in overlap],
        "cumulative_transitions": [c for _, c in transitions],
        "promotions": r.promotions,
        "demotions": r.demotions,
        "transitions": r.promotions + r.demotions,
        "updates": sched.updates,
        "deferred_moves": sched.deferred_moves,
        "hi_share": r.hi_share,
    }


def windows(times, sel, hi, width_s):
    """Share of selections on hi experts per window of `width_s` seconds: (window end times, shares)."""
    times, sel, hi = np.asarray(times), np.asarray(sel), np.asarray(hi)
    edges = np.arange(width_s, times[-1] + width_s, width_s)
    idx = np.searchsorted(edges, times, side="left")
    ends, shares = [], []
    for w in range(len(edges)):
        m = idx == w
        if sel[m].sum() > 0:
            ends.append(float(edges[w]))
            shares.append(float(hi[m].sum() / sel[m].sum()))
    return ends, shares


def record(args) -> tuple[Trace, int]:
    from moetide.analysis.workload import heldout_conversations, load_hf_model, record_conversations

    model, tok, adapter = load_hf_model(args.model)
    kw = {
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "decode": args.decode,
        "spec_distances": (),
    }
    t0 = time.time()
    code = record_conversations(
        model,
        tok,
        adapter,
        heldout_conversations(args.requests, workload="code"),
        source=f"{args.model}:heldout:code",
        **kw,
    )
    chat = record_conversations(
        model,
        tok,
        adapter,
        heldout_conversations(args.requests, workload="chat"),
        request_id_start=100_000,
        source=f"{args.model}:heldout:chat",
        **kw,
    )
    print(f"[record] code {code}, chat {chat} in {time.time() - t0:.0f} s", flush=True)
    return Trace.concat([code, chat]), len(code)


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model")
    src.add_argument("--trace")
    src.add_argument("--synthetic", action="store_true")
    ap.add_argument("--shift-step", type=int, help="first step of the second workload (with --trace)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=60, help="requests per workload")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--decode", choices=("forced", "greedy"), default="forced")
    ap.add_argument(
        "--hi-fraction", type=float, default=0.25, help="n_hi = this share of each layer's experts"
    )
    ap.add_argument("--update-interval-s", type=float, default=2.0)
    ap.add_argument("--alpha", type=float, default=0.9)
    ap.add_argument(
        "--margin", type=float, default=0.25, help="hysteresis margin (units of the layer's mean score)"
    )
    ap.add_argument("--max-transitions", type=int, default=16, help="precision changes per update at most")
    ap.add_argument("--decode-step-s", type=float, default=0.03)
    ap.add_argument("--prefill-token-s", type=float, default=0.0005)
    return ap.parse_args(argv), ap


def load_trace(args, ap, out: Path) -> tuple[Trace, int, str]:
    """(trace, first step of the second workload, a description of the source)."""
    if args.model:
        trace, shift = record(args)
        trace.save(out / "shift.trace.safetensors")
        source = f"model {args.model} (held-out code, then chat; decode={args.decode})"
    elif args.synthetic:
        from moetide.analysis.synthetic import synthetic_trace

        n = args.requests
        trace = synthetic_trace([0] * n + [1] * n, decode_steps=args.max_new_tokens - 1)
        shift = int((trace.request_ids < n).sum())
        source = "synthetic routing (topic 0, then topic 1)"
    else:
        if args.shift_step is None:
            ap.error("--trace needs --shift-step")
        trace, shift = Trace.load(args.trace), args.shift_step
        source = f"trace {args.trace}"
    return trace, shift, source


def summarize_run(r: dict, shift_time: float, update_interval_s: float) -> dict:
    """One run's hi shares per phase, overlap with the new hot set and transitions (adds its
    window series to `r`)."""
    ends, shares = windows(r["times_s"], r["selections"], r["hi_selections"], update_interval_s)
    r["window_end_s"], r["window_hi_share"] = ends, shares
    t = np.asarray(r["times_s"])
    sel, hi = np.asarray(r["selections"]), np.asarray(r["hi_selections"])
    p1, p2 = t <= shift_time, t > shift_time
    half2 = t > shift_time + (t[-1] - shift_time) / 2
    ov = np.asarray(r["overlap_with_phase2_hot"])

    def intervals_to_overlap(level: float) -> float | None:
        hit = next((float(t[i]) for i in range(len(t)) if t[i] > shift_time and ov[i] >= level), None)
        return None if hit is None else (hit - shift_time) / update_interval_s

    ctr = np.asarray(r["cumulative_transitions"])
    return {
        "hi_share_phase1": float(hi[p1].sum() / sel[p1].sum()),
        "hi_share_phase2": float(hi[p2].sum() / sel[p2].sum()),
        "hi_share_phase2_second_half": float(hi[half2].sum() / sel[half2].sum()),
        "overlap_with_phase2_hot_set_at_shift": float(ov[t <= shift_time][-1]),
        "intervals_to_75pct_overlap_with_phase2_hot_set": intervals_to_overlap(0.75),
        "intervals_to_90pct_overlap_with_phase2_hot_set": intervals_to_overlap(0.90),
        "final_overlap_with_phase2_hot_set": float(ov[-1]),
        "transitions": r["transitions"],
        "transitions_phase1": int(ctr[p1][-1]),
        "transitions_phase2": int(ctr[-1] - ctr[p1][-1]),
        "updates": r["updates"],
        "deferred_moves": r["deferred_moves"],
    }


def main(argv=None) -> int:
    args, ap = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace, shift, source = load_trace(args, ap, out)
    m = trace.meta
    args.n_hi = max(1, round(args.hi_fraction * m.num_experts))

    c1, c2 = phase_counts(trace, 0, shift), phase_counts(trace, shift, len(trace))
    hot1, hot2 = top_sets(c1, args.n_hi), top_sets(c2, args.n_hi)
    oracle = {
        "phase1": share(c1, hot1),
        "phase2": share(c2, hot2),
        "phase1_set_on_phase2": share(c2, hot1),
        "hot_set_overlap_between_phases": float((hot1 & hot2).sum() / hot2.sum()),
    }

    runs = {
        "hysteresis": run(trace, args, args.margin, None, hot2),
        "plain top-n": run(trace, args, 0.0, None, hot2),
        "frozen at shift": run(trace, args, args.margin, shift, hot2),
    }
    shift_time = runs["hysteresis"]["times_s"][shift - 1]
    summary = {name: summarize_run(r, shift_time, args.update_interval_s) for name, r in runs.items()}
    h, p = summary["hysteresis"], summary["plain top-n"]
    summary["transition_reduction_by_hysteresis"] = (
        1 - h["transitions"] / p["transitions"] if p["transitions"] else None
    )
    meta = {
        "source": source,
        "trace": repr(trace),
        "shift_step": shift,
        "shift_time_s": shift_time,
        "n_hi": args.n_hi,
        "oracle_hi_share": oracle,
    }
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "args": vars(args), "summary": summary, "runs": runs}, indent=1)
    )
    plot(
        out,
        runs,
        shift_time,
        oracle,
        args,
        f"{source}; n_hi={args.n_hi}/{m.num_experts}, T_u={args.update_interval_s}s",
    )
    print(json.dumps({"meta": meta, "summary": summary}, indent=1))
    return 0


def plot(out: Path, runs: dict, shift_time: float, oracle: dict, args, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for name, r in runs.items():
        axes[0].plot(r["window_end_s"], r["window_hi_share"], label=name, lw=1.2)
        axes[1].plot(r["times_s"], r["overlap_with_phase2_hot"], label=name, lw=1.2)
        axes[2].plot(r["times_s"], r["cumulative_transitions"], label=name, lw=1.2)
    t_end = runs["hysteresis"]["times_s"][-1]
    axes[0].hlines(
        [oracle["phase1"], oracle["phase2"]],
        [0, shift_time],
        [shift_time, t_end],
        colors="k",
        linestyles=":",
        label="oracle (phase's own hot set)",
    )
    axes[0].set_ylabel("share of selections on hi experts")
    axes[0].set_ylim(0, 1)
    axes[1].set_ylabel("hi set ∩ phase-2 hot set / n_hi")
    axes[1].set_ylim(0, 1.05)
    axes[2].set_ylabel("cumulative precision transitions")
    axes[2].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.axvline(shift_time, color="r", ls="--", lw=1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "dynaexq_shift.png", dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
