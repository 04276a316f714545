"""The memory budget: `M_total = M_fixed + expert pools`, checked at start and on every expert slot.

`M_fixed` = non-expert weights + KV-cache reservation + activation workspace + dequant scratch.
What is left is split into a hi pool and a lo pool of fixed-size slots (see `MemoryPlan`), and for a
precision ladder of more than two tiers into one pool per tier between them (`split_ladder`). Every
expert version that takes a slot first calls `BudgetTracker.try_reserve`; a failed reservation is
deferred or triggers an eviction, never an allocation past the cap.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import format_bytes
from ..errors import BudgetError
from ..store.tracker import BudgetTracker  # noqa: F401 - the device budget's tracker, defined with the host's

KV_BLOCK_SIZE = 16  # tokens per block of the paged KV cache (engine/kv_blocks.py)


def kv_pool_blocks(kv_tokens: int) -> int:
    """Usable blocks of the paged KV pool for a reservation of `kv_tokens` (rounded up to whole
    blocks); the pool allocates one pad block more."""
    return max(1, -(-kv_tokens // KV_BLOCK_SIZE))


def kv_pool_bytes(kv_tokens: int, kv_bytes_per_token: int) -> int:
    """What the paged KV pool of `kv_tokens` takes: its usable blocks and the pad block."""
    return (kv_pool_blocks(kv_tokens) + 1) * KV_BLOCK_SIZE * kv_bytes_per_token


@dataclass(frozen=True)
class FixedCosts:
    """`M_fixed`, itemised (bytes)."""

    non_expert_weights: int
    kv_cache: int
    activations: int
    dequant_scratch: int
    kv_cache_tokens: int = 0  # what the KV reservation holds, for the engine's admission control

    @property
    def total(self) -> int:
        return self.non_expert_weights + self.kv_cache + self.activations + self.dequant_scratch


@dataclass(frozen=True)
class MemoryPlan:
    """How the budget is split: fixed costs, then `hi_slots` and `lo_slots` expert slots, and for a
    deeper ladder `mid_slots[t]` slots of `mid_slot_bytes[t]` for each tier between hi and lo
    (hottest first; pools "mid1", "mid2", ...)."""

    budget_bytes: int
    fixed: FixedCosts
    hi_slot_bytes: int
    lo_slot_bytes: int
    hi_slots: int
    lo_slots: int
    mid_slot_bytes: tuple[int, ...] = ()
    mid_slots: tuple[int, ...] = ()

    @property
    def expert_bytes(self) -> int:
        mids = sum(n * b for n, b in zip(self.mid_slots, self.mid_slot_bytes, strict=True))
        return self.hi_slots * self.hi_slot_bytes + self.lo_slots * self.lo_slot_bytes + mids

    @property
    def upper_slots(self) -> tuple[int, ...]:
        """Slots of each tier above the coldest, hottest first: hi, then the middle tiers."""
        return (self.hi_slots, *self.mid_slots)

    def with_spare_kv(self, kv_bytes_per_token: int, max_kv_tokens: int) -> MemoryPlan:
        """The budget the expert pools leave unused (they are capped at one slot per expert version)
        added to the KV reservation, up to `max_kv_tokens` in all: more sequences are admitted at
        once, and nothing the pools could use is taken."""
        spare = self.budget_bytes - self.fixed.total - self.expert_bytes
        now = self.fixed.kv_cache_tokens
        room = max_kv_tokens - now
        tokens = now + min(room, spare // max(kv_bytes_per_token, 1))
        if tokens < max_kv_tokens:  # limited by the budget: whole blocks of the paged pool
            tokens = max(now, tokens - tokens % KV_BLOCK_SIZE)
        added = kv_pool_bytes(tokens, kv_bytes_per_token) - kv_pool_bytes(now, kv_bytes_per_token)
        while tokens > now and added > spare:
            tokens = max(now, (tokens - 1) // KV_BLOCK_SIZE * KV_BLOCK_SIZE)
            added = kv_pool_bytes(tokens, kv_bytes_per_token) - kv_pool_bytes(now, kv_bytes_per_token)
        if tokens <= now:
            return self
        fixed = replace(self.fixed, kv_cache=self.fixed.kv_cache + added, kv_cache_tokens=tokens)
        return replace(self, fixed=fixed)

    def describe(self) -> str:
        f = self.fixed
        return (
            f"budget {format_bytes(self.budget_bytes)}: fixed {format_bytes(f.total)} (weights"
            f" {format_bytes(f.non_expert_weights)}, KV {format_bytes(f.kv_cache)}, activations"
            f" {format_bytes(f.activations)}, dequant {format_bytes(f.dequant_scratch)}); experts: {self.hi_slots} hi"
            f" slots x {format_bytes(self.hi_slot_bytes)}"
            + "".join(
                f" + {n} mid{t} slots x {format_bytes(b)}"
                for t, (n, b) in enumerate(zip(self.mid_slots, self.mid_slot_bytes, strict=True), 1)
            )
            + f" + {self.lo_slots} lo slots x {format_bytes(self.lo_slot_bytes)}"
        )


def split_ladder(
    room_bytes: int, tier_bytes: tuple[int, ...], num_experts_total: int, min_top: int = 0
) -> list[int]:
    """Slots of each tier above a ladder's coldest (hottest first, `tier_bytes` each, strictly
    decreasing) in `room_bytes`, every expert keeping its coldest version beside them.

    Each tier gets an equal share of the bytes (so a tier of half the bytes per expert holds twice the
    experts: a pyramid, the hottest few in the top tier), the top tier at least `min_top` slots; a
    tier holds no more slots than there are experts not already placed in the tiers above it, and
    what its share cannot buy passes to the next tier down. Bytes still left then raise experts to
    the hottest tier they pay for (an expert moves up when the difference fits; with room for every
    expert in the top tier, all are there). One tier: `min(N, room // bytes)`."""
    N, T = num_experts_total, len(tier_bytes)
    slots, left = [0] * T, room_bytes
    for t, nbytes in enumerate(tier_bytes):
        share = left // (T - t)
        want = share // nbytes if t else max(min_top, share // nbytes)
        slots[t] = max(0, min(N - sum(slots), want, left // nbytes))
        left -= slots[t] * nbytes
    moved = True
    while moved:  # spend what is left, hottest tier first: a new slot, else an expert moved up
        moved = False
        for t, nbytes in enumerate(tier_bytes):
            if sum(slots) < N and left >= nbytes:
                slots[t], left, moved = slots[t] + 1, left - nbytes, True
                break
            colder = next((j for j in range(t + 1, T) if slots[j]), None)
            if colder is not None and left >= nbytes - tier_bytes[colder]:
                slots[t], slots[colder] = slots[t] + 1, slots[colder] - 1
                left -= nbytes - tier_bytes[colder]
                moved = True
                break
    return slots


def plan_memory(
    budget_bytes: int,
    fixed: FixedCosts,
    *,
    num_experts_total: int,
    hi_slot_bytes: int,
    lo_slot_bytes: int,
    min_hi_slots: int,
    mode: str,
    lo_precision: str | None = None,
    mid_slot_bytes: tuple[int, ...] = (),
    upper_slots: tuple[int, ...] | None = None,
    misses_run_lo: bool = False,
) -> MemoryPlan:
    """Split the budget left after `fixed` into expert slots.

    mode:
        "all-hi"   every expert resident in hi (no-offload): error if they do not fit.
        "all-lo"   every expert resident in lo (static-int4/int2): error if they do not fit.
        "hi-cache" all expert memory is a hi cache (on-demand, lru, finemoe, moe-infinity).
        "lo+hi"    every expert resident in lo, the rest a hi cache (dynaexq, combined); if lo does
                   not fit whole, it becomes a lo cache of what fits beside `min_hi_slots` hi slots
                   (a miss then reads the hi version from host memory: `resolve_on_miss`), unless
                   `misses_run_lo` (`--on-miss lo`: a miss runs the expert's resident lo version,
                   so every expert needs one): then BudgetError.
                   With `mid_slot_bytes` (a ladder's middle tiers, hottest first) the rest is split
                   over hi and those tiers by `split_ladder`, or as `upper_slots` says (hi, then
                   each middle tier; BudgetError if they do not fit).
    lo_precision: the lo version's name ("int4", "int2"), for the error messages only.

    The errors give the parts at this budget (the KV reservation in the fixed part grows with the
    budget); `engine.memory.check_budget` adds the smallest budget that fits.
    """
    left = budget_bytes - fixed.total
    need_min = min_hi_slots * hi_slot_bytes if mode != "all-lo" else min_hi_slots * lo_slot_bytes
    fixed_part = f"the fixed part (non-expert weights, KV cache, activations) {format_bytes(fixed.total)}"
    if left < need_min:
        raise BudgetError(
            f"--gpu-memory {format_bytes(budget_bytes)} is too small: {fixed_part} + at least"
            f" {min_hi_slots} experts {format_bytes(need_min)} do not fit"
        )
    if mode == "all-hi":
        need = num_experts_total * hi_slot_bytes
        if need > left:
            raise BudgetError(
                f"no-offload keeps every expert in hi precision: {fixed_part} + {num_experts_total} experts"
                f" {format_bytes(need)} = {format_bytes(fixed.total + need)}, more than --gpu-memory"
                f" {format_bytes(budget_bytes)}; raise it or choose an offloading policy"
            )
        return MemoryPlan(budget_bytes, fixed, hi_slot_bytes, lo_slot_bytes, num_experts_total, 0)
    if mode == "all-lo":
        need = num_experts_total * lo_slot_bytes
        if need > left:
            smaller = "use static-int2, " if lo_precision not in ("int2", None) else ""
            raise BudgetError(
                f"every expert resident in {lo_precision or 'lo precision'}: {fixed_part} +"
                f" {num_experts_total} experts {format_bytes(need)} = {format_bytes(fixed.total + need)},"
                f" more than --gpu-memory {format_bytes(budget_bytes)}; {smaller}raise the budget or"
                " choose an offloading policy"
            )
        return MemoryPlan(budget_bytes, fixed, hi_slot_bytes, lo_slot_bytes, 0, num_experts_total)
    if mode == "hi-cache":
        hi = min(num_experts_total, left // hi_slot_bytes)
        return MemoryPlan(budget_bytes, fixed, hi_slot_bytes, lo_slot_bytes, hi, 0)
    if mode == "lo+hi":
        return _plan_lo_hi(budget_bytes, fixed, left, need_min, fixed_part, num_experts_total=num_experts_total,
                           hi_slot_bytes=hi_slot_bytes, lo_slot_bytes=lo_slot_bytes, min_hi_slots=min_hi_slots,
                           lo_precision=lo_precision, mid_slot_bytes=mid_slot_bytes, upper_slots=upper_slots,
                           misses_run_lo=misses_run_lo)  # fmt: skip
    raise ValueError(f"unknown memory mode {mode!r}")


def _plan_lo_hi(
    budget_bytes: int,
    fixed: FixedCosts,
    left: int,
    need_min: int,
    fixed_part: str,
    *,
    num_experts_total: int,
    hi_slot_bytes: int,
    lo_slot_bytes: int,
    min_hi_slots: int,
    lo_precision: str | None,
    mid_slot_bytes: tuple[int, ...],
    upper_slots: tuple[int, ...] | None,
    misses_run_lo: bool,
) -> MemoryPlan:
    """`plan_memory`'s "lo+hi" mode: as many lo slots as fit beside `min_hi_slots` hi slots (every
    expert at most), the room left over split over hi and a ladder's middle tiers."""
    lo = min(num_experts_total, (left - min_hi_slots * hi_slot_bytes) // lo_slot_bytes)
    if misses_run_lo and lo < num_experts_total:
        need = num_experts_total * lo_slot_bytes + need_min
        raise BudgetError(
            f"--gpu-memory {format_bytes(budget_bytes)} is too small: a miss runs the expert's resident"
            f" {lo_precision or 'lo'} version (--on-miss lo), so {fixed_part} + {num_experts_total} lo"
            f" experts and {min_hi_slots} hi experts {format_bytes(need)} do not fit"
        )
    tier_bytes = (hi_slot_bytes, *mid_slot_bytes)
    room = left - lo * lo_slot_bytes
    if upper_slots is None:
        upper = split_ladder(room, tier_bytes, num_experts_total, min_hi_slots)
    else:
        upper = _given_upper_slots(upper_slots, tier_bytes, room, fixed_part, budget_bytes)
    mids = tuple(mid_slot_bytes), tuple(upper[1:])
    return MemoryPlan(budget_bytes, fixed, hi_slot_bytes, lo_slot_bytes, upper[0], lo, *mids)


def _given_upper_slots(upper_slots, tier_bytes, room: int, fixed_part: str, budget_bytes: int) -> list[int]:
    """`upper_slots` (hi, then each middle tier) checked against the room the coldest tier leaves."""
    if len(upper_slots) != len(tier_bytes) or any(n < 0 for n in upper_slots):
        raise ValueError(f"upper_slots needs {len(tier_bytes)} counts >= 0, got {tuple(upper_slots)}")
    need = sum(n * b for n, b in zip(upper_slots, tier_bytes, strict=True))
    if need > room:
        raise BudgetError(
            f"--gpu-memory {format_bytes(budget_bytes)} is too small: {fixed_part}, every expert's coldest"
            f" version and the ladder's {'+'.join(map(str, upper_slots))} upper-tier experts"
            f" {format_bytes(need)} do not fit"
        )
    return list(upper_slots)
