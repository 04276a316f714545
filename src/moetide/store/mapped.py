"""The checkpoint as the bottom tier: routed-expert tensors read in place from the safetensors files.

Each shard is memory-mapped read-only; a tensor is a `torch.frombuffer` view of the map, so its
bytes are the page cache's, never a private copy of the file. `MappedExperts` indexes the
gate (I, H), up (I, H) and down (H, I) tensor of every (MoE layer, expert) and writes one expert
into the store's hi layout (`host_store.hi_views`) on request: the only read of expert bytes.
"""

from __future__ import annotations

import json
import mmap
import struct
import threading
import time
import warnings
from pathlib import Path

import torch

from ..errors import CheckpointError

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
ROLES = ("gate", "up", "down")


def _data_offsets(path: Path) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int]]]:
    """`(start of the data section, name -> (dtype, shape, byte offset in the file))` of one shard."""
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    table = {}
    for name, entry in header.items():
        if name != "__metadata__":
            table[name] = (entry["dtype"], tuple(entry["shape"]), base + entry["data_offsets"][0])
    return base, table


class MappedExperts:
    """Every routed expert's tensors as views of the mapped shards; counts what it reads.

    `index[(layer, expert, role)]` = (shard number, dtype, shape, byte offset); `layer` is the MoE
    layer's number (0..L-1), as the host store numbers them.
    """

    def __init__(self, info, layer_to_moe: dict[int, int]):
        self._maps: list[mmap.mmap] = []
        self._files = []
        self._bytes: list[torch.Tensor] = []  # each map as one uint8 tensor
        self.index: dict[tuple[int, int, str], tuple[int, torch.dtype, tuple[int, ...], int]] = {}
        adapter = info.adapter
        for number, shard in enumerate(info.shards):
            _, table = _data_offsets(shard.path)
            f = shard.path.open("rb")
            self._files.append(f)
            self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            with warnings.catch_warnings():  # read-only on purpose: nothing writes to the map
                warnings.simplefilter("ignore", UserWarning)
                self._bytes.append(torch.frombuffer(self._maps[-1], dtype=torch.uint8))
            for name, (dtype, shape, offset) in table.items():
                key = adapter.match_expert_key(name)
                if key is None:
                    continue
                layer_idx, expert, role = key
                if layer_idx not in layer_to_moe:
                    raise CheckpointError(f"expert tensor {name!r} belongs to a layer without experts")
                if dtype not in _DTYPES:
                    raise CheckpointError(f"expert tensor {name!r} has dtype {dtype}, not a float type")
                self.index[(layer_to_moe[layer_idx], expert, role)] = (number, _DTYPES[dtype], shape, offset)
        self.checkpoint_dtype = next(iter(self.index.values()))[1] if self.index else None
        self._lock = threading.Lock()
        self.reads = 0  # experts read from the map
        self.read_bytes = 0  # checkpoint bytes those reads covered
        self.read_s = 0.0  # seconds spent reading (page faults included)
        self.reads_by_thread: dict[str, int] = {}  # thread name -> experts it read

    def has(self, layer: int, expert: int, role: str) -> bool:
        return (layer, expert, role) in self.index

    def tensor(self, layer: int, expert: int, role: str, rows: int | None = None) -> torch.Tensor:
        """One expert tensor `(rows or all rows, cols)` as a view of the map (no copy, read-only)."""
        number, dtype, shape, offset = self.index[(layer, expert, role)]
        count = shape[1] * (shape[0] if rows is None else min(rows, shape[0]))
        nbytes = count * dtype.itemsize
        return self._bytes[number][offset : offset + nbytes].view(dtype).view(-1, shape[1])

    def read_into(self, layer: int, expert: int, views: dict[str, torch.Tensor], inter: int) -> None:
        """Write one expert into hi views `gate_up (2I, H)`, `down (H, I)` (converting the dtype)."""
        start = time.perf_counter()
        nbytes = 0
        for role, target in (
            ("gate", views["gate_up"][:inter]),
            ("up", views["gate_up"][inter:]),
            ("down", views["down"]),
        ):
            src = self.tensor(layer, expert, role)
            if tuple(src.shape) != tuple(target.shape):
                raise CheckpointError(
                    f"expert tensor {role} of layer {layer} expert {expert} has shape {tuple(src.shape)},"
                    f" expected {tuple(target.shape)}"
                )
            target.copy_(src)
            nbytes += src.numel() * src.element_size()
            self._drop_pages(layer, expert, role)
        with self._lock:
            self.reads += 1
            self.read_bytes += nbytes
            self.read_s += time.perf_counter() - start
            name = threading.current_thread().name
            self.reads_by_thread[name] = self.reads_by_thread.get(name, 0) + 1

    def _drop_pages(self, layer: int, expert: int, role: str) -> None:
        """Unmap the pages of one tensor that has been copied out: they stay in the page cache,
        but leave this process's resident set (a file-backed map's pages count in RSS)."""
        number, dtype, shape, offset = self.index[(layer, expert, role)]
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        stop = (offset + shape[0] * shape[1] * dtype.itemsize) // mmap.PAGESIZE * mmap.PAGESIZE
        if stop > start and hasattr(mmap, "MADV_DONTNEED"):
            self._maps[number].madvise(mmap.MADV_DONTNEED, start, stop - start)

    def close(self) -> None:
        self._bytes = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view still alive keeps its map until it goes
                pass
        for f in self._files:
            f.close()
        self._maps, self._files = [], []
