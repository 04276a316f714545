"""Summarise a server's step log (`moetide serve --step-log PATH`: one JSON line per engine-thread iteration):
step time by kind (decode, prefill, folded), and the slowest steps with what they ran.

    python scripts/step_log.py STEPS.jsonl [--slowest 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def kind(line: dict) -> str:
    if not line.get("decode") and not line.get("prefill"):
        return "idle"
    if line.get("fold") or not line.get("prefill"):
        return "decode" + ("+fold" if line.get("fold") else "")
    return "decode+prefill" if line.get("decode") else "prefill"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--slowest", type=int, default=10)
    args = ap.parse_args()
    if not args.log.is_file():
        raise SystemExit(f"no step log at {args.log}")
    lines = [json.loads(x) for x in args.log.read_text().splitlines() if x.strip()]
    if not lines:
        raise SystemExit(f"{args.log} is empty")
    t0 = lines[0]["t"]
    by_kind: dict[str, list[float]] = {}
    for line in lines:
        by_kind.setdefault(kind(line), []).append(line["step_s"])
    print(f"{len(lines)} iterations over {lines[-1]['t'] - t0:.1f} s")
    for name, times in sorted(by_kind.items()):
        print(f"  {name:15s} n={len(times):6d} median {statistics.median(times) * 1e3:7.2f} ms"
              f"  max {max(times) * 1e3:8.1f} ms  total {sum(times):6.2f} s")  # fmt: skip
    print(f"slowest {args.slowest}:")
    for line in sorted(lines, key=lambda x: -x["step_s"])[: args.slowest]:
        shape = {k: line.get(k) for k in ("decode", "prefill", "fold", "running", "waiting", "added")}
        print(f"  +{line['t'] - t0:8.2f} s  {line['step_s'] * 1e3:8.1f} ms"
              f"  deliver {line['deliver_s'] * 1e3:6.1f} ms  {shape}")  # fmt: skip


if __name__ == "__main__":
    main()
