"""Checkpoint directory inspection: config, shards, tokenizer; every failure is one clear line.

Nothing here allocates model weights. Shard headers are read and checked against the file size so
that a truncated or corrupt shard is reported before loading starts, not halfway through it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, TokenizerError, UnsupportedModelError
from .registry import ADAPTERS, SUPPORTED_FAMILIES, FamilyAdapter, get_adapter

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


@dataclass(frozen=True)
class ShardInfo:
    """One safetensors file: its path and tensor table (name -> (dtype string, shape))."""

    path: Path
    tensors: dict[str, tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint directory holds, checked but not loaded."""

    path: Path
    config: object  # transformers.PretrainedConfig
    adapter: FamilyAdapter
    shards: tuple[ShardInfo, ...]


def read_shard_header(path: Path) -> ShardInfo:
    """Parse a safetensors header and check every tensor's bytes lie inside the file.

    Raises CheckpointError naming the file when it is truncated or not a safetensors file.
    """
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(
                    f"{path}: not a safetensors file (shorter than its 8-byte header length)"
                )
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8 or header_len > 100_000_000:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors shard (header runs past the end)"
                )
            header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path}: corrupt safetensors shard (unreadable header: {e.msg if hasattr(e, 'msg') else e})"
        )
    data_len = size - 8 - header_len
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    last = (0, "")  # the largest end offset in the data section, and its tensor
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            dtype, shape = entry["dtype"], tuple(entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: corrupt safetensors shard (bad entry for tensor {name!r})"
            ) from None
        if begin > end:
            raise CheckpointError(f"{path}: corrupt safetensors shard (tensor {name!r} ends before it begins)")
        tensors[name] = (dtype, shape)
        last = max(last, (end, name))
    if last[0] > data_len:  # sizes as the file system gives them: header length + header + data
        raise CheckpointError(
            f"{path}: truncated safetensors shard (its header describes {8 + header_len + last[0]:,} bytes,"
            f" the file has {size:,}; tensor {last[1]!r} ends past the end)"
        )
    return ShardInfo(path=path, tensors=tensors)


def load_config(path: Path):
    """The checkpoint's transformers config, or a CheckpointError that says what is wrong."""
    from transformers import AutoConfig

    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory (expected a folder with config.json)")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: not a checkpoint (no config.json)")
    try:
        raw = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / 'config.json'}: not valid JSON ({e})") from None
    model_type = raw.get("model_type")
    if model_type not in ADAPTERS:
        if not any(raw.get(k) for k in _EXPERT_COUNT_FIELDS):
            raise UnsupportedModelError(
                f"{path}: {model_type!r} is a dense (non-MoE) model; moetide serves MoE families: {SUPPORTED_FAMILIES}"
            )
        get_adapter(model_type)  # raises with the list of supported families
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types; the message is what matters
        raise CheckpointError(f"{path}: config.json could not be read by transformers ({e})") from None


def inspect_checkpoint(path: str | Path) -> CheckpointInfo:
    """Check a checkpoint directory without loading weights: config, family, shards, expert tensors."""
    path = Path(path).expanduser()
    config = load_config(path)
    adapter = get_adapter(config.model_type)
    shard_paths = sorted(path.glob("*.safetensors"))
    if not shard_paths:
        bins = list(path.glob("*.bin")) + list(path.glob("*.pt"))
        hint = " (found PyTorch .bin files: convert them to safetensors first)" if bins else ""
        raise CheckpointError(f"{path}: no *.safetensors weight files{hint}")
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            wanted = set(json.loads(index_path.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index_path}: unreadable shard index") from None
        missing = sorted(w for w in wanted if not (path / w).is_file())
        if missing:
            raise CheckpointError(f"{path}: shard {missing[0]} listed in the index is missing")
        shard_paths = [path / w for w in sorted(wanted)]
    shards = tuple(read_shard_header(p) for p in shard_paths)
    if not any(adapter.match_expert_key(n) for s in shards for n in s.tensors):
        raise CheckpointError(
            f"{path}: no expert tensors in the shards (expected names like {adapter.expert_key_pattern})"
        )
    return CheckpointInfo(path=path, config=config, adapter=adapter, shards=shards)


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer; TokenizerError if there is none or it cannot be read."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise TokenizerError(
            f"{path}: no tokenizer files (tokenizer.json or tokenizer.model); moetide needs one to generate text"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise TokenizerError(f"{path}: tokenizer could not be loaded ({type(e).__name__}: {e})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.convert_ids_to_tokens(0)
    return tok
