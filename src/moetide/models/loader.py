"""Build transformers' own model without weights and load the checkpoint: experts to the host store.

Steps (peak host memory ≈ the expert store + one tensor; never the model twice; with `map_hi` the
expert store holds no hi arena and the expert tensors stay in the mapped shards, `store/mapped.py`):
  1. `inspect_checkpoint`: config, family adapter, shard headers checked.
  2. Build the model with parameters on the meta device (buffers such as rotary tables are real).
  3. Replace `mlp.experts` on every MoE block instance with an `ExpertsInHostStore` placeholder
     (no weights, no class patching).
  4. Stream every tensor from the shards one at a time: routed-expert tensors into the host expert
     store, everything else onto the compute device in the compute dtype.
  5. Tie weights, check nothing is left on meta.

This module loads and describes; it builds no runtime. `engine/assemble.py` swaps the placeholders
for the managed experts module and attaches the residency and the hooks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from ..errors import CheckpointError
from ..progress import bar as progress_bar
from ..store.host_store import ExpertShape, HostExpertStore
from .checkpoint import CheckpointInfo, inspect_checkpoint
from .registry import FamilyAdapter

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """transformers' module tree with its weights placed and its experts in the host store; the
    engine fills in the runtime (`engine/assemble.py`) and the policy (`engine/llm.attach_policy`)."""

    model: nn.Module
    info: CheckpointInfo
    store: HostExpertStore
    moe_layers: list[int]  # decoder-layer index of each MoE layer, in order
    device: torch.device
    dtype: torch.dtype
    act_fn: object  # the experts' activation, taken from transformers' experts module
    runtime: object = None  # the ExpertRuntime, once assembled
    fused_routers: int = 0  # MoE blocks whose router runs the fused softmax + top-k (`compute/routing.py`)
    fused_qkv: int = 0  # attention modules whose q/k/v projections are one matmul (`compute/projections.py`)
    policy: object = None  # the policy object, for predictive policies
    policy_hooks: object = None

    @property
    def config(self):
        return self.info.config

    @property
    def adapter(self) -> FamilyAdapter:
        return self.info.adapter


def resolve_device(device: str | None) -> torch.device:
    """CUDA when available, else CPU; an explicit choice wins (and must exist)."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(
            "--device cuda was asked for but CUDA is not available on this machine; use --device cpu"
        )
    return dev


def resolve_dtype(name: str, config, device: torch.device) -> torch.dtype:
    """ "auto": the checkpoint's dtype on CUDA, float32 on CPU (CPU bf16 matmuls are slow and lossy)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt)
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


def moe_blocks(model: nn.Module, adapter: FamilyAdapter) -> list[tuple[int, nn.Module]]:
    """`(decoder layer index, MoE block)` for every layer whose `mlp` has the family's router."""
    blocks = []
    for idx, layer in enumerate(model.model.layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, adapter.router_attr) and hasattr(mlp, "experts"):
            blocks.append((idx, mlp))
    return blocks


class ExpertsInHostStore(nn.Module):
    """Stands in for a MoE block's experts, whose weights are in the host store, until the engine
    installs its managed experts module."""

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, top_k_index, top_k_weights):
        raise RuntimeError(f"MoE layer {self.layer}: its experts are in the host store; assemble the runtime")


def build_empty_model(config, dtype: torch.dtype) -> nn.Module:
    """transformers' model for `config` with parameters on meta (buffers real, on the CPU)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _assign_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, param_name = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise CheckpointError(f"checkpoint tensor {name!r} matches no module of the model") from None
    old = (
        module._parameters.get(param_name)
        if param_name in module._parameters
        else module._buffers.get(param_name)
    )
    if old is None and param_name not in module._parameters and param_name not in module._buffers:
        raise CheckpointError(f"checkpoint tensor {name!r} matches no parameter of the model")
    if old is not None and tuple(old.shape) != tuple(tensor.shape):
        raise CheckpointError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(old.shape)}"
        )
    if param_name in module._parameters:
        module._parameters[param_name] = nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[param_name] = tensor


def load_weights(
    path,
    *,
    device: str | torch.device | None = None,
    dtype: str = "auto",
    progress: bool = True,
    host_budget=None,
    map_hi: bool = False,
) -> LoadedModel:
    """Load a local HF MoE checkpoint into transformers' modeling code: non-expert weights on the
    device in the compute dtype, every routed expert in a host `HostExpertStore`.

    `host_budget`: a `BudgetTracker` of the host bytes the store may allocate (`--cpu-memory`);
    `map_hi`: read no expert tensor now; the store reads hi versions from the mapped shards."""
    info = inspect_checkpoint(path)
    config, adapter = info.config, info.adapter
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    compute_dtype = resolve_dtype(dtype, config, dev)

    model = build_empty_model(config, compute_dtype)
    blocks = moe_blocks(model, adapter)
    if not blocks:
        raise CheckpointError(
            f"{info.path}: the model has no MoE blocks with a {adapter.router_attr!r} router"
        )
    act_fn = blocks[0][1].experts.act_fn
    shape = ExpertShape(
        hidden=config.hidden_size, intermediate=adapter.expert_intermediate(config), dtype=compute_dtype
    )
    layer_to_moe = {layer_idx: i for i, (layer_idx, _) in enumerate(blocks)}
    mapped = None
    if map_hi:
        from ..store.mapped import MappedExperts

        mapped = MappedExperts(info, layer_to_moe)
    store = HostExpertStore(len(blocks), adapter.num_experts(config), shape, pin_memory=dev.type == "cuda",
                            budget=host_budget, mapped=mapped)  # fmt: skip
    for i, (_, block) in enumerate(blocks):
        block.experts = ExpertsInHostStore(i)
    _stream_shards(info, model, store, layer_to_moe, dev, compute_dtype, progress)
    store.check_complete()

    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise CheckpointError(f"{info.path}: checkpoint is missing tensor {missing[0]!r}")
    model.to(dev)  # buffers (rotary tables) follow the parameters
    return LoadedModel(model, info, store, [i for i, _ in blocks], dev, compute_dtype, act_fn)


def _stream_shards(info, model, store, layer_to_moe: dict[int, int], dev, compute_dtype, progress) -> None:
    """Every tensor of every shard, one at a time: experts into `store`, the rest onto `dev`."""
    adapter = info.adapter
    total = sum(len(s.tensors) for s in info.shards)
    bar = progress_bar(total=total, desc="loading weights", unit="tensor", enabled=progress, leave=False)
    for shard in info.shards:
        try:
            with safe_open(str(shard.path), framework="pt", device="cpu") as f:
                for name in shard.tensors:
                    key = adapter.match_expert_key(name)
                    if key is not None and store.mapped is not None:
                        bar.update(1)
                        continue  # read in place from the map when staged or quantized
                    tensor = f.get_tensor(name)
                    if key is not None:
                        layer_idx, expert, role = key
                        if layer_idx not in layer_to_moe:
                            raise CheckpointError(
                                f"expert tensor {name!r} belongs to a layer without experts"
                            )
                        store.put_projection(layer_to_moe[layer_idx], expert, role, tensor)
                    else:
                        target = (
                            tensor.to(dev, dtype=compute_dtype)
                            if tensor.is_floating_point()
                            else tensor.to(dev)
                        )
                        _assign_parameter(model, adapter.model_key(name), target)
                    bar.update(1)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises SafetensorError and others on corrupt data
            raise CheckpointError(
                f"{shard.path}: corrupt safetensors shard ({type(e).__name__}: {e})"
            ) from None
    bar.close()
