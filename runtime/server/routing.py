"""Document-affinity routing: a request goes to the engine replica whose KV store holds most of its documents,
with load as the tie-breaker, so that N replicas keep N different hot sets rather than N copies of one
(docs/design.md, "Serving: routing by documents").

    rank(replicas)              the policy, a pure function (the server's router and bench/bench_trace.py's
                                model of a cluster both call it)
    DocumentAffinityRouter      Ray Serve's pluggable `RequestRouter` for the engine deployment

What a replica holds is known two ways. Every replica reports the routing keys of the documents its store holds
(`record_routing_stats`, every `STATS_PERIOD_S`; Ray Serve's controller carries the reports to every router);
between reports, the router counts the documents it has just sent to a replica as held there for
`ROUTED_TTL_S`, so a burst of requests over the same new documents follows the first one rather than spreading
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
# How long the router counts documents it sent to a replica as held there, before that replica's reports.
ROUTED_TTL_S = 10.0
# How many requests above the mean load a replica may go for affinity: past it, documents are worth recomputing
# elsewhere rather than waiting behind a queue, and every replica keeps its share of the traffic. One request
# lets a warm replica take a second request while its peers idle, and no more (bench/bench_trace.py: with two,
# a replica of eight can be left without traffic).
HEADROOM = 1


@dataclass(frozen=True)
class ReplicaView:
    """What the policy knows of one replica for one request: hits (how many of the request's documents it
    holds), load (requests in flight there), held (documents it holds in all)."""

    id: Hashable
    hits: int
    load: int
    held: int


def rank(replicas: Sequence[ReplicaView], *, headroom: int = HEADROOM,
         rng: random.Random | None = None) -> list[Hashable]:
    """Replica ids, best first. Bounded load first (consistent hashing with bounded loads, Mirrokni et al.): a
    replica whose load with this request would exceed the mean load (this request counted) by more than
    `headroom` requests comes after the others. Then the most hits; then the least load; then the fewest
    documents held (a request cold everywhere starts a hot set where there is most room); then at random."""
    if not replicas:
        return []
    rng = rng or random
    cap = (sum(r.load for r in replicas) + 1) / len(replicas) + headroom
    scored = [(r.load + 1 > cap, -r.hits, r.load, r.held, rng.random(), r.id) for r in replicas]
    return [s[-1] for s in sorted(scored, key=lambda s: s[:-1])]


class DocumentAffinityRouter(RequestRouter):
    """Ray Serve request router of the engine deployment (see the module docstring). Keyword arguments
    (RequestRouterConfig.request_router_kwargs): headroom (HEADROOM), routed_ttl_s (ROUTED_TTL_S)."""

    def initialize_state(self, headroom: int = HEADROOM, routed_ttl_s: float = ROUTED_TTL_S):
        self._headroom = headroom
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
        views = []
        for r in candidate_replicas:
            warm = self._warm(r.replica_id, now)
            hits = len(warm.intersection(keys))
            views.append(ReplicaView(r.replica_id, hits, loads.get(r.replica_id, 0), len(warm)))
        by_id = {r.replica_id: r for r in candidate_replicas}
        return [[by_id[i]] for i in rank(views, headroom=self._headroom)]

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
