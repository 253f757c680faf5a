"""The server as a Ray Serve application: engine replicas behind a FastAPI ingress.

    SiftEngineReplica   one per GPU (a CPU replica where there is none): an EngineWorker (runtime/server/worker.py)
                        driving its engine; `generate` streams a request's chunks; `record_routing_stats` reports
                        the documents its KV store holds and its counters
    SiftIngress         the FastAPI app of runtime/server/app.py over a handle to the replicas; the handle routes
                        with DocumentAffinityRouter (runtime/server/routing.py)

    serve_app(cfg, model_name, replicas, gpus)   -> the bound application, for `serve.run`

A replica admits at most `max_queue` waiting requests (then 503) beside its running batch; Ray Serve's own
limits are set above that (the engine's batch, `MAX_RUNNING`, more per replica), so the replica, which knows its
queue, decides. The
ingress's handle queues at most `max_queue` requests more while every replica is full, then answers 503 too.
A client that disconnects cancels its ingress request, Ray Serve cancels the replica's `generate`, and the
worker aborts the request in its engine.
"""
from __future__ import annotations

import asyncio

from ray import serve
from ray.serve.config import RequestRouterConfig

from .app import build_app
from .config import ServeConfig, make_worker, tune_process
from .render import ChatRenderer
from .metrics import BOARD
from .routing import STATS_PERIOD_S, DocumentAffinityRouter

APP = "sift"
ENGINE = "SiftEngineReplica"
INGRESS = "SiftIngress"
# Requests an engine decodes at once at most (SiftEngine's max_running); it admits by KV pages below it.
MAX_RUNNING = 64


@serve.deployment(name=ENGINE)
class SiftEngineReplica:
    def __init__(self, cfg: ServeConfig, threads: int | None = None):
        tune_process()
        if threads:
            import torch

            torch.set_num_threads(threads)
        replica = serve.get_replica_context().replica_id.unique_id
        self.worker, _, _ = make_worker(cfg, replica)

    async def generate(self, call):
        async for chunk in self.worker.generate(call):
            yield chunk

    async def record_routing_stats(self) -> dict:
        # off the replica's event loop: the first report of a document tokenises it
        warm = await asyncio.to_thread(self.worker.warm_documents)
        return {"warm": warm, "snapshot": self.worker.snapshot()}

    def check_health(self) -> None:
        if not self.worker.alive:
            raise RuntimeError("the engine loop thread has stopped")

    def ready(self) -> str:
        return self.worker.replica

    def __del__(self):
        self.worker.close()


class RayBackend:
    """The app's backend in the ingress: a streaming call to the engine deployment per request."""

    def __init__(self, handle):
        self.handle = handle.options(stream=True, method_name="generate")

    async def stream(self, call):
        response = self.handle.remote(call)
        finished = False
        try:
            async for chunk in response:
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                response.cancel()

    def snapshots(self) -> list[dict]:
        return BOARD.snapshots(ENGINE)

    def healthy(self) -> bool:
        return bool(self.snapshots())


@serve.deployment(name=INGRESS, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class SiftIngress:
    async def __init__(self, engine, cfg: ServeConfig, model_name: str):
        from transformers import AutoTokenizer

        from sift.model import resolve_model_dir

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model_name))
        self.renderer = ChatRenderer(tokenizer) if getattr(tokenizer, "chat_template", None) else None
        self.engine, self.cfg, self.model_name = engine, cfg, model_name
        await engine.ready.remote()     # makes the handle's router, which then receives the replicas' reports

    def __serve_build_asgi_app__(self):
        return build_app(RayBackend(self.engine), model=self.model_name, defaults=self.cfg.defaults,
                         renderer=self.renderer)


def serve_app(cfg: ServeConfig, model_name: str, replicas: int, gpus: bool, cpus_per_replica: int = 1):
    """The bound Ray Serve application: `replicas` engine replicas (one GPU each when `gpus`) behind the ingress."""
    actor = {"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": cpus_per_replica}
    engine = SiftEngineReplica.options(
        num_replicas=replicas, ray_actor_options=actor, max_ongoing_requests=cfg.max_queue + MAX_RUNNING,
        max_queued_requests=cfg.max_queue, health_check_period_s=5.0,
        request_router_config=RequestRouterConfig(request_router_class=DocumentAffinityRouter,
                                                  request_routing_stats_period_s=STATS_PERIOD_S,
                                                  request_routing_stats_timeout_s=30.0),
    ).bind(cfg, None if gpus else cpus_per_replica)
    return SiftIngress.bind(engine, cfg, model_name)
