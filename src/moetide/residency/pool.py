"""Fixed-size expert slots carved once from one device arena, with O(1) take/give and fenced frees.

A slot is taken with its bytes reserved in the `BudgetTracker` (admission control: no reservation, no
slot) and freed through a fence: `free(slot, fence)` parks it until `fence.query()` says the last
compute that could read it has finished; `reclaim()` then returns it to the free list and releases
its bytes. No general allocator runs on the hot path: slots are handed out and returned by index.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from .budget import BudgetTracker


class SlotPool:
    """`num_slots` slots of `slot_bytes` each, in one `(num_slots, slot_bytes)` uint8 tensor.

    Every slot is always in exactly one place: the free list, taken (holding a version), or fenced
    (freed, waiting for its last reader): `free_slots + taken + pending == num_slots`.
    """

    def __init__(
        self, name: str, num_slots: int, slot_bytes: int, device: torch.device, budget: BudgetTracker | None = None
    ):
        self.name = name
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.arena = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, device=device)
        self.budget = budget
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() takes the lowest index first
        self._fenced: deque = deque()  # (slot, fence, on_free), oldest first

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def pending(self) -> int:
        """Slots freed whose fence has not been seen complete yet."""
        return len(self._fenced)

    def take(self) -> int | None:
        """A free slot with its bytes reserved; None when none is free or the budget refuses it."""
        if not self._free:
            return None
        slot = self._free.pop()
        if self.budget is not None and not self.budget.try_reserve(self.slot_bytes, f"expert_{self.name}"):
            self._free.append(slot)
            return None
        return slot

    def free(self, slot: int, fence=None, on_free: Callable[[], None] | None = None) -> None:
        """Give `slot` back once `fence` (an event with `query()`; None: at once) has completed;
        `on_free` runs when it is back on the free list."""
        self._fenced.append((slot, fence, on_free))

    def reclaim(self) -> bool:
        """Return the fenced slots whose fences completed, oldest first, stopping at the first that
        has not (fences complete in stream order). Whether any came back."""
        freed = False
        while self._fenced:
            slot, fence, on_free = self._fenced[0]
            if fence is not None and not fence.query():
                break
            self._fenced.popleft()
            self._give(slot)
            if on_free is not None:
                on_free()
            freed = True
        return freed

    def _give(self, slot: int) -> None:
        self._free.append(slot)
        if self.budget is not None:
            self.budget.release(self.slot_bytes, f"expert_{self.name}")

    def buffer(self, slot: int) -> torch.Tensor:
        """The slot's bytes `(slot_bytes,)` uint8 (a view into the arena)."""
        return self.arena[slot]

    @property
    def nbytes(self) -> int:
        return self.arena.numel()
