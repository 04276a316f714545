"""Where experts live (device or host) and in which precision: pools, handles, transfers, budget.

`build_residency` reads the policy's memory mode and options from the policy registry, sizes `M_fixed`,
splits the rest of the budget into slot pools and preloads what the mode keeps resident.
"""

from __future__ import annotations

import torch

from ..config import EngineConfig
from ..errors import BudgetError, ConfigError
from ..policies.registry import policy_spec
from ..progress import bar as progress_bar
from ..store.host_store import HostExpertStore
from .budget import (
    KV_BLOCK_SIZE,
    BudgetTracker,
    FixedCosts,
    MemoryPlan,
    kv_pool_blocks,
    kv_pool_bytes,
    plan_memory,
)
from .core import ResidencyManager, ResidencyOptions
from .metrics import ExpertMetrics
from .protocol import Residency, StaticResidency
from .transfer import CpuTransfer, CudaTransfer

MAX_PREFILL_TOKENS = 1024  # tokens per prefill forward; sizes the activation workspace


AUTO_LO_MIN_HI_SHARE = 0.25  # "auto" keeps int4 only if >= this share of the expert memory is left for hi


def lo_precision_for(
    config: EngineConfig, store: HostExpertStore | None = None, expert_room: int | None = None
) -> str:
    """The lo precision: fixed by static policies, else the config's, else (auto) the widest format
    of the registry (int4, then int2+4) whose every expert fits with a quarter of the expert memory
    left for the hot pool, else the narrowest (int2). With low-bit hot experts (`--hi int4`), auto
    takes the narrowest format below them."""
    from ..store import quant

    if store is None:
        return lo_precision_of_sizes(config, None, expert_room)
    shape = store.shape
    every = store.num_layers * store.num_experts
    return lo_precision_of_sizes(
        config, (every, lambda p: quant.nbytes_for(p, shape.intermediate, shape.hidden, shape.dtype)), expert_room
    )


def lo_precision_of_sizes(config: EngineConfig, sizes, expert_room: int | None) -> str:
    """`lo_precision_for` from the model's sizes: `sizes` = (experts in all layers, precision -> bytes
    of one expert's version), or None where they are not known (auto then takes the widest)."""
    from ..store import quant

    fixed = policy_spec(config.policy).lo_precision
    if fixed or config.lo_precision != "auto":
        return fixed or config.lo_precision
    candidates = list(quant.LOW_BIT_FORMATS)  # most bytes first
    if config.hi_precision != "hi" and policy_spec(config.policy).memory_mode == "lo+hi":
        return candidates[-1]
    if sizes is None or expert_room is None:
        return candidates[0]
    every, slot_bytes = sizes
    for precision in candidates[:-1]:
        if every * slot_bytes(precision) <= (1 - AUTO_LO_MIN_HI_SHARE) * expert_room:
            return precision
    return candidates[-1]


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """KV-cache bytes one token adds across all layers (keys + values)."""
    elt = torch.empty((), dtype=dtype).element_size()
    layers = model_config.num_hidden_layers
    heads = model_config.num_attention_heads
    if getattr(model_config, "kv_lora_rank", None):  # DeepSeek MLA, as transformers caches it
        k_dim = model_config.qk_nope_head_dim + model_config.qk_rope_head_dim
        return layers * heads * (k_dim + model_config.v_head_dim) * elt
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * elt


def max_kv_tokens(config: EngineConfig, model_config) -> int:
    """KV tokens worth reserving at most: `max_num_seqs` sequences of the full length."""
    max_len = config.max_model_len or getattr(model_config, "max_position_embeddings", 2048)
    return config.max_num_seqs * max_len


