#!/usr/bin/env python
"""Expert hit rate when the cache for step t is decided from steps < t only ("one step behind").

    moetide bench --model src/moetide/demo_model --record-trace /tmp/trace48.safetensors \
        --num-prompts 48 --output-len 32 --max-input-len 128 --device cpu
    python scripts/simulate_step_behind.py --trace /tmp/trace48.safetensors --warm-requests 16 \
        --out results/policies/step_behind_2026-12-03/trace48                  # ~6 min on 2 CPU cores

With 300 training-split conversations replayed first (never counted; ~15 min to record):

    python -c "from moetide.analysis.workload import *; m, t, a = load_hf_model('src/moetide/demo_model'); \
        record_conversations(m, t, a, training_conversations(300, seed=0), prompt_tokens=128, \
        max_new_tokens=32, request_id_start=2_000_000).save('/tmp/trace_train300.safetensors')"
    python scripts/simulate_step_behind.py --trace /tmp/trace48.safetensors --warm-requests 16 \
        --extra-warm-trace /tmp/trace_train300.safetensors \
        --out results/policies/step_behind_2026-12-03/trace48_train300_warm    # ~15 min

The trace is replayed in order (the first `--warm-requests` requests update every predictor's state
but are not counted, as in the engine's trace replay). A use is one distinct (step, layer, expert)
routed by the step; it is a hit when the expert is resident when its layer runs.

Step-behind predictors (`pure`): before step t a score (L, J) is computed from steps < t only, the
cache is set to its top `capacity` keys (scope global: one pool; layer: capacity / L per layer; ties
by recency: the later use first) and stays fixed for the whole step (misses are read in place, not
cached). Families: lru, frequency / EMA of gate probabilities, FineMoE-style successor search (the
stored iteration most like step t-1, its following iteration's map is the prediction), per-layer and
cross-layer transition counts, blends, a logistic combiner fitted on past steps, and two ceilings:
the best single stored successor chosen with hindsight, and a fixed cache knowing step t exactly.

`plan`: step-behind information only, but after layer l runs its slots are refilled with the
predictor's best keys for layers >= l + d (in-step copies assumed to land, no in-step information).

`hybrid`: the cache decided between steps by a step-behind predictor, plus FineMoE's in-step
prefetches (semantic search with step t's embedding for layers 0..d-1, trajectory search on step t's
layers 0..l for layer l + d), which evict finished layers' keys first, then the lowest-scored ones;
`hybrid` with no between-step predictor (keep the cache, LRU order) is the in-step rule alone.

References through the repository's own simulator (`moetide.analysis.simulator`): FineMoE and lru
in-step (the baseline), FineMoE's sync-free form (`lookahead` = `decision_lag` = 1 and 2). Writes
OUT/results.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moetide.analysis.simulator import simulate
from moetide.analysis.trace import Trace
from moetide.policies.baselines import LRUSpeculativePolicy, OnDemandPolicy
from moetide.policies.expert_map import delta_from_score, select_by_cumulative_probability
from moetide.policies.finemoe import FineMoEPolicy, expected_distinct

_EPS = 1e-12


# -- data -------------------------------------------------------------------------------------------
class Data:
    """The trace as arrays: P (S, L, J) mean gate probs, U (S, L, J) used, rid, prefill, emb, counted."""

    def __init__(self, trace: Trace, warm_requests: int, extra: Trace | None = None):
        import torch

        warm = set(trace.requests()[:warm_requests])
        self.start = len(extra) if extra is not None else 0  # first step of the replayed trace
        if extra is not None:
            trace = Trace.concat([extra, trace])
        m = trace.meta
        self.L, self.J, self.k = m.num_layers, m.num_experts, m.top_k
        self.S = len(trace)
        self.P = trace.gate_probs.double().numpy()
        self.emb = trace.embeddings.double().numpy()
        self.rid = trace.request_ids.numpy()
        self.prefill = trace.step_kinds.numpy() == 0
        self.ntok = (trace.token_offsets[1:] - trace.token_offsets[:-1]).numpy()
        self.U = np.zeros((self.S, self.L, self.J), dtype=bool)
        for s in range(self.S):
            a, b = int(trace.token_offsets[s]), int(trace.token_offsets[s + 1])
            ids = trace.topk_ids[a:b].numpy()  # (T, L, k)
            for layer in range(self.L):
                self.U[s, layer, np.unique(ids[:, layer])] = True
        self.counted = np.array([r not in warm for r in self.rid.tolist()])
        self.counted[: self.start] = False
        self.steps = np.nonzero(self.counted)[0]  # the counted steps
        self.rows = np.arange(max(self.start, 2), self.S)  # steps whose predictions are computed
        # recency: the last time (s * L + l) a key was used before step t, -1 if never
        self.rec = np.full((self.S, self.L, self.J), -1, dtype=np.int64)
        last = np.full((self.L, self.J), -1, dtype=np.int64)
        t_layer = np.arange(self.L)[:, None]
        for s in range(self.S):
            self.rec[s] = last
            last = np.where(self.U[s], s * self.L + t_layer, last)
        # same-request successor exists: s and s + 1 belong to one request
        self.has_next = np.zeros(self.S, dtype=bool)
        self.has_next[:-1] = self.rid[1:] == self.rid[:-1]
        del torch


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), _EPS)


# -- selection and scoring --------------------------------------------------------------------------
def select(score: np.ndarray, rec: np.ndarray, capacity: int, scope: str) -> np.ndarray:
    """(L, J) bool: the top `capacity` keys by score, ties by recency (later first)."""
    L, J = score.shape
    out = np.zeros((L, J), dtype=bool)
    if scope == "global":
        order = np.lexsort((rec.reshape(-1), score.reshape(-1)))
        out.reshape(-1)[order[-capacity:]] = True
    else:
        per = capacity // L
        for layer in range(L):
            order = np.lexsort((rec[layer], score[layer]))
            out[layer, order[-per:]] = True
    return out


def rates(D: Data, hits: int, uses: int, decode_hits: int, decode_uses: int, loads: int) -> dict:
    """A run's hit rates (all, decode steps, prefill steps), its uses and its loads per counted step."""
    return {
        "hit_rate": hits / uses,
        "decode_hit_rate": decode_hits / decode_uses,
        "prefill_hit_rate": (hits - decode_hits) / max(uses - decode_uses, 1),
        "uses": uses,
        "loads_per_step": loads / int(D.counted.sum()),
    }


