"""Softmax and top-k of router logits in one Triton kernel (`softmax_topk` in `routing.py` calls it).

Shapes: T tokens, E experts, k chosen per token.
    logits  (T, E)  any float dtype, rows of stride `stride`
    scores  (T, k)  the chosen experts' softmax probabilities (normalized over the k if NORMALIZE),
                    in the output's dtype
    ids     (T, k)  int64, in descending order of probability; equal probabilities in ascending id

One program per token: the row is loaded once, its softmax taken in float32 (as transformers' routers
take it), and the k largest are found by k passes of max and arg-min-index over the row, in registers.
It replaces the three to four kernels of `softmax` + `torch.topk` (+ normalize, cast) per MoE layer.

Import this module only where triton is installed; on CPU it runs under Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported), which the tests use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(logits_ptr, scores_ptr, ids_ptr, stride, E: tl.constexpr, E_P2: tl.constexpr,
                         K: tl.constexpr, K_P2: tl.constexpr, NORMALIZE: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_P2)
    x = tl.load(logits_ptr + t * stride + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    work = tl.where(offs < E, p, -1.0)  # probabilities are >= 0: -1 marks a taken or padded column
    ks = tl.arange(0, K_P2)
    top_p = tl.zeros((K_P2,), dtype=tl.float32)
    top_i = tl.zeros((K_P2,), dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(work, axis=0)
        idx = tl.min(tl.where(work == best, offs, E_P2), axis=0)
        top_p = tl.where(ks == j, best, top_p)
        top_i = tl.where(ks == j, idx.to(tl.int64), top_i)
        work = tl.where(offs == idx, -1.0, work)
    if NORMALIZE:
        top_p = top_p / tl.sum(top_p, axis=0)  # (columns past K hold 0)
    tl.store(scores_ptr + t * K + ks, top_p.to(scores_ptr.dtype.element_ty), mask=ks < K)
    tl.store(ids_ptr + t * K + ks, top_i, mask=ks < K)


MAX_EXPERTS = 1024  # a row in registers; wider routers keep torch's softmax + topk


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool, out_dtype: torch.dtype):
    """`(scores (T, k) out_dtype, ids (T, k) int64)` of `logits (T, E)`; one launch, no host sync."""
    tokens, experts = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    scores = torch.empty(tokens, k, device=logits.device, dtype=out_dtype)
    ids = torch.empty(tokens, k, device=logits.device, dtype=torch.int64)
    if tokens:
        _softmax_topk_kernel[(tokens,)](logits, scores, ids, logits.stride(0), E=experts,
                                        E_P2=triton.next_power_of_2(experts), K=k, K_P2=triton.next_power_of_2(k),
                                        NORMALIZE=normalize, num_warps=1 if experts <= 256 else 4)  # fmt: skip
    return scores, ids
