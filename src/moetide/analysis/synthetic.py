"""Synthetic routing traces with the structure real MoE routing shows, for tests and development.

Each request has a topic (a workload). Token t of a request has a latent state z_t in R^r that drifts
slowly from one decode step to the next (temporal locality: z_{t+1} = rho z_t + sqrt(1 - rho^2) eps).
Router logits at layer l are  topic_bias[topic, l] + W_l^T z_t + noise,  with W_{l+1} correlated to W_l
(trajectory structure across layers) and topic biases drawn heavy-tailed (a few hot experts per
topic and layer, different per topic: workload-dependent hot sets). The step's embedding is the topic
centroid plus a projection of z (semantic structure). Speculative predictions for distance d are the
top-k of layer l+d's logits with noise growing with d.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence

import torch

from .trace import STEP_DECODE, STEP_PREFILL, Trace, TraceMeta


@dataclass
class _World:
    """The synthetic "model": per-topic router biases (T, L, J), latent-to-logit maps W (L, r, J)
    correlated across layers, topic centroids (T, H) and the latent-to-embedding projection (r, H)."""

    bias: torch.Tensor
    W: torch.Tensor
    centroids: torch.Tensor
    proj: torch.Tensor

    @classmethod
    def draw(cls, seed, num_topics, L, J, H, r, bias_scale, layer_correlation) -> _World:
        world = torch.Generator().manual_seed(seed)
        # heavy-tailed topic biases: exponentiated Gaussians, centred
        bias = bias_scale * torch.randn(num_topics, L, J, generator=world).clamp(min=-1.0) ** 2
        bias = bias - bias.mean(-1, keepdim=True)
        W = [torch.randn(r, J, generator=world)]
        c = layer_correlation
        for _ in range(L - 1):
            W.append(c * W[-1] + math.sqrt(1 - c * c) * torch.randn(r, J, generator=world))
        centroids = 2.0 * torch.randn(num_topics, H, generator=world)
        proj = torch.randn(r, H, generator=world) / math.sqrt(r)
        return cls(bias, torch.stack(W), centroids, proj)

    def route(self, topic, z, g, k, noise, spec_noise, spec_distances):
        """z (T, r) -> probs (T, L, J), topk (T, L, k), spec (T, D, L, k)."""
        logits = self.bias[topic][None] + torch.einsum("tr,lrj->tlj", z, self.W)
        logits = logits + noise * torch.randn(logits.shape, generator=g)
        probs = torch.softmax(logits, -1)
        topk = torch.topk(probs, k, dim=-1).indices
        T, L, J = logits.shape
        spec = torch.full((T, len(spec_distances), L, k), -1, dtype=torch.int64)
        for i, d in enumerate(spec_distances):
            if d >= L:
                continue
            guess = logits[:, d:] + spec_noise * math.sqrt(d) * torch.randn(T, L - d, J, generator=g)
            spec[:, i, : L - d] = torch.topk(guess, k, dim=-1).indices
        return probs, topk, spec


def synthetic_trace(
    topics: Sequence[int],
    *,
    num_layers: int = 8,
    num_experts: int = 32,
    top_k: int = 4,
    hidden_size: int = 64,
    num_topics: int = 4,
    prompt_tokens: int = 16,
    decode_steps: int = 32,
    latent_dim: int = 8,
    rho: float = 0.8,
    layer_correlation: float = 0.7,
    bias_scale: float = 2.0,
    noise: float = 0.5,
    spec_noise: float = 0.6,
    spec_distances: Sequence[int] = (1, 2, 3, 4),
    seed: int = 0,
    world_seed: int = 1234,
) -> Trace:
    """A trace of `len(topics)` requests; request i is about topic `topics[i]`.

    `world_seed` fixes the "model" (topic biases, projections); `seed` the requests. Two traces with
    the same `world_seed` come from the same model (e.g. a warm-up and a test split).
    """
    L, J, k, H, r = num_layers, num_experts, top_k, hidden_size, latent_dim
    world = _World.draw(world_seed, num_topics, L, J, H, r, bias_scale, layer_correlation)
    g = torch.Generator().manual_seed(seed)
    spec_distances = tuple(spec_distances)
    req_ids, kinds, counts, embs, probs_all, ids_all, spec_all = [], [], [], [], [], [], []
    for rid, topic in enumerate(topics):
        z = torch.randn(prompt_tokens, r, generator=g)
        steps = [(STEP_PREFILL, z)]
        zt = z[-1:]
        for _ in range(decode_steps):
            zt = rho * zt + math.sqrt(1 - rho * rho) * torch.randn(1, r, generator=g)
            steps.append((STEP_DECODE, zt))
        for kind, zs in steps:
            probs, topk, spec = world.route(topic, zs, g, k, noise, spec_noise, spec_distances)
            emb = world.centroids[topic] + (zs @ world.proj).mean(0) + 0.3 * torch.randn(H, generator=g)
            req_ids.append(rid)
            kinds.append(kind)
            counts.append(zs.shape[0])
            embs.append(emb)
            probs_all.append(probs.mean(0))
            ids_all.append(topk)
            spec_all.append(spec)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(counts), 0)
    meta = TraceMeta(L, J, k, H, spec_distances=spec_distances, model_type="synthetic", source="synthetic")
    return Trace(
        meta,
        torch.tensor(req_ids),
        torch.tensor(kinds, dtype=torch.uint8),
        offsets,
        torch.stack(embs),
        torch.stack(probs_all),
        torch.cat(ids_all),
        torch.cat(spec_all),
    )
