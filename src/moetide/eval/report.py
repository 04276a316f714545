"""The report of `moetide eval`: loss increases, the summary, the gap recovered, the table and the plot.

Each function reads the list of per-configuration records `run_eval` builds (one dict per
configuration: name, bits_per_weight, expert_bytes, loss and ppl per workload).
"""

from __future__ import annotations

from pathlib import Path

from ..config import format_bytes

LADDER_ALIASES = {"dynamic": "bf16>int2", "dynamic-int4": "int4>int2"}
WORKLOADS = ("code", "non-english", "chat")
# Names of the static formats in the summary (results/targets.json keys).
SUMMARY_KEYS = {
    "int4": "int4",
    "int2+4": "int2_down4",
    "int2+4-gptq": "int2_down4_gptq",
    "int2+2": "int2_down_g32",
    "int2+2-gptq": "int2_down_g32_gptq",
    "int2": "int2",
}


def gap_recovered(results: list[dict], budget: str = "mid", config: str = "dynamic") -> dict | None:
    """(ppl_int2 - ppl_dyn) / (ppl_int2 - ppl_int4) per workload at `budget`; None if a part is missing."""
    by = {r["name"]: r for r in results if "ppl" in r}
    dyn = by.get(f"{config}@{budget}") or by.get(f"{LADDER_ALIASES.get(config, config)}@{budget}")
    lo2, lo4 = by.get("int2"), by.get("int4")
    if not (dyn and lo2 and lo4):
        return None
    out = {}
    for w in ("all", *WORKLOADS):
        if w not in lo2["ppl"] or w not in lo4["ppl"] or w not in dyn["ppl"]:
            continue
        gap = lo2["ppl"][w] - lo4["ppl"][w]
        out[w] = (lo2["ppl"][w] - dyn["ppl"][w]) / gap if gap > 0 else None
    return out


def add_loss_increase(results: list[dict]) -> None:
    """Each record's loss minus bf16's, per workload (the checkpoint's precision); in place."""
    base = next((r for r in results if r["name"] == "bf16" and "loss" in r), None)
    for r in results:
        if base is not None and "loss" in r:
            r["loss_increase"] = {w: r["loss"][w] - base["loss"][w] for w in r["loss"] if w in base["loss"]}


def summarize(results: list[dict]) -> dict:
    """The quality targets' numbers: loss increase and bits per weight of each static low-bit format,
    and the best ladder's share of the int2 -> int4 perplexity gap at the halfway memory."""
    summary: dict = {}
    for r in results:
        key = SUMMARY_KEYS.get(r["name"])
        if key and "loss_increase" in r:
            summary[f"{key}_loss_increase"] = r["loss_increase"]["all"]
            summary[f"{key}_bits_per_weight"] = r["bits_per_weight"]
    ladders = sorted({r["config"] for r in results if r.get("dynamic") and r.get("budget") == "mid"})
    gaps = {c: (gap_recovered(results, "mid", c) or {}).get("all") for c in ladders}
    gaps = {c: g for c, g in gaps.items() if g is not None}
    summary["gap_recovered_at_mid"] = gaps
    if gaps:
        best = max(gaps, key=gaps.get)
        summary["dynamic_halfway_gap_recovered"] = gaps[best]
        summary["dynamic_halfway_best_ladder"] = LADDER_ALIASES.get(best, best)
    return summary


def write_table(report: dict, path: Path) -> str:
    cols = ["all", *WORKLOADS]
    lines = [
        f"# moetide eval: {report['model_path']}",
        "",
        (
            f"machine: {report['machine'].get('gpu') or 'CPU'}; measured conversations per workload:"
            f" {report['measured_conversations']}; calibration (dynamic only):"
            f" {report['calibration_conversations']} other held-out conversations, never measured"
        ),
    ]
    if report.get("command"):
        lines.append(f"command: `{report['command']}`")
    lines += [
        "",
        (
            "Loss (nats/token) on held-out ShareGPT; its increase over bf16 per workload; bits per expert"
            " weight and expert memory from stored bytes (bf16 layout, scales/offsets/padding included)."
        ),
        "",
        ("| config | bits/weight | expert memory | hot experts | loss all | ")
        + " | ".join(f"+loss {c}" for c in cols)
        + " | ppl all |",
        "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in cols) + " | ---: |",
    ]
    for r in report["results"]:
        if r.get("error"):
            lines.append(f"| {r['name']} | error: {r['error']} |" + " |" * (len(cols) + 4))
            continue
        inc = r.get("loss_increase") or {}
        cells = " | ".join(f"{inc[c]:+.4f}" if c in inc else "n/a" for c in cols)
        hot = "+".join(map(str, r["tier_experts"])) if r.get("tier_experts") else r["hi_experts"]
        lines.append(
            f"| {r['name']} | {r['bits_per_weight']:.3f} | {format_bytes(r['expert_bytes'])} | {hot}"
            f" | {r['loss']['all']:.4f} | {cells} | {r['ppl']['all']:.3f} |"
        )
    lines.append("")
    gaps = (report.get("summary") or {}).get("gap_recovered_at_mid") or {}
    for config, gap in gaps.items():
        lines.append(
            f"Gap recovered by {LADDER_ALIASES.get(config, config)} at the memory halfway between static int2"
            f" and int4 ((ppl_int2 - ppl_dyn) / (ppl_int2 - ppl_int4), all workloads): {gap:.1%}."
        )
    if not gaps:
        lines.append("Gap recovered: not computed (needs int2, int4 and a ladder at `mid`).")
    summary = {k: v for k, v in (report.get("summary") or {}).items() if k != "gap_recovered_at_mid"}
    if summary:
        lines += [
            "",
            "Summary: "
            + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()),
        ]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def write_plot(report: dict, path: Path) -> None:
    """Loss increase over bf16 against bits per expert weight, one panel per workload: a point per
    static format, a line per dynamic ladder (over its budgets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["results"] if "loss_increase" in r]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, w in zip(axes.flat, ("all", *WORKLOADS), strict=True):
        for config in dict.fromkeys(r["config"] for r in ok if r.get("dynamic")):
            points = sorted(
                (r["bits_per_weight"], r["loss_increase"][w])
                for r in ok
                if r["config"] == config and w in r["loss_increase"]
            )
            if points:  # a workload with no measured conversation has none
                ax.plot(*zip(*points), marker="o", label=f"dynamic {LADDER_ALIASES.get(config, config)}")
        for r in ok:
            if not r.get("dynamic") and w in r["loss_increase"]:
                ax.scatter(
                    [r["bits_per_weight"]], [r["loss_increase"][w]], marker="s", s=50, zorder=3, color="k"
                )
                ax.annotate(
                    f"static {r['name']}",
                    (r["bits_per_weight"], r["loss_increase"][w]),
                    textcoords="offset points",
                    xytext=(5, 5),
                    fontsize=8,
                )
        ax.set_title(w)
        ax.set_xscale("log", base=2)
        ax.set_xticks([2, 2.5, 3, 4, 6, 8, 16], labels=["2", "2.5", "3", "4", "6", "8", "16"])
        ax.set_xlabel("bits per expert weight (stored bytes)")
        ax.set_ylabel("loss increase over bf16 (nats/token)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a legend only where a line was drawn
            ax.legend(fontsize=7)
    fig.suptitle(f"held-out loss vs bits per expert weight: {Path(report['model_path']).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
