"""All device work of the engine: prefill chunks and decode steps over the paged KV cache.

Sequences keep their KV in the blocks of one pool per layer (engine/paged_cache.py); the host
knows each sequence's block table (engine/kv_blocks.py) and describes every forward with a few
small int64 tensors, copied to the device once per forward:

    prefill (packed)  input_ids (1, T): the chunks of n sequences one after another; positions
                      (1, T); slot_mapping (T,); block_tables (1, ΣW): the sequences' tables
                      concatenated; the mask (1, 1, T, ΣW*bs) keeps each query to its own
                      sequence's columns at positions <= its own. Logits of each chunk's last token.
    decode            input_ids (B, 1): each row's last token; positions (B, 1); slot_mapping
                      (B,); block_tables (B, W), padded with the pad block; mask (B, 1, 1, W*bs).

    decode + chunks   short prefill chunks ride in a decode step as rows of their own: a chunk of n
                      tokens is n rows at consecutive positions over its sequence's whole table
                      (each row's K/V is written before any row attends, and the mask keeps each
                      to positions <= its own, so the rows compute causal attention), when the
                      CUDA-graph decoder can take the rows: a prefix-cache hit's few new tokens
                      replay a captured step instead of an eager forward (~30 ms).

Position ids count the sequence's own tokens only, so a sequence computes the same logits
whatever it is batched with. Shapes: B rows, T tokens, W blocks per row, bs block size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .paged_cache import PagedKVCache, attention_mask, sliding_window
from .sequence import Sequence

# Attention backends the engine's forwards may use: every one but cuDNN's. cuDNN attention builds an
# execution graph per (batch, query length, KV length) shape, and a decode step's KV length is new
# each step: each new shape costs ~2.5 ms per layer on the host (at batch 32, 120 ms of 230 ms host
# time in three decode steps), until every length has been seen once in the process.
ENGINE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Prefill tokens of one step that may ride in the decode step as rows of their own (0: never).
FOLD_PREFILL_TOKENS = 32


@dataclass
class DeviceTokens:
    """Input tokens of a decode step that only the device holds (decode ahead, LLMEngine): row
    `rows[i]` of the step takes `tokens[index[i]]`; `tokens (N,)` int64, the step before's samples."""

    tokens: torch.Tensor
    rows: list[int]
    index: list[int]

    def write(self, input_ids: torch.Tensor) -> None:
        """Overwrite those rows of `input_ids (B, 1)` on the device, in stream order (no host sync)."""
        n = len(self.rows)
        if self.rows == self.index == list(range(n)):
            input_ids[:n, 0].copy_(self.tokens[:n])
            return
        dev = input_ids.device
        picked = self.tokens.index_select(0, torch.tensor(self.index, device=dev))
        input_ids.view(-1).index_copy_(0, torch.tensor(self.rows, device=dev), picked)


