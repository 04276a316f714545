"""FineMoE's searcher in its own process, fed through shared memory (`FineMoEConfig.searcher="process"`).

Why a process: on a launch-bound decode step the forward thread and a searcher *thread* share the
GIL, and every search, wake-up and sink call of the thread is time the forward thread waits for it
(measured: FineMoE added 27 % to a decode step with a thread, 11 % with this process). Here the forward thread's whole share of FineMoE is:

    publish   copy the observation into a slot of a shared ring (numpy) and bump a counter
    apply     at its next publish, turn the decisions the searcher wrote back into sink calls
              (for the engine's residency: queue puts; the residency drains them in `acquire`)

and the searches, the RDY-deduplicated store inserts and the prefetch sizing run in the child, which
never touches the device and never takes the forward process's GIL.

The child is a plain `python -c` subprocess (not `multiprocessing`, whose spawn re-runs the user's
main script: a script without a `__main__` guard would fail). It inherits three descriptors: the shared
memory (a memfd, mapped by both), the read end of a wake-up pipe (end of file when the forward
process is gone) and a socket for control messages (`multiprocessing.connection`).

Waking the child costs the forward thread a system call and a context switch (measured: ~35 us per
event on the 2-core CPU, a tenth of a decode layer), so the child polls the ring every
`POLL_S` while events keep coming; after `IDLE_S` without one it raises `ctrl[SLEEPING]` and blocks
in `select` on the pipe and the socket (with a `SLEEP_TIMEOUT_S` timeout), and only then does the
forward thread write a wake-up byte.

Shared memory (numpy views on both sides; S event slots, D decision slots, W = max(H, J) floats per
event):

    ctrl       int64   (CTRL,)   sequence numbers, the forward pass's position, the child's counters
    ev_head    int64   (S, 4)    kind, iteration, layer, num_tokens (begin) or distinct experts (layer)
    ev_data    float32 (S, W)    embedding (H,) for "begin", mean gate probabilities (J,) for "layer"
    dec_head   int64   (D, 4)    kind (protect / prefetch / both), iteration, layer, number of experts n
    dec_ids    int32   (D, J)    the experts, in priority order (first n)
    dec_prob   float32 (D, J)    their predicted probabilities (prefetch only)

Writers fill a slot, then bump its sequence number, with no fence: x86-64 does not reorder stores
with other stores, nor loads with other loads, so a reader that sees the new counter sees the slot.
(A weakly ordered CPU, such as ARM, would need fences: there `SUPPORTED` is False and FineMoE
runs its searcher as a thread instead.) A full ring drops
the event (the child then skips that iteration) or the decision: neither side ever waits for the
other.
The store lives in the child; `fetch_store` / `send_store` move it over a pipe (warm-up, save, close).
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

# ctrl indices
_WRITE_SEQ, _READ_SEQ, _DEC_SEQ, _DEC_APPLIED, _POSITION, _READY, _SLEEPING, _PAUSED = range(8)
# the handler's counters (FineMoEPolicy attributes of the same names), then the child's own
POLICY_COUNTERS = (
    "semantic_searches",
    "trajectory_searches",
    "prefetch_requests",
    "prefetched_experts",
    "late_skipped",
)
_COUNTERS = (*POLICY_COUNTERS, "dropped_decisions", "search_ns", "errors", "store_size")
_C0 = 8  # first counter index
_CTRL = _C0 + len(_COUNTERS)

SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")  # see the module docstring
KIND_BEGIN, KIND_LAYER, KIND_END = 1, 2, 3  # events
KIND_PROTECT, KIND_PREFETCH, KIND_PROTECT_PREFETCH = 1, 2, 3  # decisions
POLL_S = 50e-6  # the child's polling period while busy
IDLE_S = 0.05  # without an event for this long, the child blocks until woken
SLEEP_TIMEOUT_S = 0.02  # a wake-up lost to a race costs at most this much latency
_CHILD_COMMAND = "from moetide.policies.searcher_child import child_entry; child_entry()"
_LAYER_FIELD = 1 << 16  # position = iteration * _LAYER_FIELD + layer + 1 (one store: never torn)


def encode_position(iteration: int, layer: int) -> int:
    """The forward pass's (iteration, layer) as one int64 (layer -1: the iteration has begun)."""
    return iteration * _LAYER_FIELD + layer + 1


