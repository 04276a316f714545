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

The arena carries a content hash (`store/checked_file.py`), checked on every load with its dtype,
shape and layout record: a cache that fails any of them is rebuilt from the checkpoint's experts,
with one line on stderr saying why.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..progress import bar, on_terminal
from .checked_file import DamagedFileError, check_tensor, open_checked, save_checked
from .host_store import HostExpertStore

FORMAT_VERSION = 2  # 2: keys by the values' dtype and the format spec (per-matrix bits and groups)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


_PACKAGE = Path(__file__).resolve().parents[1]  # the installed moetide package


def default_cache_dir(checkpoint: Path) -> Path:
    """`<checkpoint>/.moetide-cache` when writable, else `$MOETIDE_CACHE/<hash of the path>` (default
    `~/.cache/moetide/<hash>`). The embedded demo model is the package's own files, not the user's
    folder: its cache always goes to the second place."""
    resolved = checkpoint.resolve()
    if os.access(checkpoint, os.W_OK) and not resolved.is_relative_to(_PACKAGE):
        return checkpoint / ".moetide-cache"
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
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
        raise ValueError(f"{record['nbytes']} bytes per expert recorded, {meta.nbytes} in this layout")
    return meta


def load_cached(store: HostExpertStore, path: Path, precision: str) -> bool:
    """Adopt a cached lo arena if one is there and intact; False when there is none, or when it is
    damaged (its content hash, dtype, shape or layout is not what this store needs) and the store can
    quantize it again: then one line on stderr says so.

    Raises:
        CheckpointError: the cache is damaged and the store has no hi experts to rebuild it from.
    """
    if not path.is_file():
        return False
    try:
        arena, meta, record = _read_arena(store, path, precision)
        store.load_precision(precision, arena, meta)
        # hashed as the store holds it: the copy that had to be made anyway is what is checked
        try:
            check_tensor(record, "arena", store.versions[precision])
        except DamagedFileError:
            store.drop_precision(precision)
            raise
    except DamagedFileError as e:
        if "hi" not in store.versions and not store.hi_mapped:
            raise CheckpointError(
                f"prepared cache {path} is damaged ({e}) and the checkpoint's experts are not loaded to"
                " rebuild it: delete the file and run `moetide prepare` again"
            ) from None
        print(f"[moetide] prepared cache {path} is damaged ({e}): rebuilding it from the checkpoint",
              file=sys.stderr, flush=True)  # fmt: skip
        return False
    return True


def _read_arena(store: HostExpertStore, path: Path, precision: str):
    """The cached `(L*E, nbytes)` uint8 arena (mapped, not hashed yet), its layout and the file's
    record, checked against this store.

    Raises:
        DamagedFileError: saying what does not match.
    """
    tensors, record = open_checked(path)
    arena = tensors.get("arena")
    if arena is None or len(tensors) != 1:
        raise DamagedFileError(f"holds {sorted(tensors)}, not one tensor 'arena'")
    if record.get("precision") != precision:
        raise DamagedFileError(f"holds precision {record.get('precision')!r}, not {precision!r}")
    try:
        meta = _meta_from_record(record, store.shape.dtype)
    except (KeyError, ValueError) as e:
        raise DamagedFileError(f"its layout record is incomplete or invalid ({e})") from None
    rows = store.num_layers * store.num_experts
    if arena.dtype != torch.uint8 or tuple(arena.shape) != (rows, meta.nbytes):
        raise DamagedFileError(
            f"its arena is {str(arena.dtype).removeprefix('torch.')} {tuple(arena.shape)},"
            f" this model needs uint8 {(rows, meta.nbytes)}"
        )
    return arena, meta, record


class _LineProgress:
    """Progress off a terminal: one line when done, no bar redrawn into a log file."""

    def __init__(self, total: int, desc: str, unit: str):
        self.total, self.desc, self.unit, self.n = total, desc, unit, 0
        self.start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        before, self.n = self.n, self.n + n
        tenth = max(1, self.total // 10)
        if self.n < self.total and before // tenth != self.n // tenth:  # a line every tenth, with an ETA
            seconds = time.perf_counter() - self.start
            eta = seconds * (self.total - self.n) / self.n
            print(f"{self.desc}: {self.n}/{self.total} {self.unit}s, {seconds:.1f} s, ETA {eta:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            seconds = time.perf_counter() - self.start
            print(f"{self.desc}: {self.n} {self.unit}s in {seconds:.1f} s", file=sys.stderr, flush=True)


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True):
    """A tqdm bar with rate and ETA on a terminal; one summary line otherwise; nothing if disabled."""
    if enabled and not on_terminal():
        return _LineProgress(total, desc, unit)
    return bar(total=total, desc=desc, unit=unit, enabled=enabled, leave=False)


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
        store.add_precision(
            precision, progress=bar, device=device, hessians=hessians, experts_per_batch=per_batch
        )
    if not write_cache:
        return None
    try:
        save_checked({"arena": store.versions[precision]}, path, _meta_record(store.meta[precision]))
    except OSError:
        return None  # read-only location: the versions still live in memory for this run
    return path
