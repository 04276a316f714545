"""One small declarative adapter per Hugging Face MoE family, keyed by `config.model_type`.

An adapter says where the MoE blocks live in transformers' own model, what the router is called,
how the checkpoint names each expert's tensors, and which checkpoint names transformers renamed.
It contains no modeling code: transformers builds the model, moetide swaps `mlp.experts`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class FamilyAdapter:
    """How moetide finds and feeds the experts of one model family.

    Attributes:
        model_type: `config.model_type` this adapter serves.
        display_name: what users call the family.
        router_attr: attribute of the MoE block holding the router (returns `(logits, weights, ids)`).
        num_experts_attr / top_k_attr / expert_intermediate_attr: config fields.
        expert_key_pattern: regex over checkpoint tensor names; groups `layer`, `expert`, `proj`.
        proj_names: checkpoint projection names for (gate, up, down).
        checkpoint_renames: (checkpoint substring, model substring) pairs for non-expert tensors.
        shared_expert_attrs: MoE-block attributes of always-on shared experts (kept on the device).
    """

    model_type: str
    display_name: str
    router_attr: str
    num_experts_attr: str
    top_k_attr: str
    expert_intermediate_attr: str
    expert_key_pattern: str
    proj_names: tuple[str, str, str]
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    shared_expert_attrs: tuple[str, ...] = ()
    _compiled: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", re.compile(self.expert_key_pattern))

    def match_expert_key(self, name: str) -> tuple[int, int, str] | None:
        """`(layer, expert, "gate"|"up"|"down")` if `name` is a routed expert's tensor, else None."""
        m = self._compiled.fullmatch(name)
        if m is None:
            return None
        role = {p: r for p, r in zip(self.proj_names, ("gate", "up", "down"), strict=True)}[m["proj"]]
        return int(m["layer"]), int(m["expert"]), role

    def expert_checkpoint_key(self, layer: int, expert: int, role: str) -> str:
        """The checkpoint name of one expert tensor (`role` in gate / up / down)."""
        block = "block_sparse_moe" if self.checkpoint_renames else "mlp"
        proj = self.proj_names[("gate", "up", "down").index(role)]
        return f"model.layers.{layer}.{block}.experts.{expert}.{proj}.weight"

    def checkpoint_key(self, model_key: str) -> str:
        """Inverse of `model_key`: the checkpoint name of a non-expert model parameter."""
        for old, new in reversed(self.checkpoint_renames):
            model_key = model_key.replace(new, old)
        return model_key

    def model_key(self, checkpoint_key: str) -> str:
        """The model's parameter name for a non-expert checkpoint tensor."""
        for old, new in self.checkpoint_renames:
            checkpoint_key = checkpoint_key.replace(old, new)
        return checkpoint_key

    def num_experts(self, config) -> int:
        return int(getattr(config, self.num_experts_attr))

    def top_k(self, config) -> int:
        return int(getattr(config, self.top_k_attr))

    def expert_intermediate(self, config) -> int:
        return int(getattr(config, self.expert_intermediate_attr))


def _pattern(block: str, projs: tuple[str, str, str]) -> str:
    alternatives = "|".join(projs)
    return (
        rf"model\.layers\.(?P<layer>\d+)\.{block}\.experts\.(?P<expert>\d+)\.(?P<proj>{alternatives})\.weight"
    )


_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
_W1_W3_W2 = ("w1", "w3", "w2")

ADAPTERS: dict[str, FamilyAdapter] = {
    a.model_type: a
    for a in (
        FamilyAdapter(
            model_type="qwen3_moe",
            display_name="Qwen3-MoE",
            router_attr="gate",
            num_experts_attr="num_experts",
            top_k_attr="num_experts_per_tok",
            expert_intermediate_attr="moe_intermediate_size",
            expert_key_pattern=_pattern("mlp", _GATE_UP_DOWN),
            proj_names=_GATE_UP_DOWN,
        ),
        FamilyAdapter(
            model_type="qwen2_moe",
            display_name="Qwen1.5-MoE / Qwen2-MoE",
            router_attr="gate",
            num_experts_attr="num_experts",
            top_k_attr="num_experts_per_tok",
            expert_intermediate_attr="moe_intermediate_size",
            expert_key_pattern=_pattern("mlp", _GATE_UP_DOWN),
            proj_names=_GATE_UP_DOWN,
            shared_expert_attrs=("shared_expert", "shared_expert_gate"),
        ),
        FamilyAdapter(
            model_type="mixtral",
            display_name="Mixtral",
            router_attr="gate",
            num_experts_attr="num_local_experts",
            top_k_attr="num_experts_per_tok",
            expert_intermediate_attr="intermediate_size",
            expert_key_pattern=_pattern("block_sparse_moe", _W1_W3_W2),
            proj_names=_W1_W3_W2,
            checkpoint_renames=((".block_sparse_moe.", ".mlp."),),
        ),
        FamilyAdapter(
            model_type="olmoe",
            display_name="OLMoE",
            router_attr="gate",
            num_experts_attr="num_experts",
            top_k_attr="num_experts_per_tok",
            expert_intermediate_attr="intermediate_size",
            expert_key_pattern=_pattern("mlp", _GATE_UP_DOWN),
            proj_names=_GATE_UP_DOWN,
        ),
        FamilyAdapter(
            model_type="phimoe",
            display_name="Phi-3.5-MoE",
            router_attr="router",
            num_experts_attr="num_local_experts",
            top_k_attr="num_experts_per_tok",
            expert_intermediate_attr="intermediate_size",
            expert_key_pattern=_pattern("block_sparse_moe", _W1_W3_W2),
            proj_names=_W1_W3_W2,
            checkpoint_renames=((".block_sparse_moe.gate.", ".mlp.router."), (".block_sparse_moe.", ".mlp.")),
        ),
        FamilyAdapter(
            model_type="deepseek_v2",
            display_name="DeepSeek-V2",
            router_attr="gate",
            num_experts_attr="n_routed_experts",
            top_k_attr="num_experts_per_tok",
            expert_intermediate_attr="moe_intermediate_size",
            expert_key_pattern=_pattern("mlp", _GATE_UP_DOWN),
            proj_names=_GATE_UP_DOWN,
            shared_expert_attrs=("shared_experts",),
        ),
    )
}

SUPPORTED_FAMILIES = ", ".join(sorted(ADAPTERS))


def get_adapter(model_type: str | None) -> FamilyAdapter:
    """The adapter for `model_type`, or an `UnsupportedModelError` naming the supported families."""
    if model_type not in ADAPTERS:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported MoE families: {SUPPORTED_FAMILIES}"
        )
    return ADAPTERS[model_type]
