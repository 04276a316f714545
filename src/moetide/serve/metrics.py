"""Prometheus metrics of one server instance, in a registry of its own (no global registry).

Request metrics are updated by the engine thread as tokens arrive. Expert-residency and KV-cache
metrics are copies of `ExpertMetrics.snapshot()` and `LLMEngine.kv_stats()` that the engine thread
refreshes between steps; a scrape only reads those copies, so it never touches the residency core
or the block allocator from the event loop's thread.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
)
TPOT_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
LATENCY_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class _ExpertCollector:
    """Exports the latest expert snapshot at scrape time."""

    def __init__(self, server_metrics: ServerMetrics):
        self._metrics = server_metrics

    def collect(self):
        snap = self._metrics.expert_snapshot
        hit_rate = GaugeMetricFamily("moetide_expert_hit_rate", "Share of expert uses already resident")
        hit_rate.add_metric([], float(snap.get("hit_rate", 0.0)))
        yield hit_rate
        counters = (
            ("moetide_expert_bytes_moved", "Expert bytes copied host to device", "bytes_h2d"),
            ("moetide_expert_hits", "Expert uses found resident", "hits"),
            ("moetide_expert_misses", "Expert uses with no device version: read from host memory", "misses"),
            ("moetide_expert_lo_runs", "Expert uses that ran lo in place of hi", "lo_runs"),
            ("moetide_expert_promotions", "Experts promoted to the hi precision", "promotions"),
            ("moetide_expert_demotions", "Experts demoted to the lo precision", "demotions"),
            ("moetide_expert_evictions", "Experts evicted from the device", "evictions"),
            ("moetide_expert_prefetches_issued", "Expert prefetches issued", "prefetches_issued"),
            ("moetide_expert_prefetches_used", "Prefetched experts that were then used", "prefetches_used"),
            ("moetide_host_cache_hits", "hi copies served from the staged host cache", "host_cache_hits"),
            ("moetide_disk_reads", "Experts read from the mapped checkpoint", "disk_reads"),
            ("moetide_disk_read_bytes", "Checkpoint bytes read from the map", "disk_read_bytes"),
            ("moetide_disk_read_seconds", "Seconds spent reading experts from the map", "disk_read_s"),
        )
        yield from _families(CounterMetricFamily, counters, snap)
        host_gauges = (
            ("moetide_host_staged_bytes", "Host bytes of the staged hi cache", "host_staged_bytes"),
            ("moetide_host_expert_bytes", "Host bytes held for expert versions", "host_expert_bytes"),
            ("moetide_rss_bytes", "Resident set size of the engine's process", "rss_bytes"),
            ("moetide_rss_peak_bytes", "Peak resident set size (VmHWM)", "rss_peak_bytes"),
        )
        yield from _families(GaugeMetricFamily, host_gauges, snap)
        resident = GaugeMetricFamily(
            "moetide_resident_experts", "Experts resident on the device", labels=["precision"]
        )
        # the residency core counts per pool ("hi", "lo"); series exist at 0 before it reports any
        counts = {"hi": 0, "lo": 0, **(snap.get("resident") or {})}
        for precision, count in sorted(counts.items()):
            resident.add_metric([precision], float(count))
        yield resident


def _families(kind, series, snap: dict):
    """One unlabelled `kind` (gauge or counter family) per `(name, doc, snapshot key)` of `series`."""
    for name, doc, key in series:
        family = kind(name, doc)
        family.add_metric([], float(snap.get(key, 0)))
        yield family


class _KVCacheCollector:
    """Exports the latest KV-cache snapshot (`LLMEngine.kv_stats()`) at scrape time."""

    def __init__(self, server_metrics: ServerMetrics):
        self._metrics = server_metrics

    def collect(self):
        snap = self._metrics.kv_snapshot
        gauges = (
            ("moetide_kv_blocks_used", "KV-cache blocks referenced by running sequences", "kv_blocks_used"),
            ("moetide_kv_blocks_total", "KV-cache blocks in the pool", "kv_blocks_total"),
        )
        yield from _families(GaugeMetricFamily, gauges, snap)
        counters = (
            (
                "moetide_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                "prefix_cache_queries",
            ),
            (
                "moetide_prefix_cache_hits",
                "Prompt tokens whose KV the prefix cache held",
                "prefix_cache_hits",
            ),
            ("moetide_preemptions", "Sequences preempted (KV freed, recomputed later)", "preemptions"),
        )
        yield from _families(CounterMetricFamily, counters, snap)


class ServerMetrics:
    """Every series `GET /metrics` exposes, registered in `self.registry`."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft_s = Histogram(
            "moetide_time_to_first_token_seconds",
            "Time from arrival to the first output token",
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.tpot_s = Histogram(
            "moetide_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request",
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e_s = Histogram(
            "moetide_e2e_request_latency_seconds",
            "Time from arrival to the last token",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.waiting = Gauge("moetide_num_requests_waiting", "Requests queued, not yet running", registry=r)
        self.running = Gauge("moetide_num_requests_running", "Sequences in the running batch", registry=r)
        self.finished = Counter(
            "moetide_requests_finished", "Requests finished, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "moetide_requests_rejected", "Requests refused before running, by reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "moetide_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("moetide_generation_tokens", "Output tokens generated", registry=r)
        self.engine_errors = Counter("moetide_engine_step_errors", "Engine steps that raised", registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(reason)  # series exist (at 0) before the first request
        self.rejected.labels("queue_full")
        self.expert_snapshot: dict = {}
        self.kv_snapshot: dict = {}
        r.register(_ExpertCollector(self))
        r.register(_KVCacheCollector(self))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
