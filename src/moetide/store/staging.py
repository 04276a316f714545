"""Staged hi versions: a fixed number of host slots holding the hi versions of the hottest experts,
filled from the mapped checkpoint (`store.mapped`) by a background thread.

The residency core asks `get(layer, expert)` before it copies a hi version to the device: a staged
one is a hit (its slot buffer, `(nbytes,)` uint8); any other is queued for the stager thread and the
caller defers (the expert keeps running what it has). The slot of a version being copied to the
device is fenced by the copy's event and is not reused until that event has completed. Slots are
reused least recently used first. `stage_now` stages on the calling thread (start-up, and the
step boundaries of `--deterministic` runs, where residency must not depend on the stager's pace).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict

import torch

from .host_store import ExpertShape, hi_views


class _Held:
    """The fence of a slot handed out by `get` whose copy has not started yet."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise RuntimeError("a staged slot is held for a copy that was never started")


_HELD = _Held()


class StagedHi:
    """`slots` hi versions of `num_layers * num_experts` experts in `arena (slots, nbytes)` uint8."""

    def __init__(self, mapped, shape: ExpertShape, num_layers: int, num_experts: int, slots: int,
                 *, pin_memory: bool, budget) -> None:  # fmt: skip
        nbytes = shape.hi_nbytes
        budget.reserve(slots * nbytes, "staged", f"the host cache of {slots} staged hi experts")
        self.budget, self.mapped, self.shape = budget, mapped, shape
        self.num_experts = num_experts
        self.arena = torch.empty((slots, nbytes), dtype=torch.uint8, pin_memory=pin_memory)
        self.num_slots = slots
        self._slot_of: dict[int, int] = {}  # row (layer * E + expert) -> slot
        self._row_of: dict[int, int] = {}  # slot -> row
        self._lru: OrderedDict[int, None] = OrderedDict()  # filled slots, least recently used first
        self._free = list(range(slots - 1, -1, -1))
        self._fences: dict[int, object] = {}  # slot -> the event of a copy reading it
        self._lock = threading.Lock()
        self._pending: set[int] = set()
        self._staging: set[int] = set()  # rows being read into a slot now
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self.hits = 0  # `get` found the version staged
        self.requests = 0  # `get` queued a version for the stager
        self._thread = threading.Thread(target=self._run, name="moetide-stager", daemon=True)
        self._thread.start()

    @property
    def nbytes(self) -> int:
        return self.arena.numel()

    # -- the residency core's side -------------------------------------------------------------------
    def get(self, layer: int, expert: int, queue: bool = True) -> torch.Tensor | None:
        """The staged hi buffer `(nbytes,)` of one expert, held for a copy (`fence` or `unhold`
        release it), or None: then it is queued for the stager (unless `queue` is False)."""
        row = layer * self.num_experts + expert
        with self._lock:
            slot = self._slot_of.get(row)
            if slot is not None:
                self._lru.move_to_end(slot)
                fence = self._fences.get(slot)
                if fence is None or fence.query():
                    self._fences[slot] = _HELD
                self.hits += 1
                return self.arena[slot]
            if row in self._pending or not queue:
                return None
            self._pending.add(row)
            self.requests += 1
        self._requests.put(row)
        return None

    def _slot(self, buffer: torch.Tensor) -> int:
        return (buffer.data_ptr() - self.arena.data_ptr()) // self.arena.shape[1]

    def fence(self, buffer: torch.Tensor, event) -> None:
        """A copy reads `buffer` (a slot `get` returned and held) until `event` has completed."""
        with self._lock:
            self._fences[self._slot(buffer)] = event

    def unhold(self, buffer: torch.Tensor) -> None:
        """The copy `get` held `buffer` for was not started: the slot may be reused again."""
        with self._lock:
            if self._fences.get(self._slot(buffer)) is _HELD:
                del self._fences[self._slot(buffer)]

    def stage_now(self, layer: int, expert: int) -> torch.Tensor:
        """Stage one expert on this thread (waiting for a fenced slot if every slot is fenced)."""
        row = layer * self.num_experts + expert
        while True:
            buffer = self.get(layer, expert, queue=False)
            if buffer is not None:
                return buffer
            self._stage(row, wait=True)

    def wait_idle(self) -> None:
        """Return once every queued request has been staged (or found no slot)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
            time.sleep(0.0005)

    def staged_rows(self) -> list[int]:
        with self._lock:
            return sorted(self._slot_of)

    # -- the stager ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            row = self._requests.get()
            if row is None:
                return
            if not self._stage(row, wait=False):
                time.sleep(0.001)  # every slot fenced by copies in flight: try again
                self._requests.put(row)

    def _take_slot(self, wait: bool) -> int | None:
        """A free slot, else the least recently used one whose fence has completed (under the lock)."""
        if self._free:
            return self._free.pop()
        for slot in self._lru:
            fence = self._fences.get(slot)
            if fence is not None and not fence.query():
                continue
            self._fences.pop(slot, None)
            del self._lru[slot]
            del self._slot_of[self._row_of.pop(slot)]
            return slot
        busy = [slot for slot in self._lru if self._fences.get(slot) is not _HELD]
        if wait and busy:
            slot = busy[0]
            self._fences.pop(slot).synchronize()
            del self._lru[slot]
            del self._slot_of[self._row_of.pop(slot)]
            return slot
        return None

    def _stage(self, row: int, wait: bool) -> bool:
        """Read `row` from the map into a slot and publish it; False if no slot could be had."""
        with self._lock:
            if row in self._slot_of or row in self._staging:
                return True
            slot = self._take_slot(wait)
            if slot is None:
                return False
            self._staging.add(row)
        layer, expert = divmod(row, self.num_experts)
        self.mapped.read_into(layer, expert, hi_views(self.arena[slot], self.shape), self.shape.intermediate)
        with self._lock:
            self._slot_of[row], self._row_of[slot] = slot, row
            self._lru[slot] = None
            self._pending.discard(row)
            self._staging.discard(row)
        return True

    def close(self) -> None:
        self._requests.put(None)
        self._thread.join(timeout=5)
