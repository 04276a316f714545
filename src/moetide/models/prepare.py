"""`moetide prepare`: read a checkpoint's experts and write each lo precision's cache once.

The cache format and the quantization are the store's (`store/prepare.py`); reading the checkpoint
is the loader's.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from ..store.prepare import ensure_precision
from .loader import load_weights


def prepare(
    model_path: str,
    precisions: list[str],
    *,
    cache_dir: str | None = None,
    dtype: str = "bfloat16",
    progress: bool = True,
) -> list[Path]:
    """Read the checkpoint's experts into a host store and write each lo precision's cache."""
    loaded = load_weights(model_path, device="cpu", dtype=dtype, progress=progress)
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
    p.add_argument("--lo", default="int4,int2", help="comma-separated lo precisions (int4, int2)")
    p.add_argument("--cache-dir", default=None, help="where to write (default: <model>/.moetide-cache)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="storage dtype the versions are quantized from (bfloat16 = what CUDA runs)",
    )
    p.set_defaults(func=_cmd_prepare)


def _cmd_prepare(args) -> int:
    precisions = [p.strip() for p in args.lo.split(",") if p.strip()]
    bad = [p for p in precisions if p not in ("int4", "int2")]
    if bad or not precisions:
        raise CheckpointError(f"--lo takes int4 and/or int2, got {args.lo!r}")
    for path in prepare(args.model, precisions, cache_dir=args.cache_dir, dtype=args.dtype):
        print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0
