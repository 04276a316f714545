"""`moetide prepare`: read a checkpoint's experts and write each lo precision's cache once.

The cache format and the quantization are the store's (`store/prepare.py`); reading the checkpoint
is the loader's.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError, ConfigError
from ..progress import on_terminal
from ..store.formats import precision_names


def prepare(
    model_path: str,
    precisions: list[str],
    *,
    cache_dir: str | None = None,
    dtype: str = "auto",
    progress: bool = True,
) -> list[Path]:
    """Read the checkpoint's experts into a host store and write each lo precision's cache.

    The cache key depends on the values quantized, not on the storage dtype, so what this writes is
    what `generate`/`serve`/`bench` read on any device (given the same `--cache-dir`)."""
    from ..store.prepare import ensure_precision
    from .loader import load_weights

    # the loader's bar only on a terminal: a log gets the one line per precision the store prints
    loaded = load_weights(model_path, device="cpu", dtype=dtype, progress=progress and on_terminal())
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
    p.set_defaults(func=_cmd_prepare)


def _cmd_prepare(args) -> int:
    precisions = [p.strip() for p in args.lo.split(",") if p.strip()]
    bad = [p for p in precisions if p not in precision_names(low_bit_only=True)]
    if bad or not precisions:
        names = ", ".join(precision_names(low_bit_only=True))
        raise ConfigError(f"--lo takes one or more of {names} (comma-separated), got {args.lo!r}")
    for path in prepare(args.model, precisions, cache_dir=args.cache_dir, dtype=args.dtype):
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0
