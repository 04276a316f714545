"""Fixed-size expert slots carved once from one device arena; a free list with O(1) take/give."""

from __future__ import annotations

import torch


class SlotPool:
    """`num_slots` slots of `slot_bytes` each, in one `(num_slots, slot_bytes)` uint8 tensor.

    No general allocator runs on the hot path: slots are handed out and returned by index.
    """

    def __init__(self, name: str, num_slots: int, slot_bytes: int, device: torch.device):
        self.name = name
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.arena = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, device=device)
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: pop() takes the lowest index first

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """A free slot index, or None when the pool is full."""
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        self._free.append(slot)

    def buffer(self, slot: int) -> torch.Tensor:
        """The slot's bytes `(slot_bytes,)` uint8 (a view into the arena)."""
        return self.arena[slot]

    @property
    def nbytes(self) -> int:
        return self.arena.numel()
