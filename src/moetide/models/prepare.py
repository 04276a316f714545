"""`moetide prepare`: read a checkpoint's experts and write each lo precision's cache once.

The cache format and the quantization are the store's (`store/prepare.py`); reading the checkpoint
is the loader's.
"""

from __future__ import annotations

from pathlib import Path

from ..config import format_bytes, parse_bytes, typed_size
from ..errors import BudgetError, CheckpointError, ConfigError
from ..progress import on_terminal
from ..store.formats import precision_names


def prepare(
    model_path: str,
    precisions: list[str],
    *,
    cache_dir: str | None = None,
    dtype: str = "auto",
    progress: bool = True,
    cpu_memory_bytes: int | None = None,
) -> list[Path]:
    """Read the checkpoint's experts into a host store and write each lo precision's cache.

    The cache key depends on the values quantized, not on the storage dtype, so what this writes is
    what `generate`/`serve`/`bench` read on any device (given the same `--cache-dir`).
    `cpu_memory_bytes`: the host cap on expert versions (None: what the machine can spare); below
    every hi version + the largest lo version, the experts are read from the mapped checkpoint
    through the quantizer in batches inside the cap, and each lo version is freed once written."""
    from ..store.host_ram import machine_spare_bytes
    from ..store.tracker import BudgetTracker
    from .loader import load_weights

    cap = cpu_memory_bytes if cpu_memory_bytes is not None else machine_spare_bytes()
    map_hi = _check_cap(model_path, precisions, dtype, cap, cpu_memory_bytes is not None)
    # the loader's bar only on a terminal: a log gets the one line per precision the store prints
    loaded = load_weights(model_path, device="cpu", dtype=dtype, progress=progress and on_terminal(),
                          host_budget=BudgetTracker(cap), map_hi=map_hi)  # fmt: skip
    try:
        return _write_caches(loaded, precisions, cache_dir, progress, map_hi)
    finally:
        loaded.store.close()


def _check_cap(model_path, precisions, dtype: str, cap: int, given: bool) -> bool:
    """True when `cap` is below every hi version + the largest lo version (the experts are then read
    from the map); BudgetError below the largest lo version + one expert (one batch)."""
    import torch

    from ..store import quant
    from .checkpoint import inspect_checkpoint
    from .loader import resolve_dtype

    info = inspect_checkpoint(model_path)
    config, adapter = info.config, info.adapter
    store_dtype = resolve_dtype(dtype, config, torch.device("cpu"))
    inter, hidden = adapter.expert_intermediate(config), config.hidden_size
    experts = adapter.num_experts(config) * len({k[0] for s in info.shards for n in s.tensors
                                                 if (k := adapter.match_expert_key(n)) is not None})  # fmt: skip
    hi = 3 * inter * hidden * torch.empty((), dtype=store_dtype).element_size()
    largest = max(quant.nbytes_for(p, inter, hidden, store_dtype) for p in precisions) * experts
    if cap >= experts * hi + largest:
        return False
    minimum = largest + hi
    if cap < minimum:
        what = "--cpu-memory" if given else "what this machine can spare"
        raise BudgetError(
            f"quantizing to {', '.join(precisions)} holds {format_bytes(minimum)} of expert versions at least,"
            f" more than {what} ({format_bytes(cap)}); the smallest host budget is --cpu-memory {typed_size(minimum)}"
        )
    return True


def _write_caches(loaded, precisions, cache_dir, progress: bool, map_hi: bool) -> list[Path]:
    from ..store.prepare import ensure_precision

    written = []
    for precision in precisions:
        path = ensure_precision(
            loaded.store,
            loaded.info.path,
            precision,
            progress=progress,
            cache_dir=Path(cache_dir) if cache_dir else None,
        )
        if path is None:
            raise CheckpointError(
                f"cannot write the prepared cache next to {loaded.info.path}; pass --cache-dir"
            )
        written.append(path)
        if map_hi:  # written: its host copy makes room for the next precision
            loaded.store.drop_precision(precision)
    return written


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("prepare", help="quantize every expert to int4/int2 once and cache it on disk")
    p.add_argument("model", help="checkpoint directory")
    names = ", ".join(precision_names(low_bit_only=True))
    p.add_argument("--lo", default="int4,int2", help=f"comma-separated lo precisions ({names})")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where to write (default: <model>/.moetide-cache, or ~/.cache/moetide for the demo model and"
        " read-only folders)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="storage dtype while quantizing (auto: what the runtime uses here); the cache it writes"
        " serves every storage dtype of the same checkpoint values",
    )
    p.add_argument(
        "--cpu-memory",
        default=None,
        help="cap on host memory for expert versions, e.g. 24GiB (default: what the machine can spare);"
        " below the experts, they are read from the mapped checkpoint in batches",
    )
    p.set_defaults(func=_cmd_prepare)


def _cmd_prepare(args) -> int:
    precisions = [p.strip() for p in args.lo.split(",") if p.strip()]
    bad = [p for p in precisions if p not in precision_names(low_bit_only=True)]
    if bad or not precisions:
        names = ", ".join(precision_names(low_bit_only=True))
        raise ConfigError(f"--lo takes one or more of {names} (comma-separated), got {args.lo!r}")
    cap = parse_bytes(args.cpu_memory) if args.cpu_memory else None
    for path in prepare(
        args.model, precisions, cache_dir=args.cache_dir, dtype=args.dtype, cpu_memory_bytes=cap
    ):
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0
