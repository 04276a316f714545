"""`moetide bench`: throughput and latency sweeps, written as JSON, Markdown and PNG plots.

    moetide bench --policy on-demand,lru,finemoe,combined --gpu-memory 30% --batch-size 1,8,32 --out runs/demo
    moetide bench --synthetic olmoe-1b-7b --policy combined,lru,on-demand --gpu-memory 4GiB --batch-size 32 \
        --output-len 32 --baselines hf,hf-offload --out runs/olmoe
    moetide bench --mode online --rate 4 --num-prompts 64 --batch-size 32 --out runs/online
    moetide bench --record-trace runs/demo-trace.safetensors --num-prompts 48 --output-len 64
    moetide bench --synthetic olmoe-1b-7b --trace runs/demo-trace.safetensors --policy on-demand,lru,finemoe,combined \
        --gpu-memory 4GiB --out runs/trace

See docs/bench.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from ..config import POLICIES, RELATIVE_BUDGET_HELP
from ..errors import ConfigError


def _list(text: str | None, kind=str) -> list:
    if text is None:
        return []
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        return [kind(t) for t in items]
    except ValueError:
        raise ConfigError(f"cannot read the list {text!r}") from None


def register_cli(subparsers) -> None:
    from ..cli_args import add_engine_args
    from .synthetic import SHAPES

    p = subparsers.add_parser(
        "bench",
        help="benchmark policies x memory budgets x batch sizes (JSON, Markdown and PNG plots)",
        description=__doc__.split("\n\n")[0],
        conflict_handler="resolve",  # --policy / --gpu-memory become lists here
    )
    add_engine_args(p)
    p.add_argument(
        "--policy",
        default="on-demand,lru,finemoe,combined",
        help=f"comma-separated policies ({', '.join(POLICIES)}); POLICY:lo runs one with --on-miss lo",
    )
    p.add_argument(
        "--gpu-memory",
        default="30%",
        help=f"comma-separated budgets: sizes (4GiB), NN%% or 'none' (no cap); {RELATIVE_BUDGET_HELP}",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--synthetic",
        default=None,
        choices=sorted(SHAPES),
        help="random-weight model of this real shape (no download; routers route near-uniformly)",
    )
    p.add_argument("--synthetic-dir", default="/tmp/moetide-synthetic", help="cache of synthetic checkpoints")
    p.add_argument(
        "--batch-size", default="1", help="comma-separated batch sizes (max sequences decoded together)"
    )
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (EOS ignored)")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per run (default: one batch offline, 32 online, the whole trace)",
    )
    p.add_argument("--max-input-len", type=int, default=256, help="prompts are cut to this many tokens")
    p.add_argument(
        "--prompts",
        default=None,
        help="prompt file (one per line, or JSONL with 'prompt') instead of ShareGPT",
    )
    p.add_argument("--mode", default="offline", choices=["offline", "online"])
    p.add_argument("--rate", type=float, default=None, help="online: Poisson arrivals, requests per second")
    p.add_argument("--arrivals", default=None, help="online: CSV of arrival_s,input_len,output_len")
    p.add_argument(
        "--baselines",
        default="",
        help="comma-separated: hf (transformers on the GPU), hf-offload"
        " (transformers + accelerate at each budget)",
    )
    p.add_argument(
        "--hf-offload-output-len",
        type=int,
        default=8,
        help="output tokens per request for hf-offload (it is ~1 s per token on large shapes)",
    )
    p.add_argument("--trace", default=None, help="replay this recorded routing trace (batch 1)")
    p.add_argument(
        "--trace-warmup",
        type=int,
        default=None,
        help="traced requests replayed before measuring (default: a quarter)",
    )
    p.add_argument(
        "--record-trace",
        default=None,
        metavar="FILE",
        help="record a routing trace of held-out prompts (or of --prompts) on --model (default: demo)"
        " and exit",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-out", help="output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    if args.record_trace:
        return _record(args)
    from ..cli_args import precision_options_from_args
    from ..config import parse_bytes
    from .sweep import BenchSpec, run_sweep

    policies = _list(args.policy)
    if not policies and not args.baselines:
        raise ConfigError("--policy needs at least one policy (or give --baselines alone with --policy '')")
    budgets = [None if b.lower() in ("none", "uncapped") else b for b in _list(args.gpu_memory)] or [None]
    spec = BenchSpec(
        model=args.model,
        synthetic=args.synthetic,
        synthetic_dir=args.synthetic_dir,
        policies=policies,
        gpu_memory=budgets,
        batch_sizes=_list(args.batch_size, int),
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        max_input_len=args.max_input_len,
        mode=args.mode,
        rate=args.rate,
        arrivals=args.arrivals,
        prompts_file=args.prompts,
        baselines=_list(args.baselines),
        hf_offload_output_len=args.hf_offload_output_len,
        trace=args.trace,
        trace_warmup=args.trace_warmup,
        device=args.device,
        dtype=args.dtype,
        lo_precision=args.lo_precision,
        on_miss=args.on_miss,
        prefetch_distance=args.prefetch_distance,
        cpu_memory_bytes=parse_bytes(args.cpu_memory) if args.cpu_memory else None,
        seed=args.seed,
        **precision_options_from_args(args),
        out=args.out,
        command="moetide " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    )
    summary = run_sweep(spec, progress=not args.quiet)
    failed = sum(1 for r in summary["runs"] if r.get("error"))
    print(
        f"wrote {args.out}/summary.json, summary.md, plots and {len(summary['runs'])} run files"
        f" ({failed} failed)",
        file=sys.stderr,
    )
    return 0


def _record(args) -> int:
    from ..engine.llm import demo_model_path
    from .replay import record_heldout_trace

    model = args.model or str(demo_model_path())
    trace = record_heldout_trace(
        model,
        args.record_trace,
        num_prompts=args.num_prompts or 32,
        output_len=args.output_len,
        max_input_len=args.max_input_len,
        prompts_file=args.prompts,
    )
    print(f"wrote {args.record_trace}: {trace!r}", file=sys.stderr)
    return 0
