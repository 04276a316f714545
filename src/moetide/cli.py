"""`moetide` command line: generate | info | prepare | serve | bench | eval.

Every user error is one line on stderr (`error: ...`) and exit status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .config import CUDA_GRAPHS, LO_KERNELS, POLICIES, SEARCHERS, EngineConfig, format_bytes, parse_bytes
from .errors import MoetideError
from .store.formats import LOW_BIT_FORMATS


def add_engine_args(p: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    """Options shared by every command that loads a model (mapped onto `EngineConfig`)."""
    if model_positional:
        p.add_argument(
            "model", nargs="?", default=None, help="checkpoint directory (default: the embedded demo model)"
        )
    else:
        p.add_argument(
            "--model", default=None, help="checkpoint directory (default: the embedded demo model)"
        )
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: CUDA when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--gpu-memory", default=None, help="hard cap on moetide's device memory, e.g. 6GiB")
    p.add_argument("--policy", default="combined", choices=POLICIES, help="expert residency policy")
    p.add_argument(
        "--lo",
        dest="lo_precision",
        default="auto",
        choices=["auto", *LOW_BIT_FORMATS],
        help="lo precision (auto: int4 when every expert fits in int4 beside the hi cache, else int2;"
        " int2+4: int2 gate/up with int4 down)",
    )
    p.add_argument(
        "--on-miss",
        default="lo",
        choices=["stall", "lo"],
        help="on a miss: run a resident lo version, or stall for hi",
    )
    p.add_argument("--prefetch-distance", type=int, default=2, help="FineMoE prefetch distance d (layers)")
    p.add_argument(
        "--hi",
        dest="hi_precision",
        default="bf16",
        choices=["bf16", *LOW_BIT_FORMATS],
        help="hot experts' precision for dynaexq/combined (a low-bit one: three tiers, e.g. --hi int4"
        " --lo int2+4; lo defaults to int2)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where prepared lo versions are read and written (as `moetide prepare --cache-dir`;"
        " default: <model>/.moetide-cache)",
    )
    p.add_argument(
        "--host-versions",
        default=None,
        help="expert versions to keep in host memory, e.g. 'lo' or 'hi,lo' (default: all); a version"
        " can be dropped only where the device holds it for every expert",
    )
    p.add_argument(
        "--lo-kernel",
        default="auto",
        choices=LO_KERNELS,
        help="lo experts at decode: dequantize + bf16 matmul, the fused Triton kernel (CUDA), or auto"
        " (default: triton where it runs, else dequant)",
    )
    p.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=CUDA_GRAPHS,
        help="replay decode steps as CUDA graphs where the experts need no host decision (no-offload,"
        " static-int4/int2, uncapped runs that fit; CUDA only; default auto), or launch every step"
        " from Python (off)",
    )
    p.add_argument(
        "--searcher",
        default="process",
        choices=SEARCHERS,
        help="where FineMoE's map searcher runs (finemoe, combined): its own process (default) or a"
        " thread of the engine's process",
    )
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None)


def engine_config_from_args(args) -> EngineConfig:
    from .engine.llm import demo_model_path

    return EngineConfig(
        model=str(args.model or demo_model_path()),
        device=args.device,
        dtype=args.dtype,
        gpu_memory_bytes=parse_bytes(args.gpu_memory),
        policy=args.policy,
        lo_precision=args.lo_precision,
        on_miss=args.on_miss,
        prefetch_distance=args.prefetch_distance,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        **precision_options_from_args(args),
    )


def precision_options_from_args(args) -> dict:
    """The `EngineConfig` fields of --hi, --host-versions, --lo-kernel, --cuda-graphs and --searcher
    (shared with `moetide bench`)."""
    return {
        "hi_precision": "hi" if args.hi_precision == "bf16" else args.hi_precision,
        "cache_dir": args.cache_dir,
        "host_versions": None
        if args.host_versions is None
        else tuple(v for v in args.host_versions.split(",") if v),
        "lo_kernel": args.lo_kernel,
        "cuda_graphs": args.cuda_graphs,
        "searcher": args.searcher,
    }


# -- generate --------------------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from .engine.llm import build_engine
    from .engine.sampling import SamplingParams

    config = engine_config_from_args(args)
    loaded, engine, tokenizer = build_engine(config, progress=not args.quiet)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or None,
    )
    use_chat = not args.raw and bool(getattr(tokenizer, "chat_template", None))
    if use_chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:
        ids = tokenizer.encode(args.prompt)
    loaded.runtime.metrics.reset()
    start = time.perf_counter()
    seq = engine.add_request(ids, params)
    printed = 0
    while engine.has_unfinished():
        engine.step()
        if len(seq.text) > printed:
            sys.stdout.write(seq.text[printed:])
            sys.stdout.flush()
            printed = len(seq.text)
    elapsed = time.perf_counter() - start
    m = loaded.runtime.metrics
    n = len(seq.output_ids)
    tpot = f"{seq.tpot_s * 1000:.1f} ms" if seq.tpot_s else "n/a"
    print()
    print(
        f"[moetide] prompt {len(ids)} tok | output {n} tok ({seq.finish_reason}) | TTFT {seq.ttft_s * 1000:.1f} ms"
        f" | TPOT {tpot} | {n / elapsed:.1f} tok/s | experts moved {format_bytes(m.bytes_h2d)}"
        f" | hit rate {m.hit_rate:.1%} | {loaded.device.type} {config.policy}",
        file=sys.stderr,
    )
    return 0


# -- info --------------------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    from .engine.llm import demo_model_path
    from .models.info import describe_checkpoint

    print(describe_checkpoint(args.path or demo_model_path()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moetide", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion of one prompt to the terminal")
    g.add_argument("prompt")
    add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="no chat template: complete the prompt text as is")
    g.add_argument("--quiet", action="store_true", help="no progress bar while loading")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="describe a checkpoint: family, layers, experts, sizes")
    i.add_argument("path", nargs="?", default=None)
    i.set_defaults(func=cmd_info)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Sub-commands that live beside their subsystem (prepare, serve, bench, eval)."""
    registrars = []
    for module, attr in (
        ("moetide.store.prepare", "register_cli"),
        ("moetide.serve.cli", "register_cli"),
        ("moetide.bench.cli", "register_cli"),
        ("moetide.eval.cli", "register_cli"),
    ):
        try:
            mod = __import__(module, fromlist=[attr])
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("moetide"):
                continue  # subsystem not in this build
            raise
        registrars.append(getattr(mod, attr))
    return registrars


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except MoetideError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
