"""Build lo versions (int4/int2) of every expert once and cache them on disk (`moetide prepare`'s
format; the command itself is in `models/prepare.py`, since reading a checkpoint needs its family).

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

from ..errors import CheckpointError
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
    if spec.calibration:  # the calibration data and method decide the codes too
        from .calibrate import calibration_settings

        h.update(f":{spec.calibration}:{quant.GPTQ_DAMP}:{calibration_settings()}".encode())
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
    device_bytes: int | None = None,
) -> Path | None:
    """Give `store` a `precision` version: from the disk cache, else by quantizing (and caching).
    `device_bytes`: what the quantizer may allocate on the GPU (the budget left beside the fixed
    part); its batches are sized to it, and with less than one expert's worth it runs on the CPU."""
    path = cache_file(checkpoint, precision, store.values_dtype, cache_dir)
    if load_cached(store, path, precision):
        return path
    total = store.num_layers * store.num_experts
    device = "cuda" if torch.cuda.is_available() else None
    per_batch = None
    if device is not None and device_bytes is not None:
        per_batch = store.experts_fitting(device_bytes)
        if per_batch == 0:
            device, per_batch = None, None  # not even one expert fits: quantize in host memory
    hessians = None
    from . import quant

    if quant.format_spec(precision).calibration:
        from .calibrate import expert_hessians

        hessians = expert_hessians(checkpoint, path.parent, total, device)
    with progress_bar(total, f"quantizing experts to {precision}", "expert", progress) as bar:
        store.add_precision(precision, progress=bar, device=device, hessians=hessians, experts_per_batch=per_batch)
    if not write_cache:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a temporary name of this process's own: another process may be writing the same file
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        save_file(
            {"arena": store.versions[precision]}, str(tmp), metadata=_meta_record(store.meta[precision])
        )
        tmp.replace(path)
    except OSError:
        return None  # read-only location: the versions still live in memory for this run
    return path