def evaluate(D: Data, scores: np.ndarray, capacity: int, scope: str) -> dict:
    """Hit rates of a pure step-behind predictor; `scores[t]` may use steps < t only."""
    hits = dem = dh = dd = 0
    swaps, prev = 0, None
    for t in D.steps:
        sel = select(scores[t], D.rec[t], capacity, scope)
        if prev is not None:
            swaps += int((sel & ~prev).sum())
        prev = sel
        h, n = int((sel & D.U[t]).sum()), int(D.U[t].sum())
        hits, dem = hits + h, dem + n
        if not D.prefill[t]:
            dh, dd = dh + h, dd + n
    return rates(D, hits, dem, dh, dd, swaps)


# -- predictors (each returns (S, L, J) scores, row t from steps < t) ------------------------------
def shifted(x: np.ndarray) -> np.ndarray:
    """Row t = x[t - 1] (row 0 zeros)."""
    out = np.zeros_like(x, dtype=np.float64)
    out[1:] = x[:-1]
    return out


def ema(x: np.ndarray, lam: float, reset: np.ndarray | None = None) -> np.ndarray:
    """Row t = EMA of x[< t] with decay lam (reset[t]: start over at step t, e.g. a new request)."""
    out = np.zeros_like(x, dtype=np.float64)
    acc = np.zeros(x.shape[1:])
    for t in range(1, x.shape[0]):
        acc = lam * acc + (1 - lam) * x[t - 1]
        if reset is not None and reset[t]:
            acc = acc * 0
        out[t] = acc
    return out


def window(x: np.ndarray, k: int) -> np.ndarray:
    """Row t = mean of x[t - k .. t - 1]."""
    c = np.concatenate([np.zeros((1,) + x.shape[1:]), np.cumsum(x, 0, dtype=np.float64)])
    t = np.arange(x.shape[0])
    lo = np.maximum(t - k, 0)
    return (c[t] - c[lo]) / np.maximum(t - lo, 1)[:, None, None]


