"""The in-step reserve: versions parked out of a step's table for the prefetches the step makes as it runs.

With a layer feed (`policies/in_step.py`) the core starts prefetches within a step, but then it may
only evict versions the step can no longer read (those of layers before the routed one), which
singles out the first layers' experts. So between steps, `park` takes a few versions out of the next
step's table (their experts run as if not resident: lo, or zero-copy) while they keep their slots:
an in-step prefetch takes such a slot at once; an unused one comes back at the next step boundary,
uncopied. As many as the last steps' in-step prefetches wanted (smoothed), at most a third of a pool,
chosen by the eviction rule over every layer.
"""

from __future__ import annotations

SHARE = 3  # at most 1/SHARE of a pool is parked


class InStepReserve:
    """Per pool, the `(layer, expert)` keys parked out of the running step's table."""

    def __init__(self, pools):
        self.parked: dict[str, dict[tuple[int, int], None]] = {name: {} for name in pools}
        self._short: dict[str, int] = {}  # pool -> in-step prefetches that wanted a slot, this step
        self._target: dict[str, float] = {}  # pool -> slots to park (EMA of `_short`)
        self._history: dict[int, dict] = {}  # iteration -> what was parked in it (for the accounting)

    def is_parked(self, pool: str, key: tuple[int, int]) -> bool:
        return key in self.parked[pool]

    def any_parked(self, pool: str) -> bool:
        return bool(self.parked[pool])

    def unpark(self, pool: str, key: tuple[int, int]) -> bool:
        """Give `key`'s version its entry back (predicted after all); whether it was parked."""
        if key in self.parked[pool]:
            del self.parked[pool][key]
            return True
        return False

    def park(self, iteration: int, pools, victim_queue) -> set[tuple[int, int]]:
        """Between steps: release the last step's parked versions and park new ones for step
        `iteration`. `pools`: name -> `SlotPool` of the pools that evict; `victim_queue(pool)`: a
        `next_victim()` over the pool's candidates. Returns the keys whose entries change."""
        changed = {key for parked in self.parked.values() for key in parked}
        self.parked = {name: {} for name in self.parked}
        self._history = {it: keys for it, keys in self._history.items() if it > iteration - 4}
        self._history[iteration] = self.parked
        for name, pool in pools.items():
            wanted = self._short.pop(name, 0)
            target = self._target[name] = 0.7 * self._target.get(name, 0.0) + 0.3 * wanted
            want = min(round(target), pool.num_slots // SHARE) - pool.free_slots
            if want <= 0:
                continue
            next_victim = victim_queue(name)
            while want > 0 and (victim := next_victim()) is not None:
                key = (victim.layer, victim.expert)
                self.parked[name][key] = None
                changed.add(key)
                want -= 1
        return changed

    def wanted(self, pool: str) -> None:
        """An in-step prefetch asked for a slot of `pool` (sizes the next steps' reserve)."""
        self._short[pool] = self._short.get(pool, 0) + 1

    def take(self, pool: str, has_version) -> tuple[int, int] | None:
        """A parked key of `pool` whose version is still there (`has_version(key)`), unparked."""
        parked = self.parked[pool]
        while parked:
            key = next(iter(parked))
            del parked[key]
            if has_version(key):
                return key
        return None

    def was_parked(self, iteration: int, pool: str, key: tuple[int, int]) -> bool:
        """Whether `key` was parked out of step `iteration`'s table in `pool`."""
        return key in self._history.get(iteration, {}).get(pool, ())