@dataclass
class DecodeBatch:
    """A decode step's layout on the host (int64): `input_ids (B,)`, `positions (B,)`,
    `slot_mapping (B,)`, `block_tables (B, W)`."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        return self.block_tables.shape[1]


def mask_for(config, query_pos, column_pos, query_seq=None, column_seq=None):
    """The attention mask(s) transformers' model takes: one 4D mask, or, for a model mixing full and
    sliding-window layers (`layer_types`), one per kind."""
    window = sliding_window(config)
    full = attention_mask(query_pos, column_pos, None, query_seq, column_seq)
    if window is None:
        return full
    kinds = set(getattr(config, "layer_types", None) or ())
    sliding = attention_mask(query_pos, column_pos, window, query_seq, column_seq)
    if "full_attention" in kinds and "sliding_attention" in kinds:
        return {"full_attention": full, "sliding_attention": sliding}
    return sliding


class ModelRunner:
    """Runs transformers' model (with managed experts) for prefill chunks and decode steps.

    Args:
        model: transformers' model with managed experts.
        device: where it runs.
        kv: the paged KV cache (one pool per layer).
        graphs: a graphed_decode.GraphedDecoder for decode steps, or None: every step eager.
        runtime: the model's ExpertRuntime: each forward is one step of it (the residency writes its
            table before, the step's observations go to the host after); None for a plain model.
        max_rows: rows of a decode step at most (the engine's `max_num_seqs`: the observation
            buffers hold that many tokens).
        fold_prefill_tokens: prefill tokens of a step that may ride in its decode step as rows
            (`folds`); 0 turns folding off.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        kv: PagedKVCache,
        graphs=None,
        runtime=None,
        *,
        max_rows: int = 32,
        fold_prefill_tokens: int = FOLD_PREFILL_TOKENS,
    ):
        self.model = model
        self.device = device
        self.kv = kv
        self.graphs = graphs
        self.runtime = runtime
        self.max_rows = max_rows
        self.fold_prefill_tokens = fold_prefill_tokens
        self.folded_tokens = 0  # prefill tokens computed as decode rows

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def graph_stats(self) -> dict | None:
        """What the CUDA-graph decoder did, or None when there is none."""
        return self.graphs.stats() if self.graphs is not None else None

    def close(self) -> None:
        """Let go of the graphs and the KV pools (on CUDA the whole reservation is allocated)."""
        if self.graphs is not None:
            self.graphs.close()
        self.kv.release()

    def _in_step(self, tokens: int, forward, *args, real_tokens: int | None = None):
        """`forward(*args)` as one step of `tokens` tokens of the runtime (between `begin_step` and
        `end_step`), of which the first `real_tokens` (all unless given) are real, the rest pad rows."""
        if self.runtime is None:
            return forward(*args)
        self.runtime.begin_step(tokens, real_tokens=real_tokens)
        try:
            out = forward(*args)
        except BaseException:
            self.runtime.end_step(failed=True)  # its buffers were never written whole: nobody reads them
            raise
        self.runtime.end_step()
        return out

    def flush(self) -> None:
        """Publish the observations of the steps still in flight (the engine has gone idle)."""
        if self.runtime is not None:
            self.runtime.flush_observations()

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, mask, slot_mapping, block_tables, logits_to_keep, lengths=None
    ) -> torch.Tensor:
        """One forward over the paged cache: the new tokens' K/V go to `slot_mapping`; logits
        `(B, k, V)` of the positions `logits_to_keep` selects. A decode step passes its rows'
        `lengths (B,)` (the kernel path of `PagedKVCache.decode_kernel`)."""
        self.kv.set_step(slot_mapping, block_tables, lengths)
        with sdpa_kernel(ENGINE_SDPA_BACKENDS):
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=self.kv,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        return out.logits

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def prefill(self, chunks: list[tuple[Sequence, int]]) -> torch.Tensor:
        """The next `n` uncomputed tokens of each sequence, packed into one forward (their blocks
        are allocated) -> logits `(len(chunks), V)` of each chunk's last token."""
        bs = self.block_size
        ids, q_pos, q_seq, slots, last = [], [], [], [], []
        tables, c_seq, c_pos = [], [], []
        for r, (seq, n) in enumerate(chunks):
            start, end = seq.num_computed, seq.num_computed + n
            ids += seq.token_ids(start, end)
            q_pos += range(start, end)
            q_seq += [r] * n
            slots += [self._slot(seq.block_table, p) for p in range(start, end)]
            last.append(len(ids) - 1)
            width = -(-end // bs)
            tables += seq.block_table[:width]
            c_seq += [r] * (width * bs)
            c_pos += range(width * bs)
        dev = self.device
        as_dev = lambda values: torch.tensor(values, dtype=torch.long).to(dev)  # noqa: E731
        positions = as_dev(q_pos).view(1, -1)
        mask = mask_for(self.model.config, positions, as_dev(c_pos), as_dev(q_seq), as_dev(c_seq))
        tokens, slot_mapping, block_tables = as_dev(ids).view(1, -1), as_dev(slots), as_dev(tables).view(1, -1)
        args = (tokens, positions, mask, slot_mapping, block_tables, as_dev(last))
        return self._in_step(len(ids), self.forward, *args)[0]

    def folds(self, seqs: list[Sequence], chunks: list[tuple[Sequence, int]]) -> bool:
        """Whether the prefill `chunks` ride in this step's decode of `seqs` as rows of their own:
        they are short, the rows fit, and the CUDA-graph decoder takes a step of that many rows."""
        tokens = sum(n for _, n in chunks)
        rows = len(seqs) + tokens
        return (
            self.graphs is not None
            and 0 < tokens <= self.fold_prefill_tokens
            and rows <= self.max_rows
            and self.graphs.rows_for(rows) is not None
        )

    def decode_batch(self, seqs: list[Sequence], chunks: list[tuple[Sequence, int]] = ()) -> DecodeBatch:
        """The host layout of a decode step of `seqs` (each has one uncomputed token, its block
        allocated), then `n` rows per prefill chunk `(seq, n)`: its next `n` tokens at their
        positions, each row over the sequence's whole table."""
        rows: list[tuple[Sequence, int]] = [(s, s.num_tokens - 1) for s in seqs]
        # a token sampled ahead is on the device only: its row is written there (DeviceTokens)
        tokens = [0 if s.ahead else s.output_ids[-1] if s.output_ids else s.prompt_ids[-1] for s in seqs]
        for seq, n in chunks:
            start = seq.num_computed
            rows += [(seq, p) for p in range(start, start + n)]
            tokens += seq.token_ids(start, start + n)
        width = max(len(s.block_table) for s, _ in rows)
        tables = torch.zeros(len(rows), width, dtype=torch.long)
        for r, (seq, _) in enumerate(rows):
            tables[r, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.long)
        return DecodeBatch(
            torch.tensor(tokens),
            torch.tensor([p for _, p in rows]),
            torch.tensor([self._slot(s.block_table, p) for s, p in rows]),
            tables,
        )

    def decode(
        self,
        seqs: list[Sequence],
        chunks: list[tuple[Sequence, int]] = (),
        device_tokens: DeviceTokens | None = None,
    ) -> torch.Tensor:
        """One token for every sequence -> logits `(B, V)`; with prefill `chunks` (rows of the same
        step, `folds`), `(B + C, V)`: then each chunk's last token's. Replayed from a CUDA graph
        where `graphs` can (graphed_decode: the rows padded to their row bucket), else eager.
        `device_tokens`: the rows whose input token only the device holds (sampled ahead)."""
        batch = self.decode_batch(seqs, chunks)
        rows = self.graphs.rows_for(batch.rows) if self.graphs is not None else None
        if rows is None:
            logits = self._in_step(batch.rows, self._decode_eager, batch, device_tokens)
        else:
            logits = self._in_step(rows, self.graphs.decode, batch, rows, device_tokens, real_tokens=batch.rows)
        if not chunks:
            return logits
        keep, end = list(range(len(seqs))), len(seqs)
        for _, n in chunks:
            end += n
            keep.append(end - 1)
        self.folded_tokens += end - len(seqs)
        return logits[torch.tensor(keep, device=logits.device)]

    def _decode_eager(self, batch: DecodeBatch, device_tokens: DeviceTokens | None = None) -> torch.Tensor:
        dev = self.device
        input_ids = batch.input_ids.to(dev).view(-1, 1)
        if device_tokens is not None:
            device_tokens.write(input_ids)
        positions = batch.positions.to(dev).view(-1, 1)
        columns = torch.arange(batch.width * self.block_size, device=dev)
        mask = mask_for(self.model.config, positions, columns)
        logits = self.forward(
            input_ids,
            positions,
            mask,
            batch.slot_mapping.to(dev),
            batch.block_tables.to(dev),
            1,
            positions.view(-1) + 1,
        )
        return logits[:, -1, :]
