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

Decode steps without the gather (`decode_kernel`, set where `paged_attention.supports` the model's
heads and no layer has a sliding window): a step given its rows' `lengths (B,)` as well writes the
new K/V and hands the layer's pools themselves to the attention, which the model calls through
transformers' attention interface as `ATTENTION_NAME` (`use_decode_kernel`): given a pool (3D) it
runs `paged_attention.paged_decode_attention` over the step's block tables; given gathered rows
(4D: prefill, or a cache without the kernel) it is transformers' SDPA attention.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

ATTENTION_NAME = "moetide_paged"  # the attention implementation of models whose decode reads the pools
_KERNEL_STEP: "PagedKVCache | None" = None  # the cache whose update just handed its pools to the attention


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
        self.lengths: torch.Tensor | None = None
        self.decode_kernel = False  # decode steps given `lengths` attend straight from the pools

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
        if self.decode_kernel and self.lengths is not None and tokens == 1:
            global _KERNEL_STEP
            _KERNEL_STEP = self
            return keys, values  # (slots, H, dim): the attention reads the rows' blocks in place
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
    def set_step(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> None:
        """The next forward's layout: `slot_mapping (B*T,)`, `block_tables (B, W)` (device, int64);
        for a decode step (T = 1) that may attend straight from the pools, `lengths (B,)`: the tokens
        each row attends to, its new one included."""
        self.slot_mapping, self.block_tables, self.lengths = slot_mapping, block_tables, lengths

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


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface for `ATTENTION_NAME`: `query (B, Hq, T, D)`; `key`/`value`
    the gathered rows `(B, Hkv, L, D)` (transformers' SDPA attention) or, from a decode step of a
    cache with `decode_kernel`, the layer's pools `(slots, Hkv, D)` -> `((B, T, Hq, D), None)`."""
    if key.dim() == 4:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    from .paged_attention import paged_decode_attention_op

    step = _KERNEL_STEP
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    tables, lengths = step.block_tables, step.lengths
    out = paged_decode_attention_op(query[:, :, 0], key, value, tables, lengths, float(scale), step.block_size)
    return out.unsqueeze(1), None


def decode_kernel_supported(config) -> bool:
    """Whether decode steps of `config`'s model may attend straight from the pools: every layer full
    attention over standard heads (DeepSeek-V2's latent keys and values and sliding windows keep the
    gather)."""
    from .paged_attention import supports

    if sliding_window(config) is not None or getattr(config, "kv_lora_rank", None):
        return False
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return supports(heads, kv_heads, head_dim, head_dim)


def use_decode_kernel(model, kv: PagedKVCache) -> None:
    """Route `model`'s attention through `paged_attention_forward` and let `kv`'s decode steps hand
    it the pools (callers check `decode_kernel_supported` first)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.config._attn_implementation = ATTENTION_NAME
    kv.decode_kernel = True
