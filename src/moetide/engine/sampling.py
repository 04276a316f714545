"""Sampling parameters (vLLM's names) and the sampler.

Shapes: logits (B, V) float32 for the B sequences decoded this step.

The sampler is one batched call on the logits' device: temperature, top-k and top-p as tensors of
one value per row, then one token per row. Each row's randomness comes from its key `(seed,
draw)`: a counter-based hash of (seed, draw, token id) gives a uniform number per token, and the
token drawn is `argmax(p / q)` with `q = -log(u) ~ Exp(1)` (what `torch.multinomial` does for one
sample), so a row's token depends on its own logits, parameters and key only: not on the batch,
the device's random state or the other rows. The engine keys a sequence's draws by its seed and
the position of the token drawn; a request without a seed gets one from torch's generator.

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


_M32 = 0xFFFFFFFF
_TINY = torch.finfo(torch.float32).tiny


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, draws: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counter-based uniforms: `seeds (B,)`, `draws (B,)` int64 -> `(B, vocab)` float32 in (0, 1),
    a function of (seed, draw, token id) alone, the same on every device."""
    row = _mix32(_mix32(_mix32((seeds >> 32) & _M32) ^ (seeds & _M32)) ^ (draws & _M32))
    tokens = _mix32(torch.arange(vocab, device=seeds.device, dtype=torch.int64))
    bits = _mix32((row[:, None] + tokens[None, :] * 0x9E3779B9) & _M32)
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


def _row_values(params: list[SamplingParams], vocab: int) -> tuple[list[float], list[int], list[float]]:
    """Per row: temperature (at least float32's smallest normal), top-k (`vocab`: off), top-p (2.0:
    off), from the parameters on the host (a row whose parameters do not compare raises here)."""
    temps, ks, ps = [], [], []
    for p in params:
        temps.append(max(p.temperature, _TINY))
        ks.append(p.top_k if 0 < p.top_k < vocab else vocab)
        ps.append(p.top_p if p.top_p < 1.0 else 2.0)
    return temps, ks, ps


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: `logits (B, V)` float32 -> `(B, V)` float32, each
    row's temperature applied and the tokens outside its top-k and its top-p nucleus at 0.

    The most likely token is never masked, whatever `top_k` / `top_p` are."""
    return _probs(logits, *_row_values(params, logits.shape[-1]))


def _probs(logits: torch.Tensor, temps: list[float], ks: list[int], ps: list[float]) -> torch.Tensor:
    """`filtered_probs` from the rows' values as `_row_values` gives them."""
    vocab = logits.shape[-1]
    dev = logits.device
    temp = torch.tensor(temps, dtype=torch.float32).to(dev, non_blocking=True)
    # shifted so the maximum is 0: dividing by a tiny temperature gives -inf at worst, never inf or NaN
    rows = (logits - logits.max(dim=-1, keepdim=True).values) / temp[:, None]
    if any(k < vocab for k in ks):
        k = torch.tensor(ks, dtype=torch.int64).to(dev, non_blocking=True)
        kth = torch.sort(rows, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        rows = rows.masked_fill(rows < kth, float("-inf"))
    if any(p <= 1.0 for p in ps):
        top_p = torch.tensor(ps, dtype=torch.float32).to(dev, non_blocking=True)
        sorted_rows, order = torch.sort(rows, dim=-1, descending=True)
        probs = torch.softmax(sorted_rows, dim=-1)
        # keep the smallest prefix whose mass reaches top_p; the mass before a token is computed in
        # float32, where a top_p below ~1e-45 is 0, so the first token is kept explicitly
        drop = probs.cumsum(dim=-1) - probs >= top_p[:, None]
        drop[:, 0] = False
        rows = rows.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return torch.softmax(rows, dim=-1)


def sample_next_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    keys: list[tuple[int, int]],
    errors: list[tuple[int, Exception]] | None = None,
) -> torch.Tensor:
    """One token per row: `logits (B, V)` -> `(B,)` int64 on the logits' device, in one batched call
    (no host sync): greedy rows take their argmax, the others draw from `filtered_probs` with the
    noise of their key `(seed, draw)` (int64 seed, and a draw number the row never reuses).

    With `errors` given, a row whose parameters cannot be read gets its argmax and `(row,
    exception)` is appended there instead of failing the whole batch; the other rows draw the same
    tokens as without it.
    """
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    rows: list[int] = []
    values: list[tuple[list[float], list[int], list[float]]] = []
    for i, p in enumerate(params):
        if p.greedy:
            continue
        try:
            values.append(_row_values([p], logits.shape[-1]))
        except Exception as exc:
            if errors is None:
                raise
            errors.append((i, exc))
            continue
        rows.append(i)
    if not rows:
        return greedy
    dev = logits.device
    index = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
    seeds = torch.tensor([keys[i][0] for i in rows], dtype=torch.int64).to(dev, non_blocking=True)
    draws = torch.tensor([keys[i][1] for i in rows], dtype=torch.int64).to(dev, non_blocking=True)
    temps, ks, ps = ([v[j][0] for v in values] for j in range(3))
    probs = _probs(logits.index_select(0, index), temps, ks, ps)
    q = -torch.log(uniform_noise(seeds, draws, logits.shape[-1]))  # Exp(1), never 0
    return greedy.index_copy(0, index, (probs / q).argmax(dim=-1))
