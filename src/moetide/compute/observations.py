"""What a step shows the policies, written on the device and read on the host one step later.

The forward pass writes each MoE layer's routing into fixed device buffers (so a captured decode
step writes them too, and no layer waits for the host); `finish_step` queues one asynchronous copy
of the step's bytes into a pinned host slot, and the next step's start (`take_ready`, or `flush`)
hands the records whose copy has landed to the host (`StepRecord`). Shapes, for a step of T tokens:

    ids      (L, T, k)  int32    experts the router chose (written by the runtime, every layer)
    pools    (L, T, k)  int32    the pool each choice was read from (the table as the layer read it)
    logits   (L, T, E)  float32  router logits (written by the policy hooks, when a policy observes)
    spec     (L, T, k)  int32    speculative top-k of router l+d on layer l's input (LRU's guess)
    embed    (H,)       float32  the step's mean embedding-layer output over its real rows (FineMoE's
                                 semantic key)

A padded decode step (engine/graphed_decode.py: B real rows run as a row bucket of T) writes T rows;
the host, which launched the step, knows B (`begin_step(..., real=B)`): records and the layer feed
hand the policies the first B rows only, and the embedding is the mean of the first B rows, counted
on the device from a scalar the step's start writes (one replayed graph serves every B of its T).

All of a step's regions lie back to back from byte 0 of one buffer, so one copy moves them. Steps of
up to `decode_tokens` tokens use a buffer allocated once (its addresses stay valid in CUDA graphs);
larger ones (prefills) use a second buffer that grows as needed.

The buffer is layer-major: one row per MoE layer holding that layer's regions, then the embedding.
The layer feed (`want(feed=True)`, for policies that decide within the running step) copies each
layer's row to a pinned mirror of the buffer as soon as the layer has routed (`publish_layer`,
`publish_embedding`), then the step's number into that slot's word, both on the compute stream, so
a host thread sees the layer while the device computes the rest of the step (`feed_seq`,
`feed_read`; the embedding's word, written first in every step, tells a read the next step has
overwritten).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ..residency.slot_table import UNUSED

HOST_SLOTS = 4  # pinned copies in flight at once (a record is read at most a few steps later)


def softmax_mean(logits: np.ndarray) -> np.ndarray:
    """(..., T, E) router logits -> (..., E) float32: the mean over tokens of their softmax (one
    call for every layer of a step: `(L, T, E) -> (L, E)`)."""
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).mean(axis=-2).astype(np.float32)


@dataclass
class StepRecord:
    """One step's observations on the host (numpy views into a pinned slot, valid until the slot is
    reused: `HOST_SLOTS` steps later). T is the step's real tokens: a padded step's pad rows are
    left out."""

    iteration: int
    num_tokens: int
    ids: np.ndarray  # (L, T, k) int32
    pools: np.ndarray | None  # (L, T, k) int32
    logits: np.ndarray | None  # (L, T, E) float32
    spec: np.ndarray | None  # (L, T, k) int32
    embed: np.ndarray | None  # (H,) float32
    num_experts: int = 0
    context: object = None  # what the runtime attached at the step's start (its table snapshot)

    def gate_probs(self, layer: int | None = None) -> np.ndarray:
        """Mean softmax over the step's tokens of layer `layer`'s router logits: (E,) float32; of
        every layer when `layer` is None: (L, E)."""
        return softmax_mean(self.logits if layer is None else self.logits[layer])

    def ran_from(self) -> np.ndarray:
        """(L, E) int32: the pool each expert of each layer ran from in this step, -2 where no token
        chose it (needs `pools`)."""
        L, T, k = self.ids.shape
        ran = np.full((L, self.num_experts), UNUSED, dtype=np.int32)
        rows = np.repeat(np.arange(L), T * k)
        ran[rows, self.ids.reshape(-1)] = self.pools.reshape(-1)
        return ran


class _Layout:
    """Where each region lies for a step of `tokens` tokens: layer-major rows, one per MoE layer
    (ids, pools, logits, spec: the regions a layer writes, back to back), then the embedding. A
    region is `(offset within a row, words)`, the embedding `(offset in the buffer, words)`."""

    def __init__(self, L, E, k, H, tokens: int, logits: bool, spec: bool, embed: bool, pools: bool):
        self.tokens = tokens
        self.layers = L
        words = 0
        self.ids = (0, tokens * k)
        words += tokens * k
        self.pools = (4 * words, tokens * k) if pools else None
        words += tokens * k if pools else 0
        self.logits = (4 * words, tokens * E) if logits else None
        words += tokens * E if logits else 0
        self.spec = (4 * words, tokens * k) if spec else None
        words += tokens * k if spec else 0
        self.row_bytes = 4 * words
        self.embed = (L * self.row_bytes, H) if embed else None
        self.nbytes = L * self.row_bytes + (4 * H if embed else 0)


class StepObservations:
    """Device buffers for one step's routing, and the pinned slots they are copied into.

    Args:
        num_layers, num_experts, top_k, hidden_size: L, E, k, H.
        device: where the forward pass runs.
        decode_tokens: steps of at most this many tokens (decode batches) use the fixed buffer.
    """

    def __init__(self, num_layers, num_experts, top_k, hidden_size, device, decode_tokens: int = 32):
        self.shape = (num_layers, num_experts, top_k, hidden_size)
        self.device = torch.device(device)
        self.decode_tokens = decode_tokens
        self.want_logits = False  # set by the policy hooks
        self.want_spec = False
        self.want_embed = False
        self.want_pools = False  # set by the runtime where its residency accounts each step
        self.want_feed = False  # mirror each layer to the host as it routes (policies.in_step)
        self.on_publish: list = []  # called after each feed publication (the CPU wakes the feeds' threads)
        self._seq_dev: torch.Tensor | None = None  # () int64: the running step's number, on the device
        self._seq_host: torch.Tensor | None = None  # (1 + L,) int64 pinned: the step each slot holds
        self._mirror: dict[str, torch.Tensor] = {}  # "fixed" / "growing" -> pinned copy of that buffer
        self._host_views: dict = {}  # like `_views`, over the mirrors
        self._fixed: torch.Tensor | None = None
        self._growing: torch.Tensor | None = None
        self._host: list[torch.Tensor | None] = [None] * HOST_SLOTS
        self._next_slot = 0
        self._pending: deque = deque()  # (record without views, slot, layout, event)
        self._views: dict = {}  # (buffer id, tokens) -> {region: tensor view}
        # the running step: (iteration, context) and its token count (known up front from the
        # runner, which a replayed CUDA graph needs: no Python runs in it; else set by the first record)
        self._step: tuple | None = None
        self._step_tokens: int | None = None
        self._step_real: int | None = None  # of those, the real ones (the rest: pad rows)
        self._real_dev: torch.Tensor | None = None  # () int64: the running step's real tokens, on the device

    def want(
        self, *, logits: bool = False, spec: bool = False, embed: bool = False, pools: bool = False, feed: bool = False
    ) -> None:
        """Which regions beyond the ids are recorded (asked for before any step), and whether each
        layer is mirrored to the host as it routes (`feed`)."""
        self.want_logits |= logits
        self.want_spec |= spec
        self.want_embed |= embed
        self.want_pools |= pools
        self.want_feed |= feed
        self._fixed = self._growing = None
        self._views.clear()
        self._mirror.clear()
        self._host_views.clear()
        if self.want_feed and self._seq_dev is None:
            L = self.shape[0]
            self._seq_dev = torch.full((), -1, dtype=torch.int64, device=self.device)
            self._seq_host = torch.full((1 + L,), -1, dtype=torch.int64, pin_memory=self.device.type == "cuda")
            self._seq_np = self._seq_host.numpy()  # the host thread polls this view (no torch call per look)
        if self.want_embed and self._real_dev is None:
            self._real_dev = torch.zeros((), dtype=torch.int64, device=self.device)

    # -- the forward pass (device ops only) --------------------------------------------------------
    def layout(self, tokens: int) -> _Layout:
        L, E, k, H = self.shape
        return _Layout(L, E, k, H, tokens, self.want_logits, self.want_spec, self.want_embed, self.want_pools)

    def _buffer_for(self, nbytes: int, tokens: int) -> torch.Tensor:
        if tokens <= self.decode_tokens:
            if self._fixed is None:
                most = self.layout(self.decode_tokens).nbytes
                self._fixed = torch.empty(most, dtype=torch.uint8, device=self.device)
            return self._fixed
        if self._growing is None or self._growing.numel() < nbytes:
            self._growing = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._views = {key: v for key, v in self._views.items() if key[0] != "growing"}
            self._host_views = {key: v for key, v in self._host_views.items() if key[0] != "growing"}
        return self._growing

    def views(self, tokens: int) -> dict[str, torch.Tensor]:
        """The regions of a `tokens`-token step: "ids" (L, T, k) int32, and "logits" (L, T, E),
        "spec" (L, T, k), "embed" (H,) where wanted. The same tensors each time for the same T."""
        key = ("fixed" if tokens <= self.decode_tokens else "growing", tokens)
        views = self._views.get(key)
        if views is None:
            lay = self.layout(tokens)
            views = self._regions(self._buffer_for(lay.nbytes, tokens), lay)
            self._views[key] = views
        return views

    def _regions(self, buf: torch.Tensor, lay: _Layout) -> dict[str, torch.Tensor]:
        """Tensor views of `lay`'s regions over the uint8 buffer `buf` ("rows": (L, row bytes))."""
        L, E, k, H = self.shape
        tokens = lay.tokens
        rows = buf[: L * lay.row_bytes].view(L, lay.row_bytes)
        views = {"buffer": buf[: lay.nbytes], "rows": rows}

        def region(spec, dtype, shape):
            start, count = spec
            return rows[:, start : start + 4 * count].view(dtype).view(shape)

        views["ids"] = region(lay.ids, torch.int32, (L, tokens, k))
        if lay.pools:
            views["pools"] = region(lay.pools, torch.int32, (L, tokens, k))
        if lay.logits:
            views["logits"] = region(lay.logits, torch.float32, (L, tokens, E))
        if lay.spec:
            views["spec"] = region(lay.spec, torch.int32, (L, tokens, k))
        if lay.embed:
            start = lay.embed[0]
            views["embed"] = buf[start : start + 4 * H].view(torch.float32)
        return views

    def _mirror_views(self, tokens: int) -> dict[str, torch.Tensor]:
        """The regions of a `tokens`-token step over the pinned host mirror of its device buffer."""
        which = "fixed" if tokens <= self.decode_tokens else "growing"
        key = (which, tokens)
        views = self._host_views.get(key)
        if views is None:
            lay = self.layout(tokens)
            device_buf = self._buffer_for(lay.nbytes, tokens)
            mirror = self._mirror.get(which)
            if mirror is None or mirror.numel() < device_buf.numel():
                mirror = torch.zeros(device_buf.numel(), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
                self._mirror[which] = mirror
                self._host_views = {k: v for k, v in self._host_views.items() if k[0] != which}
            views = self._host_views[key] = self._regions(mirror, lay)
        return views

    def begin_step(
        self, iteration: int, context=None, tokens: int | None = None, real: int | None = None
    ) -> None:
        """A step starts; `tokens`: its T where the caller knows it (every step the engine runs),
        `real`: how many of them are real (the first; all unless given)."""
        self._step = (iteration, context)
        self._step_tokens = tokens
        self._step_real = real if real is not None else tokens
        if self.want_feed:
            self._seq_dev.fill_(iteration)  # a kernel argument: no host buffer to race with
        if self._real_dev is not None and self._step_real is not None:
            self._real_dev.fill_(self._step_real)  # read by the step's embedding mean, replays too

    def _tokens(self, tokens: int) -> dict[str, torch.Tensor]:
        if self._step_tokens is None:
            self._step_tokens = tokens
        return self.views(tokens)

    @torch.compiler.disable  # host bookkeeping; a compiled step breaks here (beside the MoE break)
    def record_ids(self, layer: int, top_k_index: torch.Tensor) -> None:
        """`top_k_index (T, k)` of MoE layer `layer` into the step's ids region."""
        self._tokens(top_k_index.shape[0])["ids"][layer].copy_(top_k_index)

    @torch.compiler.disable  # host bookkeeping; a compiled step breaks here (beside the MoE break)
    def record_pools(self, layer: int, pool_of: torch.Tensor, top_k_index: torch.Tensor) -> None:
        """The pool each of `top_k_index (T, k)`'s choices reads at this moment: `pool_of (E,)`
        gathered on the device (what the layer's kernel reads next, mid-step publications included)."""
        out = self._tokens(top_k_index.shape[0])["pools"][layer]
        torch.index_select(pool_of, 0, top_k_index.reshape(-1), out=out.view(-1))

    @torch.compiler.disable  # host bookkeeping; a compiled step breaks here (beside the MoE break)
    def record_logits(self, layer: int, logits: torch.Tensor) -> None:
        """Router logits `(T, E)` of layer `layer` (float32 in the buffer)."""
        logits = logits.reshape(-1, logits.shape[-1])
        self._tokens(logits.shape[0])["logits"][layer].copy_(logits)

    @torch.compiler.disable  # host bookkeeping; a compiled step breaks here (beside the MoE break)
    def record_spec(self, layer: int, top_k_index: torch.Tensor) -> None:
        top_k_index = top_k_index.reshape(-1, top_k_index.shape[-1])
        self._tokens(top_k_index.shape[0])["spec"][layer].copy_(top_k_index)

    @torch.compiler.disable  # host bookkeeping; a compiled step breaks here (beside the MoE break)
    def record_embedding(self, hidden: torch.Tensor) -> None:
        """The embedding-layer output `(..., H)`: its mean over the step's real tokens (the first
        `real` of `begin_step`, counted on the device), or over every token of a step whose count
        was not given (a forward outside the engine's runner)."""
        h = hidden.reshape(-1, hidden.shape[-1])
        out = self._tokens(h.shape[0])["embed"]
        if self._step_real is None:
            torch.mean(h, dim=0, dtype=torch.float32, out=out)
            return
        real = torch.arange(h.shape[0], device=h.device) < self._real_dev  # (T,) bool
        torch.sum(torch.where(real.unsqueeze(1), h.float(), 0.0), dim=0, out=out)
        out.div_(self._real_dev)

    # -- the layer feed (device ops; read on a host thread) -------------------------------------------
    @torch.compiler.disable  # host bookkeeping; a compiled step breaks here (beside the MoE break)
    def publish_layer(self, layer: int) -> None:
        """Layer `layer` has routed (its ids, logits and speculative ids are recorded): copy them to
        the host mirror between its two step words (slot 1 + layer)."""
        if self.want_feed and self._step_tokens is not None:
            self._publish(1 + layer, layer)

    @torch.compiler.disable  # host bookkeeping; a compiled step breaks here (beside the MoE break)
    def publish_embedding(self) -> None:
        """The step's pooled embedding is recorded: copy it to the host mirror (slot 0)."""
        if self.want_feed and self._step_tokens is not None and self.want_embed:
            self._publish(0, None)

    def _publish(self, slot: int, layer: int | None) -> None:
        """Two copies on the compute stream: the slot's bytes (the embedding, or the layer's row),
        then the step's number into the slot's word."""
        tokens = self._step_tokens
        dev, host = self.views(tokens), self._mirror_views(tokens)
        async_ = self.device.type == "cuda"
        region = "embed" if layer is None else "rows"
        src, dst = (dev[region], host[region]) if layer is None else (dev[region][layer], host[region][layer])
        dst.copy_(src, non_blocking=async_)
        self._seq_host[slot].copy_(self._seq_dev, non_blocking=async_)
        for wake in self.on_publish:
            wake()

    def feed_seq(self, slot: int) -> int:
        """The step whose slot `slot` (0: embedding, 1 + l: layer l) last landed whole on the host."""
        return int(self._seq_np[slot])

    def feed_read(
        self, slot: int, iteration: int, tokens: int, real: int | None = None
    ) -> dict[str, np.ndarray] | None:
        """Copies of slot `slot`'s regions for step `iteration` of `tokens` tokens, its first `real`
        rows (all unless given; the rest are pad rows): "embed" (H,), or "ids" (real, k), "logits"
        (real, E), "spec" (real, k); None if that step's data is not (or no longer) there whole."""
        if self.feed_seq(slot) != iteration:
            return None
        host = self._host_views.get(("fixed" if tokens <= self.decode_tokens else "growing", tokens))
        if host is None:  # (made by the forward thread's first publication of that shape)
            return None
        if slot == 0:
            out = {"embed": host["embed"].numpy().copy()}
        else:
            out = {n: host[n][slot - 1, :real].numpy().copy() for n in ("ids", "logits", "spec") if n in host}
        # the next step publishes its embedding before any of its layers: while slot 0 still holds
        # this step (or an earlier one), no later step has begun overwriting what was just read
        if self.feed_seq(0) > iteration:
            return None
        return out

    # -- step boundaries (host) --------------------------------------------------------------------
    def take_ready(self) -> list[StepRecord]:
        """The earlier steps whose copies have landed (oldest first); the engine calls this at the
        start of a step, when the step before it has finished (its tokens were read)."""
        return self._ready(block_oldest=False)

    def finish_step(self, discard: bool = False) -> None:
        """Queue the running step's copy to a pinned slot (a step that recorded nothing is skipped,
        and so is one whose forward failed: `discard`)."""
        step, tokens, real = self._step, self._step_tokens, self._step_real
        self._step = self._step_tokens = self._step_real = None
        if step is not None and tokens is not None and not discard:
            self._queue_copy(step[0], tokens, real if real is not None else tokens, step[1])

    def flush(self) -> list[StepRecord]:
        """Every queued record, waiting for the copies still in flight (end of a run)."""
        return self._ready(block_oldest=True, everything=True)

    def _queue_copy(self, iteration: int, tokens: int, real: int, context) -> None:
        if len(self._pending) >= HOST_SLOTS:  # every slot is still being read: wait for the oldest
            self._wait(self._pending[0][3])
        lay = self.layout(tokens)
        src = self.views(tokens)["buffer"]
        slot = self._next_slot
        self._next_slot = (slot + 1) % HOST_SLOTS
        host = self._host[slot]
        if host is None or host.numel() < lay.nbytes:
            pin = self.device.type == "cuda"
            host = self._host[slot] = torch.empty(max(lay.nbytes, 1 << 16), dtype=torch.uint8, pin_memory=pin)
        event = None
        if self.device.type == "cuda":
            host[: lay.nbytes].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host[: lay.nbytes].copy_(src)
        self._pending.append(((iteration, real, context), slot, lay, event))

    @staticmethod
    def _wait(event) -> None:
        if event is not None:
            event.synchronize()

    def _ready(self, *, block_oldest: bool, everything: bool = False) -> list[StepRecord]:
        out = []
        while self._pending:
            step, slot, lay, event = self._pending[0]
            if event is not None and not event.query():
                if not (block_oldest or everything):
                    break
                self._wait(event)
            self._pending.popleft()
            out.append(self._record(step, self._host[slot], lay))
        return out

    def _record(self, step, host: torch.Tensor, lay: _Layout) -> StepRecord:
        """The host record of a step of `lay.tokens` tokens, its first `real` (of `step`) only."""
        iteration, real, context = step
        L, E, k, H = self.shape
        tokens = lay.tokens
        raw = host.numpy()
        rows = raw[: L * lay.row_bytes].reshape(L, lay.row_bytes)

        def region(spec, dtype, shape):
            if spec is None:
                return None
            start, count = spec
            return rows[:, start : start + 4 * count].view(dtype).reshape(shape)[:, :real]

        embed = None
        if lay.embed is not None:
            embed = raw[lay.embed[0] : lay.embed[0] + 4 * H].view(np.float32)
        return StepRecord(
            iteration,
            real,
            region(lay.ids, np.int32, (L, tokens, k)),
            region(lay.pools, np.int32, (L, tokens, k)),
            region(lay.logits, np.float32, (L, tokens, E)),
            region(lay.spec, np.int32, (L, tokens, k)),
            embed,
            E,
            context,
        )
