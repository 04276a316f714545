"""The paged KV cache on the device, behind transformers' `Cache` interface.

Every family's attention calls `past_key_values.update(keys, values, layer_idx)` and attends over
what it returns, with the 4D mask the model was given (a 4D mask is passed through by
transformers' mask functions as it is). So one cache object serves every family, GQA and MLA
alike (DeepSeek-V2 caches its compressed latent and rope key as its "keys" and "values"), with
transformers' own SDPA attention:

    pool keys     (slots, kv_heads, k_dim) per layer, slots = (num_blocks + 1) * block_size
    pool values   (slots, kv_heads, v_dim) per layer (allocated at the layer's first update)

A forward over B rows of T new tokens each is given, before it runs (`set_step`):

    slot_mapping  (B * T,) int64   the slot each new token's K/V is written to
    block_tables  (B, W) int64     each row's blocks in token order, padded with block 0 (the pad
                                   block: its columns always masked for real rows; only the pad rows
                                   of a padded decode step write it, at slot 0, finite values)

and `update` writes the new K/V at `slot_mapping`, then gathers each row's blocks:
`(B, kv_heads, W * block_size, dim)`, column c = the row's token c (see `attention_mask`). The
gather costs one read and write of the rows' KV per layer (the attention reads it again); all
shapes are fixed by (B, T, W), so a decode step with fixed buffers is captured as a CUDA graph.

On the CPU the pool grows (zero-filled) up to the highest block handed out, so an uncapped CPU
run does not touch memory it never uses; on CUDA it is allocated whole at the first forward.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class PagedKVCache(Cache):
    """One block pool per layer, read and written through the step's block tables."""

    is_compileable = False

    def __init__(self, num_blocks: int, block_size: int, device: torch.device, *, grow: bool):
        # not Cache.__init__: this cache has no per-layer `CacheLayerMixin`s; `layers` stays empty
        # so transformers' generic helpers see no layer to crop, offload or reorder
        self.layers = []
        self.layer_class_to_replicate = None
        self.offloading = False
        self.num_blocks = num_blocks  # usable blocks; block 0 (pad) comes on top
        self.block_size = block_size
        self.device = device
        self.grow = grow
        self.capacity = 1 if grow else num_blocks + 1  # blocks allocated per layer (pad included)
        self.generation = 0  # bumped whenever the pools move (CUDA graphs read their addresses)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.slot_mapping: torch.Tensor | None = None
        self.block_tables: torch.Tensor | None = None

    # -- transformers' Cache interface ---------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None):
        """Write `key_states (B, H, T, k_dim)`, `value_states (B, H, T, v_dim)` at the step's slots;
        return the rows' gathered keys and values `(B, H, W * block_size, dim)`."""
        if layer_idx not in self.keys:
            self._allocate_layer(layer_idx, key_states, value_states)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows, heads, tokens = key_states.shape[:3]
        slots = self.slot_mapping
        keys.index_copy_(0, slots, key_states.transpose(1, 2).reshape(rows * tokens, heads, -1))
        values.index_copy_(0, slots, value_states.transpose(1, 2).reshape(rows * tokens, heads, -1))
        return self._gather(keys), self._gather(values)

    def _gather(self, pool: torch.Tensor) -> torch.Tensor:
        rows, width = self.block_tables.shape
        blocks = pool.view(-1, self.block_size, *pool.shape[1:])[self.block_tables]  # (B, W, bs, H, D)
        return blocks.reshape(rows, width * self.block_size, *pool.shape[1:]).transpose(1, 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly (the engine's position_ids)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of what `update` returns: every row's blocks gathered, block-table
        width x block size, from offset 0. (The engine passes its own 4D mask, so transformers asks
        this only of a forward run outside it; for one sequence, whose blocks lie in order, the
        causal mask over these sizes is the right one.)"""
        if self.block_tables is None:
            return query_length, 0
        return self.block_tables.shape[1] * self.block_size, 0

    def __len__(self) -> int:
        return len(self.keys)

    # -- the engine's side -----------------------------------------------------------------------------
    def set_step(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> None:
        """The next forward's layout: `slot_mapping (B*T,)`, `block_tables (B, W)` (device, int64)."""
        self.slot_mapping, self.block_tables = slot_mapping, block_tables

    def reserve(self, high_water: int) -> None:
        """Make blocks 0..`high_water` addressable (the CPU pool grows to a power of two)."""
        if high_water < self.capacity:
            return
        capacity = min(self.num_blocks + 1, 1 << high_water.bit_length())
        slots = capacity * self.block_size
        for pools in (self.keys, self.values):
            for layer, old in pools.items():
                new = old.new_zeros(slots, *old.shape[1:])
                new[: old.shape[0]].copy_(old)
                pools[layer] = new
        self.capacity = capacity
        self.generation += 1

    def _allocate_layer(self, layer_idx: int, key_states, value_states) -> None:
        slots = self.capacity * self.block_size
        heads = key_states.shape[1]
        self.keys[layer_idx] = key_states.new_zeros(slots, heads, key_states.shape[-1])
        self.values[layer_idx] = value_states.new_zeros(slots, value_states.shape[1], value_states.shape[-1])
        self.generation += 1

    def release(self) -> None:
        """Free the pools (the engine is closed); a later forward would allocate them again."""
        self.keys.clear()
        self.values.clear()
        self.capacity = 1 if self.grow else self.num_blocks + 1
        self.generation += 1

    @property
    def nbytes(self) -> int:
        """Bytes the pools hold now."""
        return sum(t.numel() * t.element_size() for pools in (self.keys, self.values) for t in pools.values())


def attention_mask(
    query_pos: torch.Tensor,
    column_pos: torch.Tensor,
    window: int | None = None,
    query_seq: torch.Tensor | None = None,
    column_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """The 4D boolean mask `(B, 1, T, L)` over the gathered columns: a query at position p sees the
    columns of its sequence at positions c <= p (and c > p - window with a sliding window).

    `query_pos (B, T)`, `column_pos (L,)`: positions in their sequence (a row's gathered columns
    are its positions 0..L-1; pad-block columns lie past every query). For a packed prefill (B = 1,
    several sequences' chunks one after another, their block tables concatenated),
    `query_seq (T,)` and `column_seq (L,)` say which sequence each query and column belongs to.
    """
    q = query_pos.unsqueeze(-1)  # (B, T, 1)
    c = column_pos.view(1, 1, -1)  # (1, 1, L)
    mask = c <= q
    if window is not None:
        mask &= c > q - window
    if query_seq is not None:
        mask &= column_seq.view(1, 1, -1) == query_seq.view(1, -1, 1)
    return mask.unsqueeze(1)


def sliding_window(config) -> int | None:
    """The attention window of `config`'s layers, or None for full attention (what transformers'
    mask functions would apply; the engine passes its own 4D mask, so it applies it here)."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None
