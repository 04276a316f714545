"""A finished step's expert uses, as the residency core accounts them (read one step late).

Each use (a distinct expert a layer ran) is exactly one of: a hit (the wanted version: hi, or lo
where lo is what the mode runs), a lo run (lo, or a ladder's middle tier, in place of hi) or a miss
(read from host memory, or nowhere). Used versions are touched for LRU and counted for prob-freq
eviction; a miss in the hi-cache mode asks for its expert to be cached for the next steps. A use of
a version a prediction brought in, before anything else used it, is a used prefetch; a prediction
that was still on its way when its layer read the table is a late one.
"""

from __future__ import annotations

import numpy as np

from .slot_table import NOT_RESIDENT, UNUSED, WAITED


def account_step(core, ran: np.ndarray, iteration: int) -> None:
    """Account step `iteration` on `core` (a `ResidencyManager`): `ran (L, E)` int32 the pool id
    each expert ran from as its layer read the table (`StepRecord.ran_from`; `UNUSED`: not used;
    `WAITED` added: sent to a copy in flight, whose landing the layer waited for)."""
    metrics, ids = core.metrics, core.pool_ids
    waited = ran >= WAITED
    if waited.any():
        ran = np.where(waited, ran - WAITED, ran)
        metrics.bump("hits_in_flight", int(waited.sum()))
    used = ran != UNUSED
    hi_id, lo_id, host_id = ids["hi"], ids["lo"], ids["host"]
    wanted = lo_id if core.options.mode == "all-lo" else hi_id
    hits = (ran == wanted).sum(axis=1)
    mid_ids = [ids[name] for name in core.tiers[1:-1]]
    mid_runs = np.isin(ran, mid_ids).sum(axis=1) if mid_ids else np.zeros(len(ran), dtype=np.int64)
    lo_runs = (ran == lo_id).sum(axis=1) + mid_runs if wanted != lo_id else np.zeros(len(ran), int)
    missed = (ran == host_id) | (ran == NOT_RESIDENT)
    per_layer = zip(used.sum(axis=1).tolist(), hits.tolist(), lo_runs.tolist(), mid_runs.tolist(),
                    missed.sum(axis=1).tolist(), strict=True)  # fmt: skip
    for counters, (n_used, n_hits, n_lo, n_mid, n_miss) in zip(metrics.layers, per_layer, strict=True):
        counters.used += n_used
        counters.hits += n_hits
        counters.lo_runs += n_lo
        counters.mid_runs += n_mid
        counters.misses += n_miss
    core.stats.visits += used
    names = {ids[name]: name for name in core.tiers}
    # only pools that evict keep an LRU order worth touching, and only misses ask for anything: the
    # rest of a batch-32 step's ~1,000 uses cost nothing here
    watched = missed.copy()
    for pid, name in names.items():
        if core.cache.evicts(name):
            watched |= ran == pid
    layers, experts = np.nonzero(watched)
    cache, hi_cache = core.cache, core.options.mode == "hi-cache"
    for layer, expert, pid in zip(layers.tolist(), experts.tolist(), ran[layers, experts].tolist(), strict=True):
        pool = names.get(pid)
        h = core.handles[layer][expert]
        version = h.versions.get(pool) if pool is not None else None
        if version is not None:
            cache.touch(h, pool)
            if version.prefetched:
                version.prefetched = False
                metrics.bump("prefetches_used")
        elif pool is None and hi_cache and "hi" not in h.versions:
            core.queue.cache_miss(iteration, layer, expert)  # cache what was used
        hi = h.versions.get("hi")
        if pool != "hi" and hi is not None:  # it ran from lo or host memory with a hi version kept
            if hi.prefetched and hi.issued_at <= iteration:
                metrics.bump("prefetches_late")  # predicted in time, landed too late
            elif core.reserve.was_parked(iteration, "hi", (layer, expert)):
                metrics.bump("parked_misses")  # its slot was parked for in-step prefetches