def successor_search(
    D: Data, w_sem: float = 0.0, K: int = 1, mu: float = 0.0, oracle_capacity=None, scope="global"
):
    """FineMoE-style search one step behind: match step t-1 (its map, EMA'd over its request's past
    steps with decay mu, blended with its embedding by w_sem) against stored steps s <= t-2 that have
    a same-request successor; the prediction is the mean of the top-K matches' successor maps.
    With oracle_capacity: the single successor whose selection hits step t most (hindsight ceiling)."""
    S, L, J = D.P.shape
    flat = D.P.reshape(S, L * J)
    if mu > 0:
        start = np.ones(S, dtype=bool)
        start[1:] = D.rid[1:] != D.rid[:-1]
        q = np.zeros_like(flat)
        acc = np.zeros(L * J)
        for s in range(S):
            acc = flat[s] if start[s] else mu * acc + (1 - mu) * flat[s]
            q[s] = acc
    else:
        q = flat
    uq, ue = unit(q).astype(np.float32), unit(D.emb).astype(np.float32)
    out = np.zeros((S, L, J))
    if oracle_capacity is not None:
        sel = np.stack([select(D.P[s], D.rec[s], oracle_capacity, scope) for s in range(S)])
        gain = sel.reshape(S, -1).astype(np.float32) @ D.U[D.steps].reshape(len(D.steps), -1).T.astype(
            np.float32
        )
        col = {int(t): i for i, t in enumerate(D.steps)}
    for t in D.rows:
        cand = np.nonzero(D.has_next[: t - 1])[0]
        if cand.size == 0:
            continue
        if oracle_capacity is not None:
            if int(t) not in col:
                continue
            best = cand[np.argmax(gain[cand + 1, col[int(t)]])]
            out[t] = D.P[best + 1]
            continue
        sc = (1 - w_sem) * (uq[cand] @ uq[t - 1]) + w_sem * (ue[cand] @ ue[t - 1])
        top = cand[np.argsort(-sc, kind="stable")[:K]]
        out[t] = D.P[top + 1].mean(0)
    return out


def token_search(D: Data, K: int) -> np.ndarray:
    """NOT step-behind: the mean map of the K stored steps (< t) whose embedding is most like step t's
    own (its input token, known once step t-1 has sampled it; FineMoE's semantic search)."""
    ue = unit(D.emb).astype(np.float32)
    out = np.zeros_like(D.P)
    for t in D.rows:
        sc = ue[:t] @ ue[t]
        top = np.argsort(-sc, kind="stable")[:K]
        out[t] = D.P[top].mean(0)
    return out


def transitions(D: Data, cross_layer: bool, weight: str = "used", alpha: float = 0.1):
    """Empirical transition counts over past same-request step pairs (online): score_t = sum over keys
    active at t-1 (used, or weighted by gate prob) of P(key' used at t | key used at t-1)."""
    S, L, J = D.P.shape
    n = L * J
    out = np.zeros((S, L, J))
    if cross_layer:
        C, N = np.zeros((n, n)), np.zeros(n)
    else:
        C, N = np.zeros((L, J, J)), np.zeros((L, J))
    for t in range(1, S):
        if t >= 2 and D.has_next[t - 2]:  # learn the pair (t-2, t-1)
            a, b = D.U[t - 2].astype(np.float64), D.U[t - 1].astype(np.float64)
            if cross_layer:
                C += np.outer(a.reshape(-1), b.reshape(-1))
                N += a.reshape(-1)
            else:
                C += a[:, :, None] * b[:, None, :]
                N += a
        if t < D.rows[0]:
            continue
        x = D.U[t - 1].astype(np.float64) if weight == "used" else D.P[t - 1]
        if cross_layer:
            cond = (C + alpha * D.k / J) / (N[:, None] + alpha)
            out[t] = (x.reshape(-1) @ cond).reshape(L, J) / max(x.sum(), _EPS)
        else:
            cond = (C + alpha * D.k / J) / (N[:, :, None] + alpha)
            out[t] = np.einsum("lj,ljm->lm", x, cond) / np.maximum(x.sum(-1, keepdims=True), _EPS)
    return out


