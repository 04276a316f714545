"""Tables and plots of a bench sweep: `summary.md`, `throughput.png`, `tpot.png`, `hit_rate.png`."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..config import format_bytes


def _ms(x) -> str:
    return "" if x is None else f"{x * 1000:.1f}"


def _num(x, fmt="{:.1f}") -> str:
    return "" if x is None else fmt.format(x)


def _pct(x) -> str:
    return "" if x is None else f"{x:.1%}"


def write_markdown(summary: dict, path: Path) -> None:
    """One row per run: throughput, TTFT/TPOT/E2E percentiles (ms), residency counters, peak memory."""
    lines = [f"# moetide bench: {summary.get('model_path')}", ""]
    m = summary.get("machine") or {}
    lines.append(
        f"machine: {m.get('gpu') or 'CPU'}, torch {m.get('torch')}, transformers {m.get('transformers')}"
    )
    if summary.get("command"):
        lines.append(f"command: `{summary['command']}`")
    for note in summary.get("notes", []):
        lines.append(f"note: {note}")
    lines += [
        "",
        (
            "| run | engine | policy | budget | batch | tok/s | TTFT mean / p50 / p90 / p99 (ms) "
            "| TPOT mean / p50 / p90 / p99 (ms) | E2E p50 / p99 (s) | hit rate | lo runs | H2D | promo / demo "
            "| peak GPU |"
        ),
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in summary["runs"]:
        budget = r["gpu_memory"] or "none"
        if r.get("budget_bytes"):
            budget += f" ({format_bytes(r['budget_bytes'])})"
        if r.get("error"):
            lines.append(
                f"| {r['name']} | {r['engine']} | {r['policy']} | {budget} | {r['batch_size']} "
                f"| error: {r['error']} |  |  |  |  |  |  |  |  |"
            )
            continue
        ttft = " / ".join(_ms(r[f"ttft_{s}_s"]) for s in ("mean", "p50", "p90", "p99"))
        tpot = " / ".join(_ms(r[f"tpot_{s}_s"]) for s in ("mean", "p50", "p90", "p99"))
        e2e = " / ".join(_num(r[f"e2e_{s}_s"], "{:.2f}") for s in ("p50", "p99"))
        hit = "" if r.get("hit_rate") is None else f"{r['hit_rate']:.1%}"
        h2d = "" if r.get("bytes_h2d") is None else format_bytes(r["bytes_h2d"])
        promo = "" if r.get("promotions") is None else f"{r['promotions']} / {r['demotions']}"
        peak = "" if r.get("peak_gpu_bytes") is None else format_bytes(r["peak_gpu_bytes"])
        lines.append(
            f"| {r['name']} | {r['engine']} | {r['policy']} | {budget} | {r['batch_size']} "
            f"| {_num(r['throughput_tok_s'])} | {ttft} | {tpot} | {e2e} | {hit} | {_pct(r.get('lo_run_rate'))} "
            f"| {h2d} | {promo} | {peak} |"
        )
    path.write_text("\n".join(lines) + "\n")


def _series(rows: list[dict], value: str) -> dict[str, list[tuple[int, float]]]:
    """`{"policy @ budget": [(batch size, value)]}` over the runs that succeeded."""
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r.get("error") or r.get(value) is None:
            continue
        label = r["policy"] if r["gpu_memory"] is None else f"{r['policy']} @ {r['gpu_memory']}"
        out[label].append((r["batch_size"], r[value]))
    return {k: sorted(v) for k, v in out.items()}


def write_plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """Throughput and TPOT against batch size (one line per policy @ budget); hit rate per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for value, scale, ylabel, fname in (
        ("throughput_tok_s", 1.0, "output tokens / s", "throughput.png"),
        ("tpot_mean_s", 1000.0, "TPOT, mean (ms)", "tpot.png"),
    ):
        series = _series(rows, value)
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, pts in sorted(series.items()):
            ax.plot([p[0] for p in pts], [p[1] * scale for p in pts], marker="o", label=label)
        batch_sizes = sorted({p[0] for pts in series.values() for p in pts})
        if len(batch_sizes) > 1 and batch_sizes[-1] / batch_sizes[0] >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=120)
        plt.close(fig)
        written.append(out_dir / fname)
    hits = [r for r in rows if not r.get("error") and r.get("hit_rate") is not None]
    if hits:
        fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(hits) + 2), 4.5))
        ax.bar(range(len(hits)), [r["hit_rate"] for r in hits])
        ax.set_xticks(range(len(hits)), [r["name"] for r in hits], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("expert hit rate")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(out_dir / "hit_rate.png", dpi=120)
        plt.close(fig)
        written.append(out_dir / "hit_rate.png")
    return written
