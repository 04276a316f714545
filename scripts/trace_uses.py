"""Log every routed use of a CPU trace replay, with what the residency held for it, so that two
engines (this one and an older checkout, through PYTHONPATH) can be compared use by use:

    python scripts/trace_uses.py --trace TRACE --policy finemoe --prefetch-distance 1 --out uses.npz

Per use (trace step, layer, expert): whether it hit, and how (resident when the step began, copied
within the step, a copy in flight waited for; for a miss: never fetched, evicted between steps or
within the step, parked, in flight, landed but not in the table). Per prefetch request (from any
thread): the iteration and layer it was for and when it arrived, against when that layer read its
experts. It wraps methods of this process only (the engine is unchanged) and works on the sync-free
engine (a device table) and on the in-step one before it (`acquire` per layer).
"""

from __future__ import annotations

import collections
import json
import threading
import time

import sys
from pathlib import Path

import numpy as np
import torch

from moetide.bench import replay
from moetide.compute import runtime as rt
from moetide.residency import core
from moetide.residency.metrics import ExpertMetrics

sys.path.insert(0, str(Path(__file__).parent))
from classify_misses import replay_parser, run_replay  # noqa: E402

MISS_KINDS = ("miss:never", "miss:evicted between", "miss:evicted in step", "miss:parked",
              "miss:in flight", "miss:stale")  # fmt: skip
ISSUE_OUTCOMES = ("started", "resident", "deferred: link", "deferred: no slot", "stale")
HIT_KINDS = ("hit:resident", "hit:copied in step", "hit:waited")
KINDS = HIT_KINDS + MISS_KINDS


class Log:
    """What the wrappers record (lists of tuples; the forward thread and the feed's thread append)."""

    def __init__(self):
        self.uses = []  # (step, iteration, layer, expert, kind index, t)
        self.requests = []  # (iteration, layer, expert, t, rank in request)
        self.copies = []  # (iteration, layer, expert, t, priority)
        self.issues = []  # (iteration of the request, layer, expert, t, outcome index: ISSUE_OUTCOMES)
        self.evictions = collections.defaultdict(list)  # (layer, expert) -> [(iteration, in_step, t)]
        self.reads = {}  # (iteration, layer) -> t of the layer's read
        self.step_of = {}  # iteration -> trace step
        self.cursor = -1
        self.reset_step = None  # trace step at the last metrics reset (the measured part starts)
        self.resident = {}  # iteration -> (L, E) bool: a hi version the step began with
        self.lock = threading.Lock()
        self.in_step_victims = []  # (iteration, layer, expert, routed, was parked, t)
        self.routed = None


def _hi_state(res, layer: int, expert: int) -> str:
    v = res.handles[layer][expert].versions.get("hi")
    if v is None:
        return "none"
    return "landed" if (v.published or v.ready.query()) else "flight"


def _resident_now(res) -> np.ndarray:
    L, E = len(res.handles), len(res.handles[0])
    out = np.zeros((L, E), dtype=bool)
    for layer in range(L):
        for e in range(E):
            out[layer, e] = _hi_state(res, layer, e) == "landed"
    return out


def _miss_kind(log: Log, res, it: int, layer: int, e: int) -> str:
    v = res.handles[layer][e].versions.get("hi")
    if v is None:
        ev = log.evictions.get((layer, e))
        if not ev:
            return "miss:never"
        return "miss:evicted in step" if ev[-1][1] else "miss:evicted between"
    if (layer, e) in getattr(res, "_parked", {}).get("hi", {}):
        return "miss:parked"
    return "miss:in flight" if not v.ready.query() else "miss:stale"


def _copied_in_step(log: Log, it: int, layer: int, e: int) -> bool:
    return log.resident.get(it) is not None and not log.resident[it][layer, e]


def install_common(log: Log) -> None:
    begin, prefetch, start_copy, reset = (replay.TraceReplay._begin_step, core.ResidencyManager.prefetch,
                                          core.ResidencyManager._start_copy, ExpertMetrics.reset)  # fmt: skip

    def begin_step(self, module, args):
        begin(self, module, args)
        log.cursor = self.cursor - 1

    def prefetch_(self, layer, experts, *, iteration, priorities=None, protect=False):
        t = time.perf_counter()
        with log.lock:
            log.requests.extend((iteration, layer, int(e), t, i) for i, e in enumerate(experts))
        return prefetch(self, layer, experts, iteration=iteration, priorities=priorities, protect=protect)

    def start_copy_(self, handle, pool, slot, priority):
        if pool == "hi":
            with log.lock:
                log.copies.append((self.iteration, handle.layer, handle.expert, time.perf_counter(),
                                   priority))  # fmt: skip
        return start_copy(self, handle, pool, slot, priority)

    def reset_(self):
        log.reset_step = log.cursor
        return reset(self)

    replay.TraceReplay._begin_step = begin_step
    core.ResidencyManager.prefetch = prefetch_
    core.ResidencyManager._start_copy = start_copy_
    ExpertMetrics.reset = reset_