def decode_position(value: int) -> tuple[int, int]:
    it, layer = divmod(int(value), _LAYER_FIELD)
    return it, layer - 1


class SharedRings:
    """numpy views of the shared block (both processes build the same views from the same sizes)."""

    def __init__(self, buffer, event_slots: int, decision_slots: int, width: int, num_experts: int):
        self.sizes = (event_slots, decision_slots, width, num_experts)
        S, D, W, J = self.sizes
        buf = memoryview(buffer).cast("B")
        offset = 0

        def take(dtype, shape):
            nonlocal offset
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            view = np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
            offset += (n + 63) // 64 * 64
            return view

        self.ctrl = take(np.int64, (_CTRL,))
        self.ev_head = take(np.int64, (S, 4))
        self.ev_data = take(np.float32, (S, W))
        self.dec_head = take(np.int64, (D, 4))
        self.dec_ids = take(np.int32, (D, J))
        self.dec_prob = take(np.float32, (D, J))

    @staticmethod
    def nbytes(event_slots: int, decision_slots: int, width: int, num_experts: int) -> int:
        shapes = [
            (8, _CTRL),
            (8, event_slots * 4),
            (4, event_slots * width),
            (8, decision_slots * 4),
            (4, decision_slots * num_experts),
            (4, decision_slots * num_experts),
        ]
        return sum((size * n + 63) // 64 * 64 for size, n in shapes)


class SearcherProcess:
    """The forward process's end of a FineMoE searcher process.

    `config`: the parent's `FineMoEConfig`; `geometry`: (num_layers L, num_experts J, top_k,
    hidden_size H); `store`: the map store to start from (or None). Every method except `drain`,
    `fetch_store`, `send_store` and `close` returns in microseconds and never waits for the child.
    """

    def __init__(self, config, geometry: tuple[int, int, int, int], store=None):
        L, J, _, H = geometry
        self.geometry = geometry
        self.event_slots = max(256, 8 * (L + 2))
        self.decision_slots = max(256, 8 * 2 * L)
        sizes = (self.event_slots, self.decision_slots, max(H, J), J)
        nbytes = SharedRings.nbytes(*sizes)
        if hasattr(os, "memfd_create"):
            mem_fd = os.memfd_create("moetide-finemoe-searcher")
        else:  # an unlinked temporary file serves as well
            with tempfile.TemporaryFile() as f:
                mem_fd = os.dup(f.fileno())
        os.ftruncate(mem_fd, nbytes)
        self._memory = mmap.mmap(mem_fd, nbytes)
        self.rings = SharedRings(self._memory, *sizes)
        wake_read, self._wake = os.pipe()
        os.set_blocking(self._wake, False)
        mine, theirs = socket.socketpair()
        self.submitted = 0
        self.dropped_events = 0
        self._applied = 0
        package_root = str(Path(__file__).resolve().parents[2])  # the directory holding `moetide`
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        env.update(dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1"))
        fds = (mem_fd, wake_read, theirs.fileno())
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _CHILD_COMMAND, *map(str, fds)],
                pass_fds=fds,
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            for fd in (mem_fd, wake_read):
                os.close(fd)
            theirs.close()
        self._conn = Connection(mine.detach())
        self._conn.send(("init", config, geometry, sizes, store.state() if store is not None else None))

    # -- forward thread ------------------------------------------------------------------------------
    def publish(self, kind: int, iteration: int, layer: int, count: int, data=None) -> bool:
        """One event into the ring (False: the ring was full and the event was dropped); a "begin" or
        "layer" event also records the forward pass's position. `data`: (H,) embedding or (J,)
        probabilities, any array-like of floats."""
        rings = self.rings
        if kind != KIND_END:
            rings.ctrl[_POSITION] = encode_position(iteration, layer)
        if self.submitted - int(rings.ctrl[_READ_SEQ]) >= self.event_slots:
            self.dropped_events += 1
            return False
        slot = self.submitted % self.event_slots
        rings.ev_head[slot] = (kind, iteration, layer, count)
        if data is not None:
            rings.ev_data[slot, : len(data)] = data
        self.submitted += 1
        rings.ctrl[_WRITE_SEQ] = self.submitted
        if rings.ctrl[_SLEEPING]:
            self._poke()
        return True

    def publish_layers(self, iteration: int, counts: np.ndarray, probs: np.ndarray) -> bool:
        """Every MoE layer of a finished step at once (the engine publishes a step after it ran): L
        "layer" events, `counts (L,)` distinct experts and `probs (L, J)` gate probabilities, written
        with one position, one sequence update and at most one wake-up. All or none: False (every
        one dropped) when the ring lacks room for L."""
        rings, L = self.rings, len(counts)
        rings.ctrl[_POSITION] = encode_position(iteration, L - 1)
        if self.submitted + L - int(rings.ctrl[_READ_SEQ]) > self.event_slots:
            self.dropped_events += L
            return False
        slots = (self.submitted + np.arange(L)) % self.event_slots
        rings.ev_head[slots] = np.stack([np.full(L, KIND_LAYER), np.full(L, iteration), np.arange(L), counts], 1)
        rings.ev_data[slots, : probs.shape[1]] = probs
        self.submitted += L
        rings.ctrl[_WRITE_SEQ] = self.submitted
        if rings.ctrl[_SLEEPING]:
            self._poke()
        return True

    def _poke(self) -> None:
        """Wake the child (a full pipe means it has plenty to wake up for already)."""
        try:
            os.write(self._wake, b"\x01")
        except (BlockingIOError, BrokenPipeError, OSError):
            pass

    def apply_decisions(self, sink) -> int:
        """Hand the decisions the searcher wrote since the last call to `sink`. Returns how many."""
        rings = self.rings
        end = int(rings.ctrl[_DEC_SEQ])
        start = self._applied
        while self._applied < end:
            slot = self._applied % self.decision_slots
            kind, iteration, layer, n = rings.dec_head[slot].tolist()
            experts = rings.dec_ids[slot, :n].tolist()
            if kind == KIND_PROTECT:
                sink.protect(layer, experts, iteration=iteration)
            else:
                priorities = rings.dec_prob[slot, :n].tolist()
                both = kind == KIND_PROTECT_PREFETCH
                sink.prefetch(layer, experts, iteration=iteration, priorities=priorities, protect=both)
            self._applied += 1
        rings.ctrl[_DEC_APPLIED] = self._applied
        return self._applied - start

    # -- reports and control (not on the forward path) -----------------------------------------------
    @property
    def ready(self) -> bool:
        return bool(self.rings.ctrl[_READY])

    @property
    def paused(self) -> bool:
        return bool(self.rings.ctrl[_PAUSED])

    @paused.setter
    def paused(self, value: bool) -> None:
        """Paused: the child reads every event and drops it (no search, no insert, no decision), so
        the forward process publishes exactly as it does otherwise (what publishing alone costs)."""
        self.rings.ctrl[_PAUSED] = int(value)

    @property
    def alive(self) -> bool:
        return self._child.poll() is None

    def counters(self) -> dict:
        values = self.rings.ctrl[_C0:_CTRL].tolist()
        return dict(zip(_COUNTERS, values, strict=True))

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until the child has handled every event published so far (tests, shutdown only)."""
        deadline = time.monotonic() + timeout_s
        while int(self.rings.ctrl[_READ_SEQ]) < self.submitted:
            if time.monotonic() > deadline or not self.alive:
                return False
            time.sleep(0.0005)
        return True

    def _call(self, message: tuple, timeout_s: float):
        if not self.alive:
            raise RuntimeError("the FineMoE searcher process has exited")
        self._conn.send(message)  # the child waits on this socket too (select)
        if not self._conn.poll(timeout_s):
            raise TimeoutError(
                f"the FineMoE searcher process did not answer {message[0]!r} in {timeout_s:.0f} s"
            )
        return self._conn.recv()

    def fetch_store(self, timeout_s: float = 60.0):
        """The child's current map store (an `ExpertMapStore`), or None if it has none yet."""
        from .expert_map import ExpertMapStore

        state = self._call(("get_store",), timeout_s)
        return ExpertMapStore.from_state(state) if state is not None else None

    def send_store(self, store, timeout_s: float = 60.0) -> None:
        """Replace the child's map store with `store`."""
        self._call(("set_store", store.state()), timeout_s)

    def errors(self, timeout_s: float = 10.0) -> list[str]:
        if not self.alive:
            return ["the FineMoE searcher process has exited"]
        return self._call(("errors",), timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        if self.alive:
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
        os.close(self._wake)  # end of file on the child's side, whatever it is doing
        try:
            self._child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait(timeout_s)
        self._conn.close()
