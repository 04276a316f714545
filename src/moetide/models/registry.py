"""One small declarative adapter per Hugging Face MoE family, keyed by `config.model_type`.

An adapter says where the MoE blocks live in transformers' own model, what the router is called,
how the checkpoint names each expert's tensors, and which checkpoint names transformers renamed.
It contains no modeling code: transformers builds the model, moetide swaps `mlp.experts`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import UnsupportedModelError

_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
_W1_W3_W2 = ("w1", "w3", "w2")


@dataclass(frozen=True)
class FamilyAdapter:
    """How moetide finds and feeds the experts of one model family.

    Attributes:
        model_type: `config.model_type` this adapter serves.
        display_name: what users call the family.
        num_experts_attr / top_k_attr / expert_intermediate_attr: config fields.
        router_attr: attribute of the MoE block holding the router (returns `(logits, weights, ids)`).
        proj_names: checkpoint projection names for (gate, up, down).
        checkpoint_block: the MoE block's name in checkpoint tensor names (`mlp`, `block_sparse_moe`).
        checkpoint_renames: (checkpoint substring, model substring) pairs for non-expert tensors.
        shared_expert_attrs: MoE-block attributes of always-on shared experts (kept on the device).
        expert_key_pattern (derived): regex over checkpoint tensor names; groups `layer`, `expert`, `proj`.
    """

    model_type: str
    display_name: str
    num_experts_attr: str
    expert_intermediate_attr: str
    router_attr: str = "gate"
    top_k_attr: str = "num_experts_per_tok"
    proj_names: tuple[str, str, str] = _GATE_UP_DOWN
    checkpoint_block: str = "mlp"
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    shared_expert_attrs: tuple[str, ...] = ()
    expert_key_pattern: str = field(init=False, compare=False)
    _compiled: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        projs = "|".join(self.proj_names)
        pattern = (
            rf"model\.layers\.(?P<layer>\d+)\.{self.checkpoint_block}\.experts\.(?P<expert>\d+)"
            rf"\.(?P<proj>{projs})\.weight"
        )
        object.__setattr__(self, "expert_key_pattern", pattern)
        object.__setattr__(self, "_compiled", re.compile(pattern))

    def match_expert_key(self, name: str) -> tuple[int, int, str] | None:
        """`(layer, expert, "gate"|"up"|"down")` if `name` is a routed expert's tensor, else None."""
        m = self._compiled.fullmatch(name)
        if m is None:
            return None
        role = {p: r for p, r in zip(self.proj_names, ("gate", "up", "down"), strict=True)}[m["proj"]]
        return int(m["layer"]), int(m["expert"]), role

    def expert_checkpoint_key(self, layer: int, expert: int, role: str) -> str:
        """The checkpoint name of one expert tensor (`role` in gate / up / down)."""
        proj = self.proj_names[("gate", "up", "down").index(role)]
        return f"model.layers.{layer}.{self.checkpoint_block}.experts.{expert}.{proj}.weight"

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


ADAPTERS: dict[str, FamilyAdapter] = {
    a.model_type: a
    for a in (
        FamilyAdapter("qwen3_moe", "Qwen3-MoE", "num_experts", "moe_intermediate_size"),
        FamilyAdapter(
            "qwen2_moe",
            "Qwen1.5-MoE / Qwen2-MoE",
            "num_experts",
            "moe_intermediate_size",
            shared_expert_attrs=("shared_expert", "shared_expert_gate"),
        ),
        FamilyAdapter(
            "mixtral",
            "Mixtral",
            "num_local_experts",
            "intermediate_size",
            proj_names=_W1_W3_W2,
            checkpoint_block="block_sparse_moe",
            checkpoint_renames=((".block_sparse_moe.", ".mlp."),),
        ),
        FamilyAdapter("olmoe", "OLMoE", "num_experts", "intermediate_size"),
        FamilyAdapter(
            "phimoe",
            "Phi-3.5-MoE",
            "num_local_experts",
            "intermediate_size",
            router_attr="router",
            proj_names=_W1_W3_W2,
            checkpoint_block="block_sparse_moe",
            checkpoint_renames=((".block_sparse_moe.gate.", ".mlp.router."), (".block_sparse_moe.", ".mlp.")),
        ),
        FamilyAdapter(
            "deepseek_v2",
            "DeepSeek-V2",
            "n_routed_experts",
            "moe_intermediate_size",
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
