"""Tile sizes of the fused MoE kernel: a small table per (T bucket, H, I, format), tuned once on one
GPU (the table's `note` names it; `scripts/tune_fused_moe.py`, `triton.testing.do_bench`) and committed as
`fused_moe_configs.json`; a T bucket between two tuned ones takes the nearest tuned bucket's tiles
(`nearest_bucket`), other buckets and shapes not in it get `default_config`.

T buckets: 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, then larger (a T maps to the smallest
bucket >= T). Formats are `PoolFormat.name`: "bfloat16", "float16", "float32", "int4", "int2",
"int2+int4", ...
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("fused_moe_configs.json")
T_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
GEMV_MAX_TOKENS = 2  # up to this many tokens, every pair is its own block (no sort), GEMV tiles by default
FUSED_MAX_TOKENS = 16  # up to this many tokens, GEMV tiles may take the one-launch path (`KernelConfig.split_i`)
MIN_SPLIT_I = 32  # the narrowest slice of I a one-launch program takes (bounds its per-slice outputs)


@dataclass(frozen=True)
class KernelConfig:
    """block_m rows per block (1 = GEMV), block_n output columns, block_k the K-step of the reduction
    loop (for packed matrices: it may span several groups, computed as one product per group, and is
    cut to divide the row; `fused_moe.k_tiles`), warps and pipeline stages per program, and the tile
    product of packed matrices (`fused_moe.PACKED_TILES`; dense ones ignore it). split_i > 0 (GEMV
    tiles, up to FUSED_MAX_TOKENS tokens): one launch per pool computes gate_up, SiLU·mul and down,
    each program a slice of split_i intermediate columns of one pair (`fused_moe._fused_gemv_kernel`);
    block_n is then the width of its down loop's output chunks. 0: a gate_up and a down launch."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    packed_tile: str = "v1"
    split_i: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.block_m != 1 and self.block_m < 16 or self.block_n < 16 or self.block_k < 16:
            raise ValueError("tl.dot needs block_m (unless 1), block_n and block_k >= 16")
        if self.split_i and (self.block_m != 1 or self.split_i < MIN_SPLIT_I or self.split_i & (self.split_i - 1)):
            raise ValueError(f"split_i must be 0, or a power of two >= {MIN_SPLIT_I} with block_m 1, got {self.split_i}")


def t_bucket(num_tokens: int) -> int:
    for bucket in T_BUCKETS:
        if num_tokens <= bucket:
            return bucket
    return T_BUCKETS[-1]


def default_config(num_tokens: int) -> KernelConfig:
    """A safe choice for shapes the table does not hold: GEMV tiles for a couple of tokens, 16-row
    blocks for decode batches, 64-row blocks for prefill."""
    if num_tokens <= GEMV_MAX_TOKENS:
        return KernelConfig(block_m=1, block_n=32, block_k=128, num_warps=4, num_stages=2)
    if num_tokens <= 64:
        return KernelConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=3)
    return KernelConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


def table_key(num_tokens: int, hidden: int, inter: int, fmt: str, beside: str | None = None) -> str:
    """`beside`: the format of the pool that leads a mixed layer (`fused_moe.LO_POOL_ID`), for the tiles
    of another pool's launches there: a few hot experts' pairs, on the lead pool's block_m."""
    return f"T{t_bucket(num_tokens)}_H{hidden}_I{inter}_{fmt}" + (f"@{beside}" if beside else "")


@lru_cache(maxsize=1)
def _table() -> dict[str, KernelConfig]:
    if not TABLE_PATH.exists():
        return {}
    raw = json.loads(TABLE_PATH.read_text())
    return {key: KernelConfig(**value) for key, value in raw.get("configs", {}).items()}


def config_for(num_tokens: int, hidden: int, inter: int, fmt: str, beside: str | None = None) -> KernelConfig:
    """The tuned tiles for this shape (beside a lead pool of format `beside`: that cell if tuned, else
    the format's own); a T bucket the table does not hold takes the format's nearest tuned bucket of
    the same shape (`nearest_bucket`); a shape or format it does not hold at all, `default_config`."""
    table = _table()
    if beside is not None and (mixed := table.get(table_key(num_tokens, hidden, inter, fmt, beside))):
        return mixed
    if own := table.get(table_key(num_tokens, hidden, inter, fmt)):
        return own
    near = nearest_bucket(t_bucket(num_tokens), hidden, inter, fmt)
    return table[table_key(near, hidden, inter, fmt)] if near is not None else default_config(num_tokens)


@lru_cache(maxsize=512)
def nearest_bucket(bucket: int, hidden: int, inter: int, fmt: str) -> int | None:
    """The tuned T bucket of (H, I, format) closest to `bucket` in log2 (a tie takes the smaller: fewer
    padded rows per block), or None where `bucket` is not between two tuned ones: decode batches of 2,
    4, 16 or 64 sequences run on a neighbour's tuned tiles rather than on the untuned default (v1
    products); buckets past the tuned range (prefill chunks) keep `default_config`."""
    suffix = f"_H{hidden}_I{inter}_{fmt}"
    heads = [key[1 : -len(suffix)] for key in _table() if key.startswith("T") and key.endswith(suffix)]
    tuned = [int(head) for head in heads if head.isdigit()]
    if not tuned or not min(tuned) <= bucket <= max(tuned):
        return None
    return min(tuned, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))


def as_json(configs: dict[str, KernelConfig]) -> dict:
    return {key: asdict(value) for key, value in configs.items()}


def moe_scratch_bytes(model_config, hi_expert_bytes: int, num_tokens: int) -> int:
    """Device scratch of one MoE layer at a `num_tokens` forward: the fused kernel's intermediate
    (padded pairs x I, compute dtype) and per-pair outputs (pairs x H, float32); or, on the
    reference path, one expert's dequantized weights (`hi_expert_bytes`), whichever is larger."""
    top_k = getattr(model_config, "num_experts_per_tok", 2)
    experts = getattr(model_config, "num_experts", None) or getattr(model_config, "n_routed_experts", 1)
    pairs = num_tokens * top_k
    rows = pairs + min(experts, pairs) * (default_config(num_tokens).block_m - 1)
    hidden = model_config.hidden_size
    inter_bytes = hi_expert_bytes // (3 * hidden)  # I x the element size
    # the one-launch path's outputs: one row per (pair, slice of I) at up to FUSED_MAX_TOKENS tokens
    fused_pairs = min(num_tokens, FUSED_MAX_TOKENS) * top_k
    slices = max(1, inter_bytes // 2 // MIN_SPLIT_I)  # at most I // MIN_SPLIT_I (an element takes >= 2 bytes)
    fused = fused_pairs * inter_bytes + fused_pairs * slices * hidden * 4
    return max(rows * inter_bytes + pairs * hidden * 4, fused, hi_expert_bytes)
