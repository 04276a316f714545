"""`moetide` command line: generate | info | prepare | serve | bench | eval.

Every user error is one line on stderr (`error: ...`) and exit status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

from .config import (
    COMPILE_MODES, CUDA_GRAPHS, DECODE_AHEAD, LO_KERNELS, ON_MISS, POLICIES, SEARCHERS, EngineConfig, format_bytes,
    parse_bytes,
)
from .errors import ConfigError, MoetideError
from .store.formats import LOW_BIT_FORMATS


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`error: ...`, exit 2) instead of the usage block."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


_NEGATIVE_VALUE = re.compile(r"-[0-9.]")


def join_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--gpu-memory -5GiB` -> `--gpu-memory=-5GiB`: argparse takes a value that starts with '-' (and is
    not a plain number) for an option and reports "expected one argument"; joined, the value reaches
    its own check, which says what is wrong with it."""
    takes_value = {
        option
        for p in _all_parsers(parser)
        for option, action in p._option_string_actions.items()
        if action.nargs != 0
    }
    out = []
    for i, token in enumerate(argv):
        if out and out[-1] in takes_value and _NEGATIVE_VALUE.match(token) and argv[i - 1] == out[-1]:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def add_engine_args(p: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    """Options shared by every command that loads a model (mapped onto `EngineConfig`)."""
    where = {"help": "checkpoint directory (default: the embedded demo model)", "default": None}
    p.add_argument(*(["model"] if model_positional else ["--model"]), **where, **({"nargs": "?"} if model_positional else {}))
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: CUDA when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--gpu-memory",
        default=None,
        help="hard cap on moetide's device memory, e.g. 6GiB, or NN%% (the fixed part + NN%% of all"
        " experts in hi precision)",
    )
    p.add_argument("--cpu-memory", default=None, help="hard cap on host memory for expert versions, e.g."
                   " 24GiB (default: what the machine can spare; docs/memory.md)")  # fmt: skip
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
        " default: <model>/.moetide-cache)",
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


def add_step_args(p: argparse.ArgumentParser) -> None:
    """How each step runs: kernel, graphs, compile, determinism, FineMoE's searcher."""
    p.add_argument(
        "--lo-kernel",
        default="auto",
        choices=LO_KERNELS,
        help="how experts are computed: the per-expert reference (dequant), the fused Triton kernel"
        " (triton; CUDA), or auto (default: triton on CUDA, else dequant)",
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
        "--searcher",
        default="process",
        choices=SEARCHERS,
        help="where FineMoE's map searcher runs (finemoe, combined): its own process (default) or a"
        " thread of the engine's process",
    )


def engine_config_from_args(args) -> EngineConfig:
    """The `EngineConfig` of the engine options; a relative `--gpu-memory NN%` is resolved against
    the model (built on the meta device: no weights are read)."""
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
    if args.gpu_memory is None:
        return config
    return dataclasses.replace(config, gpu_memory_bytes=resolve_budget(args.gpu_memory, config))


def precision_options_from_args(args) -> dict:
    """The `EngineConfig` fields of --hi, --ladder, --host-versions, --lo-kernel, --cuda-graphs and --searcher
    (shared with `moetide bench`)."""
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
    }


# -- generate --------------------------------------------------------------------------------------------
def cmd_generate(args) -> int:
    from .engine.detokenize import TextStream
    from .engine.llm import build_engine, context_length, quiet_tokenizer
    from .engine.sampling import SamplingParams
    from .models.checkpoint import inspect_checkpoint, load_tokenizer

    # everything the user typed is checked before the weights load (seconds to minutes)
    if not args.prompt.strip():
        raise ConfigError("the prompt is empty; give the text to complete, e.g. moetide generate \"Hello\"")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or None,
    )
    config = engine_config_from_args(args)
    info = inspect_checkpoint(config.model_path)
    tokenizer = quiet_tokenizer(load_tokenizer(config.model_path))
    ids = prompt_ids(tokenizer, args.prompt, chat=not args.raw)
    check_context(len(ids), params.max_tokens, context_length(config, info.config))
    loaded, engine, tokenizer = build_engine(config, progress=not args.quiet)
    loaded.runtime.metrics.reset()
    start = time.perf_counter()
    seq = engine.add_request(ids, params)
    stream = TextStream(params.stop)
    while engine.has_unfinished():
        engine.step()
        # only text later tokens cannot change: no half UTF-8 character, no half stop string
        sys.stdout.write(stream.delta(seq.text, seq.finished))
        sys.stdout.flush()
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


