"""Sampling parameters (vLLM's names) and the sampler.

Shapes: logits (B, V) float32 for the B sequences decoded this step.

Every valid parameter samples: the most likely token always survives top-k and top-p (a top_p that
rounds to 0 in float32 keeps it alone), and logits are shifted by their maximum before the division
by the temperature, so a tiny temperature cannot overflow to inf/NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from .detokenize import stop_strings


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 = greedy; top_k 0 or -1 = off; top_p 1.0 = off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] | list[str] | str | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ConfigError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        object.__setattr__(self, "stop", stop_strings(self.stop))  # capped: engine/detokenize.py
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (-inf) logits outside top-k and outside the top-p nucleus: `(V,)` -> `(V,)`.

    The most likely token is never masked, whatever `top_k` / `top_p` are.
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p; the mass before a token is computed in
        # float32, where a top_p below ~1e-45 is 0, so the first token is kept explicitly
        drop = probs.cumsum(dim=-1) - probs >= top_p
        drop[0] = False
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token from one row: `logits (V,)` float32 -> `()` int64 (on the CPU unless greedy)."""
    if p.greedy:
        return logits.argmax()
    # shifted so the maximum is 0, and a temperature no smaller than float32's smallest normal number
    # (a smaller one is 0 in float32, and 0/0 is NaN): dividing gives -inf at worst, never inf or NaN
    row = (logits - logits.max()) / max(p.temperature, torch.finfo(torch.float32).tiny)
    row = _filter_top_k_top_p(row, p.top_k, p.top_p)
    probs = torch.softmax(row, dim=-1)
    # generator lives on the CPU so seeded runs give the same tokens on any device
    return torch.multinomial(probs.cpu(), 1, generator=generator)[0]


def sample_next_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    errors: list[tuple[int, Exception]] | None = None,
) -> torch.Tensor:
    """One token per row: `logits (B, V)` -> `(B,)` int64 on the logits' device.

    With `errors` given, a row whose sampling raises gets its argmax and `(row, exception)` is appended
    there instead of failing the whole batch; each row is sampled once, so a seeded row draws the same
    numbers whether or not another row fails.
    """
    logits = logits.float()
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for i, (p, gen) in enumerate(zip(params, generators, strict=True)):
        try:
            out[i] = sample_row(logits[i], p, gen)
        except Exception as exc:
            if errors is None:
                raise
            errors.append((i, exc))
            out[i] = logits[i].argmax()
    return out
