"""Host->device copies of expert versions, each with a completion event; never on the compute stream.

Two backends behind one interface:
    CudaTransfer  copies on dedicated streams (`demand` at high priority, `migration` for prefetches
                  and precision changes) from pinned host memory; events are `torch.cuda.Event`s.
    CpuTransfer   a separate device arena on the CPU; copies run on a worker thread, optionally at a
                  simulated bandwidth and with the destination poisoned first, so every invariant of
                  the residency core can be tested without a GPU.
The compute side marks the end of a read with `compute_marker()`; a slot is recycled only once that
marker has completed (`residency.core` checks `query()` and waits only if no other slot is free).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

import torch

POISON_BYTE = 0xFF  # bf16/fp32 bytes 0xFFFF... are NaN: a read of an unwritten slot cannot go unnoticed
PRIORITY_DEMAND, PRIORITY_PREFETCH, PRIORITY_MIGRATION = 0, 1, 2


class DoneEvent:
    """An event that has already happened (CPU compute is synchronous)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class ThreadEvent:
    """Completion of a copy on the CPU backend's worker thread."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def set(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class CudaTransfer:
    """Copies on two side streams; compute waits on a copy's event only when it uses that version."""

    def __init__(self, device: torch.device):
        self.device = device
        self.demand_stream = torch.cuda.Stream(device, priority=-1)
        self.migration_stream = torch.cuda.Stream(device, priority=0)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, priority: int, then=()) -> torch.cuda.Event:
        """Copy `src` (pinned host) into `dst` on a side stream; then, on the same stream and in
        order, each `(device word, pinned word)` of `then` (the table entries that publish the copy:
        they can only land after it). The event completes after all of them."""
        stream = self.demand_stream if priority == PRIORITY_DEMAND else self.migration_stream
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            for word, value in then:
                word.copy_(value, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def write_words(self, words) -> None:
        """Each `(device word, pinned word)` of `words`, in order, on the demand stream (at once: it
        waits behind no prefetch)."""
        with torch.cuda.stream(self.demand_stream):
            for word, value in words:
                word.copy_(value, non_blocking=True)

    def compute_marker(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def close(self) -> None:
        pass


class CpuTransfer:
    """CPU backend: a worker thread performs copies in priority order.

    Args:
        bandwidth_bytes_per_s: if set, copies proceed in chunks paced to this rate (simulated PCIe).
        poison: fill the destination with POISON_BYTE before copying into it.
    """

    CHUNK_BYTES = 1 << 16

    def __init__(self, bandwidth_bytes_per_s: float | None = None, poison: bool = False):
        self.bandwidth = bandwidth_bytes_per_s
        self.poison = poison
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._run, name="moetide-copy", daemon=True)
        self._thread.start()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, priority: int, then=()) -> ThreadEvent:
        """As `CudaTransfer.copy`: the words of `then` are written after the copy, in order."""
        event = ThreadEvent()
        self._jobs.put((priority, next(self._order), dst, src, (event, tuple(then))))
        return event

    def _run(self) -> None:
        while True:
            _, _, dst, src, job = self._jobs.get()
            if job is None:
                return
            event, then = job
            if self.poison:
                dst.fill_(POISON_BYTE)
            n = src.numel()
            step = n if self.bandwidth is None else self.CHUNK_BYTES
            for start in range(0, n, step):
                end = min(n, start + step)
                dst[start:end].copy_(src[start:end])
                if self.bandwidth is not None:
                    time.sleep((end - start) / self.bandwidth)
            for word, value in then:
                word.copy_(value)
            event.set()

    def write_words(self, words) -> None:
        """As `CudaTransfer.write_words`; here written at once."""
        for word, value in words:
            word.copy_(value)

    def compute_marker(self) -> DoneEvent:
        return DoneEvent()

    def close(self) -> None:
        self._jobs.put((-1, -1, None, None, None))  # job None: stop
        self._thread.join(timeout=5)
