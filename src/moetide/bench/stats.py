"""Latency and throughput summaries of one benchmark run (all times in seconds)."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), `q` in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float | None]) -> dict:
    """`{mean, p50, p90, p99, n}` over the values that exist (None skipped); NaNs when none do."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "n": 0}
    return {
        "mean": sum(xs) / len(xs),
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "n": len(xs),
    }


def summarize(records: list[dict], duration_s: float) -> dict:
    """Run summary from per-request records (`ttft_s`, `tpot_s`, `e2e_s`, `prompt_len`, `output_len`).

    Throughput = output tokens of all requests / wall time from the first submission to the last
    finish (prefill included, as a user sees it); `input_tok_s` counts prompt tokens the same way.
    """
    out_tokens = sum(r["output_len"] for r in records)
    in_tokens = sum(r["prompt_len"] for r in records)
    return {
        "requests": len(records),
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "duration_s": duration_s,
        "throughput_tok_s": out_tokens / duration_s if duration_s > 0 else None,
        "input_tok_s": in_tokens / duration_s if duration_s > 0 else None,
        "request_throughput_per_s": len(records) / duration_s if duration_s > 0 else None,
        "ttft_s": distribution([r["ttft_s"] for r in records]),
        "tpot_s": distribution([r["tpot_s"] for r in records]),
        "e2e_s": distribution([r["e2e_s"] for r in records]),
    }