def norm_rows(x: np.ndarray) -> np.ndarray:
    """Scale each step's (L, J) scores to sum k per layer (so families blend on one scale)."""
    return x / np.maximum(x.sum(-1, keepdims=True), _EPS)


def logistic(D: Data, feats: dict[str, np.ndarray], refit_every: int = 64, l2: float = 1e-3):
    """A logistic combiner of per-key features (plus per-layer biases and a prefill flag), refitted
    every `refit_every` counted steps on the replayed trace's steps < t (labels: used at that step)."""
    import torch

    names = sorted(feats)
    S, L, J = D.P.shape
    rows = D.rows
    X = np.stack([feats[n][rows] for n in names], -1)  # (R, L, J, F)
    R = len(rows)
    X = np.concatenate([X, np.broadcast_to(np.eye(L)[None, :, None, :], (R, L, J, L))], -1)
    X = np.concatenate(
        [X, np.broadcast_to(D.prefill[rows, None, None, None], (R, L, J, 1)).astype(np.float64)], -1
    )
    F = X.shape[-1]
    Xt = torch.from_numpy(X.reshape(R, L * J, F)).float()
    Y = torch.from_numpy(D.U[rows].reshape(R, L * J)).float()
    out = np.zeros((S, L, J))
    w = None
    for i, t in enumerate(rows):
        if D.counted[t] and (w is None or (t - D.steps[0]) % refit_every == 0):
            w = torch.zeros(F, requires_grad=True)
            xs, ys = Xt[:i].reshape(-1, F), Y[:i].reshape(-1)
            opt = torch.optim.LBFGS([w], max_iter=100, line_search_fn="strong_wolfe")

            def closure(opt=opt, xs=xs, ys=ys, w=w):
                opt.zero_grad()
                loss = torch.nn.functional.binary_cross_entropy_with_logits(xs @ w, ys) + l2 * (w * w).sum()
                loss.backward()
                return loss

            opt.step(closure)
        if w is not None:
            out[t] = (Xt[i] @ w.detach()).numpy().reshape(L, J)
    return out, names


def mlp(D: Data, ema09: np.ndarray, refit_every: int = 128, hidden: int = 512, seed: int = 0):
    """A small MLP from step t-1 (its map, its used set, its embedding) and the EMA of maps to the
    keys step t uses (sigmoid outputs, BCE), trained on every step < t (the extra warm trace too):
    30 epochs before the first counted step, 3 more at each refit."""
    import torch

    torch.manual_seed(seed)
    S, L, J = D.P.shape
    X = np.concatenate(
        [shifted(D.P).reshape(S, -1), shifted(D.U).reshape(S, -1), ema09.reshape(S, -1), shifted(D.emb)], 1
    )
    X = torch.from_numpy(X).float()
    Y = torch.from_numpy(D.U.reshape(S, -1)).float()
    net = torch.nn.Sequential(
        torch.nn.Linear(X.shape[1], hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, L * J),
    )
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2)
    out = np.zeros((S, L, J))

    def train(n: int, epochs: int) -> None:
        idx = torch.arange(1, n)
        for _ in range(epochs):
            perm = idx[torch.randperm(len(idx))]
            for b in range(0, len(perm), 256):
                sel = perm[b : b + 256]
                loss = torch.nn.functional.binary_cross_entropy_with_logits(net(X[sel]), Y[sel])
                opt.zero_grad()
                loss.backward()
                opt.step()

    first = True
    for t in D.steps:
        if first or (t - D.steps[0]) % refit_every == 0:
            net.train()
            train(int(t), 30 if first else 3)
            net.eval()
            first = False
        with torch.no_grad():
            out[t] = net(X[t : t + 1]).numpy().reshape(L, J)
    return out


