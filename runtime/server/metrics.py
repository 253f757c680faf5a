"""Prometheus metrics of the server (`GET /metrics`, the text exposition format).

Measured at the HTTP front, per request, as clients see it:

    sift_time_to_first_token_seconds      histogram, by mode: request received -> first generated token sent
    sift_time_per_output_token_seconds    histogram, by mode: (last token - first token) / (tokens - 1)
    sift_engine_time_to_first_token_seconds  the engine's own TTFT (add_request -> first token) of the same requests
    sift_requests_total                   counter, by endpoint and outcome (a finish reason or an error code)
    sift_prompt_tokens_total / sift_generation_tokens_total
    sift_tile_fraction                    histogram: attention tiles computed over dense, per request (when known)

Reported by each engine replica (label `replica`), from its latest snapshot (`EngineWorker.snapshot`):

    sift_queue_depth, sift_running_requests            gauges
    sift_requests_aborted_total, ..._rejected_total, ..._timed_out_total
    sift_kv_store_hits_total{tier}, sift_kv_store_misses_total, sift_kv_store_bytes_moved_total{direction},
    sift_kv_store_evictions_total, sift_kv_store_bytes{tier}, sift_kv_store_pinned_entries,
    sift_kv_store_pages{state}
    sift_index_bits_hits_total, sift_index_bits_misses_total

Each app has its own registry, so several apps in one process (tests, benchmarks) never share series.
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
                60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
FRACTION_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class Metrics:
    """The server's metrics; `snapshots` returns the latest snapshot of every engine replica."""

    def __init__(self, snapshots: Callable[[], Iterable[dict]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("sift_time_to_first_token_seconds", "Time to first token at the HTTP front",
                              ["mode"], buckets=TTFT_BUCKETS, registry=r)
        self.engine_ttft = Histogram("sift_engine_time_to_first_token_seconds",
                                     "Time to first token inside the engine replica (add_request to first token)",
                                     ["mode"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("sift_time_per_output_token_seconds", "Time per output token after the first",
                              ["mode"], buckets=TPOT_BUCKETS, registry=r)
        self.requests = Counter("sift_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("sift_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("sift_generation_tokens", "Generated tokens sent", registry=r)
        self.tile_fraction = Histogram("sift_tile_fraction", "Attention tiles computed over dense, per request",
                                       ["mode"], buckets=FRACTION_BUCKETS, registry=r)
        r.register(_ReplicaCollector(snapshots))
        self._modes: dict[str, ModeSeries] = {}

    def mode(self, mode: str) -> "ModeSeries":
        """The histograms of one mode (their labelled children looked up once per mode, not per token)."""
        series = self._modes.get(mode)
        if series is None:
            series = self._modes[mode] = ModeSeries(self.ttft.labels(mode), self.engine_ttft.labels(mode),
                                                    self.tpot.labels(mode), self.tile_fraction.labels(mode))
        return series

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class ModeSeries(NamedTuple):
    ttft: Histogram
    engine_ttft: Histogram
    tpot: Histogram
    tile_fraction: Histogram


class _ReplicaCollector:
    """The replicas' gauges and counters, read from their snapshots at scrape time."""

    def __init__(self, snapshots: Callable[[], Iterable[dict]]):
        self.snapshots = snapshots

    def describe(self):
        return []

    def collect(self):
        snaps = list(self.snapshots())
        for kind, name, doc, series in _REPLICA_SERIES:
            label = next((k for _, extra in series for k in extra), None)
            fam = kind(name, doc, labels=["replica"] + ([label] if label else []))
            for s in snaps:
                for path, extra in series:
                    value = _dig(s, path)
                    if value is not None:
                        fam.add_metric([s["replica"], *extra.values()], value)
            yield fam


G, C = GaugeMetricFamily, CounterMetricFamily
# (kind, name, help, [(snapshot path, extra labels)])
_REPLICA_SERIES = [
    (G, "sift_queue_depth", "Requests waiting for admission", [("waiting", {})]),
    (G, "sift_running_requests", "Requests in the running batch", [("running", {})]),
    (C, "sift_requests_aborted", "Requests aborted (client gone, timeout)", [("aborted", {})]),
    (C, "sift_requests_rejected", "Requests refused with 503 (queue full)", [("rejected", {})]),
    (C, "sift_requests_timed_out", "Requests past the server's timeout", [("timed_out", {})]),
    (C, "sift_kv_store_hits", "Documents found in the KV store",
     [("store.hits_hbm", {"tier": "hbm"}), ("store.hits_dram", {"tier": "dram"})]),
    (C, "sift_kv_store_misses", "Documents computed (not in the KV store)", [("store.misses", {})]),
    (C, "sift_kv_store_bytes_moved", "KV bytes copied between tiers",
     [("store.bytes_h2d", {"direction": "h2d"}), ("store.bytes_d2h", {"direction": "d2h"})]),
    (C, "sift_kv_store_evictions", "KV store entries evicted from HBM", [("store.evictions", {})]),
    (G, "sift_kv_store_bytes", "KV bytes held by documents",
     [("store.hbm_bytes", {"tier": "hbm"}), ("store.dram_bytes", {"tier": "dram"})]),
    (G, "sift_kv_store_pinned_entries", "KV store entries in use by running requests", [("store.pinned", {})]),
    (G, "sift_kv_store_pages", "HBM pages of the KV pool no one holds (free) and held by requests (scratch)",
     [("store.pages_free", {"state": "free"}), ("store.pages_scratch", {"state": "scratch"})]),
    (C, "sift_index_bits_hits", "Documents whose bits were on the device", [("index.hits", {})]),
    (C, "sift_index_bits_misses", "Documents whose bits were copied to the device", [("index.misses", {})]),
]


class ReplicaBoard:
    """The latest snapshot of every engine replica, per deployment, as the request routers of this process
    receive them with the replicas' routing reports (runtime/server/routing.py); the ingress's /metrics reads it.
    Written from the routers' thread, read from the app's: each update replaces a deployment's dict whole."""

    def __init__(self):
        self._by_deployment: dict[str, dict[str, dict]] = {}

    def update(self, deployment: str, snapshots: dict[str, dict | None]) -> None:
        self._by_deployment[deployment] = {k: v for k, v in snapshots.items() if v is not None}

    def snapshots(self, deployment: str) -> list[dict]:
        return list(self._by_deployment.get(deployment, {}).values())


BOARD = ReplicaBoard()


def _dig(snapshot: dict, path: str):
    value = snapshot
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value
