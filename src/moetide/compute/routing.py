"""Fused routers: a MoE block's softmax and top-k in one kernel, where the router is a plain one.

transformers' top-k routers (OLMoE, Qwen2-MoE, Qwen3-MoE, Mixtral, ...) compute, per token,

    logits = x @ W^T;  p = softmax(logits) in float32;  the k largest p and their ids;
    [the k normalized to sum 1];  [cast to the logits' dtype]  ->  (logits, scores, ids)

which on CUDA is four to five kernels per layer (softmax, two of `torch.topk`, the normalization and
the cast; measured at batch 1: 10 us of a 15 us router). `fuse_routers` replaces, on
each MoE block's router instance, the forward by one that keeps the logits' matmul and computes the
rest in one Triton kernel (`routing_kernel.py`) behind the operator `torch.ops.moetide.softmax_topk`
(opaque to `torch.compile`, like the attention's), after a probe on random inputs shows that it
gives what the router's own forward gives: the same logits, the same experts with the same scores
(up to the float32 rounding of the exponential), the same dtypes. Routers that compute anything else
(grouped or biased selection, sigmoid scores, jitter) fail the probe and keep their forward. CPU
runs keep the routers' own forward; the operator's CPU implementation is the reference below.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn


def softmax_topk_reference(logits: torch.Tensor, k: int, normalize: bool, out_dtype: torch.dtype):
    """`(scores (T, k), ids (T, k) int64)` of `logits (T, E)` as transformers' routers compute them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(out_dtype), ids


@torch.library.custom_op("moetide::softmax_topk", mutates_args=())
def softmax_topk(
    logits: torch.Tensor, k: int, normalize: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_topk_reference`, computed by one kernel on CUDA (`routing_kernel.softmax_topk`)."""
    from . import routing_kernel

    if logits.is_cuda and logits.shape[-1] <= routing_kernel.MAX_EXPERTS:
        return routing_kernel.softmax_topk(logits, k, normalize, out_dtype)
    return softmax_topk_reference(logits, k, normalize, out_dtype)


@softmax_topk.register_fake
def _softmax_topk_fake(logits, k, normalize, out_dtype):
    tokens = logits.shape[0]
    return logits.new_empty(tokens, k, dtype=out_dtype), logits.new_empty(tokens, k, dtype=torch.int64)


def fused_forward(router: nn.Module, normalize: bool, out_dtype: torch.dtype, hidden_states: torch.Tensor):
    """A plain router's forward through the fused kernel: `hidden_states (..., H)` ->
    `(logits (T, E), scores (T, k) out_dtype, ids (T, k) int64)`."""
    logits = F.linear(hidden_states.reshape(-1, router.weight.shape[1]), router.weight)
    scores, ids = torch.ops.moetide.softmax_topk(logits, router.top_k, normalize, out_dtype)
    return logits, scores, ids


PROBE_TOKENS = 64


def matching_spec(router: nn.Module, seed: int = 0) -> tuple[bool, torch.dtype] | None:
    """`(normalize, out_dtype)` with which `fused_forward` gives what `router`'s own forward gives on
    random inputs (`PROBE_TOKENS` tokens on the router's device), or None where no spec does (or the
    router is not a plain `weight (E, H)`, `top_k` one)."""
    weight = getattr(router, "weight", None)
    top_k = getattr(router, "top_k", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not isinstance(top_k, int):
        return None
    if getattr(router, "bias", None) is not None:
        return None
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(PROBE_TOKENS, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    with torch.no_grad():
        want = router(x)
        if not (isinstance(want, tuple) and len(want) == 3 and all(isinstance(t, torch.Tensor) for t in want)):
            return None
        declared = getattr(router, "norm_topk_prob", None)
        for normalize in [declared] if isinstance(declared, bool) else [True, False]:
            got = fused_forward(router, normalize, want[1].dtype, x)
            if same_routing(got, want):
                return normalize, want[1].dtype
    return None


def same_routing(got, want) -> bool:
    """Same logits, and per token experts of the same probabilities with the same scores, in
    descending order (bf16 logits tie often enough that equal probabilities at the k-th place are
    common: either expert is the router's choice)."""
    (logits, scores, ids), (want_logits, want_scores, want_ids) = got, want
    if logits.shape != want_logits.shape or not torch.equal(logits, want_logits):
        return False
    if scores.shape != want_scores.shape or scores.dtype != want_scores.dtype or want_ids.dtype != ids.dtype:
        return False
    if not torch.equal(ids.sort(dim=-1).values.diff(dim=-1) > 0, torch.ones_like(ids[:, 1:], dtype=torch.bool)):
        return False  # the k ids of a token are distinct
    probs = torch.softmax(logits.float(), dim=-1)
    if not torch.equal(probs.gather(-1, ids), probs.gather(-1, want_ids).sort(dim=-1, descending=True).values):
        return False  # the same probabilities chosen, in descending order
    tol = 1e-5 if scores.dtype == torch.float32 else 1e-2
    want_sorted = want_scores.float().sort(dim=-1, descending=True).values  # (some routers leave k unsorted)
    return torch.allclose(scores.float(), want_sorted, rtol=tol, atol=tol)


def fuse_routers(model: nn.Module, adapter, device: torch.device) -> int:
    """Give each MoE block's router that passes `matching_spec` the fused forward (on the instance);
    the number of routers fused. CUDA with triton only."""
    from ..models.loader import moe_blocks

    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return 0
    fused = 0
    for _, block in moe_blocks(model, adapter):
        router = getattr(block, adapter.router_attr, None)
        spec = matching_spec(router) if isinstance(router, nn.Module) else None
        if spec is not None:
            router.forward = functools.partial(fused_forward, router, *spec)
            fused += 1
    return fused
