"""`BudgetTracker`: bytes reserved per category against a hard total (the device budget's expert
slots, and the host budget's expert versions)."""

from __future__ import annotations

import threading

from ..errors import BudgetError
from ..units import format_bytes


class BudgetTracker:
    """Bytes reserved per category against a hard total. Thread-safe; O(1) per call."""

    def __init__(self, total_bytes: int):
        self.total_bytes = total_bytes
        self.reserved: dict[str, int] = {}
        self.peak_bytes = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return sum(self.reserved.values())

    def try_reserve(self, nbytes: int, category: str) -> bool:
        """Reserve `nbytes` under `category` if it fits; False (nothing reserved) otherwise."""
        with self._lock:
            used = sum(self.reserved.values())
            if used + nbytes > self.total_bytes:
                return False
            self.reserved[category] = self.reserved.get(category, 0) + nbytes
            self.peak_bytes = max(self.peak_bytes, used + nbytes)
            return True

    def reserve(self, nbytes: int, category: str, what: str) -> None:
        """`try_reserve` that raises a BudgetError naming what did not fit."""
        if not self.try_reserve(nbytes, category):
            raise BudgetError(
                f"{what} needs {format_bytes(nbytes)} but only {format_bytes(self.total_bytes - self.used_bytes)}"
                f" of the {format_bytes(self.total_bytes)} budget is left"
            )

    def release(self, nbytes: int, category: str) -> None:
        with self._lock:
            left = self.reserved.get(category, 0) - nbytes
            if left < 0:
                raise RuntimeError(f"released more {category} bytes than reserved")
            self.reserved[category] = left
