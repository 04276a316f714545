"""A small host store and residency cores over it on the CPU backend (copies on a worker thread, at a
simulated bandwidth, each destination poisoned first), and one step run through the device table:
what the residency tests share."""

from __future__ import annotations

import numpy as np
import torch

from moetide.residency.budget import BudgetTracker, FixedCosts, plan_memory
from moetide.residency.core import ResidencyManager, ResidencyOptions
from moetide.residency.metrics import ExpertMetrics
from moetide.residency.slot_table import UNUSED, slot_in_pool
from moetide.residency.transfer import CpuTransfer
from moetide.store import quant
from moetide.store.host_store import ExpertShape, HostExpertStore

LAYERS, EXPERTS, HIDDEN, INTER = 3, 8, 32, 32


def make_store(lo: str = "int4") -> HostExpertStore:
    torch.manual_seed(0)
    store = HostExpertStore(LAYERS, EXPERTS, ExpertShape(HIDDEN, INTER, torch.float32))
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            store.put_projection(layer, e, "gate", torch.randn(INTER, HIDDEN) * 0.1)
            store.put_projection(layer, e, "up", torch.randn(INTER, HIDDEN) * 0.1)
            store.put_projection(layer, e, "down", torch.randn(HIDDEN, INTER) * 0.1)
    store.check_complete()
    store.add_precision(lo)
    return store


STORE = make_store()


def make_manager(mode: str, hi_slots: int, lo_slots: int, *, bandwidth: float | None = 2e8, **options):
    """A core of `hi_slots` hi and `lo_slots` int4 slots under a budget that holds exactly them;
    `options`: `ResidencyOptions` fields (on_miss defaults to the mode's: lo where every lo version
    is resident, else zero-copy)."""
    hi_bytes, lo_bytes = STORE.bytes_per_expert("hi"), STORE.bytes_per_expert("int4")
    fixed = FixedCosts(1000, 0, 0, 0)
    budget = fixed.total + hi_slots * hi_bytes + lo_slots * lo_bytes
    plan = plan_memory(
        budget,
        fixed,
        num_experts_total=LAYERS * EXPERTS,
        hi_slot_bytes=hi_bytes,
        lo_slot_bytes=lo_bytes,
        min_hi_slots=2 if mode != "all-lo" else 0,
        mode=mode,
    )
    tracker = BudgetTracker(budget)
    tracker.reserve(fixed.total, "fixed", "fixed")
    transfer = CpuTransfer(bandwidth_bytes_per_s=bandwidth, poison=True)
    options.setdefault("on_miss", "lo" if mode in ("lo+hi", "all-lo") else "zero-copy")
    manager = ResidencyManager(
        STORE, ExpertMetrics(LAYERS), plan, tracker, transfer, torch.device("cpu"),
        ResidencyOptions(mode=mode, lo_precision="int4", **options),
    )  # fmt: skip
    if mode in ("lo+hi", "all-lo"):
        manager.preload("lo")
    return manager


def expected_weights(layer: int, expert: int, precision: str, store=STORE) -> torch.Tensor:
    """The expert's dense gate_up as the host store holds `precision` (hi, or a low-bit format)."""
    if precision == "hi":
        return store.views(layer, expert, "hi")["gate_up"]
    gate_up, _ = quant.dequantize(store.views(layer, expert, precision), store.meta[precision], torch.float32)
    return gate_up


def read_entry(manager, layer: int, expert: int) -> int:
    """Read `(layer, expert)` through the device table as the kernel would and check that the slot
    holds the version the table names (not poison, not another expert's); returns the pool id (-1:
    the table sends it nowhere, so it adds nothing)."""
    pool_of, slot_of = manager.step_table(layer)
    pool_id = int(pool_of[expert])
    if pool_id < 0:
        return pool_id
    slot = int(slot_in_pool(slot_of, pool_id, expert))
    gate_up, _ = manager.kernel_pools(torch.float32)[pool_id].weights(slot, torch.float32)
    gate_up = gate_up.cpu()
    assert torch.isfinite(gate_up).all(), "read a poisoned (partially written) slot"
    name = {v: k for k, v in manager.pool_ids.items()}[pool_id]
    want = expected_weights(layer, expert, manager.precision_of(name), manager.store)
    assert torch.equal(gate_up, want), f"{name} slot {slot} does not hold ({layer}, {expert})"
    return pool_id


def run_step(manager, iteration: int, uses: dict[int, list[int]]) -> np.ndarray:
    """One step: `begin_step`, every `(layer, expert)` of `uses` read through the table (checked),
    `end_step`, then the step's record handed back as the engine does (`observe_step`). Returns
    `ran (L, E)`, the pool each expert ran from."""
    manager.begin_step(iteration)
    ran = np.full((LAYERS, EXPERTS), UNUSED, dtype=np.int32)
    for layer, experts in uses.items():
        for expert in experts:
            ran[layer, expert] = read_entry(manager, layer, expert)
    manager.end_step()
    if manager.accounts:
        manager.observe_step(ran, iteration)
    return ran


def land_all(manager) -> None:
    """Wait until every copy in flight has landed (they publish at the next step boundary)."""
    for row in manager.handles:
        for h in row:
            for v in h.versions.values():
                v.ready.synchronize()


def resident(manager, layer: int, pool: str = "hi") -> set[int]:
    return {e for e in range(EXPERTS) if pool in manager.handles[layer][e].versions}
