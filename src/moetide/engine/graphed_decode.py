"""Decode steps as CUDA graphs, for batches whose experts need no host decisions.

A decode step of a 1-7 B MoE on a large GPU is launch-bound: ~1000 kernel launches from Python
keep the GPU busy a third of the step. Where the expert path has
no host sync (no-offload: every expert hi-resident at a fixed slot; static-int4/int2 with the fused
low-bit kernel; any policy whose misses run lo or zero-copy, its table written between steps), one
step is captured once per (row bucket R, block-table width W) and replayed.

A step of B rows runs in the graph of the smallest bucket R >= B (`ROW_BUCKETS`; past the last one,
a multiple of `ROW_STEP`; never more than the engine's `max_num_seqs`): the number of running
sequences changes almost every step while serving, and a graph per exact B would be captured (two
eager steps and a capture) again and again. Rows B..R-1 are pad rows: token 0 at position 0, their
block table all pad block, their K/V written to slot 0 of the pad block. So a pad row attends to
exactly its own column 0 (a fully masked row would be NaN, and NaN in the pad block's K/V would
reach the real rows' masked columns as 0 * NaN), and every column of the pad block stays finite.
The kernels compute pad rows like real ones; the logits returned are the first B rows, and the
step's observations are the first B rows too (`runtime.begin_step(R, real_tokens=B)`).

The KV stays where it is, in the paged pool (engine/paged_cache.py); a captured step reads fixed
device buffers of its shape (`PagedDecodeState`), all in one int64 buffer so that one copy from
the host sets them:

    input_ids     (R, 1)   the tokens sampled last step
    positions     (R, 1)   each row's position (its sequence's tokens so far, less one)
    slot_mapping  (R,)     where each row's new K/V goes
    block_tables  (R, W)   each row's blocks, padded with the pad block

and computes the mask `(R, 1, 1, W * block_size)` from the positions inside the step. W is the
batch's widest block table rounded up to `column_bucket` tokens times a power of two (256, 512,
1024, ... tokens), so long contexts add few widths. Rows joining or leaving only change what the
host writes into the buffers of a bucket: a new request in the same bucket and width replays the
same graph. Up to 128 rows and 4096 tokens there are at most 11 x 5 shapes, all kept
(`MAX_STATES`). The graph is valid while the pool tensors do not move (`PagedKVCache.generation`;
they move only while a CPU pool grows).

Without capture (`capture=False`), the same fixed-buffer step runs eagerly: how CPU tests check
that it computes what the eager path computes.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict

import torch
from torch.nn.attention import sdpa_kernel

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # rows a decode step is padded up to
ROW_STEP = 32  # past the last bucket: rows rounded up to a multiple of this
# every (row bucket, width) shape up to 128 rows and 4096 tokens (11 buckets x 5 widths of 256 * 2^k
# tokens) is kept, none evicted; a graph's buffers are small and the graphs share one memory pool
MAX_STATES = 64


def row_bucket(rows: int, max_rows: int | None = None, buckets=ROW_BUCKETS) -> int:
    """The rows a decode step of `rows` real rows runs with: the smallest of `buckets` >= `rows`
    (past the last, `rows` rounded up to a multiple of `ROW_STEP`), at most `max_rows` (the most
    rows the engine decodes at once) and never fewer than `rows`. `buckets=None`: `rows` itself."""
    if buckets is None:
        return rows
    bucket = next((b for b in buckets if b >= rows), -(-rows // ROW_STEP) * ROW_STEP)
    return bucket if max_rows is None else max(rows, min(bucket, max_rows))


def width_bucket(blocks: int, per_bucket: int) -> int:
    """Blocks per row for a widest table of `blocks` blocks: `per_bucket` times the smallest power of
    two that holds it."""
    units = max(1, -(-blocks // per_bucket))
    return per_bucket * (1 << (units - 1).bit_length())


def count_forward_hooks(modules) -> int:
    """Forward (pre-)hooks on every module of `modules` (a model's `modules()`, listed once: walking
    the OLMoE shape's module tree took 0.37 ms per step on the development CPU, the list 0.05 ms):
    observers that a replay would skip."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules)


class PagedDecodeState:
    """Fixed buffers of a decode step of `rows` rows (a row bucket: real rows first, then pad rows)
    over `width` blocks each, and its graph."""

    def __init__(self, rows: int, width: int, block_size: int, device: torch.device):
        self.rows, self.width = rows, width
        self.meta = torch.zeros(rows * (3 + width), dtype=torch.long, device=device)
        self.input_ids = self.meta[:rows].view(rows, 1)
        self.positions = self.meta[rows : 2 * rows].view(rows, 1)
        self.slot_mapping = self.meta[2 * rows : 3 * rows]
        self.block_tables = self.meta[3 * rows :].view(rows, width)
        self.columns = torch.arange(width * block_size, device=device)
        self.host = torch.zeros(rows * (3 + width), dtype=torch.long)  # staging on the host
        self.logits: torch.Tensor | None = None
        self.graph = None
        self.generation = -1  # the pool generation the graph was captured on

    def load(self, batch) -> None:
        """Copy a `runner.DecodeBatch` (B <= rows rows, at most `width` blocks) into the buffers, rows
        B.. as pad rows (token 0, position 0, slot 0 and a table of the pad block, block 0): one copy
        host -> device (pageable: the host buffer may be rewritten as soon as it returns)."""
        rows, real, host = self.rows, batch.rows, self.host
        host.zero_()
        host[:real] = batch.input_ids
        host[rows : rows + real] = batch.positions
        host[2 * rows : 2 * rows + real] = batch.slot_mapping
        host[3 * rows :].view(rows, self.width)[:real, : batch.width] = batch.block_tables
        self.meta.copy_(host)

    def step(self, model, kv, mask_for, in_place: bool = True) -> None:
        """One decode step on the fixed buffers (what is captured): the mask and, `in_place`, each
        row's length (the in-place attention of `PagedKVCache.decode_kernel`) from the positions, the
        model over the paged cache, the last logits kept."""
        lengths = self.positions.view(-1) + 1 if in_place else None
        kv.set_step(self.slot_mapping, self.block_tables, lengths)
        mask = mask_for(model.config, self.positions, self.columns)
        out = model(
            input_ids=self.input_ids,
            attention_mask=mask,
            position_ids=self.positions,
            past_key_values=kv,
            use_cache=True,
            logits_to_keep=1,
        )
        if self.logits is None:
            self.logits = out.logits[:, -1, :].clone()
        else:
            self.logits.copy_(out.logits[:, -1, :])


class GraphedDecoder:
    """Runs decode steps from fixed buffers over the paged KV cache, captured as CUDA graphs.

    Args:
        model: transformers' model with managed experts.
        kv: the engine's `PagedKVCache`.
        sync_free: `sync_free(rows) -> bool`, whether the expert path of a `rows`-token step needs
            no host sync (`ExpertRuntime.decode_is_sync_free`).
        sdpa_backends: the attention backends the engine allows (runner.ENGINE_SDPA_BACKENDS).
        capture: record a CUDA graph per (row bucket, width) and replay it; False runs the same
            fixed-buffer step eagerly (CPU tests).
        column_bucket: a state's width is the batch's widest table rounded up to this many tokens
            times a power of two.
        max_states: shapes kept (buffers and graph) at most, least recently used dropped first. The
            graphs share one memory pool (they are replayed one at a time and each step's logits
            are copied out), so more shapes cost their buffers, not more activation memory.
        compile_step: run the step through `torch.compile` (once per shape) before capturing it.
        max_rows: the most rows a step can have (the engine's `max_num_seqs`): no bucket is larger,
            so the expert kernels' scratch and the observations' fixed buffer stay as planned.
        max_width: blocks of the longest sequence (the engine's context): every state's width when
            the cache's decode attention reads the pools in place (`width_for`).
        row_buckets: the row buckets (`ROW_BUCKETS`), or None: a shape per exact row count.
    """

    def __init__(
        self,
        model,
        kv,
        sync_free,
        sdpa_backends,
        *,
        capture: bool,
        column_bucket: int = 256,
        max_states: int = MAX_STATES,
        compile_step: bool = False,
        max_rows: int | None = None,
        row_buckets=ROW_BUCKETS,
        max_width: int | None = None,
    ):
        from .runner import mask_for

        self.model = model
        self.kv = kv
        self.mask_for = mask_for
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
        self.column_bucket = max(column_bucket, kv.block_size)
        self.max_states = max_states
        self.max_rows = max_rows
        self.row_buckets = row_buckets
        self.max_width = max_width
        self.modules = list(model.modules())  # the tree is fixed once the runtime is assembled
        self.hooks_at_start = count_forward_hooks(self.modules)
        self.states: OrderedDict[tuple[int, int], PagedDecodeState] = OrderedDict()
        self.graph_pool = None  # the memory pool every captured graph allocates from
        self.rows_entered: Counter[int] = Counter()  # real batch rows -> decode steps run from buffers
        self.padded_rows = 0  # pad rows run, over all steps (bucket rows less real rows)
        self.allocations = 0  # buffers allocated (one per shape while kept)
        self.evictions = 0  # shapes dropped to keep `max_states`
        self.captures = 0  # graphs recorded (each costs two eager steps and a capture)
        self.replays = 0
        self.failed: str | None = None  # why capturing was switched off, after an error

    @property
    def entries(self) -> int:
        """Decode steps run from fixed buffers."""
        return self.rows_entered.total()

    def close(self) -> None:
        """Let go of every kept buffer and graph."""
        self.states.clear()
        self.graph_pool = None

    def stats(self) -> dict:
        """What this decoder did (bench JSON)."""
        return {
            "entries": self.entries,
            "rows_entered": dict(self.rows_entered),
            "padded_rows": self.padded_rows,
            "allocations": self.allocations,
            "evictions": self.evictions,
            "captures": self.captures,
            "replays": self.replays,
            "failed": self.failed,
        }

    def width_for(self, batch) -> int:
        """Blocks per row of the buffers for `batch`: its widest table rounded up to `column_bucket`
        tokens times a power of two; `max_width` where the cache's decode attention reads the pools
        in place (its work follows each row's length, so one width serves every batch)."""
        # compiled or not, decode steps may attend from the pools in place: the attention kernel is
        # an operator dynamo does not trace (`paged_attention.paged_decode_attention_op`)
        in_place = self.kv.decode_kernel
        if in_place and self.max_width is not None and batch.width <= self.max_width:
            return self.max_width
        return width_bucket(batch.width, self.column_bucket // self.kv.block_size)

    def applicable(self, rows: int) -> bool:
        return (
            self.failed is None
            and self.sync_free(rows)
            and count_forward_hooks(self.modules) == self.hooks_at_start
        )

    def rows_for(self, rows: int) -> int | None:
        """The rows a step of `rows` real rows runs with from the buffers (its row bucket), or None:
        not applicable (the eager path runs it). Asked before the step starts: the runtime records
        the step's observations for that many rows, of which the first `rows` are real."""
        bucket = row_bucket(rows, self.max_rows, self.row_buckets)
        return bucket if self.applicable(bucket) else None

    @torch.inference_mode()
    def decode(self, batch, rows: int | None = None, device_tokens=None) -> torch.Tensor | None:
        """A `runner.DecodeBatch` of B rows -> logits `(B, V)` from the fixed buffers of `rows`
        rows (`rows_for(B)` unless given), or None: not applicable, nothing done (the caller runs
        the eager path). `device_tokens` (`runner.DeviceTokens`): rows whose input token only the
        device holds, written into the buffer on the device after the host's copy."""
        rows = self.rows_for(batch.rows) if rows is None else rows
        if rows is None:
            return None
        state = self._state_for(rows, self.width_for(batch))
        state.load(batch)
        if device_tokens is not None:
            device_tokens.write(state.input_ids)
        if state.generation != self.kv.generation:
            state.graph = None  # the pools moved: the graph would read the old ones
        if self.capture and state.graph is None:
            try:
                self._record(state)
            except Exception as e:  # noqa: BLE001 - fall back for good, loudly, and keep serving
                self.failed = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed, decoding without graphs: %s", self.failed)
                self.states.clear()
                state.graph = None  # this step still runs from its buffers (its rows were announced)
        if state.graph is not None:
            state.graph.replay()
            self.replays += 1
        else:
            with sdpa_kernel(self.sdpa_backends):
                state.step(self.forward, self.kv, self.mask_for)
        self.rows_entered[batch.rows] += 1
        self.padded_rows += rows - batch.rows
        return state.logits[: batch.rows].clone()

    def _state_for(self, rows: int, width: int) -> PagedDecodeState:
        key = (rows, width)
        state = self.states.pop(key, None)
        if state is None:
            while len(self.states) >= self.max_states:
                self.states.popitem(last=False)
                self.evictions += 1
            state = PagedDecodeState(rows, width, self.kv.block_size, self.kv.device)
            self.allocations += 1
        self.states[key] = state  # the most recently used last
        return state

    def _record(self, state: PagedDecodeState) -> None:
        """Two eager warm-up steps on a side stream (lazy inits, kernel autotuning), then the capture.
        A warm-up writes the K/V of this step's tokens into their slots; the replay writes the same
        values there again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        if self.forward is not self.model:
            log.info(
                "compiling the decode step for %d rows x %d blocks (once per shape)", state.rows, state.width
            )
        with torch.cuda.stream(side), sdpa_kernel(self.sdpa_backends):
            for _ in range(2):
                state.step(self.forward, self.kv, self.mask_for)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        # thread-local: the residency's copies and the layer feed keep running on their own threads
        capture = torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local")
        with capture, sdpa_kernel(self.sdpa_backends):
            state.step(self.forward, self.kv, self.mask_for)
        state.graph = graph
        state.generation = self.kv.generation
        self.captures += 1
