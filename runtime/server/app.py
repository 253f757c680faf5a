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


class _Watch:
    """Watches a request's connection once its body is read: when the client goes away it cancels the request's
    task (awaiting the backend, or streaming the response), whose handler then closes the backend's generator,
    which aborts the request in its engine. The watch is a task of its own awaiting ASGI `receive`, so the
    request's own path, a chunk from the backend to the client, awaits nothing else: the chunk resumes the
    request's task in the event loop's next iteration and goes out in that one."""

    def __init__(self, receive):
        self.disconnected = False
        self._task = asyncio.current_task()
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        self._task.cancel()

    def stop(self) -> None:
        """Stop watching (before the response completes: the server reports a completed response as a
        disconnect too)."""
        self._watcher.cancel()

    def left(self) -> bool:
        """Called on a CancelledError of the request's task: whether the watch cancelled it (the client left);
        if so the cancellation is taken back and the handler answers instead."""
        if self.disconnected:
            self._task.uncancel()
        return self.disconnected


class _EventStreamResponse(StreamingResponse):
    """Starlette's StreamingResponse sent from the request's own task, without a second task listening for the
    disconnect (the request's `_Watch` does): nothing but the iterator stands between a chunk and its write."""

    def __init__(self, events: AsyncIterator[bytes], watch: _Watch, headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.watch = watch

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not self.watch.left():
                raise
        finally:
            self.watch.stop()
            await self.body_iterator.aclose()   # cancelled outside it (in a send): its `finally` runs now


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _Timing:
    """TTFT and TPOT of one request as the front sees it."""

    def __init__(self, metrics: Metrics, t0: float, mode: str):
        self.metrics, self.series, self.t0 = metrics, metrics.mode(mode), t0
        self.first = self.last = None
        self.tokens = 0

    def saw(self, chunk: Chunk) -> None:
        now = time.perf_counter()
        if chunk.token_ids and self.first is None:
            self.first = now
            self.series.ttft.observe(now - self.t0)
        if chunk.engine_ttft_s is not None:
            self.series.engine_ttft.observe(chunk.engine_ttft_s)
        if chunk.tile_fraction is not None:
            self.series.tile_fraction.observe(chunk.tile_fraction)
        if chunk.token_ids:
            self.last = now
            self.tokens += len(chunk.token_ids)
            self.metrics.generation_tokens.inc(len(chunk.token_ids))

    def finish(self, chunk: Chunk) -> None:
        if self.tokens > 1:
            self.series.tpot.observe((self.last - self.first) / (self.tokens - 1))
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
        gen = watch = None
        try:
            parsed = _parse(kind, await request.body())
            watch = _Watch(request.receive)
            gen = backend.stream(parsed.call)
            first = await gen.__anext__()
        except BaseException as e:  # noqa: BLE001 - every failure becomes an HTTP error
            return await _failed(e, kind, gen, watch)
        timing = _Timing(metrics, t0, parsed.call.mode)
        timing.saw(first)
        # Where this request's TTFT went: the app's (request received -> first chunk) and the engine's own
        # (add_request -> first token), beside what the client measures.
        headers = {"x-sift-replica": first.replica, "x-sift-app-ttft": f"{time.perf_counter() - t0:.6f}"}
        if first.engine_ttft_s is not None:
            headers["x-sift-engine-ttft"] = f"{first.engine_ttft_s:.6f}"
        if parsed.stream:
            return _EventStreamResponse(_events(parsed, first, gen, timing, watch), watch, headers)
        try:
            text, last = await _collect(first, gen, timing)
        except BaseException as e:  # noqa: BLE001
            return await _failed(e, kind, gen, watch)
        watch.stop()
        await _close(gen)
        timing.finish(last)
        metrics.requests.labels(kind, last.finish_reason).inc()
        return JSONResponse(response(parsed, model, text, last), headers=headers)

    async def _failed(e: BaseException, kind: str, gen, watch: _Watch | None) -> Response:
        """A request that failed before its response started: its generator closed, its HTTP error (499 when the
        client left). A cancellation by the server is raised on."""
        if watch is not None:
            watch.stop()
        await _close(gen)
        if isinstance(e, asyncio.CancelledError):
            if watch is None or not watch.left():
                raise e
            metrics.requests.labels(kind, "disconnected").inc()
            return Response(status_code=499)
        if not isinstance(e, Exception):
            raise e
        err = error_of(e, kind)
        metrics.requests.labels(kind, err.code or str(err.status)).inc()
        return _error_response(err)

    async def _collect(first: Chunk, gen, timing: _Timing) -> tuple[str, Chunk]:
        parts, last = [first.text], first
        while not last.finished:
            last = await gen.__anext__()
            timing.saw(last)
            parts.append(last.text)
        return "".join(parts), last

    async def _events(parsed: Parsed, first: Chunk, gen, timing: _Timing, watch: _Watch):
        kind = parsed.kind
        stream = EventStream(parsed, model)
        outcome = "disconnected"
        try:
            chunk = first
            for event in stream.events(chunk):
                yield event
            while not chunk.finished:
                chunk = await gen.__anext__()
                timing.saw(chunk)
                for event in stream.events(chunk):
                    yield event
            timing.finish(chunk)
            outcome = chunk.finish_reason
            yield EventStream.DONE
        except Exception as e:  # noqa: BLE001 - after the first chunk an error is the stream's last event
            err = error_of(e, kind)
            outcome = err.code or str(err.status)
            yield EventStream.error(err)
            yield EventStream.DONE
        finally:
            watch.stop()            # before the response's last send (which the server reports as a disconnect)
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
