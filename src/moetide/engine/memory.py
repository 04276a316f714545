"""A `--gpu-memory` budget checked against a model before any weight is read.

The fixed part (`residency.fixed_costs`: non-expert weights, KV reservation, activation workspace,
dequant scratch) and the expert slot sizes are computed from transformers' model built on the meta
device, exactly as the residency core computes them after the load. So a budget too small for the
policy is refused in a second instead of after the load, and the message names the smallest budget
that works. That minimum is the fixed point of `budget = fixed(budget) + experts`: the KV
reservation grows with the budget (a tenth of it), so "the fixed part at this budget + the experts"
would move each time the user retried with it.

Budgets can also be relative, the one way to name the same pressure on the demo model and on a
47 B-parameter shape (`relative_budget`): `25%` = the budget whose room after its fixed part holds
25 % of all experts in hi precision.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..config import EngineConfig, parse_bytes, typed_size
from ..errors import BudgetError, ConfigError
from ..residency.budget import FixedCosts, MemoryPlan, plan_memory

_LARGEST_BUDGET = 1 << 50  # 1 PiB: past this there is no minimum worth printing


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """What a budget is made of for one model and engine configuration (bytes)."""

    fixed: FixedCosts  # at the config's budget (at 1 TiB when it has none)
    hi_expert_bytes: int  # one expert (gate, up, down) in the compute dtype
    num_experts_total: int  # MoE layers x experts per layer
    top_k: int
    fixed_at: Callable[[int], FixedCosts] = dataclasses.field(repr=False, compare=False)
    slot_bytes: Callable[[str], int] = dataclasses.field(repr=False, compare=False)  # precision -> bytes

    @property
    def all_experts_hi_bytes(self) -> int:
        return self.hi_expert_bytes * self.num_experts_total


def model_bytes(config: EngineConfig) -> ModelBytes:
    """Fixed costs and expert sizes of `config`'s model on `config`'s device, without loading weights."""
    from ..compute.fused_moe_config import moe_scratch_bytes
    from ..models.checkpoint import inspect_checkpoint
    from ..models.loader import build_empty_model, moe_blocks, resolve_device, resolve_dtype
    from ..residency import MAX_PREFILL_TOKENS, fixed_costs
    from ..store import quant

    info = inspect_checkpoint(config.model_path)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, info.config, device)
    model = build_empty_model(info.config, dtype)
    if getattr(info.config, "tie_word_embeddings", False):
        model.tie_weights()  # as the loader does: a tied head is one tensor on the device
    blocks = moe_blocks(model, info.adapter)
    elt = torch.empty((), dtype=dtype).element_size()
    # the loader keeps every parameter but the routed experts on the device (the meta model holds
    # them as fused `experts.*` parameters, which the managed experts module replaces)
    expert_params = {id(p) for _, block in blocks for p in block.experts.parameters()}
    weights = sum(p.numel() * elt for p in model.parameters() if id(p) not in expert_params)
    intermediate = info.adapter.expert_intermediate(info.config)
    hidden = info.config.hidden_size

    hi_bytes = 3 * intermediate * hidden * elt  # as the host store lays a hi version out

    def slot_bytes(precision: str) -> int:
        return hi_bytes if precision == "hi" else quant.nbytes_for(precision, intermediate, hidden, dtype)

    def fixed_at(budget_bytes: int) -> FixedCosts:
        scratch = moe_scratch_bytes(info.config, hi_bytes, MAX_PREFILL_TOKENS)
        fixed = fixed_costs(config, info.config, model, dtype, scratch, budget_bytes)  # meta weights count 0
        return dataclasses.replace(fixed, non_expert_weights=fixed.non_expert_weights + weights)

    return ModelBytes(
        fixed_at(config.gpu_memory_bytes or (1 << 40)),
        hi_bytes,
        len(blocks) * info.adapter.num_experts(info.config),
        int(getattr(info.config, "num_experts_per_tok", 1)),
        fixed_at,
        slot_bytes,
    )


def plan_for(config: EngineConfig, mb: ModelBytes, budget_bytes: int) -> MemoryPlan:
    """The memory plan the residency core will make at `budget_bytes` (BudgetError if it cannot).

    Where the lo precision is "auto", int2 stands in for it: the smallest lo version, so a budget
    is never refused here that the load would take.
    """
    from ..policies.registry import policy_spec
    from ..residency import all_hi_fits

    spec = policy_spec(config.policy)
    mode, needs_lo = spec.memory_mode, spec.needs_lo
    if all_hi_fits(mode, mb.all_experts_hi_bytes, budget_bytes - mb.fixed_at(budget_bytes).total):
        mode, needs_lo = "all-hi", False
    lo = spec.lo_precision or config.lo_precision
    lo = "int2" if lo == "auto" else lo
    hi = config.hi_precision if mode == "lo+hi" else "hi"
    if hi != "hi" and config.ladder is None:
        lo = "int2"
    mids = config.mid_precisions if mode == "lo+hi" else ()
    return plan_memory(
        budget_bytes,
        mb.fixed_at(budget_bytes),
        num_experts_total=mb.num_experts_total,
        hi_slot_bytes=mb.slot_bytes(hi),
        lo_slot_bytes=mb.slot_bytes(lo) if needs_lo else mb.slot_bytes(hi),
        min_hi_slots=mb.top_k,
        mode=mode,
        lo_precision=lo if needs_lo else None,
        mid_slot_bytes=tuple(mb.slot_bytes(m) for m in mids),
        upper_slots=config.ladder_slots if mode == "lo+hi" else None,
        misses_run_lo=(spec.on_miss or config.on_miss) == "lo",
    )


def minimum_budget(config: EngineConfig, mb: ModelBytes) -> int | None:
    """The smallest budget (bytes) at which `config.policy` fits, or None past 1 PiB.

    Feasibility only grows with the budget (the fixed part grows by at most a tenth of it), so a
    bisection finds the fixed point."""

    def fits(budget: int) -> bool:
        try:
            plan_for(config, mb, budget)
        except BudgetError:
            return False
        return True

    low = mb.fixed_at(1).total  # the smallest fixed part (one sequence of KV): nothing fits in it
    high = 2 * low
    while not fits(high):
        low, high = high, 2 * high
        if high > _LARGEST_BUDGET:
            return None
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            high = mid
        else:
            low = mid
    return high


def check_budget(config: EngineConfig, mb: ModelBytes | None = None) -> None:
    """Refuse, before the load, a `config.gpu_memory_bytes` too small for the policy; the error ends
    with the smallest `--gpu-memory` that works (stable: retrying with it succeeds)."""
    if config.gpu_memory_bytes is None:
        return
    mb = mb or model_bytes(config)
    try:
        plan_for(config, mb, config.gpu_memory_bytes)
    except BudgetError as e:
        minimum = minimum_budget(config, mb)
        hint = (
            f"; the smallest budget for {config.policy} is --gpu-memory {typed_size(minimum)}"
            if minimum is not None
            else ""
        )
        raise BudgetError(f"{e}{hint}") from None


def relative_budget(share: float, config: EngineConfig) -> int:
    """Bytes of the budget `share` (0.25 for "25%") for `config`: the smallest budget B at which,
    after the fixed part `config`'s engine reserves at B (the one the too-small error reports), the
    room left holds `share` of all experts in hi precision. The fixed part grows with the budget (its
    KV reservation), so B is the fixed point of `B = fixed(B) + share x experts`, found by bisection
    (`B - fixed(B)` only grows with B). Every command resolves NN% here."""
    mb = model_bytes(config)
    want = int(share * mb.all_experts_hi_bytes)

    def room(budget: int) -> int:
        return budget - mb.fixed_at(budget).total

    low = mb.fixed_at(1).total + want - 1  # the fixed part is never smaller than at the smallest budget
    high = max(low + 1, 2 * low)
    while room(high) < want:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        if room(mid) >= want:
            high = mid
        else:
            low = mid
    return high


def resolve_budget(spec: str | int | None, config: EngineConfig) -> int | None:
    """Bytes for a `--gpu-memory` value: None / "none" (no cap), a size ("6GiB", or an int of bytes), or
    "NN%" (`relative_budget`; `config` names the model, device and dtype)."""
    if spec is None or str(spec).strip().lower() in ("", "none", "uncapped"):
        return None
    if isinstance(spec, (int, float)):
        return parse_bytes(spec)
    text = str(spec).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100.0
        except ValueError:
            raise ConfigError(f"cannot read budget {spec!r}; write it like 25% or 6GiB") from None
        if not share > 0:
            raise ConfigError(f"a relative budget must be > 0%, got {spec!r}")
        return relative_budget(share, config)
    return parse_bytes(text)
