"""Decode steps as CUDA graphs, for batches whose experts need no host decisions.

A decode step of a 1-7 B MoE on a large GPU is launch-bound: ~1000 kernel launches from Python
keep the GPU busy a third of the step (run 9/10 profiles, BENCHMARKS.md). Where the expert path has
no host sync (no-offload: every expert hi-resident at a fixed slot; static-int4/int2 with the fused
low-bit kernel), one step is captured once per (batch rows B, cache columns C) and replayed.

The running batch's KV cache moves, layer by layer, into fixed buffers while it decodes this way
(`StaticDecodeState`):

    keys/values   (B, kv_heads, C, head_dim) per layer, transformers' `StaticCache` layers; the
                  batch's left-padded columns 0..S-1 first, then one column per step
    mask          (B, 1, 1, C) bool, True where a row attends (its real tokens so far)
    positions     (B, 1) int64, the next token's position per row (real tokens only)
    input_ids     (B, 1) int64, the tokens sampled last step

All of them are updated inside the captured step, so a replay is one launch plus the copy of the
sampled tokens. C is the current length rounded up to `column_bucket` (bounded by the engine's KV
reservation); when the columns run out, or rows join or leave, the batch goes back to a
`DynamicCache` and the next step enters again, reusing the last buffers and graph when the shape
is the same (a new request of the same length does not capture again).

Without capture (`capture=False`), the same static-KV step runs eagerly: how CPU tests check that it
computes what the dynamic path computes.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch.nn.attention import sdpa_kernel

log = logging.getLogger(__name__)


def count_forward_hooks(model: torch.nn.Module) -> int:
    """Forward (pre-)hooks on every module of `model`: observers that a replay would skip."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


class StaticDecodeState:
    """Fixed buffers for `rows` x `columns` of KV, and the step captured on them (reused by later
    batches of the same shape: the graph reads and writes these addresses only)."""

    def __init__(self, model, rows: int, columns: int, template_layers, device: torch.device):
        from transformers import StaticCache

        self.rows, self.columns = rows, columns
        self.cache = StaticCache(config=model.config, max_cache_len=columns)
        if len(self.cache.layers) != len(template_layers):
            raise ValueError("static and dynamic caches disagree on the number of layers")
        for static, dynamic in zip(self.cache.layers, template_layers, strict=True):
            static.lazy_initialization(dynamic.keys[..., :1, :], dynamic.values[..., :1, :])
        self.mask = torch.zeros(rows, 1, 1, columns, dtype=torch.bool, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.input_ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.start = 0  # columns the batch had when it entered
        self.used = 0  # columns written so far
        self.graph = None

    @property
    def full(self) -> bool:
        return self.used >= self.columns

    def load(self, batch) -> None:
        """Take `batch`'s KV (left-padded columns 0..S-1), mask and positions into the buffers,
        freeing its `DynamicCache` layer by layer (the KV is never held twice)."""
        start = batch.seq_len
        for static, dynamic in zip(self.cache.layers, batch.cache.layers, strict=True):
            static.keys[..., :start, :].copy_(dynamic.keys)
            static.values[..., :start, :].copy_(dynamic.values)
            dynamic.keys = dynamic.values = None
        self._set_written(start)
        self.mask.zero_()
        self.mask[:, 0, 0, :start] = batch.mask.bool()
        self.positions.copy_(batch.lengths.reshape(self.rows, 1))
        self.start = self.used = start

    def step(self, model) -> None:
        """One decode step on the fixed buffers (what is captured): mark this step's column, run the
        model on `input_ids`, keep the last logits, advance the positions."""
        column = self.cache.layers[0].cumulative_length.reshape(1)
        self.mask.index_fill_(3, column, True)
        out = model(
            input_ids=self.input_ids,
            attention_mask=self.mask,
            position_ids=self.positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if self.logits is None:
            self.logits = out.logits[:, -1, :].clone()
        else:
            self.logits.copy_(out.logits[:, -1, :])
        self.positions.add_(1)

    def _set_written(self, columns: int) -> None:
        """Every layer's next write goes to column `columns` (StaticLayer's device-side counter)."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(columns)

    def rewind(self, used: int, positions: torch.Tensor) -> None:
        """Undo the warm-up steps of a capture: columns after `used` are free again."""
        self._set_written(used)
        self.mask[..., used:] = False
        self.positions.copy_(positions)

    def write_back(self, batch) -> None:
        """Hand the KV back to `batch`'s `DynamicCache` (its mask and lengths too)."""
        for static, dynamic in zip(self.cache.layers, batch.cache.layers, strict=True):
            dynamic.keys = static.keys[..., : self.used, :].clone()
            dynamic.values = static.values[..., : self.used, :].clone()
        new = self.used - self.start
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(self.rows, new)], dim=1)
        batch.lengths = self.positions.reshape(-1).clone()


