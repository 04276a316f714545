#!/usr/bin/env python3
"""Where a kernel's warps wait, instruction by instruction: Nsight Compute's per-SASS warp-state
samples (`--section SourceCounters`), exported as CSV, summed per kernel.

    ncu --section SourceCounters --section WarpStateStats --import-source no -o rep <command>
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python scripts/ncu_source_stalls.py rep.csv [--top 12]

For each kernel in the export (the export may list a kernel more than once; the first is read): its
samples, the share of each stall reason over all of them (`long_sb`: waiting on a load's result,
`wait`: a fixed-latency dependency, `selected`: issuing, ...), and the instructions with the most
samples, each with its two main reasons. `gpu_fused.sh ncu` with NCU_SOURCE=1 writes and reads such an
export per cell.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import sys
from dataclasses import dataclass
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class KernelStalls:
    name: str
    samples: float
    executed: float  # warp-level instructions
    reasons: dict[str, float]  # reason -> share of all samples, largest first
    top: list[tuple[str, str, float, int, list[str]]]  # (address, SASS, share, executed, two main reasons)


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def kernels(text: str, top: int = 12) -> list[KernelStalls]:
    """Every kernel of a `--page source --csv --print-source sass` export, in export order, once each."""
    out, seen = [], set()
    for block in text.split('"Kernel Name",')[1:]:
        name_line, _, table = block.partition("\n")
        name = next(csv.reader([name_line]))[0]
        if name in seen:
            continue
        seen.add(name)
        rows = list(csv.reader(io.StringIO(table)))
        if not rows:
            continue
        header, data = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
        col = {h: i for i, h in enumerate(header)}
        if SAMPLES not in col:
            raise ValueError(f"no {SAMPLES!r} column: export with --section SourceCounters")
        reasons = [h for h in header if h.startswith("stall_") and not h.endswith("(Not Issued)")]
        total = sum(_number(r[col[SAMPLES]]) for r in data) or 1.0
        shares = {h[len("stall_"):]: sum(_number(r[col[h]]) for r in data) / total for h in reasons}
        ranked = sorted(data, key=lambda r: -_number(r[col[SAMPLES]]))[:top]
        hot = []
        for r in ranked:
            main = sorted(reasons, key=lambda h: -_number(r[col[h]]))[:2]
            hot.append((r[col["Address"]], r[col["Source"]].strip(), _number(r[col[SAMPLES]]) / total,
                        int(_number(r[col[EXECUTED]])), [h[len("stall_"):] for h in main]))  # fmt: skip
        out.append(KernelStalls(name, total, sum(_number(r[col[EXECUTED]]) for r in data),
                                dict(sorted(shares.items(), key=lambda kv: -kv[1])), hot))  # fmt: skip
    return out


def render(stalls: list[KernelStalls]) -> str:
    lines = []
    for k in stalls:
        lines.append(f"{k.name}: {k.samples:.0f} samples, {k.executed:.0f} warp instructions")
        lines.append("  " + ", ".join(f"{r} {s:.1%}" for r, s in k.reasons.items() if s >= 0.005))
        for addr, sass, share, executed, main in k.top:
            lines.append(f"  {share:6.1%} {addr[-6:]:>6} x{executed:<8d} {sass[:56]:56s} {', '.join(main)}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", type=Path, help="the export (.csv or .csv.gz)")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    if not args.csv.exists():
        raise SystemExit(f"ncu_source_stalls: no such file: {args.csv}")
    opener = gzip.open if args.csv.suffix == ".gz" else open
    with opener(args.csv, "rt") as f:
        print(render(kernels(f.read(), args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
