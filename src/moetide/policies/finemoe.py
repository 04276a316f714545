"""FineMoE: fine-grained expert prefetch from expert maps (semantic + trajectory search).

Per iteration (one forward step), in the paper's in-step form (`lookahead=0`):
    begin      semantic search with the step's embedding -> best map -> prefetch layers 0..d-1
    layer l    trajectory search with the observed P_0..P_l -> best map's P_{l+d} -> prefetch l+d
    end        the iteration's map (embedding, P_0..P_{L-1}) goes into the store (RDY dedup when full)
In the engine's sync-free steps (`lookahead=n`, n = 2) an iteration is observed after it ran: at its
end the whole map is matched against stored iterations whose map n steps later is known, and that
later map prefetches every layer of the step n on (`FineMoEConfig.lookahead`).
Each prefetch takes the matched distribution's experts in descending probability until their mass
exceeds delta = clip(1 - score, 0, 1), never fewer than top-k, and also *protects* them (eviction
spares them until their layer has run). A step of several tokens (a prefill) needs the union of its
tokens' experts, so its floor is the number of distinct experts it selected at its last observed layer
(before any layer: `expected_distinct` from the matched distribution) instead of top-k.

Asynchronous searcher (publisher/subscriber): the forward thread's methods only publish an event
(never block) and record how far the forward pass has got; the searcher consumes events, searches,
and calls the sink. A search whose target layer the forward pass has already reached is skipped
(`late_skipped`). Where the searcher runs (`FineMoEConfig.searcher`):
    "process"  its own process, fed through shared memory (`searcher_process.py`); the forward thread
               hands the decisions the searcher wrote back to the sink at its next publish
    "thread"   a thread of this process, fed through a `queue.SimpleQueue`; it calls the sink itself
    "inline"   the forward thread runs the handler (the simulator: simulated hit rates reflect this
               exact code); `synchronous=True` means the same
The engine needs "process" and the simulator "inline". "thread" stays because "process" cannot run
everywhere: its lock-free rings rely on x86-64's store ordering, so on a weakly ordered CPU (ARM,
`searcher_process.SUPPORTED`) the engine falls back to the thread. The thread costs the decode step
more than the process does (it shares the GIL with the forward thread), so it is never the default
where the process runs.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from .base import PolicyBase
from .expert_map import ExpertMapStore, delta_from_score, select_by_cumulative_probability
from .searcher_process import KIND_BEGIN, KIND_END, KIND_LAYER, POLICY_COUNTERS, SUPPORTED, SearcherProcess

_STOP = ("stop",)
SEARCHERS = ("process", "thread", "inline")


def expected_distinct(probs: torch.Tensor, num_tokens: int, top_k: int) -> int:
    """Distinct experts a step of `num_tokens` tokens is expected to select at one layer, if each
    token picks expert e with probability min(1, top_k * p_e): sum_e 1 - (1 - f_e)^T.
    Equals top_k for one token (unless the distribution is peaked enough to clamp)."""
    if num_tokens <= 1:
        return top_k
    f = (probs.float() * top_k).clamp(max=1.0)
    return round(float((1.0 - (1.0 - f) ** num_tokens).sum()))


@dataclass(frozen=True)
class FineMoEConfig:
    """Knobs of `FineMoEPolicy`; ablation switches included.

    prefetch_distance: d, in layers (paper: Mixtral 3, Qwen1.5-MoE 6, Phi-3.5-MoE 4; profile it).
    map_store_capacity: expert maps kept (paper: 1000, < 200 MB).
    use_semantic / use_trajectory: the two searches ("Map(T)" = trajectory only, "Map(T+S)" = both).
        With trajectory off, the semantic match of the iteration also drives layers d..L-1.
    adaptive_delta: cumulative-probability selection (off = exactly the floor, top-k for one token).
    online_updates: insert each finished iteration's map into the store.
    protect_predictions: tell the sink to spare predicted experts from eviction.
    searcher: "process" (own process, shared memory; x86-64, else a thread), "thread" or "inline" (see
        the module docstring).
    synchronous: run the searcher inline (simulation, tests), whatever `searcher` says.
    max_queue: events beyond this backlog are dropped (the forward pass never waits).
    preferred_eviction: eviction rule the simulator uses for this policy ("prob-freq": FineMoE's).
    lookahead: 0 = predict within the running step (semantic search for layers 0..d-1, trajectory
        search at each layer for layer l+d: the paper's mechanism, for callers that let a step wait
        on its layers). n > 0 = the engine's sync-free steps, where a step's observations reach the
        policy after it ran and a decision reaches the device table n steps after the observed one:
        when a step ends, its whole map (and embedding) is matched against the stored iterations
        whose map n steps later is known (RDY's blend of semantic and trajectory scores), and that
        later map drives the prefetch of every layer for the step n on.
    """

    prefetch_distance: int = 2
    map_store_capacity: int = 1000
    use_semantic: bool = True
    use_trajectory: bool = True
    adaptive_delta: bool = True
    online_updates: bool = True
    protect_predictions: bool = True
    searcher: str = "process"
    synchronous: bool = False
    max_queue: int = 10_000
    preferred_eviction: str = "prob-freq"
    lookahead: int = 0

    def __post_init__(self) -> None:
        if self.prefetch_distance < 1:
            raise ValueError(f"prefetch_distance must be >= 1 layer, got {self.prefetch_distance}")
        if self.map_store_capacity < 1:
            raise ValueError(f"map_store_capacity must be >= 1, got {self.map_store_capacity}")
        if not (self.use_semantic or self.use_trajectory):
            raise ValueError("enable at least one of use_semantic / use_trajectory")
        if self.searcher not in SEARCHERS:
            raise ValueError(f"searcher must be one of {', '.join(SEARCHERS)}, got {self.searcher!r}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0 steps, got {self.lookahead}")


class FineMoEPolicy(PolicyBase):
    """FineMoE prefetch policy behind the `ExpertPolicy` interface.

    `store` may be given (e.g. loaded with `ExpertMapStore.load`); otherwise one is created at the
    first `warm_up` or the first observed embedding.
    """

    name = "finemoe"

    def __init__(self, config: FineMoEConfig | None = None, store: ExpertMapStore | None = None, **overrides):
        config = config or FineMoEConfig()
        self.config = replace(config, **overrides) if overrides else config
        self.prefetch_distance = self.config.prefetch_distance
        self.preferred_eviction = self.config.preferred_eviction
        self.store = store
        # forward-thread state (written only by the forward thread)
        self._progress: tuple[int, int] = (-1, -1)
        self._num_tokens_published = 1
        # searcher state (touched only by the handler)
        self._it = -1
        self._embedding: torch.Tensor | None = None
        self._prefix_np = np.zeros((0, 0), dtype=np.float32)  # (L, J): this iteration's observed P_0..
        self._prefix_len = 0
        self._semantic_match: tuple[float, int] | None = None
        self._num_tokens = 1
        self._distinct = np.zeros(0, dtype=np.int64)  # (L,) distinct experts per layer this iteration
        self._inserted: dict[int, int] = {}  # iteration -> store row (the last lookahead + 1 of them)
        # counters
        self.semantic_searches = 0
        self.trajectory_searches = 0
        self.prefetch_requests = 0
        self.prefetched_experts = 0
        self.late_skipped = 0
        self.dropped_events = 0
        self.search_time_s = 0.0
        self.errors: list[str] = []
        self._submitted = 0
        self._processed = 0
        self._idle = threading.Condition()
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._process: SearcherProcess | None = None
        self._asynchronous = not self.synchronous  # searches can be late (the handler checks)

    @property
    def synchronous(self) -> bool:
        """True when the searcher runs inline (what the simulator needs)."""
        return self.config.synchronous or self.config.searcher == "inline"

    @property
    def _in_process(self) -> bool:
        """A searcher process (x86-64 only: elsewhere "process" runs the searcher as a thread)."""
        return not self.synchronous and self.config.searcher == "process" and SUPPORTED

    # -- set-up -------------------------------------------------------------------------------------
    def attach(self, sink, num_layers, num_experts, top_k) -> None:
        super().attach(sink, num_layers, num_experts, top_k)
        self._prefix_np = np.zeros((num_layers, num_experts), dtype=np.float32)
        self._prefix_len = 0
        self._distinct = np.zeros(num_layers, dtype=np.int64)
        if self.config.prefetch_distance > num_layers:
            raise ValueError(
                f"prefetch_distance {self.config.prefetch_distance} exceeds {num_layers} MoE layers"
            )
        if self.store is not None and (self.store.num_layers, self.store.num_experts) != (
            num_layers,
            num_experts,
        ):
            raise ValueError("the expert map store was built for a different model geometry")
        if self._in_process:
            if self.store is not None:
                self._start_process(self.store.hidden_size)
        elif not self.synchronous and self._thread is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._searcher_loop, name="finemoe-searcher", daemon=True)
            self._thread.start()

    def prepare(self, hidden_size: int) -> None:
        """Start the searcher process now (it takes a second or two to import torch; events published
        before it is up are dropped once the ring is full)."""
        if self._in_process:
            self._start_process(hidden_size)

    def _start_process(self, hidden_size: int) -> None:
        """Start the searcher process (once the embedding size is known: a store, or the first step)."""
        if self._process is None and self.sink is not None:
            geometry = (self.num_layers, self.num_experts, self.top_k, hidden_size)
            self._process = SearcherProcess(self.config, geometry, self.store)

    def pause_searches(self, paused: bool) -> None:
        """With the searcher in its own process: `paused`, the child drops every event unread (no
        search, no insert, no decision) while the hooks publish as always, so a benchmark can pair
        FineMoE with its publishing alone on one engine."""
        if self._process is None:
            raise ValueError("pause_searches needs a running searcher process (searcher='process')")
        self._process.drain()  # the events published before the switch are handled as they were
        self._process.paused = paused

    def _sync_store_from_process(self) -> None:
        """Bring the searcher process's store (with its online inserts) back into `self.store`."""
        if self._process is not None and self._process.alive:
            self._process.drain()
            store = self._process.fetch_store()
            if store is not None:
                self.store = store

    def _ensure_store(self, num_layers: int, num_experts: int, hidden_size: int) -> ExpertMapStore:
        if self.store is None:
            self.store = ExpertMapStore(
                self.config.map_store_capacity,
                num_layers,
                num_experts,
                hidden_size,
                self.config.prefetch_distance,
            )
        return self.store

    def warm_up(self, trace) -> int:
        """Fill the store from a recorded `Trace` (every step's map, in order). Returns inserts."""
        m = trace.meta
        self._sync_store_from_process()
        store = self._ensure_store(m.num_layers, m.num_experts, m.hidden_size)
        inserted = store.add_trace(trace, lookahead=self.config.lookahead)
        self._store_changed()
        return inserted

    def _store_changed(self) -> None:
        """`self.store` was replaced or added to on this side: the searcher process gets it."""
        if not self._in_process or self.store is None:
            return
        if self._process is None:
            self._start_process(self.store.hidden_size)  # starts with the store
        else:
            self._process.send_store(self.store)

    def save_store(self, path) -> None:
        self._sync_store_from_process()
        if self.store is None:
            raise ValueError("the expert map store is empty")
        self.store.save(path)

    def load_store(self, path) -> None:
        self.store = ExpertMapStore.load(
            path, capacity=self.config.map_store_capacity, prefetch_distance=self.config.prefetch_distance
        )
        self._store_changed()

    # -- forward thread: publish only -----------------------------------------------------------------
    def _submit(self, event: tuple) -> None:
        if self.synchronous:
            self._handle(event)
            return
        if self._queue is None:
            return  # not attached
        if self._submitted - self._processed >= self.config.max_queue:
            self.dropped_events += 1
            return
        self._submitted += 1
        self._queue.put(event)

    def begin_iteration(self, iteration, embedding, num_tokens, request_ids=()) -> None:
        self._progress = (iteration, -1)
        self._num_tokens_published = num_tokens
        if self._in_process:
            self._start_process(int(embedding.shape[-1]))  # a no-op once started
            process = self._process
            if process is None:
                return  # not attached
            process.apply_decisions(self.sink)
            process.publish(KIND_BEGIN, iteration, -1, num_tokens, embedding.numpy())
            return
        self._submit(("begin", iteration, embedding, num_tokens))

    def observe_layer(self, iteration, layer, gate_probs, topk_ids) -> None:
        self._progress = (iteration, layer)
        if self._process is not None:
            process = self._process
            process.apply_decisions(self.sink)
            distinct = self.top_k if self._num_tokens_published == 1 else len(np.unique(topk_ids.numpy()))
            process.publish(KIND_LAYER, iteration, layer, distinct, gate_probs.numpy())
            return
        self._submit(("layer", iteration, layer, gate_probs, topk_ids))

    def observe_step(self, iteration, gate_probs, topk_ids) -> None:
        """A whole step that has run (the engine's step-late publication): with the searcher process,
        its L layer events in one write (`SearcherProcess.publish_layers`), the distinct experts of
        every layer counted at once; otherwise `observe_layer` per layer."""
        if self._process is None:
            super().observe_step(iteration, gate_probs, topk_ids)
            return
        L = len(gate_probs)
        self._progress = (iteration, L - 1)
        self._process.apply_decisions(self.sink)
        if self._num_tokens_published == 1:
            distinct = np.full(L, self.top_k, dtype=np.int64)
        else:
            ids = topk_ids.numpy().reshape(L, -1)
            seen = np.zeros((L, self.num_experts), dtype=bool)
            seen[np.arange(L)[:, None], ids] = True
            distinct = seen.sum(axis=1)
        self._process.publish_layers(iteration, distinct, gate_probs.numpy())

    def poll(self) -> None:
        """Hand the searcher process's latest decisions to the sink (the layer feed calls this while
        it waits for the next layer, so that a prediction reaches the residency before its layer)."""
        if self._process is not None:
            self._process.apply_decisions(self.sink)

    def end_iteration(self, iteration) -> None:
        if self._process is not None:
            self._process.apply_decisions(self.sink)
            self._process.publish(KIND_END, iteration, -1, 0)
            return
        self._submit(("end", iteration))

    # -- searcher -----------------------------------------------------------------------------------
    def _searcher_loop(self) -> None:
        assert self._queue is not None
        while True:
            event = self._queue.get()
            if event is _STOP:
                return
            try:
                self._handle(event)
            except Exception as e:  # noqa: BLE001 - a failed search must never take the engine down
                self.errors.append(f"{type(e).__name__}: {e}")
            finally:
                with self._idle:
                    self._processed += 1
                    self._idle.notify_all()

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until the searcher has handled every event published so far (tests, shutdown only).
        With a searcher process, its decisions so far are handed to the sink too, and its errors
        copied into `errors`."""
        if self.synchronous:
            return True
        if self._process is not None:
            done = self._process.drain(timeout_s)
            self._process.apply_decisions(self.sink)
            self.errors = self._process.errors()  # says so if the process has exited
            return done
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._processed < self._submitted:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _forward_position(self) -> tuple[int, int]:
        """(iteration, layer) the forward pass has published last (a searcher process reads it from
        shared memory)."""
        return self._progress

    def _is_late(self, iteration: int, target_layer: int) -> bool:
        if not self._asynchronous:
            return False
        it, layer = self._forward_position()
        return it > iteration or (it == iteration and layer >= target_layer)

    def _handle(self, event: tuple) -> None:
        kind = event[0]
        if kind == "begin":
            _, it, embedding, num_tokens = event
            self._it, self._embedding, self._semantic_match = it, embedding, None
            self._prefix_len = 0
            self._num_tokens = num_tokens
            store = self._ensure_store(self.num_layers, self.num_experts, embedding.shape[-1])
            if self.config.lookahead or not self.config.use_semantic or len(store) == 0:
                return
            t0 = time.perf_counter()
            match = store.semantic_search(embedding)
            self.search_time_s += time.perf_counter() - t0
            self.semantic_searches += 1
            if match is None:
                return
            self._semantic_match = match
            score, row = match
            for layer in range(min(self.config.prefetch_distance, self.num_layers)):
                if self._is_late(it, layer):
                    self.late_skipped += 1
                    continue
                stored = store.map_layer_np(row, layer)
                floor = expected_distinct(torch.from_numpy(stored), num_tokens, self.top_k)
                self._issue(it, layer, stored, score, floor)
        elif kind == "layer":
            _, it, layer, probs, topk_ids = event  # topk_ids: (T, k) ids, or their distinct count
            if it != self._it or layer != self._prefix_len:
                return  # the begin event or an earlier layer was dropped: skip this iteration
            if isinstance(probs, torch.Tensor):
                probs = probs.detach().float().reshape(-1).numpy()
            self._prefix_np[layer] = probs
            self._prefix_len += 1
            if self._num_tokens == 1:
                self._distinct[layer] = self.top_k
            else:
                self._distinct[layer] = topk_ids if isinstance(topk_ids, int) else int(torch.unique(topk_ids).numel())
            if self.config.lookahead:
                return  # the whole map is matched when the step ends
            target = layer + self.config.prefetch_distance
            if target >= self.num_layers or self.store is None or len(self.store) == 0:
                return
            if self._is_late(it, target):
                self.late_skipped += 1
                return
            if self.config.use_trajectory:
                t0 = time.perf_counter()
                match = self.store.trajectory_search_np(self._prefix_np[: self._prefix_len])
                self.search_time_s += time.perf_counter() - t0
                self.trajectory_searches += 1
            else:
                match = self._semantic_match
            if match is None:
                return
            score, row = match
            # a step needs as many experts per layer as it just used (top-k for one token)
            if self._num_tokens == 1:
                floor = self.top_k
            else:
                floor = topk_ids if isinstance(topk_ids, int) else int(torch.unique(topk_ids).numel())
            self._issue(it, target, self.store.map_layer_np(row, target), score, floor)
        elif kind == "end":
            _, it = event
            complete = it == self._it and self._prefix_len == self.num_layers and self._embedding is not None
            if not complete or self.store is None:
                return
            if self.config.lookahead:
                self._predict_ahead(it)
            if self.config.online_updates:
                full = torch.from_numpy(self._prefix_np.copy())
                row = self.store.add(self._embedding, full)
                self._link_ahead(it, row, full)

    def _link_ahead(self, iteration: int, row: int, full: torch.Tensor) -> None:
        """The map just stored is the later map of the iteration `lookahead` steps back (same stream:
        consecutive iterations), unless that row has been replaced since."""
        n = self.config.lookahead
        if not n:
            return
        back = self._inserted.get(iteration - n)
        if back is not None and back != row and back not in (self._inserted.get(iteration - j) for j in range(1, n)):
            self.store.set_ahead(back, full)
        self._inserted[iteration] = row
        for old in [i for i in self._inserted if i <= iteration - n]:
            del self._inserted[old]

    def _predict_ahead(self, iteration: int) -> None:
        """At the end of a step: the stored iteration most like it (whole map and embedding) whose map
        `lookahead` steps later is known -> that map prefetches every layer of the step `lookahead` on."""
        t0 = time.perf_counter()
        embedding = self._embedding
        embedding = embedding.numpy() if isinstance(embedding, torch.Tensor) else np.asarray(embedding)
        match = self.store.lookahead_search_np(embedding, self._prefix_np)
        self.search_time_s += time.perf_counter() - t0
        self.trajectory_searches += 1
        if match is None:
            return
        score, row = match
        ahead = self.store.ahead_np(row)
        target = iteration + self.config.lookahead
        for layer in range(self.num_layers):
            self._issue(target, layer, ahead[layer], score, int(self._distinct[layer]))

    def _issue(self, iteration: int, layer: int, probs: np.ndarray, score: float, floor: int) -> None:
        """Prefetch (and protect) layer `layer`'s experts from a matched distribution `probs` (J,) numpy.

        `floor`: experts the step needs at least (top-k for a one-token step); the ablation without
        adaptive delta takes exactly that many.
        """
        floor = max(floor, self.top_k)
        if self.config.adaptive_delta:
            experts = select_by_cumulative_probability(probs, delta_from_score(score), floor)
        else:
            experts = np.argsort(-probs, kind="stable")[:floor].tolist()
        priorities = probs[experts].tolist()
        self.prefetch_requests += 1
        self.prefetched_experts += len(experts)
        # protected first (in the same request), so that the prefetch cannot evict its own experts
        protect = self.config.protect_predictions
        self.sink.prefetch(layer, experts, iteration=iteration, priorities=priorities, protect=protect)

    # -- shutdown / report --------------------------------------------------------------------------
    def close(self) -> None:
        if self._process is not None:
            try:
                self._sync_store_from_process()  # keep the online inserts (save_store after close)
            except (RuntimeError, TimeoutError, OSError, EOFError):
                pass
            self._process.close()
            self._process = None
        if self._thread is not None and self._queue is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout=5.0)
            self._thread = None

    def stats(self) -> dict:
        """Counters for reports; the same keys wherever the searcher runs (plus, for a process,
        whether it is alive and how many of its decisions found the ring full)."""
        extra: dict = {}
        if self._process is not None:
            c = self._process.counters()
            search_s, store_size, errors = c["search_ns"] / 1e9, c["store_size"], c["errors"]
            extra = {"searcher_alive": self._process.alive, "dropped_decisions": c["dropped_decisions"]}
            searcher, dropped = "process", self._process.dropped_events
        else:
            c = {name: getattr(self, name) for name in POLICY_COUNTERS}
            search_s, errors = self.search_time_s, len(self.errors)
            store_size = len(self.store) if self.store is not None else 0
            searcher, dropped = ("inline" if self.synchronous else "thread"), self.dropped_events
        searches = c["semantic_searches"] + c["trajectory_searches"]
        requests = c["prefetch_requests"]
        return {
            "searcher": searcher,
            **extra,
            "semantic_searches": c["semantic_searches"],
            "trajectory_searches": c["trajectory_searches"],
            "prefetch_requests": requests,
            "mean_prefetch_size": c["prefetched_experts"] / requests if requests else 0.0,
            "late_skipped": c["late_skipped"],
            "dropped_events": dropped,
            "search_s": search_s,
            "mean_search_us": 1e6 * search_s / searches if searches else 0.0,
            "store_size": store_size,
            "errors": errors,
        }