def install_sync_free(log: Log) -> None:
    """The device-table engine: a use is read from the table as its layer runs."""
    run_layer, evict, take_in_step, begin = (rt.ExpertRuntime.run_layer, core.ResidencyManager._evict,
                                             core.ResidencyManager._take_slot_in_step,
                                             core.ResidencyManager.begin_step)  # fmt: skip

    def begin_step(self, iteration):
        begin(self, iteration)
        if self.table_mode:
            log.resident[iteration] = self._table_master[:, 0].copy() == self.pool_ids["hi"]

    def classify(self, layer, hidden, top_k_index, top_k_weights):
        res = self.residency
        if getattr(res, "table_mode", False) and res.step_table(layer) is not None:
            t, it = time.perf_counter(), res.iteration
            log.step_of[it] = log.cursor
            log.reads[(it, layer)] = t
            pool_of = res.step_table(layer)[0]
            for e in torch.unique(top_k_index[: self.real_tokens]).tolist():
                if int(pool_of[e]) == res.pool_ids["hi"]:
                    kind = "hit:copied in step" if _copied_in_step(log, it, layer, e) else "hit:resident"
                else:
                    kind = _miss_kind(log, res, it, layer, e)
                log.uses.append((log.cursor, it, layer, e, KINDS.index(kind), t))
        return run_layer(self, layer, hidden, top_k_index, top_k_weights)

    def evict_between(self, handle, pool):
        if pool == "hi":
            log.evictions[(handle.layer, handle.expert)].append((self.iteration, False, time.perf_counter()))
        return evict(self, handle, pool)

    def evict_in_step(self, pool, next_victim):
        before, parked = set(self._lru[pool]), set(self._parked[pool])
        slot = take_in_step(self, pool, next_victim)
        for key in before - set(self._lru[pool]):
            log.evictions[key].append((self.iteration, True, time.perf_counter()))
            log.in_step_victims.append((self.iteration, *key, log.routed, key in parked, time.perf_counter()))
        return slot

    in_step_ = core.ResidencyManager.in_step

    def in_step_wrapped(self, iteration, routed, used=None):
        log.routed = routed
        return in_step_(self, iteration, routed, used)

    core.ResidencyManager.in_step = in_step_wrapped

    issue, link_full = core.ResidencyManager._issue_prefetch, core.ResidencyManager._prefetch_link_full
    last = {"full": False}

    def link_full_(self):
        last["full"] = link_full(self)
        return last["full"]

    def issue_(self, iteration, layer, expert, victims_for=None, in_step=None):
        before, last["full"] = self.metrics.deferred, False
        had = "hi" in self.handles[layer][expert].versions
        started = issue(self, iteration, layer, expert, victims_for=victims_for, in_step=in_step)
        if started:
            outcome = "started"
        elif self.metrics.deferred > before:
            outcome = "deferred: link" if last["full"] else "deferred: no slot"
        else:
            outcome = "resident" if had else "stale"
        log.issues.append((iteration, layer, expert, time.perf_counter(), ISSUE_OUTCOMES.index(outcome)))
        return started

    core.ResidencyManager._issue_prefetch = issue_
    core.ResidencyManager._prefetch_link_full = link_full_
    rt.ExpertRuntime.run_layer = classify
    core.ResidencyManager._evict = evict_between
    core.ResidencyManager._take_slot_in_step = evict_in_step
    core.ResidencyManager.begin_step = begin_step


def install_in_step(log: Log) -> None:
    """The engine before sync-free steps: `acquire` resolves each expert on the host as its layer runs."""
    usable, evict, begin, acquire = (core.ResidencyManager._usable, core.ResidencyManager._evict,
                                     core.ResidencyManager.begin_iteration,
                                     core.ResidencyManager.acquire)  # fmt: skip
    state = {"first": False}

    def begin_iteration(self, iteration):
        begin(self, iteration)
        log.resident[iteration] = _resident_now(self)
        log.step_of[iteration] = log.cursor

    def acquire_(self, layer, experts, device):
        key = (self.iteration, layer)
        state["first"] = key not in log.reads
        if state["first"]:
            log.reads[key] = time.perf_counter()
        return acquire(self, layer, experts, device)

    def usable_(self, h, demand_pool, counters):
        if state["first"]:
            it, layer, e = self.iteration, h.layer, h.expert
            s = _hi_state(self, layer, e)
            if s == "landed":
                kind = "hit:copied in step" if _copied_in_step(log, it, layer, e) else "hit:resident"
            elif s == "flight":
                kind = "hit:waited"
            else:
                kind = _miss_kind(log, self, it, layer, e)
            log.uses.append((log.cursor, it, layer, e, KINDS.index(kind), time.perf_counter()))
        return usable(self, h, demand_pool, counters)

    def evict_(self, handle, pool):
        if pool == "hi":
            log.evictions[(handle.layer, handle.expert)].append((self.iteration, False, time.perf_counter()))
        return evict(self, handle, pool)

    core.ResidencyManager._usable = usable_
    core.ResidencyManager._evict = evict_
    core.ResidencyManager.begin_iteration = begin_iteration
    core.ResidencyManager.acquire = acquire_


