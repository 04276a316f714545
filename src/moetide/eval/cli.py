"""`moetide eval`: held-out loss per workload against bits per expert weight, for every static format
and dynamic ladders (hot > cold) at several budgets.

    moetide eval --first 128 --budgets mid --out runs/eval       # the demo model, CPU or GPU
    moetide eval --model PATH --configs int2,int4,int4>int2+4 --budgets mid,0.25 --out runs/eval

Writes eval.json (with a `summary` of the quality targets), eval.md (table, gap recovered) and
quality_vs_bits.png. See docs/bench.md.
"""

from __future__ import annotations

import shlex
import sys


def register_cli(subparsers) -> None:
    from .quality import DEFAULT_CONFIGS, STATIC

    p = subparsers.add_parser(
        "eval",
        help="held-out loss per workload vs bits per expert weight: static formats, dynamic ladders",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded demo model)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: CUDA when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"comma-separated static formats ({', '.join(STATIC)}) and dynamic ladders HOT>COLD (e.g."
        " int4>int2+4; dynamic = bf16>int2, dynamic-int4 = int4>int2)",
    )
    p.add_argument(
        "--budgets",
        default="mid,int4,0.25,0.5",
        help="dynamic expert-memory budgets: mid (halfway int2..int4), int4, or a fraction f of the way"
        " from all-cold to all-bf16",
    )
    p.add_argument(
        "--first",
        type=int,
        default=None,
        help="measure the first N held-out conversations (all workloads; the quality targets use 128);"
        " the next --calib-convs calibrate (default: per-workload subsets, see --max-convs)",
    )
    p.add_argument(
        "--cache-dir", default=None, help="prepared lo versions (as `moetide prepare --cache-dir`)"
    )
    p.add_argument("--max-convs", type=int, default=64, help="measured conversations per workload (0 = all)")
    p.add_argument(
        "--calib-convs",
        type=int,
        default=16,
        help="first held-out conversations used to calibrate the dynamic hot set (never measured)",
    )
    p.add_argument("--max-len", type=int, default=512, help="tokens per conversation")
    p.add_argument("--batch-size", type=int, default=8, help="conversations per forward")
    p.add_argument(
        "--no-adapt",
        action="store_true",
        help="freeze the dynamic hot set after calibration (default: the scheduler keeps updating)",
    )
    p.add_argument("--out", default="eval-out", help="output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    from .quality import EvalSpec, run_eval, write_table

    spec = EvalSpec(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        configs=[c.strip() for c in args.configs.split(",") if c.strip()],
        budgets=[b.strip() for b in args.budgets.split(",") if b.strip()],
        max_convs=args.max_convs or None,
        first=args.first,
        cache_dir=args.cache_dir,
        calib_convs=args.calib_convs,
        max_len=args.max_len,
        batch_size=args.batch_size,
        adapt=not args.no_adapt,
        out=args.out,
        command="moetide " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    )
    report = run_eval(spec, progress=not args.quiet)
    from pathlib import Path

    print(write_table(report, Path(args.out) / "eval.md"))
    return 0
