"""FineMoE's Expert Map Store: past iterations' expert maps, searched by meaning and by trajectory.

An expert map of iteration i is `map_i = {P_1 .. P_L}`, `P_l in R^J` the gate's probability
distribution at layer l (here: the mean over the step's tokens, see `policies/base.py`). Each entry also
keeps the iteration's semantic embedding (pooled embedding-layer output, (H,)).

Searches are vectorised in torch over the whole store:

    semantic    score_sem(x, y)  = cos(sem_x, sem_y)                          (H,) vs (N, H)
    trajectory  score_traj(x, y) = cos(P_1..l of x, P_1..l of y), flattened    (l*J,) vs (N, l*J)

When the store is full, a new map replaces the most redundant one:
    RDY(x, y) = d/L * score_sem(x, y) + (L - d)/L * score_traj(x, y)   (full maps, l = L)
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import torch

_EPS = 1e-12


def select_by_cumulative_probability(probs: torch.Tensor | np.ndarray, delta: float, top_k: int) -> list[int]:
    """FineMoE's adaptive prefetch set for one layer.

    Experts in descending probability (ties: lower id first) until their cumulative probability
    exceeds `delta`, never fewer than `top_k`, never more than J. `probs`: (J,) non-negative.
    With delta = clip(1 - score, 0, 1): a confident match (score ~ 1) gives ~top_k experts, a poor one
    hedges with more.
    """
    # numpy, not torch: this runs on the searcher thread per layer and per step, and numpy's per-call
    # overhead on a (J,) vector is a fraction of torch's (less time holding the GIL, docs/policies.md)
    if isinstance(probs, np.ndarray):
        p = probs.astype(np.float32, copy=False).reshape(-1)
    else:
        p = probs.detach().float().reshape(-1).cpu().numpy()
    J = p.shape[0]
    order = np.argsort(-p, kind="stable")  # descending, ties: lower id first
    cumulative = np.cumsum(p[order])
    count = int(np.count_nonzero(cumulative <= delta)) + 1  # first prefix whose mass exceeds delta
    count = max(min(count, J), min(top_k, J))
    return order[:count].tolist()


def delta_from_score(score: float) -> float:
    """delta = clip(1 - score, 0, 1)."""
    return min(max(1.0 - float(score), 0.0), 1.0)


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)


class ExpertMapStore:
    """A bounded CPU store of (embedding (H,), map (L, J)) entries with cosine searches.

    Thread-safe (one lock); searches and inserts are O(N * L * J) matrix-vector products.
    """

    def __init__(
        self, capacity: int, num_layers: int, num_experts: int, hidden_size: int, prefetch_distance: int
    ):
        if capacity < 1 or num_layers < 1 or num_experts < 1 or hidden_size < 1:
            raise ValueError("capacity, num_layers, num_experts and hidden_size must be >= 1")
        if not 1 <= prefetch_distance <= num_layers:
            raise ValueError(f"prefetch_distance must be in 1..{num_layers}, got {prefetch_distance}")
        self.capacity = capacity
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.prefetch_distance = prefetch_distance
        L, J = num_layers, num_experts
        self._embeddings = torch.zeros(capacity, hidden_size)
        self._unit_embeddings = torch.zeros(capacity, hidden_size)
        self._maps = torch.zeros(capacity, L * J)  # flattened (L, J) rows: prefixes are column slices
        self._unit_maps = torch.zeros(capacity, L * J)
        self._prefix_norms = torch.zeros(capacity, L)  # ||P_1..l|| for l = 1..L
        # the map of a later iteration of the same stream, `lookahead` steps on (FineMoEConfig), for
        # predicting from a finished step the step the residency can still act on
        self._ahead = torch.zeros(capacity, L * J)
        self._has_ahead = torch.zeros(capacity, dtype=torch.bool)
        self._size = 0
        self._lock = threading.RLock()
        self.inserts = 0
        self.replacements = 0

    def __len__(self) -> int:
        return self._size

    # -- writes -------------------------------------------------------------------------------------
    def _check(self, embedding: torch.Tensor, gate_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = embedding.detach().float().reshape(-1).cpu()
        m = gate_probs.detach().float().cpu()
        if e.shape[0] != self.hidden_size or m.shape != (self.num_layers, self.num_experts):
            raise ValueError(
                f"expected embedding ({self.hidden_size},) and map ({self.num_layers}, {self.num_experts}), "
                f"got {tuple(e.shape)} and {tuple(m.shape)}"
            )
        return e, m

    def redundancy(self, embedding: torch.Tensor, gate_probs: torch.Tensor) -> torch.Tensor:
        """RDY of a new entry against every stored one: (N,) float32."""
        e, m = self._check(embedding, gate_probs)
        d, L = self.prefetch_distance, self.num_layers
        with self._lock:  # numpy: the searcher thread runs this after every step once the store is full
            n = self._size
            sem = self._unit_embeddings.numpy()[:n] @ _normalize(e).numpy()
            traj = self._unit_maps.numpy()[:n] @ _normalize(m.reshape(-1)).numpy()
        return torch.from_numpy(d / L * sem + (L - d) / L * traj)

    def add(self, embedding: torch.Tensor, gate_probs: torch.Tensor) -> int:
        """Insert one map; when full, replace the most redundant entry (max RDY). Returns its row."""
        e, m = self._check(embedding, gate_probs)
        with self._lock:
            if self._size < self.capacity:
                row = self._size
                self._size += 1
            else:
                row = int(torch.argmax(self.redundancy(e, m)))
                self.replacements += 1
            self._write(row, e, m)
            self.inserts += 1
            return row

    def set_ahead(self, row: int, gate_probs: torch.Tensor) -> None:
        """`gate_probs (L, J)`: the map that followed row `row`'s iteration, some steps later."""
        with self._lock:
            self._ahead[row] = gate_probs.detach().float().reshape(-1)
            self._has_ahead[row] = True

    def lookahead_search_np(self, embedding: np.ndarray, full_map: np.ndarray) -> tuple[float, int] | None:
        """The stored iteration most like a finished one, among those whose later map is known:
        `d/L * score_sem + (L - d)/L * score_traj` over the whole map (RDY's blend), as
        (score, row); None when no row has a later map. `embedding (H,)`, `full_map (L, J)`."""
        e = embedding.reshape(-1).astype(np.float32)
        q = full_map.reshape(-1).astype(np.float32)
        e, q = e / max(float(np.linalg.norm(e)), _EPS), q / max(float(np.linalg.norm(q)), _EPS)
        d, L = self.prefetch_distance, self.num_layers
        with self._lock:
            n = self._size
            has = self._has_ahead.numpy()[:n]
            if not has.any():
                return None
            scores = d / L * (self._unit_embeddings.numpy()[:n] @ e) + (L - d) / L * (
                self._unit_maps.numpy()[:n] @ q
            )
            scores = np.where(has, scores, -np.inf)
        row = int(np.argmax(scores))
        return float(scores[row]), row

    def ahead_np(self, row: int) -> np.ndarray:
        """The later map of row `row`: (L, J) float32 numpy (a copy)."""
        with self._lock:
            return self._ahead.numpy()[row].reshape(self.num_layers, self.num_experts).copy()

    def _write(self, row: int, e: torch.Tensor, m: torch.Tensor) -> None:
        self._has_ahead[row] = False  # a replaced row's later map belonged to the old entry
        flat = m.reshape(-1)
        self._embeddings[row] = e
        self._unit_embeddings[row] = _normalize(e)
        self._maps[row] = flat
        self._unit_maps[row] = _normalize(flat)
        self._prefix_norms[row] = torch.cumsum(m.square().sum(-1), 0).sqrt()

    def add_trace(self, trace, lookahead: int = 0) -> int:
        """Insert every step of a `Trace` in order (warm-up); with `lookahead`, each step's map is also
        the later map of the step `lookahead` earlier in the same request. Returns the inserts."""
        rows: list[int] = []
        rids = trace.request_ids.tolist()
        for s in range(len(trace)):
            rows.append(self.add(trace.embeddings[s], trace.gate_probs[s]))
            back = s - lookahead
            if lookahead and back >= 0 and rids[back] == rids[s] and rows[back] not in rows[back + 1 :]:
                self.set_ahead(rows[back], trace.gate_probs[s])
        return len(trace)

    # -- searches -----------------------------------------------------------------------------------
    def _semantic_scores_np(self, embedding: torch.Tensor) -> np.ndarray:
        q = embedding.detach().float().reshape(-1).cpu().numpy()
        q = q / max(float(np.linalg.norm(q)), _EPS)
        with self._lock:
            return self._unit_embeddings.numpy()[: self._size] @ q

    def trajectory_scores(self, prefix: torch.Tensor) -> torch.Tensor:
        """cos(observed P_1..l, stored P_1..l): (N,). `prefix`: (l, J), 1 <= l <= L."""
        p = prefix.detach().float().cpu()
        l = p.shape[0]
        if not 1 <= l <= self.num_layers or p.shape[1] != self.num_experts:
            raise ValueError(f"prefix must be (l, {self.num_experts}) with 1 <= l <= {self.num_layers}")
        return torch.from_numpy(self._trajectory_scores_np(p.numpy()))

    def _trajectory_scores_np(self, prefix: np.ndarray) -> np.ndarray:
        """numpy body of `trajectory_scores` (a strided matrix-vector product over the stored prefixes);
        `prefix` (l, J) float32."""
        q = prefix.reshape(-1)
        l = prefix.shape[0]
        with self._lock:
            n = self._size
            dots = self._maps.numpy()[:n, : l * self.num_experts] @ q
            norms = self._prefix_norms.numpy()[:n, l - 1] * float(np.linalg.norm(q))
            return dots / np.maximum(norms, _EPS)

    def semantic_search(self, embedding: torch.Tensor) -> tuple[float, int] | None:
        """(best cosine score, row) or None when the store is empty."""
        with self._lock:
            if self._size == 0:
                return None
            scores = self._semantic_scores_np(embedding)
        row = int(np.argmax(scores))
        return float(scores[row]), row

    def trajectory_search(self, prefix: torch.Tensor) -> tuple[float, int] | None:
        """(best cosine score, row) or None when the store is empty."""
        with self._lock:
            if self._size == 0:
                return None
            scores = self.trajectory_scores(prefix).numpy()
        row = int(np.argmax(scores))
        return float(scores[row]), row

    def trajectory_search_np(self, prefix: np.ndarray) -> tuple[float, int] | None:
        """`trajectory_search` for the searcher's hot path: `prefix` (l, J) float32 numpy, no checks
        beyond the shapes numpy enforces."""
        with self._lock:
            if self._size == 0:
                return None
            scores = self._trajectory_scores_np(prefix)
        row = int(np.argmax(scores))
        return float(scores[row]), row

    def map_layer_np(self, row: int, layer: int) -> np.ndarray:
        """Stored map of `row` at `layer`: (J,) float32 numpy (a copy)."""
        J = self.num_experts
        with self._lock:
            if not 0 <= row < self._size:
                raise IndexError(f"row {row} out of range (size {self._size})")
            return self._maps.numpy()[row, layer * J : (layer + 1) * J].copy()

    def map(self, row: int) -> torch.Tensor:
        """Stored map of `row`: (L, J) float32 (a copy)."""
        with self._lock:
            if not 0 <= row < self._size:
                raise IndexError(f"row {row} out of range (size {self._size})")
            return self._maps[row].view(self.num_layers, self.num_experts).clone()

    def embedding(self, row: int) -> torch.Tensor:
        with self._lock:
            return self._embeddings[row].clone()

    # -- plain arrays (a searcher process gets and gives back its store this way) ------------------------
    def state(self) -> dict:
        """The store as picklable plain values: geometry, `embeddings (N, H)`, `maps (N, L*J)` (numpy
        copies, rows in order) and the insert counters."""
        with self._lock:
            n = self._size
            return {
                "geometry": (
                    self.capacity,
                    self.num_layers,
                    self.num_experts,
                    self.hidden_size,
                    self.prefetch_distance,
                ),
                "embeddings": self._embeddings[:n].numpy().copy(),
                "maps": self._maps[:n].numpy().copy(),
                "ahead": self._ahead[:n].numpy().copy(),
                "has_ahead": self._has_ahead[:n].numpy().copy(),
                "inserts": self.inserts,
                "replacements": self.replacements,
            }

    @classmethod
    def from_state(cls, state: dict) -> ExpertMapStore:
        """The store `state()` described (same rows in the same order)."""
        capacity, L, J, H, d = state["geometry"]
        store = cls(capacity, L, J, H, d)
        maps = torch.from_numpy(state["maps"]).view(-1, L, J)
        ahead, has = state.get("ahead"), state.get("has_ahead")
        store._fill(torch.from_numpy(state["embeddings"]), maps,
                    None if ahead is None else torch.from_numpy(ahead), None if has is None else torch.from_numpy(has))  # fmt: skip
        store.inserts, store.replacements = state["inserts"], state["replacements"]
        return store

    def _fill(self, embeddings, maps, ahead=None, has_ahead=None) -> None:
        """Insert saved rows in order: `embeddings (n, H)`, `maps (n, L, J)`, and each row's later map
        `ahead (n, L*J)` where `has_ahead (n,)` bool says it is known (a row replaced while filling a
        smaller store loses it with its entry)."""
        known = [] if has_ahead is None else has_ahead.nonzero().flatten().tolist()
        rows = [self.add(e, m) for e, m in zip(embeddings, maps, strict=True)]
        for i in known:
            if rows[i] not in rows[i + 1 :]:
                self.set_ahead(rows[i], ahead[i])

    # -- files --------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the whole store (safetensors; geometry in the header's metadata): embeddings, maps and
        the later maps of the rows that have one."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            n = self._size
            tensors = {
                "embeddings": self._embeddings[:n].contiguous(),
                "maps": self._maps[:n].view(n, self.num_layers, self.num_experts).contiguous(),
                "ahead": self._ahead[:n].contiguous(),
                "has_ahead": self._has_ahead[:n].contiguous(),
            }
            meta = {
                "capacity": self.capacity,
                "num_layers": self.num_layers,
                "num_experts": self.num_experts,
                "hidden_size": self.hidden_size,
                "prefetch_distance": self.prefetch_distance,
            }
        save_file(tensors, str(path), metadata={"moetide_expert_map_store": json.dumps(meta)})
        return path

    @classmethod
    def load(
        cls, path: str | Path, *, capacity: int | None = None, prefetch_distance: int | None = None
    ) -> ExpertMapStore:
        """Read a store written by `save`; `capacity` / `prefetch_distance` override the saved ones."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            if "moetide_expert_map_store" not in header:
                raise ValueError(f"{path} is not an expert map store")
            meta = json.loads(header["moetide_expert_map_store"])
            embeddings, maps = f.get_tensor("embeddings"), f.get_tensor("maps")
            names = set(f.keys())
            ahead = f.get_tensor("ahead") if "ahead" in names else None
            has_ahead = f.get_tensor("has_ahead") if "has_ahead" in names else None
        store = cls(
            capacity if capacity is not None else meta["capacity"],
            meta["num_layers"],
            meta["num_experts"],
            meta["hidden_size"],
            prefetch_distance if prefetch_distance is not None else meta["prefetch_distance"],
        )
        store._fill(embeddings, maps, ahead, has_ahead)
        return store