def save(log: Log, path: str, row: dict) -> None:
    uses = np.array(log.uses, dtype=np.float64).reshape(-1, 6)
    reqs = np.array(log.requests, dtype=np.float64).reshape(-1, 5)
    copies = np.array(log.copies, dtype=np.float64).reshape(-1, 5)
    issues = np.array(log.issues, dtype=np.float64).reshape(-1, 5)
    victims = np.array(log.in_step_victims, dtype=np.float64).reshape(-1, 6)
    evictions = np.array([(l, e, it, ins, t) for (l, e), ev in log.evictions.items() for it, ins, t in ev],
                         dtype=np.float64).reshape(-1, 5)  # fmt: skip
    reads = np.array([(it, layer, t) for (it, layer), t in log.reads.items()], dtype=np.float64)
    reads = reads.reshape(-1, 3)
    step_of = np.array(sorted(log.step_of.items()), dtype=np.int64).reshape(-1, 2)
    np.savez_compressed(path, uses=uses, requests=reqs, copies=copies, issues=issues, victims=victims,
                        evictions=evictions, reads=reads, step_of=step_of,
                        reset_step=np.int64(-1 if log.reset_step is None else log.reset_step),
                        kinds=np.array(KINDS), row=json.dumps(row, default=str))  # fmt: skip


def _force_searcher(searcher: str) -> None:
    """Every FineMoE policy of this process runs its searcher `searcher` (an A/B of where it runs)."""
    from moetide.policies import finemoe

    init = finemoe.FineMoEPolicy.__init__

    def init_(self, config=None, store=None, **overrides):
        init(self, config, store, **overrides)
        self.config = finemoe.replace(self.config, searcher=searcher)
        self._asynchronous = not self.synchronous

    finemoe.FineMoEPolicy.__init__ = init_


def _wait_for_feed() -> None:
    """A zero-latency feed, as a bound: after publishing a layer's row, the forward thread waits until
    the feed's thread has published that layer to the policies and started its in-step prefetches."""
    from moetide.compute import observations
    from moetide.policies import in_step

    feeds, init, publish = [], in_step.LayerFeed.__init__, observations.StepObservations._publish

    def init_(self, *a, **k):
        init(self, *a, **k)
        feeds.append(self)

    def publish_(self, slot, layer):
        seen = feeds[-1].layers_seen if feeds else None
        publish(self, slot, layer)
        if seen is None or layer is None:
            return
        deadline = time.monotonic() + 0.05
        while feeds[-1].layers_seen == seen and time.monotonic() < deadline:
            time.sleep(0)

    in_step.LayerFeed.__init__ = init_
    observations.StepObservations._publish = publish_


def main() -> None:
    ap = replay_parser(__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the log (.npz)")
    ap.add_argument("--searcher", default=None, help="FineMoE's searcher for this run (e.g. inline)")
    ap.add_argument("--switch-s", type=float, default=None, help="the layer feed's thread switch interval")
    ap.add_argument("--wait-feed", action="store_true",
                    help="a bound, not the engine: each layer waits until the feed has handled it")
    ap.add_argument("--wait-for-copies", action="store_true")
    args = ap.parse_args()
    log = Log()
    if args.wait_feed:
        _wait_for_feed()
    if args.switch_s:
        from moetide.policies import in_step

        in_step.SWITCH_S = args.switch_s
    if args.searcher:
        _force_searcher(args.searcher)
    install_common(log)
    (install_sync_free if hasattr(core.ResidencyManager, "in_step") else install_in_step)(log)
    row = run_replay(args, wait_for_copies=args.wait_for_copies)
    save(log, args.out, row)
    first = -1 if log.reset_step is None else log.reset_step
    kinds = collections.Counter(KINDS[int(u[4])] for u in log.uses if u[0] > first)
    total = sum(kinds.values())
    print(f"{args.policy} d={args.prefetch_distance}: hit rate {row['hit_rate']}; {total} measured uses")
    for kind, n in kinds.most_common():
        print(f"  {kind:24s} {n:7d}  {n / total:.3f}")


if __name__ == "__main__":
    main()
