"""Eviction rules behind one interface, and the per-expert statistics they read.

A rule scores each candidate; the lowest score goes first, and among equal scores the least
recently used. The residency core and the trace simulator (`analysis/simulator.py`) both rank
their candidates with `eviction_order`, so a new rule is one class in `RULES`:

    lru        every candidate scores 0: least recently used first
    prob-freq  FineMoE's rule: probability x visits (the latest probability estimate of the expert,
               from a prediction's priority or its router's mean gate probability, times the times it
               ran); ties by LRU

`ExpertStats` holds what the rules and FineMoE's protection read, one entry per (layer, expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

UNPROTECTED = -(1 << 62)  # `ExpertStats.protected` of an expert no prediction spares (below any iteration)


class EvictionRule:
    """Scores eviction candidates: lower goes first (ties: least recently used first)."""

    name = "lru"
    recency_only = True  # every candidate scores the same: the LRU order alone decides

    def scores(self, prob: np.ndarray, visits: np.ndarray) -> np.ndarray:
        """`(n,)` float64 scores of `n` candidates from their probability estimates and visits."""
        return np.zeros(len(prob), dtype=np.float64)


class ProbFreq(EvictionRule):
    name = "prob-freq"
    recency_only = False

    def scores(self, prob: np.ndarray, visits: np.ndarray) -> np.ndarray:
        return np.asarray(prob, dtype=np.float64) * np.asarray(visits, dtype=np.float64)


RULES: dict[str, EvictionRule] = {rule.name: rule for rule in (EvictionRule(), ProbFreq())}
EVICTION_RULES = tuple(RULES)


def eviction_rule(name: str) -> EvictionRule:
    """The rule called `name` (ValueError naming the choices otherwise)."""
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"eviction must be one of {EVICTION_RULES}, got {name!r}") from None


def eviction_order(
    rule: EvictionRule, recency, prob, visits, first: np.ndarray | None = None
) -> np.ndarray:
    """Candidate indices `(n,)` in the order `rule` evicts them: those with `first` set before the
    rest (a precision policy's cold versions), then by score, then by `recency` (lower: used longer
    ago), then by index. All inputs `(n,)`."""
    recency = np.asarray(recency)
    score = rule.scores(np.asarray(prob), np.asarray(visits))
    keys = (recency, score) if first is None else (recency, score, ~np.asarray(first, dtype=bool))
    return np.lexsort(keys)  # (a stable sort: equal keys keep index order)


def first_victim(rule: EvictionRule, recency, prob, visits) -> int:
    """`eviction_order(rule, recency, prob, visits)[0]` in one pass (no sort): the candidate the rule
    evicts first. Inputs `(n,)`, n >= 1."""
    recency = np.asarray(recency)
    if not rule.recency_only:
        score = rule.scores(np.asarray(prob), np.asarray(visits))
        recency = np.where(score == score.min(), recency, np.iinfo(np.int64).max)
    return int(np.argmin(recency))


@dataclass
class ExpertStats:
    """`(L, E)` arrays: `prob` the latest probability estimate, `visits` the uses so far and
    `protected` the iteration each expert is spared for (`UNPROTECTED`: none)."""

    prob: np.ndarray
    visits: np.ndarray
    protected: np.ndarray

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int) -> ExpertStats:
        shape = (num_layers, num_experts)
        return cls(
            np.zeros(shape, dtype=np.float32),
            np.zeros(shape, dtype=np.int64),
            np.full(shape, UNPROTECTED, dtype=np.int64),
        )

    def protect(self, layer: int, experts, iteration: int) -> None:
        self.protected[layer, list(experts)] = iteration

    def unprotect(self, up_to: int, layers: slice | int = slice(None)) -> None:
        """End the protections of `layers` for iterations up to `up_to`."""
        view = self.protected[layers]
        view[view <= up_to] = UNPROTECTED

    def is_protected(self, layer: int, expert: int) -> bool:
        return self.protected[layer, expert] != UNPROTECTED


def cold_victims(pool: str, next_victim, cold_only: bool):
    """`next_victim` (a callable giving the next eviction candidate of `pool`, or None), stopped at
    the first version the precision policy wants in `pool` where `cold_only` (the candidates come
    cold first: after a warm one there is no cold one left)."""
    if not cold_only or next_victim is None:
        return next_victim

    def cold_victim():
        h = next_victim()
        return h if h is None or h.target != pool else None

    return cold_victim
