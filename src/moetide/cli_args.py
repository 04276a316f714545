"""The engine options every command that loads a model shares: their argparse flags and their mapping
onto `EngineConfig`. The `moetide` command line (cli.py) and the sub-commands that live beside their
subsystem (serve/cli.py, bench/cli.py) import them from here.
"""

from __future__ import annotations

import argparse
import dataclasses

from .config import (
    COMPILE_MODES,
    CUDA_GRAPHS,
    DECODE_AHEAD,
    LO_KERNELS,
    ON_MISS,
    POLICIES,
    RELATIVE_BUDGET_HELP,
    SEARCHERS,
    EngineConfig,
    parse_bytes,
)
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
    add_memory_args(p)
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
        default="auto",
        choices=list(ON_MISS),
        help="an expert with no device version: run its resident lo version (lo) or read it from pinned"
        " host memory in the kernel (zero-copy); either way it is copied in for the next steps;"
        " auto: lo where the policy keeps lo versions resident, else zero-copy",
    )
    p.add_argument("--prefetch-distance", type=int, default=2, help="FineMoE prefetch distance d (layers)")
    p.add_argument(
        "--hi",
        dest="hi_precision",
        default="bf16",
        choices=["bf16", *LOW_BIT_FORMATS],
        help="hot experts' precision for dynaexq/combined (a low-bit one, e.g. --hi int4 --lo int2+4; lo"
        " then defaults to int2; more than two tiers: --ladder)",
    )
    p.add_argument(
        "--ladder",
        default=None,
        help="dynaexq/combined's precision tiers, hottest first, e.g. 'bf16>int4>int2': every expert keeps"
        " its coldest version resident and the tiers above it share the rest of the budget (the hottest"
        " experts in the top tier, the next in the next); sets --hi and --lo from its ends",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where prepared lo versions are read and written (as `moetide prepare --cache-dir`;"
        " default: <model>/.moetide-cache, or ~/.cache/moetide for the demo model and read-only folders)",
    )
    p.add_argument(
        "--host-versions",
        default=None,
        help="expert versions to keep in host memory, e.g. 'lo' or 'hi,lo' (default: all); a version"
        " can be dropped only where the device holds it for every expert",
    )
    add_step_args(p)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="tokens of paged KV cache to reserve inside --gpu-memory (default: a tenth of the budget,"
        " at least one full-length sequence, plus whatever the expert pools leave); more admits more"
        " sequences at once, less leaves more room for experts",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="do not reuse the KV blocks of a request's longest cached prefix (default: reuse them)",
    )


def add_memory_args(p: argparse.ArgumentParser) -> None:
    """The device and host memory caps (`EngineConfig.gpu_memory_bytes`, `cpu_memory_bytes`)."""
    p.add_argument(
        "--gpu-memory",
        default=None,
        help=f"hard cap on moetide's device memory, e.g. 6GiB, or NN%%; {RELATIVE_BUDGET_HELP}",
    )
    p.add_argument(
        "--cpu-memory",
        default=None,
        help="hard cap on moetide's host memory for expert versions, e.g. 24GiB (default: what the"
        " machine can spare); below the model's experts, hi versions are read from the mapped checkpoint",
    )


def add_step_args(p: argparse.ArgumentParser) -> None:
    """How each step runs: kernel, graphs, compile, determinism, FineMoE's searcher."""
    p.add_argument(
        "--lo-kernel",
        default="auto",
        choices=LO_KERNELS,
        help="how experts are computed: the per-expert reference (dequant), the fused kernel with its"
        " Triton tiles only (triton; CUDA), the fused kernel with the tensor-core kernels for int2/int4"
        " pools (cuda), or auto (default: cuda on CUDA, else dequant)",
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
        "--deterministic",
        action="store_true",
        help="residency decisions depend on the request stream alone (copies published at step"
        " boundaries, searches inline, DynaExq updates by step count): identical runs, identical tokens",
    )
    p.add_argument(
        "--wait-for-copies",
        action="store_true",
        help="a layer whose expert is still being copied in waits for the copy on the device (a late"
        " prefetch becomes a hit with a stall) instead of reading it from host memory or running lo",
    )
    p.add_argument(
        "--compile",
        default="off",
        choices=COMPILE_MODES,
        help="torch.compile each captured decode step before capturing it (auto; CUDA only), or not (off,"
        " the default)",
    )
    p.add_argument(
        "--decode-ahead",
        default="auto",
        choices=DECODE_AHEAD,
        help="launch each decode step before the host reads the last step's tokens, where every row is"
        " greedy and nothing waits to be prefilled (auto, the default), or read every step's tokens"
        " first (off)",
    )
    p.add_argument(
        "--map-store",
        default=None,
        metavar="PATH",
        help="FineMoE's expert-map store (finemoe, combined): loaded from PATH where the file exists,"
        " written there when generate ends, the engine closes or the server shuts down (bench: loaded"
        " for every run, never written)",
    )
    p.add_argument(
        "--searcher",
        default="process",
        choices=SEARCHERS,
        help="where FineMoE's map searcher runs (finemoe, combined): its own process (default) or a"
        " thread of the engine's process",
    )


def engine_config_from_args(args, **overrides) -> EngineConfig:
    """The `EngineConfig` of the engine options and `overrides` (fields a command sets itself); a
    relative `--gpu-memory NN%` is then resolved against that config (the model built on the meta
    device: no weights are read)."""
    from .engine.llm import demo_model_path
    from .engine.memory import resolve_budget

    config = EngineConfig(
        model=str(args.model or demo_model_path()),
        device=args.device,
        dtype=args.dtype,
        policy=args.policy,
        lo_precision=args.lo_precision,
        on_miss=args.on_miss,
        prefetch_distance=args.prefetch_distance,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_tokens=getattr(args, "kv_cache_tokens", None),
        prefix_caching=getattr(args, "prefix_caching", True),
        cpu_memory_bytes=parse_bytes(args.cpu_memory) if args.cpu_memory else None,
        **precision_options_from_args(args),
    )
    config = dataclasses.replace(config, **overrides)
    if args.gpu_memory is None:
        return config
    return dataclasses.replace(config, gpu_memory_bytes=resolve_budget(args.gpu_memory, config))


def precision_options_from_args(args) -> dict:
    """The `EngineConfig` fields of --hi, --ladder, --host-versions, --lo-kernel, --cuda-graphs,
    --searcher and --map-store (shared with `moetide bench`)."""
    return {
        "hi_precision": "hi" if args.hi_precision == "bf16" else args.hi_precision,
        "ladder": args.ladder,
        "cache_dir": args.cache_dir,
        "host_versions": None
        if args.host_versions is None
        else tuple(v for v in args.host_versions.split(",") if v),
        "lo_kernel": args.lo_kernel,
        "cuda_graphs": args.cuda_graphs,
        "compile": args.compile,
        "decode_ahead": args.decode_ahead,
        "deterministic": args.deterministic,
        "wait_for_copies": args.wait_for_copies,
        "searcher": args.searcher,
        "map_store": args.map_store,
    }
