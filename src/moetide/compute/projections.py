"""Fused q/k/v projections: one matmul where an attention module's three projections read one input.

transformers' attention modules (OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral, Phi-3.5-MoE, ...) project
their input three times,

    q = x @ Wq^T [+ bq];  k = x @ Wk^T [+ bk];  v = x @ Wv^T [+ bv]        x (..., H)

three GEMMs per layer that each read a weight once: at a decode step's few tokens they are bound by
those reads and by their launches (OLMoE at batch 1: 5.6 us each, with the output
projection 0.36 ms of a 1.3 ms step). `fuse_qkv` lays the three weights out as one (Nq + Nk + Nv, H)
tensor, each projection's weight a view of its rows (no extra memory), and gives the module a
forward pre-hook that computes `x @ W^T` once per call and keeps it for the call; each projection's
forward, on the instance, returns its columns of that product when it is handed the same input
tensor, and computes its own product otherwise (a module that projects anything else than its first
input stays correct). A forward hook drops the product after the call. The modeling code is not
touched; `torch.compile` traces the hooks like any module call.

Each output column is the same dot product as before, but the one GEMM may sum it in another order
than three would: results can differ from the unfused ones by float rounding (tests: logits within
1e-5 relative, greedy tokens equal).
DeepSeek-V2's low-rank attention has no such triplet and is left as it is.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

PROJECTIONS = ("q_proj", "k_proj", "v_proj")
PRODUCT = "_moetide_qkv"  # the module attribute holding (input, product) during one call


def fusable(module: nn.Module) -> list[nn.Linear] | None:
    """The module's q/k/v projections where all three are plain `nn.Linear` of one input width, dtype and
    device, all with a bias or none; else None."""
    layers = [getattr(module, name, None) for name in PROJECTIONS]
    if not all(type(layer) is nn.Linear for layer in layers):
        return None
    first = layers[0].weight
    if any(
        layer.in_features != layers[0].in_features or layer.weight.dtype != first.dtype
        or layer.weight.device != first.device or (layer.bias is None) != (layers[0].bias is None)
        for layer in layers
    ):  # fmt: skip
        return None
    return layers


def fuse_qkv(model: nn.Module) -> int:
    """Fuse the q/k/v projections of every module of `model` that has `fusable` ones (in place, after
    the weights are where they stay); the number of modules fused."""
    fused = 0
    for module in list(model.modules()):
        layers = fusable(module)
        if layers is None or hasattr(module, PRODUCT):
            continue
        weight = _one_tensor([layer.weight for layer in layers])
        bias = _one_tensor([layer.bias for layer in layers]) if layers[0].bias is not None else None
        start = 0
        for layer in layers:
            stop = start + layer.out_features
            layer.weight = nn.Parameter(weight[start:stop], requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias[start:stop], requires_grad=False)
            layer.forward = functools.partial(_columns_of_product, module, layer, start, stop)
            start = stop
        setattr(module, PRODUCT, None)
        module.register_forward_pre_hook(functools.partial(_project_once, weight, bias), with_kwargs=True)
        module.register_forward_hook(_drop_product)
        fused += 1
    return fused


def _one_tensor(parts: list[torch.Tensor]) -> torch.Tensor:
    """`parts` (N_i, ...) concatenated along rows into one new tensor, each part freed by its owner
    once replaced by a view."""
    with torch.no_grad():
        return torch.cat([part.detach() for part in parts])


def _project_once(weight: torch.Tensor, bias: torch.Tensor | None, module: nn.Module, args, kwargs):
    """Forward pre-hook: the product of the call's input (its first argument, or `hidden_states`) with
    every projection's rows, kept on the module for this call."""
    x = args[0] if args else kwargs.get("hidden_states")
    setattr(module, PRODUCT, (x, F.linear(x, weight, bias)) if isinstance(x, torch.Tensor) else None)


def _drop_product(module: nn.Module, args, output):
    setattr(module, PRODUCT, None)


def _columns_of_product(module: nn.Module, layer: nn.Linear, start: int, stop: int, x: torch.Tensor):
    """A fused projection's forward: its columns [start, stop) of the module's product when `x` is the
    input that product was computed from, else its own `x @ W^T [+ b]`. `x (..., H)` -> `(..., stop - start)`."""
    product = getattr(module, PRODUCT, None)
    if product is not None and product[0] is x:
        return product[1][..., start:stop]
    return F.linear(x, layer.weight, layer.bias)
