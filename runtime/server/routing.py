"""Document-affinity routing: a request goes to the engine replica whose KV store holds most of its documents,
with load as the tie-breaker, so that N replicas keep N different hot sets rather than N copies of one
(docs/design.md, "Serving: routing by documents").

    rank(replicas, keys)        the policy, a pure function (the server's router and bench/bench_trace.py's
                                model of a cluster both call it)
    DocumentAffinityRouter      Ray Serve's pluggable `RequestRouter` for the engine deployment

What a replica holds is known two ways. Every replica reports the routing keys of the documents its store holds
(`record_routing_stats`, every `STATS_PERIOD_S`; Ray Serve's controller carries the reports to every router);
between reports, the router counts the documents it has just sent to a replica as held there for
`routed_ttl_s`, so a burst of requests over the same new documents follows the first one rather than spreading
before the next report. A document's routing key is a hash of its text (protocol.doc_key).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Hashable, Sequence

from ray.serve.request_router import RequestRouter

from . import metrics

# How often each replica reports its warm documents and its counters (seconds).
STATS_PERIOD_S = 1.0
# A replica more loaded than the least loaded one by more than this (requests in flight) is passed over for
# affinity: documents are worth recomputing once rather than waiting behind a queue.
MAX_IMBALANCE = 8


@dataclass(frozen=True)
class ReplicaView:
    """What the policy knows of one replica: warm (routing keys its store holds, or was just sent), load
    (requests in flight)."""

    id: Hashable
    warm: frozenset | set
    load: int


def rank(replicas: Sequence[ReplicaView], keys: Sequence[str], *, max_imbalance: int = MAX_IMBALANCE,
         rng: random.Random | None = None) -> list[Hashable]:
    """Replica ids, best first: replicas within `max_imbalance` of the least load before the others; then most
    of `keys` warm; then least loaded; then the fewest warm documents (a request that is cold everywhere starts
    a hot set on the replica holding least); then at random."""
    if not replicas:
        return []
    rng = rng or random
    least = min(r.load for r in replicas)
    keys = set(keys)
    scored = [(r.load - least > max_imbalance, -len(keys & r.warm) if keys else 0, r.load, len(r.warm), rng.random(),
               r.id) for r in replicas]
    return [s[-1] for s in sorted(scored, key=lambda s: s[:-1])]


class DocumentAffinityRouter(RequestRouter):
    """Ray Serve request router of the engine deployment (see the module docstring). Keyword arguments
    (RequestRouterConfig.request_router_kwargs): max_imbalance, routed_ttl_s."""

    def initialize_state(self, max_imbalance: int = MAX_IMBALANCE, routed_ttl_s: float = 10.0):
        self._max_imbalance = max_imbalance
        self._routed_ttl_s = routed_ttl_s
        self._reported: dict = {}       # ReplicaID -> frozenset of routing keys (its last report)
        self._routed: dict = {}         # ReplicaID -> {routing key: time sent}

    def update_replicas(self, replicas):
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for r in replicas:
            stats = r.routing_stats or {}
            if "warm" in stats:
                self._reported[r.replica_id] = frozenset(stats["warm"])
        for gone in set(self._reported) - live:
            self._reported.pop(gone, None)
            self._routed.pop(gone, None)
        # metrics is a module of its own: Ray Serve ships this module by value, so state kept here would be a
        # copy the ingress never sees.
        metrics.BOARD.update(self._deployment_id.name, {r.replica_id.unique_id: (r.routing_stats or {}).get("snapshot")
                                                        for r in replicas})

    def _warm(self, replica_id, now: float) -> set:
        routed = self._routed.get(replica_id, {})
        for key in [k for k, t in routed.items() if now - t > self._routed_ttl_s]:
            del routed[key]
        return set(self._reported.get(replica_id, ())) | set(routed)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        keys = _doc_keys(pending_request)
        loads = {}
        probe = []
        for r in candidate_replicas:
            n = self.replica_queue_len_cache.get(r.replica_id)
            if n is None:
                probe.append(r)
            else:
                loads[r.replica_id] = n
        if probe:   # (as Ray Serve's own routers do: the probe fills the cache other routing steps read)
            for r, n in await self._probe_queue_lens(probe, 0):
                if n is not None:
                    loads[r.replica_id] = n
        now = time.time()
        views = [ReplicaView(r.replica_id, self._warm(r.replica_id, now), loads.get(r.replica_id, 0))
                 for r in candidate_replicas]
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[i]] for i in rank(views, keys, max_imbalance=self._max_imbalance)]

    def on_request_routed(self, pending_request, replica_id, result):
        keys = _doc_keys(pending_request)
        if keys:
            now = time.time()
            routed = self._routed.setdefault(replica_id, {})
            for key in keys:
                routed[key] = now


def _doc_keys(pending_request) -> tuple[str, ...]:
    """The routing keys of a pending request to the engine deployment (its Call's doc_keys)."""
    if pending_request is None:
        return ()
    for arg in pending_request.args or ():
        keys = getattr(arg, "doc_keys", None)
        if keys is not None:
            return tuple(keys)
    return ()
