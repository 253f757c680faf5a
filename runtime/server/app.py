"""The HTTP front: one FastAPI app, whatever runs the engine behind it.

    build_app(backend, ...)     POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
                                GET /metrics

A backend is where generations run: `LocalBackend` (an `EngineWorker` in this process: `sift-serve --replicas
0`, the tests' fast path and single-GPU serving) or the Ray Serve ingress's handle to the engine replicas
(runtime/server/deploy.py). The app validates and renders a request (a bad one never reaches an engine), hands
the backend a `Call`, and waits for its first chunk before it answers: an error up to then is an HTTP error with
OpenAI's body; after it, a streaming response ends with an error event. While it waits, and while a plain
(non-streaming) request runs, it watches for the client going away; a streaming response is cancelled by the
server when its client disconnects. Either way the backend's generator is closed, which aborts the request in
its engine and frees its pages.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable, Iterable, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .errors import ApiError
from .metrics import CONTENT_TYPE, Metrics
from .protocol import Call, Chunk, EventStream, Parsed, ServerDefaults, error_of, parse_chat, parse_completion
from .protocol import response

# How often a waiting handler checks whether its client went away.
DISCONNECT_POLL_S = 0.1


class Backend(Protocol):
    def stream(self, call: Call) -> AsyncIterator[Chunk]: ...

    def snapshots(self) -> Iterable[dict]: ...

    def healthy(self) -> bool: ...


class LocalBackend:
    """The engine replica in this process."""

    def __init__(self, worker):
        self.worker = worker

    def stream(self, call: Call) -> AsyncIterator[Chunk]:
        return self.worker.generate(call)

    def snapshots(self) -> list[dict]:
        return [self.worker.snapshot()]

    def healthy(self) -> bool:
        return self.worker.alive


class _Disconnected(Exception):
    pass


async def _unless_disconnected(request: Request, awaitable):
    """Await `awaitable`, or raise _Disconnected (cancelling it) when the client goes away first."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _Disconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _Timing:
    """TTFT and TPOT of one request as the front sees it."""

    def __init__(self, metrics: Metrics, t0: float):
        self.metrics, self.t0 = metrics, t0
        self.first = self.last = None
        self.tokens = 0

    def saw(self, chunk: Chunk, mode: str) -> None:
        now = time.perf_counter()
        if chunk.token_ids and self.first is None:
            self.first = now
            self.metrics.ttft.labels(mode).observe(now - self.t0)
        if chunk.engine_ttft_s is not None:
            self.metrics.engine_ttft.labels(mode).observe(chunk.engine_ttft_s)
        if chunk.tile_fraction is not None:
            self.metrics.tile_fraction.labels(mode).observe(chunk.tile_fraction)
        if chunk.token_ids:
            self.last = now
            self.tokens += len(chunk.token_ids)
            self.metrics.generation_tokens.inc(len(chunk.token_ids))

    def finish(self, chunk: Chunk, mode: str) -> None:
        if self.tokens > 1:
            self.metrics.tpot.labels(mode).observe((self.last - self.first) / (self.tokens - 1))
        self.metrics.prompt_tokens.inc(chunk.prompt_tokens)


def build_app(backend: Backend, *, model: str, defaults: ServerDefaults, renderer=None,
              snapshots: Callable[[], Iterable[dict]] | None = None) -> FastAPI:
    """The OpenAI-compatible app over `backend`. model: the name /v1/models lists (requests must name it);
    renderer: the chat renderer (None: /v1/chat/completions refuses, e.g. a model without a chat template)."""
    app = FastAPI(title="sift-serve", docs_url=None, redoc_url=None)
    metrics = Metrics(snapshots or backend.snapshots)
    app.state.metrics = metrics
    created = int(time.time())

    @app.get("/health")
    async def health():
        if not backend.healthy():
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "sift"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(request, "chat")

    def _parse(kind: str, body) -> Parsed:
        if kind == "chat":
            if renderer is None:
                raise ApiError(400, "the served model has no chat template: use /v1/completions",
                               param="messages", code="no_chat_template")
            parsed = parse_chat(body, defaults, renderer)
        else:
            parsed = parse_completion(body, defaults)
        if parsed.model != model:
            raise ApiError(404, f"the model {parsed.model!r} is not served here; this server serves {model!r}",
                           type="invalid_request_error", param="model", code="model_not_found")
        return parsed

    async def _generate(request: Request, kind: str):
        t0 = time.perf_counter()
        gen = None
        try:
            parsed = _parse(kind, await request.body())
            gen = backend.stream(parsed.call)
            first = await _unless_disconnected(request, gen.__anext__())
        except _Disconnected:
            await _close(gen)
            metrics.requests.labels(kind, "disconnected").inc()
            return Response(status_code=499)
        except asyncio.CancelledError:     # the server cancelled the request (its client went away)
            await _close(gen)
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes an HTTP error
            await _close(gen)
            err = error_of(e, kind)
            metrics.requests.labels(kind, err.code or str(err.status)).inc()
            return _error_response(err)
        mode = parsed.call.mode
        timing = _Timing(metrics, t0)
        timing.saw(first, mode)
        # Where this request's TTFT went: the app's (request received -> first chunk) and the engine's own
        # (add_request -> first token), beside what the client measures.
        headers = {"x-sift-replica": first.replica, "x-sift-app-ttft": f"{time.perf_counter() - t0:.6f}"}
        if first.engine_ttft_s is not None:
            headers["x-sift-engine-ttft"] = f"{first.engine_ttft_s:.6f}"
        if parsed.stream:
            return StreamingResponse(_events(parsed, first, gen, timing), media_type="text/event-stream",
                                     headers=headers)
        try:
            text, last = await _unless_disconnected(request, _collect(first, gen, timing, mode))
        except _Disconnected:
            metrics.requests.labels(kind, "disconnected").inc()
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001
            err = error_of(e, kind)
            metrics.requests.labels(kind, err.code or str(err.status)).inc()
            return _error_response(err)
        finally:
            await _close(gen)
        timing.finish(last, mode)
        metrics.requests.labels(kind, last.finish_reason).inc()
        return JSONResponse(response(parsed, model, text, last), headers=headers)

    async def _collect(first: Chunk, gen, timing: _Timing, mode: str) -> tuple[str, Chunk]:
        parts, last = [first.text], first
        while not last.finished:
            last = await gen.__anext__()
            timing.saw(last, mode)
            parts.append(last.text)
        return "".join(parts), last

    async def _events(parsed: Parsed, first: Chunk, gen, timing: _Timing):
        kind, mode = parsed.kind, parsed.call.mode
        stream = EventStream(parsed, model)
        outcome = "disconnected"
        try:
            chunk = first
            for event in stream.events(chunk):
                yield event
            while not chunk.finished:
                chunk = await gen.__anext__()
                timing.saw(chunk, mode)
                for event in stream.events(chunk):
                    yield event
            timing.finish(chunk, mode)
            outcome = chunk.finish_reason
            yield EventStream.DONE
        except Exception as e:  # noqa: BLE001 - after the first chunk an error is the stream's last event
            err = error_of(e, kind)
            outcome = err.code or str(err.status)
            yield EventStream.error(err)
            yield EventStream.DONE
        finally:
            await _close(gen)
            metrics.requests.labels(kind, outcome).inc()

    return app


async def _close(gen) -> None:
    """Close a backend generator (aborting its request when it had not finished)."""
    if gen is not None:
        try:
            await gen.aclose()
        except Exception:  # noqa: BLE001 - closing after a failure: the failure was already reported
            pass
