"""`moetide prepare`: build lo versions (any low-bit format of `formats.FORMATS`) of every expert once
and cache them on disk.

Cache layout: `<cache dir>/<precision>-<key>.safetensors` with one tensor `arena (L*E, nbytes)` uint8
in the kernel-ready layout of `quant.expert_layout`, and the layout's parameters in the metadata.
`key` hashes the checkpoint's shard names, sizes and modification times, the dtype of the values
quantized (`HostExpertStore.values_dtype`: a bf16 checkpoint's is bf16 whether the store holds it in
bf16 on a GPU or widened to float32 on the CPU, since both quantize the same numbers to the same
bytes), the precision's format spec and the quantizer settings; any change to the checkpoint
invalidates the cache. A cached arena serves every storage dtype: only the layout's dequantize
target (`QuantMeta.dtype`) differs, and it is set from the store that loads it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..errors import CheckpointError, ConfigError
from .formats import precision_names
from .host_store import HostExpertStore

FORMAT_VERSION = 2  # 2: keys by the values' dtype and the format spec (per-matrix bits and groups)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def default_cache_dir(checkpoint: Path) -> Path:
    """`<checkpoint>/.moetide-cache` when writable, else `~/.cache/moetide/<hash of the path>`."""
    local = checkpoint / ".moetide-cache"
    if os.access(checkpoint, os.W_OK):
        return local
    digest = hashlib.sha256(str(checkpoint.resolve()).encode()).hexdigest()[:16]
    return Path(os.environ.get("MOETIDE_CACHE", Path.home() / ".cache" / "moetide")) / digest


def cache_key(checkpoint: Path, precision: str, values_dtype: torch.dtype) -> str:
    """Hash of the checkpoint's shards, the values' dtype, the format spec and the quantizer."""
    from . import quant

    spec = quant.format_spec(precision)
    h = hashlib.sha256()
    for shard in sorted(checkpoint.glob("*.safetensors")):
        st = shard.stat()
        h.update(f"{shard.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(
        f"{spec.name}:{spec.bits_gate_up}:{spec.bits_down}:{spec.group_size_gate_up}:{spec.group_size_down}"
        f":{_DTYPE_NAMES[values_dtype]}:{quant.DEFAULT_QUANT_METHOD}:{dict(quant.DEFAULT_GROUP_SIZE)}"
        f":{quant.HQQ_ITERS}:{quant.LS_ITERS}:{dict(quant.LS_CLIP_RATIOS)}".encode()
    )
    h.update(f"v{FORMAT_VERSION}".encode())
    return h.hexdigest()[:20]


def cache_file(
    checkpoint: Path, precision: str, values_dtype: torch.dtype, cache_dir: Path | None = None
) -> Path:
    """`<cache dir>/<precision>-<key>.safetensors` ("+" is kept: it is legal in file names)."""
    folder = cache_dir or default_cache_dir(checkpoint)
    return folder / f"{precision}-{cache_key(checkpoint, precision, values_dtype)}.safetensors"


def _meta_record(meta) -> dict[str, str]:
    return {
        "precision": meta.precision,
        "dtype": _DTYPE_NAMES[meta.dtype],  # informational: a loading store sets its own
        "intermediate_size": str(meta.intermediate_size),
        "hidden_size": str(meta.hidden_size),
        "group_size_gate_up": str(meta.group_size_gate_up),
        "group_size_down": str(meta.group_size_down),
        "quant_method": meta.quant_method,
        "nbytes": str(meta.nbytes),
    }


def _meta_from_record(record: dict[str, str], dtype: torch.dtype):
    """The layout a cache file records, with `dtype` (the loading store's) as dequantize target."""
    from . import quant

    meta = quant.expert_layout(
        record["precision"],
        int(record["intermediate_size"]),
        int(record["hidden_size"]),
        dtype,
        (int(record["group_size_gate_up"]), int(record["group_size_down"])),
        record["quant_method"],
    )
    if meta.nbytes != int(record["nbytes"]):
        raise CheckpointError("prepared cache was written by an incompatible moetide version; delete it")
    return meta


def load_cached(store: HostExpertStore, path: Path, precision: str) -> bool:
    """Adopt a cached lo arena if one matches; False when there is none (or it is unreadable)."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            record = f.metadata() or {}
            arena = f.get_tensor("arena")
    except Exception:
        return False  # a damaged cache is rebuilt, never trusted
    if record.get("precision") != precision:
        return False
    store.load_precision(precision, arena, _meta_from_record(record, store.shape.dtype))
    return True


class _LineProgress:
    """Progress off a terminal: one line when done, no bar redrawn into a log file."""

    def __init__(self, total: int, desc: str, unit: str):
        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self.start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            seconds = time.perf_counter() - self.start
            print(f"{self.desc}: {self.n} {self.unit}s in {seconds:.1f} s", file=sys.stderr, flush=True)


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True):
    """A tqdm bar with rate and ETA on a terminal; one summary line otherwise; nothing if disabled."""
    if not enabled:
        return tqdm(total=total, disable=True)
    if not sys.stderr.isatty():
        return _LineProgress(total, desc, unit)
    return tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)


def ensure_precision(
    store: HostExpertStore,
    checkpoint: Path,
    precision: str,
    *,
    progress: bool = True,
    cache_dir: Path | None = None,
    write_cache: bool = True,
) -> Path | None:
    """Give `store` a `precision` version: from the disk cache, else by quantizing (and caching)."""
    path = cache_file(checkpoint, precision, store.values_dtype, cache_dir)
    if load_cached(store, path, precision):
        return path
    total = store.num_layers * store.num_experts
    with progress_bar(total, f"quantizing experts to {precision}", "expert", progress) as bar:
        store.add_precision(precision, progress=bar, device="cuda" if torch.cuda.is_available() else None)
    if not write_cache:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(
            {"arena": store.versions[precision]}, str(tmp), metadata=_meta_record(store.meta[precision])
        )
        tmp.replace(path)
    except OSError:
        return None  # read-only location: the versions still live in memory for this run
    return path


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
    from ..models.loader import load_model

    # the loader's bar only on a terminal: a log gets the one line per precision `progress_bar` prints
    loaded = load_model(model_path, device="cpu", dtype=dtype, progress=progress and sys.stderr.isatty())
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
    p.add_argument("--cache-dir", default=None, help="where to write (default: <model>/.moetide-cache)")
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