def prompt_ids(tokenizer, text: str, *, chat: bool) -> list[int]:
    """The prompt's token ids: one user turn through the chat template when asked and the tokenizer
    has one (encoded as the server and `LLM.chat` do: special-token text stays text), else the text
    as is."""
    if chat and getattr(tokenizer, "chat_template", None):
        from .engine.chat import ChatEncoder

        return ChatEncoder(tokenizer).encode([{"role": "user", "content": text}])
    return list(tokenizer.encode(text))


def check_context(prompt_tokens: int, max_tokens: int, context: int) -> None:
    """The prompt and `--max-tokens` must fit the context together (ConfigError saying what fits)."""
    if prompt_tokens >= context:
        raise ConfigError(
            f"the prompt has {prompt_tokens} tokens; the context holds {context} (prompt + output):"
            " shorten the prompt"
        )
    if prompt_tokens + max_tokens > context:
        raise ConfigError(
            f"--max-tokens {max_tokens} does not fit: the prompt's {prompt_tokens} tokens + {max_tokens}"
            f" exceed the context of {context} tokens; use --max-tokens {context - prompt_tokens} or less"
        )


# -- info --------------------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    from .engine.host_memory import describe_needs, host_cap
    from .engine.llm import demo_model_path
    from .engine.memory import resolve_budget
    from .models.info import describe_checkpoint
    from .models.loader import resolve_device

    path = args.path or demo_model_path()
    print(describe_checkpoint(path))
    config = EngineConfig(model=str(path), device=args.device,
                          cpu_memory_bytes=parse_bytes(args.cpu_memory) if args.cpu_memory else None)  # fmt: skip
    config = dataclasses.replace(config, gpu_memory_bytes=resolve_budget(args.gpu_memory, config))
    device = resolve_device(args.device)
    gpu = "no cap" if config.gpu_memory_bytes is None else format_bytes(config.gpu_memory_bytes)
    print(
        f"\nmemory per policy on {device.type} (--gpu-memory {gpu}; host cap {format_bytes(host_cap(config))})"
    )
    print("\n".join(describe_needs(config, device.type)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="moetide", description=__doc__.splitlines()[0])
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
    i.add_argument(
        "--device", default=None, help="the device the needs are for (default: CUDA when available)"
    )
    i.add_argument(
        "--gpu-memory", default=None, help="the device budget the needs are for, e.g. 16GiB or 25%%"
    )
    i.add_argument(
        "--cpu-memory",
        default=None,
        help="the host cap to compare against (default: what the machine can spare)",
    )
    i.set_defaults(func=cmd_info)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Sub-commands that live beside their subsystem (prepare, serve, bench, eval)."""
    registrars = []
    for command, module, attr in (
        ("prepare", "moetide.models.prepare", "register_cli"),
        ("serve", "moetide.serve.cli", "register_cli"),
        ("bench", "moetide.bench.cli", "register_cli"),
        ("eval", "moetide.eval.cli", "register_cli"),
    ):
        try:
            mod = __import__(module, fromlist=[attr])
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("moetide"):
                continue  # subsystem not in this build
            # a dependency of that one command is missing: the others still run, it says what to install
            registrars.append(_missing_dependency(command, e.name))
            continue
        registrars.append(getattr(mod, attr))
    return registrars


_MISSING: dict[str, str] = {}  # sub-command -> the package it needs and this install lacks


def _missing_dependency(command: str, package: str):
    """A stand-in sub-command (`moetide serve` without uvicorn, say): listed, and `main` refuses it
    with one line before parsing its arguments."""
    _MISSING[command] = package

    def register(subparsers) -> None:
        subparsers.add_parser(command, help=f"(needs the {package} package)")

    return register


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _MISSING:
        package = _MISSING[argv[0]]
        print(f"error: moetide {argv[0]} needs the {package} package: pip install {package}", file=sys.stderr)
        return 2
    args = parser.parse_args(join_negative_values(parser, argv))
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
