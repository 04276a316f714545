"""All device work of the engine: prefill, decode and the batch's KV cache.

The running batch keeps one transformers `DynamicCache` whose rows are left-padded to a common
length S, and a mask `(B, S)` (1 = real token). New sequences are prefilled on their own (in chunks
when long) and then merged in by left-padding whichever side is shorter; finished rows are dropped
with `index_select`, and columns that became padding in every row are trimmed. Position ids count
real tokens only, so a sequence computes the same logits whatever it is batched with.

Shapes: B rows, S cache length, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .sequence import Sequence

# Attention backends the engine's forwards may use: every one but cuDNN's. cuDNN attention builds an
# execution graph per (batch, query length, KV length) shape, and a decode step's KV length is new
# each step: on the H200 each new shape cost ~2.5 ms per layer on the host (run 9, batch 32: 120 ms of
# 230 ms host time in three decode steps), until every length had been seen once in the process.
ENGINE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _cache_layers(cache):
    return cache.layers


class BatchKVCache:
    """The running rows' KV cache `(B, heads, S, head_dim)` per layer and their mask `(B, S)`."""

    def __init__(self, cache, mask: torch.Tensor, lengths: torch.Tensor):
        self.cache = cache
        self.mask = mask  # (B, S) int64
        self.lengths = lengths  # (B,) real tokens per row
        # while decoding from fixed buffers (graphed_decode.StaticDecodeState), the KV, mask and
        # lengths live there; `ensure_dynamic` brings them back before any change of rows
        self.static = None
        self._on_leave = None

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    @property
    def seq_len(self) -> int:
        return self.static.used if self.static is not None else self.mask.shape[1]

    def attach_static(self, state, on_leave=None) -> None:
        """Decode from `state`'s fixed buffers; `on_leave(state)` is called once they are handed back."""
        self.static, self._on_leave = state, on_leave

    def close(self) -> None:
        """The batch is done (every row finished or failed): give fixed buffers back unread."""
        self._leave_static(write_back=False)

    def ensure_dynamic(self) -> None:
        """Move the KV back from fixed buffers into the `DynamicCache` (no-op when it is there)."""
        self._leave_static(write_back=True)

    def _leave_static(self, *, write_back: bool) -> None:
        if self.static is not None:
            state, self.static = self.static, None
            if write_back:
                state.write_back(self)
            if self._on_leave is not None:
                self._on_leave(state)

    def _pad_left(self, pad: int) -> None:
        if pad <= 0:
            return
        for layer in _cache_layers(self.cache):
            for name in ("keys", "values"):
                t = getattr(layer, name)
                zeros = t.new_zeros(*t.shape[:-2], pad, t.shape[-1])
                setattr(layer, name, torch.cat([zeros, t], dim=-2))
        self.mask = torch.cat([self.mask.new_zeros(self.batch_size, pad), self.mask], dim=1)

    def merge(self, other: BatchKVCache) -> None:
        """Append `other`'s rows (after this batch's rows), left-padding to a common length."""
        self.ensure_dynamic()
        other.ensure_dynamic()
        self._pad_left(other.seq_len - self.seq_len)
        other._pad_left(self.seq_len - other.seq_len)
        for mine, theirs in zip(_cache_layers(self.cache), _cache_layers(other.cache), strict=True):
            mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
            mine.values = torch.cat([mine.values, theirs.values], dim=0)
        self.mask = torch.cat([self.mask, other.mask], dim=0)
        self.lengths = torch.cat([self.lengths, other.lengths], dim=0)

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not in `rows`, then trim columns that are padding in every kept row."""
        self.ensure_dynamic()
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, idx)
        self.lengths = self.lengths.index_select(0, idx)
        for layer in _cache_layers(self.cache):
            layer.keys = layer.keys.index_select(0, idx)
            layer.values = layer.values.index_select(0, idx)
        # NOTE: host sync (once per finished-sequence event, not per token)
        lead = int(self.seq_len - self.lengths.max().item()) if rows else 0
        if lead > 0:
            self.mask = self.mask[:, lead:]
            for layer in _cache_layers(self.cache):
                layer.keys = layer.keys[..., lead:, :]
                layer.values = layer.values[..., lead:, :]


class ModelRunner:
    """Runs transformers' model (with managed experts) for prefill and decode steps."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        prefill_chunk_tokens: int = 512,
        graphs=None,
        runtime=None,
    ):
        self.model = model
        self.device = device
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.graphs = graphs  # a graphed_decode.GraphedDecoder, or None: every step eager
        # the model's ExpertRuntime: each forward is one step of it (the residency writes its table
        # before, the step's observations go to the host after); None for a plain model
        self.runtime = runtime

    def graph_stats(self) -> dict | None:
        """What the CUDA-graph decoder did, or None when there is none."""
        return self.graphs.stats() if self.graphs is not None else None

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _in_step(self, tokens: int, forward, *args):
        """`forward(*args)` as one step of `tokens` tokens of the runtime (between `begin_step` and
        `end_step`)."""
        if self.runtime is None:
            return forward(*args)
        self.runtime.begin_step(tokens)
        try:
            return forward(*args)
        finally:
            self.runtime.end_step()

    def flush(self) -> None:
        """Publish the observations of the steps still in flight (the engine has gone idle)."""
        if self.runtime is not None:
            self.runtime.flush_observations()

    def _forward(self, input_ids, mask, positions, cache) -> torch.Tensor:
        return self._in_step(input_ids.numel(), self._forward_now, input_ids, mask, positions, cache)

    @torch.inference_mode()
    def _forward_now(self, input_ids, mask, positions, cache) -> torch.Tensor:
        with sdpa_kernel(ENGINE_SDPA_BACKENDS):
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[:, -1, :]

    def prefill(self, seqs: list[Sequence]) -> tuple[BatchKVCache, torch.Tensor]:
        """Prompts of `seqs` (left-padded together) -> their cache and last logits `(n, V)`.

        A single long prompt is fed in chunks of `prefill_chunk_tokens` to bound activation memory.
        """
        prompts = [s.prompt_ids for s in seqs]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = self._new_cache()
        chunk = self.prefill_chunk_tokens if len(seqs) == 1 else width
        logits = None
        for start in range(0, width, chunk):
            end = min(width, start + chunk)
            logits = self._forward(ids[:, start:end], mask[:, :end], positions[:, start:end], cache)
        lengths = mask.sum(dim=1)
        return BatchKVCache(cache, mask, lengths), logits

    def decode(self, batch: BatchKVCache, last_tokens: torch.Tensor) -> torch.Tensor:
        """One token for every row: `last_tokens (B,)` -> logits `(B, V)`; grows the cache by one.
        Replayed from a CUDA graph where `graphs` can (graphed_decode), else eager."""
        return self._in_step(last_tokens.numel(), self._decode_now, batch, last_tokens)

    def _decode_now(self, batch: BatchKVCache, last_tokens: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None:
            logits = self.graphs.decode(batch, last_tokens)
            if logits is not None:
                return logits
        batch.ensure_dynamic()
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(batch.batch_size, 1)], dim=1)
        positions = batch.lengths.unsqueeze(1)
        logits = self._forward_now(last_tokens.unsqueeze(1), batch.mask, positions, batch.cache)
        batch.lengths = batch.lengths + 1
        return logits
