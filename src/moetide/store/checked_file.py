"""safetensors cache files that carry a content hash per tensor, written atomically.

`save_checked` writes `{name: tensor}` with, in the file's metadata, `sha256.<name>`: a SHA-256 over
the SHA-256s of the tensor's bytes in `HASH_CHUNK_BYTES` chunks (with its dtype and shape), so that the
chunks are hashed on several threads. A hash per tensor rather than per file: it
covers exactly the bytes a store adopts and lives in the header of the file it checks (a file hash
cannot be inside its own file, and a side file can be lost or copied apart from it).

The file is written under a temporary name of this process's own (another process may write the
same cache) and renamed into place; the temporary file is removed on every path, failures included.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

HASH_CHUNK_BYTES = 64 << 20  # chunks hashed in parallel: enough of them for 8 threads at ~1 GB
HASH_THREADS = min(8, os.cpu_count() or 1)  # hashlib releases the GIL while it hashes a chunk
_HASH_KEY = "sha256."
_CHUNK_KEY = "sha256_chunk_bytes"


class DamagedFileError(Exception):
    """A cache file that cannot be trusted: unreadable, a tensor without its hash or with another
    hash, or a header that does not describe what its reader expects. The message says which."""


def tensor_digest(tensor: torch.Tensor, chunk_bytes: int = HASH_CHUNK_BYTES) -> str:
    """Hex SHA-256 of a CPU tensor's dtype, shape and bytes (a hash of its chunks' hashes)."""
    data = memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    chunks = [data[i : i + chunk_bytes] for i in range(0, len(data), chunk_bytes)]
    if len(chunks) > 1 and HASH_THREADS > 1:
        with ThreadPoolExecutor(min(HASH_THREADS, len(chunks))) as pool:
            digests = list(pool.map(lambda c: hashlib.sha256(c).digest(), chunks))
    else:
        digests = [hashlib.sha256(c).digest() for c in chunks]
    top = hashlib.sha256(f"{tensor.dtype}:{tuple(tensor.shape)}:{chunk_bytes};".encode())
    for digest in digests:
        top.update(digest)
    return top.hexdigest()


def save_checked(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """Write `tensors` to `path` with a content hash per tensor in the metadata, atomically.

    Raises:
        OSError: the location cannot be written, or the write failed (a full disk); nothing is left.
    """
    record = dict(metadata or {})
    record[_CHUNK_KEY] = str(HASH_CHUNK_BYTES)
    record.update({_HASH_KEY + name: tensor_digest(t) for name, t in tensors.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        try:
            save_file(tensors, str(tmp), metadata=record)
        except SafetensorError as e:  # the writer's own error type for a failed write (a full disk)
            raise OSError(f"cannot write {tmp}: {e}") from None
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)  # gone already after the rename; left by a failed write or rename


def open_checked(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of `path` (mapped from the file, not hashed yet: `check_tensor`) and its metadata.

    Raises:
        DamagedFileError: unreadable, or without a content hash for every tensor.
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            record = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise DamagedFileError(f"unreadable: {e}") from None
    if _CHUNK_KEY not in record:
        raise DamagedFileError("no content hash (written by an older moetide)")
    if record[_CHUNK_KEY] != str(HASH_CHUNK_BYTES):
        raise DamagedFileError(f"hashed in chunks of {record[_CHUNK_KEY]!r} bytes, not {HASH_CHUNK_BYTES}")
    missing = [name for name in tensors if _HASH_KEY + name not in record]
    if missing:
        raise DamagedFileError(f"no content hash for tensor {missing[0]!r}")
    return tensors, record


def check_tensor(record: dict[str, str], name: str, tensor: torch.Tensor) -> None:
    """Raise DamagedFileError unless `tensor` (the file's tensor `name`, or a copy of it) has the
    bytes `record` hashed."""
    if tensor_digest(tensor) != record.get(_HASH_KEY + name):
        raise DamagedFileError(f"the content hash of tensor {name!r} does not match its bytes")


def load_checked(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of `path` and its metadata, each tensor's hash checked.

    Raises:
        DamagedFileError: unreadable, or a tensor's hash missing or different.
    """
    tensors, record = open_checked(path)
    for name, tensor in tensors.items():
        check_tensor(record, name, tensor)
    return tensors, record