def fixed_costs(
    config: EngineConfig, model_config, model, dtype: torch.dtype, moe_scratch: int, budget_bytes: int
) -> FixedCosts:
    """`M_fixed` for this model and engine configuration (bytes); `moe_scratch`: what one MoE layer's
    compute needs at the largest prefill forward (`compute.fused_moe_config.moe_scratch_bytes`)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    per_token = kv_bytes_per_token(model_config, dtype)
    max_len = config.max_model_len or getattr(model_config, "max_position_embeddings", 2048)
    if config.kv_cache_tokens is not None:
        kv_tokens = config.kv_cache_tokens
    else:  # a tenth of the budget, at least one full-length sequence and, up to a quarter of the
        # budget, `kv_tokens_per_seq` per sequence (more if the pools leave room: `with_spare_kv`)
        per_seq = min(config.max_num_seqs * config.kv_tokens_per_seq, budget_bytes // 4 // per_token)
        tenth = budget_bytes // 10 // per_token
        kv_tokens = min(max_kv_tokens(config, model_config), max(max_len, tenth, per_seq))
    elt = torch.empty((), dtype=dtype).element_size()
    hidden = model_config.hidden_size
    heads = model_config.num_attention_heads
    tokens = MAX_PREFILL_TOKENS
    activations = (
        tokens * hidden * elt * 40  # residual stream, norms, q/k/v/o, MLP and expert intermediates
        + heads * tokens * tokens * 4  # attention scores if the math path of SDPA is taken
        + config.max_num_seqs * model_config.vocab_size * 4 * 3  # last-position logits and sampling
    )
    return FixedCosts(weights, kv_pool_bytes(kv_tokens, per_token), activations, moe_scratch, kv_tokens)


def all_hi_fits(mode: str, all_hi_bytes: int, room: int) -> bool:
    """An offloading mode ("hi-cache", "lo+hi") whose room holds every expert in hi runs as "all-hi"
    (every expert resident, no policy): a cap at least that large behaves as no cap."""
    return mode in ("hi-cache", "lo+hi") and all_hi_bytes <= room


def resolve_on_miss(on_miss: str, mode: str, lo_whole: bool = True) -> str:
    """`EngineConfig.on_miss` for a memory mode: "auto" runs a miss from its resident lo version where
    the mode keeps one of every expert (lo+hi with `lo_whole`: the lo pool holds every expert), else
    reads it zero-copy from host memory (an expert with no device version never adds 0); "lo" asks
    for a lo version that a hi cache does not have."""
    keeps_lo = mode == "all-lo" or mode == "lo+hi" and lo_whole
    if on_miss == "auto":
        return "lo" if keeps_lo else "zero-copy"
    if on_miss == "lo" and mode == "hi-cache":
        raise ConfigError(
            "--on-miss lo needs a policy that keeps a lo version of every expert (combined, dynaexq);"
            " this one caches hi versions only: use --on-miss zero-copy"
        )
    return on_miss


def build_residency(
    config: EngineConfig,
    store: HostExpertStore,
    metrics: ExpertMetrics,
    device: torch.device,
    model,
    model_config,
    progress: bool = True,
    moe_scratch_bytes: int = 0,
) -> Residency:
    """The residency for `config.policy` on `device` under `config.gpu_memory_bytes`;
    `moe_scratch_bytes` joins `M_fixed` (the MoE compute's scratch, which the engine knows)."""
    spec = policy_spec(config.policy)
    mode, needs_lo = spec.memory_mode, spec.needs_lo
    budget_bytes = config.gpu_memory_bytes
    if budget_bytes is None:
        if device.type == "cpu" and mode != "all-lo":
            return StaticResidency(store, metrics, device)  # host memory is device memory: nothing to move
        budget_bytes = int(torch.cuda.mem_get_info(device)[0] * 0.9) if device.type == "cuda" else 1 << 62
    hi_bytes = store.bytes_per_expert("hi")
    fixed = fixed_costs(config, model_config, model, store.shape.dtype, moe_scratch_bytes, budget_bytes)
    room = budget_bytes - fixed.total  # what the expert pools may use
    if all_hi_fits(mode, store.num_layers * store.num_experts * hi_bytes, room):
        mode, needs_lo = "all-hi", False  # the whole model fits in hi: nothing to offload, as with no cap
    lo = lo_precision_for(config, store, room)
    hi_precision = config.hi_precision if mode == "lo+hi" else "hi"
    mids = config.mid_precisions if mode == "lo+hi" else ()  # a deeper ladder's middle tiers
    precisions = (*((lo,) if needs_lo else ()), hi_precision, *mids)
    _prepare_versions(config, store, precisions, room, progress)
    if store.hi_mapped and (mode == "all-hi" or hi_precision == "hi" and mode == "lo+hi"):
        stage_hi_within_cap(store, getattr(model_config, "num_experts_per_tok", 1))
    lo_bytes = store.bytes_per_expert(lo) if lo in store.versions else 0
    top_k = getattr(model_config, "num_experts_per_tok", 1)
    plan = plan_memory(
        budget_bytes,
        fixed,
        num_experts_total=store.num_layers * store.num_experts,
        hi_slot_bytes=store.bytes_per_expert(hi_precision),
        lo_slot_bytes=lo_bytes or hi_bytes,
        min_hi_slots=top_k,
        mode=mode,
        mid_slot_bytes=tuple(store.bytes_per_expert(m) for m in mids),
        upper_slots=config.ladder_slots if mode == "lo+hi" else None,
        misses_run_lo=(spec.on_miss or config.on_miss) == "lo",
    )
    if config.kv_cache_tokens is None:  # a KV size the user gave is kept as it is
        plan = plan.with_spare_kv(
            kv_bytes_per_token(model_config, store.shape.dtype), max_kv_tokens(config, model_config)
        )
    every = store.num_layers * store.num_experts
    tracker = BudgetTracker(budget_bytes)
    tracker.reserve(plan.fixed.total, "fixed", "the fixed part (weights, KV cache, activations)")
    transfer = (
        CudaTransfer(device)
        if device.type == "cuda"
        else CpuTransfer(config.simulated_copy_bytes_per_s, poison=config.poison_slots)
    )
    options = ResidencyOptions(
        mode=mode,
        lo_precision=lo,
        on_miss=resolve_on_miss(spec.on_miss or config.on_miss, mode, plan.lo_slots >= every),
        hi_precision=hi_precision,
        mid_precisions=mids,
        eviction=spec.eviction,
        deterministic=config.deterministic,
        wait_for_copies=config.wait_for_copies,
    )
    manager = ResidencyManager(store, metrics, plan, tracker, transfer, device, options)
    preload = {"all-hi": "hi", "all-lo": "lo", "lo+hi": "lo"}.get(mode)
    if preload:
        n = plan.hi_slots if preload == "hi" else plan.lo_slots
        with progress_bar(
            total=n, desc=f"placing {preload} experts", unit="expert", enabled=progress, leave=False
        ) as bar:
            manager.preload(preload, progress=bar)
    if config.host_versions is not None:
        drop_host_versions(store, config.host_versions, mode, plan, lo)
    return manager


def _prepare_versions(
    config: EngineConfig, store: HostExpertStore, precisions, room: int, progress: bool
) -> None:
    """Quantize (or read from the prepared cache) every version of `precisions` the store lacks;
    under a cap the quantizer's batches stay inside `room`, what the expert pools will use later."""
    from pathlib import Path

    from ..store.prepare import ensure_precision

    cache_dir = Path(config.cache_dir).expanduser() if config.cache_dir else None
    quant_bytes = max(0, room) if config.gpu_memory_bytes is not None else None
    for precision in precisions:
        if precision not in store.versions and precision != "hi":  # (hi: the checkpoint's, mapped)
            ensure_precision(store, config.model_path, precision, progress=progress, cache_dir=cache_dir,
                             device_bytes=quant_bytes)  # fmt: skip


def stage_hi_within_cap(store: HostExpertStore, at_least: int) -> None:
    """Give a mapped store its staged hi slots: as many as the host cap has room for beside the
    versions it holds (all experts at most, `at_least` at least: one layer's top-k)."""
    every = store.num_layers * store.num_experts
    room = store.budget.total_bytes - store.budget.used_bytes
    slots = min(every, room // store.shape.hi_nbytes)
    if slots < at_least:
        raise BudgetError(
            f"the host cap leaves room for {slots} staged hi experts beside the lo versions; this policy"
            f" needs {at_least} (one layer's top-k)"
        )
    from ..store.staging import StagedHi

    store.staged = StagedHi(store.mapped, store.shape, store.num_layers, store.num_experts, slots,
                            pin_memory=store.pin_memory, budget=store.budget)  # fmt: skip


def drop_host_versions(
    store: HostExpertStore, keep: tuple[str, ...], mode: str, plan: MemoryPlan, lo: str
) -> None:
    """Free the host copies the user does not want kept, where the device holds them for good."""
    every = store.num_layers * store.num_experts
    device_holds = {
        "hi": mode == "all-hi" and plan.hi_slots >= every,
        "lo": mode in ("all-lo", "lo+hi") and plan.lo_slots >= every,
    }
    needed_for_misses = {"hi": mode in ("hi-cache", "lo+hi"), "lo": False}
    for kind in ("hi", "lo"):
        precision = "hi" if kind == "hi" else lo
        if kind in keep or precision not in store.versions:
            continue
        if mode == "all-lo" and kind == "hi" or device_holds[kind] and not needed_for_misses[kind]:
            store.drop_precision(precision)
            continue
        raise BudgetError(
            f"cannot drop the host {kind} versions: this policy loads {kind} experts from host memory on demand"
        )


__all__ = [
    "BudgetTracker",
    "ExpertMetrics",
    "MemoryPlan",
    "Residency",
    "ResidencyManager",
    "ResidencyOptions",
    "StaticResidency",
    "build_residency",
]