class GraphedDecoder:
    """Runs a `BatchKVCache`'s decode steps from fixed buffers, captured as CUDA graphs.

    Args:
        model: transformers' model with managed experts.
        sync_free: `sync_free(rows) -> bool`, whether the expert path of a `rows`-token step needs
            no host sync (`ExpertRuntime.decode_is_sync_free`).
        sdpa_backends: the attention backends the engine allows (runner.ENGINE_SDPA_BACKENDS).
        capture: record a CUDA graph per (rows, columns) and replay it; False runs the same
            static-KV step eagerly (CPU tests).
        kv_cache_tokens: the engine's KV reservation; rows x columns never exceeds it.
        column_bucket: columns are the cache length rounded up to this.
        compile_step: run the step through `torch.compile` (once per shape) before capturing it.
    """

    def __init__(
        self,
        model,
        sync_free,
        sdpa_backends,
        *,
        capture: bool,
        kv_cache_tokens: int | None = None,
        column_bucket: int = 256,
        compile_step: bool = False,
    ):
        self.model = model
        # Inductor fuses the non-expert elementwise work; each MoE layer is a graph break
        # (ManagedExperts.forward is compile-disabled) and stays the fused kernel
        self.forward = model
        if compile_step:
            import torch._dynamo

            # every decoder layer is its own frame after the MoE graph break, and dynamo keys each
            # on its layer_idx: the default limit of 8 compiles left later layers eager (measured)
            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, 1024)
            config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4096)
            self.forward = torch.compile(model, dynamic=False)
        self.sync_free = sync_free
        self.sdpa_backends = sdpa_backends
        self.capture = capture
        self.kv_cache_tokens = kv_cache_tokens
        self.column_bucket = column_bucket
        self.hooks_at_start = count_forward_hooks(model)
        self.cacheable = self._cache_is_plain()
        self.kept: StaticDecodeState | None = None  # the last buffers, for a batch of their shape
        self.rows_entered: Counter[int] = Counter()  # batch rows -> times such a batch moved in
        self.allocations = 0  # times new buffers were allocated for it (the rest reused the last)
        self.captures = 0  # graphs recorded (each costs two eager steps and a capture)
        self.replays = 0
        self.failed: str | None = None  # why capturing was switched off, after an error

    @property
    def entries(self) -> int:
        """Times a batch moved into fixed buffers."""
        return self.rows_entered.total()

    def close(self) -> None:
        """Let go of the kept buffers and graph (the running batch, if any, keeps its own)."""
        self.kept = None

    def stats(self) -> dict:
        """What this decoder did (bench JSON)."""
        return {
            "entries": self.entries,
            "rows_entered": dict(self.rows_entered),
            "allocations": self.allocations,
            "captures": self.captures,
            "replays": self.replays,
            "failed": self.failed,
        }

    def _cache_is_plain(self) -> bool:
        """Only full-attention layers of transformers' own `StaticLayer` (no sliding windows)."""
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        try:
            probe = StaticCache(config=self.model.config, max_cache_len=8)
        except Exception:  # noqa: BLE001 - a config transformers cannot build a static cache for
            return False
        return all(type(layer) is StaticLayer for layer in probe.layers)

    def columns_for(self, batch) -> int | None:
        """Columns for `batch`'s buffers, or None when the KV reservation cannot hold one more step."""
        need = batch.seq_len + 1
        columns = -(-need // self.column_bucket) * self.column_bucket
        if self.kv_cache_tokens is not None:
            columns = min(columns, self.kv_cache_tokens // batch.batch_size)
        return columns if columns >= need else None

    def applicable(self, batch) -> bool:
        return (
            self.failed is None
            and self.cacheable
            and self.sync_free(batch.batch_size)
            and count_forward_hooks(self.model) == self.hooks_at_start
        )

    @torch.inference_mode()
    def decode(self, batch, last_tokens: torch.Tensor) -> torch.Tensor | None:
        """`last_tokens (B,)` -> logits `(B, V)` from the fixed buffers (the batch grows by one
        column), or None: not applicable, nothing done (the caller runs the dynamic path)."""
        state: StaticDecodeState | None = batch.static
        if state is None or state.full:
            if state is not None:
                batch.ensure_dynamic()
            if not self.applicable(batch):
                return None
            columns = self.columns_for(batch)
            if columns is None:
                return None
            state = self._state_for(batch, columns)
            state.load(batch)
            batch.attach_static(state, self._left)
            self.rows_entered[batch.batch_size] += 1
        state.input_ids.copy_(last_tokens.reshape(-1, 1))
        if self.capture and state.graph is None:
            try:
                self._record(state)
            except Exception as e:  # noqa: BLE001 - fall back for good, loudly, and keep serving
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed, decoding without graphs: %s", self.failed)
                state.graph = None
                batch.ensure_dynamic()
                self.kept = None
                return None
        if state.graph is not None:
            state.graph.replay()
            self.replays += 1
        else:
            with sdpa_kernel(self.sdpa_backends):
                state.step(self.forward)
        state.used += 1
        return state.logits.clone()

    def _state_for(self, batch, columns: int) -> StaticDecodeState:
        """The buffers (and graph) of the last batch if it had this shape, else new ones."""
        kept, self.kept = self.kept, None
        if kept is not None and (kept.rows, kept.columns) == (batch.batch_size, columns):
            return kept
        del kept  # freed before the new buffers are allocated
        self.allocations += 1
        return StaticDecodeState(self.model, batch.batch_size, columns, batch.cache.layers, batch.mask.device)

    def _left(self, state: StaticDecodeState) -> None:
        """A batch has moved back to its dynamic cache: keep its buffers and graph for the next batch
        of the same shape when the KV reservation holds them beside a second batch's KV (no limit,
        or 2 x rows x columns <= the reservation); else let them go."""
        limit = self.kv_cache_tokens
        if limit is None or 2 * state.rows * state.columns <= limit:
            self.kept = state

    def _record(self, state: StaticDecodeState) -> None:
        """Two eager warm-up steps on a side stream (lazy inits, kernel autotuning), then the capture;
        the warm-ups' columns and positions are rewound so the replay writes them again."""
        used, positions = state.used, state.positions.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        if self.forward is not self.model:
            log.info("compiling the decode step for %d rows x %d columns (once per shape)", state.rows, state.columns)
        with torch.cuda.stream(side), sdpa_kernel(self.sdpa_backends):
            for _ in range(2):
                state.step(self.forward)
                state.rewind(used, positions)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: the residency's copies and the layer feed keep running on their own threads
        with torch.cuda.graph(graph, capture_error_mode="thread_local"), sdpa_kernel(self.sdpa_backends):
            state.step(self.forward)
        state.graph = graph
        self.captures += 1
