"""Prometheus metrics at /metrics. Names follow what users of vLLM-style servers look for.

Request-level series are recorded as requests run; runtime state (queue depth, KV blocks and
usage, requests waiting for KV blocks, preemptions, per-node batch sizes) is read from
``Runtime.stats()`` when Prometheus scrapes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mstar_requests", "HTTP requests by route and status",
                                ["model", "route", "status"], registry=r)
        self.running = Gauge("mstar_running_requests", "requests admitted and not finished", ["model"], registry=r)
        self.ttft = Histogram("mstar_time_to_first_token_seconds", "time to first token", ["model", "route"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mstar_inter_token_latency_seconds", "time between streamed tokens",
                             ["model", "route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttfa = Histogram("mstar_time_to_first_audio_seconds", "time to first audio packet",
                              ["model", "route"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("mstar_e2e_request_latency_seconds", "end-to-end request latency",
                             ["model", "route"], buckets=LATENCY_BUCKETS, registry=r)
        self.rtf = Histogram("mstar_audio_real_time_factor", "generation time / audio duration", ["model", "route"],
                             buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 5, 10), registry=r)
        self.aborted = Counter("mstar_aborted_requests", "requests aborted because the client went away",
                               ["model"], registry=r)
        self.tokens = Counter("mstar_generation_tokens", "generated tokens", ["model", "route"], registry=r)

    def install_runtime_collector(self, stats_fn) -> None:
        self.registry.register(_RuntimeCollector(self.model, stats_fn))


class _RuntimeCollector:
    def __init__(self, model: str, stats_fn) -> None:
        self.model, self.stats_fn = model, stats_fn

    def collect(self):
        try:
            stats = self.stats_fn()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the runtime is down
            return
        queue = GaugeMetricFamily("mstar_queue_depth", "work items waiting in node queues",
                                  labels=["model", "rank", "node"])
        used = GaugeMetricFamily("mstar_kv_blocks_used", "KV-cache blocks in use", labels=["model", "rank", "node"])
        free = GaugeMetricFamily("mstar_kv_blocks_free", "free KV-cache blocks", labels=["model", "rank", "node"])
        batches = GaugeMetricFamily("mstar_node_batches", "batched forwards run, by batch size",
                                    labels=["model", "rank", "node", "batch_size"])
        for r in stats["ranks"]:
            rank = str(r["rank"])
            for node, depth in r["queue_depth"].items():
                queue.add_metric([self.model, rank, node], depth)
            for node, kv in r["kv"].items():
                used.add_metric([self.model, rank, node], kv["blocks_used"])
                free.add_metric([self.model, rank, node], kv["blocks_free"])
            for node, hist in r["batch_sizes"].items():
                for size, count in hist.items():
                    batches.add_metric([self.model, rank, node, str(size)], count)
        yield from (queue, used, free, batches, *self._kv_pressure(stats))

    def _kv_pressure(self, stats):
        """Per KV module: cache usage, requests waiting for blocks, preemptions (swap-outs) so far,
        prefix-cache lookups and hits (tokens) and the blocks it keeps."""
        labels = ["model", "rank", "node"]
        usage = GaugeMetricFamily("mstar_kv_cache_usage", "fraction of KV-cache blocks in use", labels=labels)
        waiting = GaugeMetricFamily("mstar_kv_waiting_requests", "requests whose next step waits for KV blocks",
                                    labels=labels)
        swapped = GaugeMetricFamily("mstar_kv_swapped_requests", "preempted requests whose KV blocks are in host "
                                    "memory", labels=labels)
        preempted = CounterMetricFamily("mstar_kv_preemptions", "requests swapped out to free KV blocks",
                                        labels=labels)
        queried = CounterMetricFamily("mstar_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                      labels=labels)
        hits = CounterMetricFamily("mstar_prefix_cache_hits", "prompt tokens whose KV blocks came from the prefix "
                                   "cache", labels=labels)
        cached = GaugeMetricFamily("mstar_kv_cached_blocks", "unreferenced KV blocks kept for prefix reuse (counted "
                                   "as free)", labels=labels)
        for r in stats["ranks"]:
            rank = str(r["rank"])
            for node, kv in r["kv"].items():
                key = [self.model, rank, node]
                usage.add_metric(key, kv["blocks_used"] / max(kv["blocks_total"], 1))
                swapped.add_metric(key, kv.get("swapped_requests", 0))
                preempted.add_metric(key, kv.get("preemptions", 0))
                queried.add_metric(key, kv.get("prefix_query_tokens", 0))
                hits.add_metric(key, kv.get("prefix_hit_tokens", 0))
                cached.add_metric(key, kv.get("blocks_cached", 0))
            for node, n in r.get("waiting", {}).items():
                waiting.add_metric([self.model, rank, node], n)
        return usage, waiting, swapped, preempted, queried, hits, cached
