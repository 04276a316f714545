"""The device table every MoE layer reads, and the protocol that changes it under a running step.

Layout, per layer (`slot_table.py` gives the kernel's view): `(2 + P, E)` int32 words:

    row 0          pool id of each expert's entry (`NOT_RESIDENT`: nowhere)
    rows 1 .. P    its slot in each of the P pools
    row 1 + P      the number of the copy the layer must see landed first (0: none; wait_for_copies)

The host keeps the authoritative table (`master`, numpy). Between steps `write()` copies it whole to
the device from one of two pinned staging buffers. Within a step an entry changes only through
`publish_words`, whose writes run in stream order on the copy stream, after the copy they publish:
the slot word first, then the wait word, then the pool word, so a reader sees either the old entry
or the new one, never a pool word with a slot that is not yet its own.
"""

from __future__ import annotations

import numpy as np
import torch

from .slot_table import NOT_RESIDENT

WORD_RING = 1 << 16  # pinned int32 words the copy side writes device words from, reused in turn


class DeviceTable:
    """`(L, 2 + P, E)` int32 on the host (`master`) and on `device` (`device_table`)."""

    def __init__(self, num_layers: int, num_pools: int, num_experts: int, device: torch.device, landed_slots: int):
        self.num_pools = num_pools
        self.wait_row = 1 + num_pools
        shape = (num_layers, 2 + num_pools, num_experts)
        self.master = np.full(shape, NOT_RESIDENT, dtype=np.int32)
        self.master[:, 1:] = 0
        self.device_table = torch.from_numpy(self.master.copy()).to(device)
        self.on_cuda = device.type == "cuda"
        self._staging = [torch.empty(shape, dtype=torch.int32, pin_memory=self.on_cuda) for _ in range(2)]
        self._events: list = [None, None]
        self._turn = 0
        self._words = torch.zeros(WORD_RING, dtype=torch.int32, pin_memory=self.on_cuda)
        self._next_word = 0
        # per hi slot, the number of the last copy that landed there (written by the copy stream)
        self.landed = torch.zeros(max(1, landed_slots), dtype=torch.int32, device=device)
        self._copy_number = 0

    # -- the kernel's views ---------------------------------------------------------------------------
    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(pool_of (E,), slot_of (P, E))` int32 device views of `layer`'s entries."""
        return self.device_table[layer, 0], self.device_table[layer, 1 : self.wait_row]

    def wait_view(self, layer: int) -> torch.Tensor:
        """`wait_of (E,)` int32: the copy number each expert's hi entry waits for (0: none)."""
        return self.device_table[layer, self.wait_row]

    # -- the host's table -----------------------------------------------------------------------------
    def set_entry(self, layer: int, expert: int, pool_id: int, slot: int, wait: int = 0) -> None:
        """The host's entry of `(layer, expert)` (reaches the device at the next `write` or publish)."""
        self.master[layer, 0, expert] = pool_id
        self.master[layer, self.wait_row, expert] = wait
        if pool_id >= 0:
            self.master[layer, 1 + pool_id, expert] = slot

    def set_slot(self, layer: int, expert: int, pool_id: int, slot: int) -> None:
        """Only the slot word of `pool_id`'s row: no reader looks there before the pool word says so."""
        self.master[layer, 1 + pool_id, expert] = slot

    def withdraw(self, layer: int, expert: int) -> None:
        """The host's entry sends `(layer, expert)` nowhere until it is recomputed."""
        self.master[layer, 0, expert] = NOT_RESIDENT

    def write(self) -> None:
        """Copy the whole host table to the device (CUDA: from a pinned staging buffer whose previous
        copy has finished, asynchronously on the current stream)."""
        if not self.on_cuda:
            self.device_table.copy_(torch.from_numpy(self.master))
            return
        turn = self._turn
        self._turn ^= 1
        staging, event = self._staging[turn], self._events[turn]
        if event is not None and not event.query():
            event.synchronize()  # two writes back: in practice long done
        staging.numpy()[...] = self.master
        self.device_table.copy_(staging, non_blocking=True)
        event = self._events[turn] = torch.cuda.Event()
        event.record()

    # -- publishing within a step --------------------------------------------------------------------
    def pinned_word(self, value: int) -> torch.Tensor:
        """A pinned int32 word holding `value`, from the ring the copy side writes device words from."""
        i = self._next_word
        self._next_word = (i + 1) % WORD_RING
        word = self._words[i : i + 1]
        word[0] = value
        return word

    def publish_words(self, layer: int, expert: int, pool_id: int, slot: int, wait: int | None = None) -> list:
        """The `(device word, pinned word)` writes, in the order they must land, that point
        `(layer, expert)`'s device entry at `slot` of pool `pool_id`: slot, then (given) wait, then pool."""
        row = self.device_table[layer]
        words = [(row[1 + pool_id, expert : expert + 1], self.pinned_word(slot))]
        if wait is not None:
            words.append((row[self.wait_row, expert : expert + 1], self.pinned_word(wait)))
        return words + [(row[0, expert : expert + 1], self.pinned_word(pool_id))]

    def next_copy_number(self) -> int:
        """A fresh copy number (1 .. 2^31 - 1, cycling) for a copy whose layer may wait on it."""
        self._copy_number = self._copy_number % (2**31 - 1) + 1
        return self._copy_number

    def landed_word(self, slot: int, number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The write that marks copy `number` landed in hi slot `slot` (right after the copy's data)."""
        return self.landed[slot : slot + 1], self.pinned_word(number)