# -- in-step variants -------------------------------------------------------------------------------
def in_step(
    D: Data,
    base: np.ndarray | None,
    capacity: int,
    scope: str,
    d: int,
    source: str,
    budget: int | None = None,
) -> dict:
    """Cache set from `base[t]` before each step (None: keep the previous step's cache), then in-step
    prefetches after each layer l for layer l + d (and for layers 0..d-1 before layer 0):
    source "finemoe": FineMoE's searches on step t's own embedding / layers 0..l (store: every step
    < t); source "plan": `base[t]` itself (step-behind information, in-step copies; at most `budget`
    refills after each layer, None = every slot of the finished layers).
    Victims: keys of finished layers first, then the lowest priority (base score, or LRU order);
    never a key protected by an in-step prediction whose layer has not run, nor the running layer's."""
    S, L, J = D.P.shape
    per = capacity // L
    flat = D.P.reshape(S, L * J).astype(np.float32)
    unit_e = unit(D.emb).astype(np.float32)
    prefix_norm = np.sqrt(np.cumsum((D.P**2).sum(-1), 1)).astype(np.float32)  # (S, L)
    resident = np.zeros((L, J), dtype=bool)
    last_use = np.full((L, J), -1.0)
    hits = dem = dh = dd = 0
    loads = 0
    for t in range(D.start, S):
        if base is not None:
            prio = base[t] + 1e-9 * (D.rec[t] + 1) / (S * L)
            new = select(base[t], D.rec[t], capacity, scope)
            loads += int((new & ~resident).sum()) if D.counted[t] else 0
            resident = new
        else:
            prio = last_use.copy()
        protected = np.zeros((L, J), dtype=bool)

        def insert(layer: int, experts, running: int, resident=resident, protected=protected, prio=prio, t=t):
            nonlocal loads
            for e in experts:
                if resident[layer, e]:
                    protected[layer, e] = True
                    continue
                if scope == "layer":
                    full = resident[layer].sum() >= per
                else:
                    full = resident.sum() >= capacity
                if full:
                    cand = resident & ~protected
                    if scope == "layer":
                        keep = np.zeros_like(cand)
                        keep[layer] = cand[layer]
                        cand = keep
                    if not cand.any():
                        continue
                    finished = np.zeros_like(cand)
                    finished[: running + 1] = True
                    key = np.where(cand, prio - 1e6 * finished, np.inf)
                    v = np.unravel_index(int(np.argmin(key)), key.shape)
                    resident[v] = False
                resident[layer, e] = True
                protected[layer, e] = True
                if base is None:
                    prio[layer, e] = t * L + running + 0.5  # a prefetch counts as a use (the simulator's LRU)
                if D.counted[t]:
                    loads += 1

        if source == "finemoe" and t > 0:
            row = int(np.argmax(unit_e[:t] @ unit_e[t]))
            score = float(unit_e[row] @ unit_e[t])
            for layer in range(min(d, L)):
                p = D.P[row, layer]
                floor = max(expected_distinct(_t(p), int(D.ntok[t]), D.k), D.k)
                insert(
                    layer,
                    select_by_cumulative_probability(p.astype(np.float32), delta_from_score(score), floor),
                    -1,
                )
        for layer in range(L):
            used = D.U[t, layer]
            h, n = int((resident[layer] & used).sum()), int(used.sum())
            if D.counted[t]:
                hits, dem = hits + h, dem + n
                if not D.prefill[t]:
                    dh, dd = dh + h, dd + n
            last_use[layer, used] = t * L + layer
            if base is None:
                prio[layer, used] = t * L + layer
            protected[layer] = False
            target = layer + d
            if target >= L:
                continue
            if source == "finemoe" and t > 0:
                q = flat[t, : (layer + 1) * J]
                dots = flat[:t, : (layer + 1) * J] @ q
                sc = dots / np.maximum(prefix_norm[:t, layer] * np.linalg.norm(q), _EPS)
                row = int(np.argmax(sc))
                floor = D.k if D.ntok[t] == 1 else n
                p = D.P[row, target].astype(np.float32)
                insert(
                    target,
                    select_by_cumulative_probability(p, delta_from_score(float(sc[row])), floor),
                    layer,
                )
            elif source == "plan":
                # refill the slots of finished layers with base's best keys of layers >= l + d
                free = int(resident[: layer + 1].sum()) if scope == "global" else 0
                free = free if budget is None else min(free, budget)
                if free == 0:
                    continue
                sc = np.where(resident, -np.inf, prio)
                sc[:target] = -np.inf
                order = np.argsort(-sc.reshape(-1), kind="stable")[:free]
                for key in order:
                    if not np.isfinite(sc.reshape(-1)[key]):
                        break
                    insert(int(key) // J, [int(key) % J], layer)
    return rates(D, hits, dem, dh, dd, loads)


def _t(p: np.ndarray):
    import torch

    return torch.from_numpy(np.asarray(p, dtype=np.float32))


# -- the repository simulator's references ------------------------------------------------------------
def reference_runs(
    trace: Trace, warm_requests: int, capacity: int, scope: str, distances, extra: Trace | None = None
) -> list[dict]:
    """Through `moetide.analysis.simulator`: (a) the split of simulate_hit_rate.py (store warmed on the
    warm requests, cold cache on the rest) and (b) the whole trace replayed, counted after warm-up
    (only (a) with an extra warm trace, which goes first into the warm-up)."""
    reqs = trace.requests()
    warm, test = trace.select_requests(reqs[:warm_requests]), trace.select_requests(reqs[warm_requests:])
    modes = ("split", "replay")
    if extra is not None:
        warm, modes = Trace.concat([extra, warm]), ("split",)
    n_warm = len(warm)
    rows = []

    def one(name, make, d, lag=0, warm_store=True):
        for mode in modes:
            policy = make()
            mark = {}

            def on_step(s, sim, mark=mark):
                if s == n_warm - 1:
                    r = sim.result
                    mark.update(h=r.hits, n=r.demands, dh=r.decode_hits, dn=r.decode_demands)

            if mode == "split":
                if warm_store and hasattr(policy, "warm_up"):
                    policy.warm_up(warm)
                r = simulate(test, policy, capacity, scope=scope, prefetch_distance=d, decision_lag=lag)
                h, n, dh, dn = r.hits, r.demands, r.decode_hits, r.decode_demands
            else:
                r = simulate(
                    trace,
                    policy,
                    capacity,
                    scope=scope,
                    prefetch_distance=d,
                    decision_lag=lag,
                    on_step=on_step,
                )
                h, n = r.hits - mark["h"], r.demands - mark["n"]
                dh, dn = r.decode_hits - mark["dh"], r.decode_demands - mark["dn"]
            rows.append(
                {
                    "name": name,
                    "d": d,
                    "mode": mode,
                    "hit_rate": h / n,
                    "decode_hit_rate": dh / dn,
                    "prefill_hit_rate": (h - dh) / max(n - dn, 1),
                }
            )
            print(f"[ref] {name} d={d} {mode}: {h / n:.4f} (decode {dh / dn:.4f})", flush=True)

    for d in distances:
        one("sim finemoe in-step", lambda d=d: FineMoEPolicy(prefetch_distance=d, synchronous=True), d)
        one("sim lru in-step (speculative gate)", lambda d=d: LRUSpeculativePolicy(d), d)
    one("sim on-demand (no prefetch)", OnDemandPolicy, 1)
    one("sim on-demand, misses cached next step", OnDemandPolicy, 1, lag=1)
    for n in (1, 2):
        one(
            f"sim finemoe sync-free (lookahead={n}, decision_lag={n})",
            lambda n=n: FineMoEPolicy(prefetch_distance=1, synchronous=True, lookahead=n),
            1,
            lag=n,
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--warm-requests", type=int, default=16)
    ap.add_argument("--cache-fraction", type=float, default=0.25)
    ap.add_argument("--distances", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument(
        "--extra-warm-trace",
        help="a trace replayed before --trace, never counted (e.g. training-split requests)",
    )
    ap.add_argument("--no-mlp", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    trace = Trace.load(args.trace)
    extra = Trace.load(args.extra_warm_trace) if args.extra_warm_trace else None
    D = Data(trace, args.warm_requests, extra)
    C = round(args.cache_fraction * D.L * D.J)
    print(f"{trace}; extra warm {extra}; counted steps {int(D.counted.sum())}, capacity {C}", flush=True)
    rows: list[dict] = []

    def rec(name, family, scores, scopes=("global", "layer"), **extra):
        for scope in scopes:
            r = evaluate(D, scores, C, scope)
            r.update(name=name, family=family, scope=scope, kind="pure", **extra)
            rows.append(r)
            print(
                f"  {family:10s} {name:48s} {scope:6s} {r['hit_rate']:.4f} decode {r['decode_hit_rate']:.4f}",
                flush=True,
            )

    P, U = D.P, D.U.astype(np.float64)
    new_req = np.zeros(D.S, dtype=bool)
    new_req[1:] = D.rid[1:] != D.rid[:-1]
    # ceilings
    oracle = U + 1e-3 * P  # knows step t (not step-behind): a fixed cache's best
    rec("oracle fixed cache (knows step t)", "ceiling", oracle)
    # a. lru
    rec("lru (recency of use)", "lru", D.rec.astype(np.float64))
    # b. frequency / recency of gate probabilities and of uses
    for k in (1, 2, 4, 8, 16, 32, 64, 256):
        rec(f"mean gate prob, last {k} steps", "freq", window(P, k))
        rec(f"use count, last {k} steps", "freq", window(U, k))
    emas = {}
    for lam in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99):
        emas[lam] = ema(P, lam)
        rec(f"EMA gate prob, decay {lam}", "freq", emas[lam])
        rec(f"EMA use, decay {lam}", "freq", ema(U, lam))
        rec(f"EMA gate prob within request, decay {lam}", "freq", ema(P, lam, reset=new_req))
    # c. FineMoE-style successor search
    succ = {}
    for w_sem in (0.0, 1 / D.L, 0.5, 1.0):
        for K in (1, 4, 16, 64, 256):
            for mu in (0.0, 0.5):
                if w_sem == 1.0 and mu > 0:
                    continue
                s = successor_search(D, w_sem=w_sem, K=K, mu=mu)
                succ[(w_sem, K, mu)] = s
                rec(f"successor search w_sem={w_sem:.3f} K={K} mu={mu}", "search", s)
    for scope in ("global", "layer"):
        s = successor_search(D, oracle_capacity=C, scope=scope)
        rec("successor search, hindsight best single match", "ceiling", s, scopes=(scope,))
    tok = {}
    for K in (1, 4, 16, 64):
        tok[K] = token_search(D, K)
        rec(f"token-embedding search K={K} (uses step t's input token: NOT step-behind)", "token", tok[K])
    # transition counts
    trans = {}
    for cross in (False, True):
        for weight in ("used", "prob"):
            trans[(cross, weight)] = transitions(D, cross, weight)
            rec(f"transition counts cross_layer={cross} weight={weight}", "markov", trans[(cross, weight)])
    # d. blends (each family scaled to sum 1 per layer)
    best_succ = max(
        succ,
        key=lambda key: next(
            r["hit_rate"]
            for r in rows
            if r["name"] == f"successor search w_sem={key[0]:.3f} K={key[1]} mu={key[2]}"
            and r["scope"] == "global"
        ),
    )
    S_ = norm_rows(succ[best_succ])
    fams = {
        "ema0.5": norm_rows(emas[0.5]),
        "ema0.9": norm_rows(emas[0.9]),
        "prev": norm_rows(shifted(U)),
        "markov": norm_rows(trans[(True, "used")]),
    }
    for a in (0.25, 0.5, 0.75):
        for fname, F in fams.items():
            rec(f"blend {a} x best search {best_succ} + {1 - a} x {fname}", "blend", a * S_ + (1 - a) * F)
    rec(
        "blend search + markov + ema0.9 + prev (equal)",
        "blend",
        (S_ + fams["markov"] + fams["ema0.9"] + fams["prev"]) / 4,
    )
    feats = {
        "a_prev_prob": shifted(P),
        "prev_used": shifted(U),
        "ema0.5": emas[0.5],
        "ema0.9": emas[0.9],
        "ema0.98": emas[0.98],
        "ema_use0.9": ema(U, 0.9),
        "succ_K1": succ[(1 / D.L, 1, 0.0)],
        "succ_K16": succ[(1 / D.L, 16, 0.0)],
        "succ_best": succ[best_succ],
        "markov_layer": trans[(False, "used")],
        "markov_cross": trans[(True, "used")],
        "recency": np.where(
            D.rec >= 0, np.exp(-(np.arange(D.S)[:, None, None] * D.L - D.rec) / (4 * D.L)), 0.0
        ),
    }
    logit, names = logistic(D, feats)
    rec(
        "logistic combiner of all features (refit every 64 steps on steps < t)",
        "learned",
        logit,
        features=names,
    )
    learned = {"logistic": logit, "best search": succ[best_succ]}
    if not args.no_mlp:
        learned["mlp"] = mlp(D, emas[0.9])
        rec(
            "MLP on step t-1 (map, used set, embedding) + EMA map, trained on steps < t",
            "learned",
            learned["mlp"],
        )
    best_base = max(learned, key=lambda n: evaluate(D, learned[n], C, "global")["hit_rate"])
    # the next token as well (known once step t-1 has sampled it, before step t runs)
    mixed = None
    for a in (0.25, 0.5, 0.75):
        blend = a * norm_rows(tok[16]) + (1 - a) * norm_rows(
            1 / (1 + np.exp(-learned[best_base])) if best_base != "best search" else learned[best_base]
        )
        rec(
            f"blend {a} x token search K=16 + {1 - a} x {best_base} (NOT step-behind: next token)",
            "token",
            blend,
        )
        if a == 0.5:
            mixed = blend
    pure_best = {
        scope: max(
            (r for r in rows if r["scope"] == scope and r["family"] not in ("ceiling", "token")),
            key=lambda r: r["hit_rate"],
        )
        for scope in ("global", "layer")
    }
    # plan / hybrid, global scope (the engine's pool), and per layer
    bases = {**learned, "lru": D.rec.astype(np.float64)}
    for d in args.distances:
        for scope in ("global", "layer"):
            for bname, bscores in bases.items():
                r = in_step(D, bscores, C, scope, d, "finemoe")
                r.update(
                    name=f"hybrid: {bname} between steps + FineMoE in-step",
                    family="hybrid",
                    scope=scope,
                    kind="hybrid",
                    d=d,
                )
                rows.append(r)
                print(
                    f"  hybrid {bname} d={d} {scope}: {r['hit_rate']:.4f} decode {r['decode_hit_rate']:.4f}",
                    flush=True,
                )
            r = in_step(D, None, C, scope, d, "finemoe")
            r.update(
                name="in-step FineMoE alone (cache kept, LRU victims)",
                family="hybrid",
                scope=scope,
                kind="in-step",
                d=d,
            )
            rows.append(r)
            print(
                f"  in-step alone d={d} {scope}: {r['hit_rate']:.4f} decode {r['decode_hit_rate']:.4f}",
                flush=True,
            )
        for budget in (1, 2, 4, None):
            r = in_step(D, learned[best_base], C, "global", d, "plan", budget=budget)
            r.update(
                name=f"plan: {best_base} between steps, after layer l up to {budget or 'all'} finished-layer slots refilled for layers >= l+d (no in-step info)",
                family="plan",
                scope="global",
                kind="plan",
                d=d,
                budget=budget,
            )
            rows.append(r)
            print(
                f"  plan {best_base} budget {budget} d={d}: {r['hit_rate']:.4f} decode {r['decode_hit_rate']:.4f} loads/step {r['loads_per_step']:.1f}",
                flush=True,
            )
        r = in_step(D, mixed, C, "global", d, "plan", budget=2)
        r.update(
            name=f"plan: 0.5 token search + 0.5 {best_base}, budget 2 (NOT step-behind: next token)",
            family="token",
            scope="global",
            kind="plan",
            d=d,
            budget=2,
        )
        rows.append(r)
        print(
            f"  plan token-blend budget 2 d={d}: {r['hit_rate']:.4f} decode {r['decode_hit_rate']:.4f} loads/step {r['loads_per_step']:.1f}",
            flush=True,
        )
    ref = (
        []
        if args.skip_reference
        else reference_runs(trace, args.warm_requests, C, "global", args.distances, extra)
    )
    result = {
        "trace": args.trace,
        "trace_repr": repr(trace),
        "extra_warm_trace": args.extra_warm_trace,
        "extra_warm_repr": repr(extra) if extra is not None else None,
        "best_learned_base": best_base,
        "warm_requests": args.warm_requests,
        "counted_steps": int(D.counted.sum()),
        "capacity_experts": C,
        "rows": rows,
        "reference": ref,
        "best_pure": pure_best,
        "best_search_key": {"w_sem": best_succ[0], "K": best_succ[1], "mu": best_succ[2]},
        "seconds": time.time() - t0,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / 'results.json'} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
